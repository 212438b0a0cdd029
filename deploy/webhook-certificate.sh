#!/bin/sh
# The webhook's serving certificate, made with openssl: a CA of its own
# (kept only as the webhook configuration's caBundle) and a certificate for
# the gpuvisor-webhook Service, stored as the Secret gpuvisor-webhook-tls.
#
#   deploy/webhook-certificate.sh              make the pair and apply the Secret
#   deploy/webhook-certificate.sh --ca-bundle  also put the CA into webhook.yaml's
#                                              Mutating- and ValidatingWebhookConfiguration
#                                              (applied)
#   deploy/webhook-certificate.sh --out DIR    only write ca.crt, tls.crt, tls.key to DIR
#
# Run it again to renew (valid DAYS, default 825): the Secret is replaced,
# the kubelet updates the mounted files and `gpuvisor webhook` reloads them;
# with --ca-bundle the configuration gets the new CA.  cert-manager users
# can instead issue a Certificate for the same DNS names into the same
# Secret and annotate the configuration with
# cert-manager.io/inject-ca-from: gpuvisor/<certificate name>.
set -eu
. "$(dirname "$0")/certificate-lib.sh"

NAMESPACE=${NAMESPACE:-gpuvisor}
SERVICE=${SERVICE:-gpuvisor-webhook}
SECRET=${SECRET:-gpuvisor-webhook-tls}
WEBHOOK_CONFIG=${WEBHOOK_CONFIG:-gpuvisor-webhook}
GUARD_CONFIG=${GUARD_CONFIG:-gpuvisor-allocation-guard}
DAYS=${DAYS:-825}
KUBECTL=${KUBECTL:-kubectl}

out=""
ca_bundle=0
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out=${2:?--out needs a directory}; shift 2 ;;
        --ca-bundle) ca_bundle=1; shift ;;
        *) echo "webhook-certificate.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

issue_pair "$out" "gpuvisor-webhook-ca" "$SERVICE.$NAMESPACE.svc" \
    "DNS:$SERVICE,DNS:$SERVICE.$NAMESPACE,DNS:$SERVICE.$NAMESPACE.svc,DNS:$SERVICE.$NAMESPACE.svc.cluster.local"

"$KUBECTL" -n "$NAMESPACE" create secret tls "$SECRET" \
    --cert="$dir/tls.crt" --key="$dir/tls.key" --dry-run=client -o yaml | "$KUBECTL" apply -f -
if [ "$ca_bundle" = 1 ]; then
    bundle=$(base64 < "$dir/ca.crt" | tr -d '\n')
    "$KUBECTL" patch mutatingwebhookconfiguration "$WEBHOOK_CONFIG" --type=json \
        -p "[{\"op\":\"add\",\"path\":\"/webhooks/0/clientConfig/caBundle\",\"value\":\"$bundle\"}]"
    "$KUBECTL" patch validatingwebhookconfiguration "$GUARD_CONFIG" --type=json \
        -p "[{\"op\":\"add\",\"path\":\"/webhooks/0/clientConfig/caBundle\",\"value\":\"$bundle\"}]"
fi
