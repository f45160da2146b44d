#!/bin/sh
# Development TLS material for NATS: a throwaway CA and a server certificate valid for the
# compose service names and this host (deploy/compose.tls.yml mounts the directory).
#   deploy/nats/make-dev-certs.sh [OUT_DIR]     (default: deploy/nats/tls)
# Production: certificates from your own CA, with the names your clients dial.
set -eu
out=${1:-$(dirname "$0")/tls}
mkdir -p "$out"
cd "$out"
days=${DAYS:-365}
openssl req -x509 -newkey rsa:2048 -nodes -days "$days" -subj "/CN=mooncake-dev-ca" \
    -keyout ca-key.pem -out ca.pem 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=nats" \
    -keyout server-key.pem -out server.csr 2>/dev/null
printf 'subjectAltName=DNS:nats,DNS:nats-1,DNS:nats-2,DNS:nats-3,DNS:localhost,IP:127.0.0.1\n' \
    > san.ext
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca-key.pem -CAcreateserial \
    -days "$days" -extfile san.ext -out server.pem 2>/dev/null
rm -f server.csr san.ext ca.srl
# The server reads its key as whatever user the nats image runs as.
chmod 644 ca.pem server.pem server-key.pem
chmod 600 ca-key.pem
echo "wrote $out/ca.pem, $out/server.pem, $out/server-key.pem"
