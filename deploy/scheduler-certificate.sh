#!/bin/sh
# The scheduler extender's serving certificate, made with openssl: a CA of
# its own and a certificate for 127.0.0.1 and localhost (kube-scheduler
# calls `gpuvisor scheduler` inside their Pod), stored with the CA as the
# Secret gpuvisor-scheduler-tls (ca.crt, tls.crt, tls.key), which
# scheduler.yaml mounts into both: the extender serves tls.crt, and
# kube-scheduler's extender entry trusts ca.crt (tlsConfig.caFile).
#
#   deploy/scheduler-certificate.sh            make the pair and apply the Secret
#   deploy/scheduler-certificate.sh --out DIR  only write ca.crt, tls.crt, tls.key to DIR
#
# Run it again to renew (valid DAYS, default 825): the Secret is replaced
# and the extender reloads the pair, but kube-scheduler reads its caFile
# only at start, so then `kubectl -n gpuvisor rollout restart
# deploy/gpuvisor-scheduler`.  cert-manager users can instead issue a
# Certificate with ipAddresses [127.0.0.1] into the same Secret (its
# ca.crt included).
set -eu
. "$(dirname "$0")/certificate-lib.sh"

NAMESPACE=${NAMESPACE:-gpuvisor}
SECRET=${SECRET:-gpuvisor-scheduler-tls}
DAYS=${DAYS:-825}
KUBECTL=${KUBECTL:-kubectl}

out=""
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out=${2:?--out needs a directory}; shift 2 ;;
        *) echo "scheduler-certificate.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

issue_pair "$out" "gpuvisor-scheduler-ca" "gpuvisor-scheduler-extender" \
    "IP:127.0.0.1,DNS:localhost"

"$KUBECTL" -n "$NAMESPACE" create secret generic "$SECRET" --type=kubernetes.io/tls \
    --from-file=ca.crt="$dir/ca.crt" --from-file=tls.crt="$dir/tls.crt" \
    --from-file=tls.key="$dir/tls.key" --dry-run=client -o yaml | "$KUBECTL" apply -f -
