# Sourced by scheduler-certificate.sh and webhook-certificate.sh: what they
# share.  Not a command of its own.

# issue_pair OUT CA_NAME LEAF_NAME SAN: a CA of its own named CA_NAME and a
# serving certificate for LEAF_NAME with the subject alternative names SAN
# (openssl's syntax), signed by it, valid DAYS days, written as ca.crt,
# tls.crt and tls.key (private) to OUT, or to a directory of its own that
# is removed at exit when OUT is empty; $dir names it.  The CA's key is
# deleted: the CA signs this pair only.  With OUT it says what it wrote and
# ends the script.
issue_pair() {
    dir=${1:-$(mktemp -d)}
    [ -n "$1" ] || trap 'rm -rf "$dir"' EXIT
    mkdir -p "$dir"
    umask 077
    openssl req -x509 -newkey rsa:2048 -nodes -days "$DAYS" \
        -subj "/CN=$2" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign" \
        -keyout "$dir/ca.key" -out "$dir/ca.crt" 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -subj "/CN=$3" \
        -keyout "$dir/tls.key" -out "$dir/tls.csr" 2>/dev/null
    cat > "$dir/ext.cnf" <<EXT
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=$4
EXT
    openssl x509 -req -in "$dir/tls.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
        -CAcreateserial -days "$DAYS" -extfile "$dir/ext.cnf" -out "$dir/tls.crt" 2>/dev/null
    rm -f "$dir/ca.key" "$dir/tls.csr" "$dir/ext.cnf" "$dir/ca.srl"
    if [ -n "$1" ]; then
        echo "wrote $dir/ca.crt $dir/tls.crt $dir/tls.key"
        exit 0
    fi
}
