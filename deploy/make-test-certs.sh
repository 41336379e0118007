#!/usr/bin/env bash
# Makes a test CA and certificates with openssl (ECDSA P-256, 30 days): for
# tests, the quick start over TLS and a Helm install on a test cluster.
# NOT for production: the CA key sits next to the certificates.
#
#   deploy/make-test-certs.sh OUTDIR [--name DNS]... [--release R] [--namespace NS]
#                                    [--ca-from DIR] [--prefix P]
#
# Writes to OUTDIR:
#   ca.crt ca.key              the test CA (reused when OUTDIR already has one)
#   server.crt server.key      serverAuth + clientAuth (every moe-serve process:
#                              it serves, and presents it to its peers for mutual TLS)
#   client.crt client.key      clientAuth only (moectl, moe-client, moe-bench, curl)
#   tls.crt tls.key            copies of server.*: the layout of a Kubernetes TLS Secret
#                              (with ca.crt), so OUTDIR works as --tls-dir and --etcd-tls-dir
# Subject alternative names of server.crt: 127.0.0.1, ::1, localhost, moe-serve, and
# the Helm chart's Service names for release R (default "demo") in namespace NS
# (default "moe"): R-moe-serve-coordinator, -coordinator-http, -etcd, *.R-moe-serve-etcd-headless,
# each short, .NS, .NS.svc and .NS.svc.cluster.local, plus every --name.
# --ca-from DIR signs with the CA of DIR (a second certificate from the same CA,
# e.g. to test a reload); --prefix P names the files P-server.crt ... instead.
# Every certificate gets a fresh random serial.
#
#   deploy/make-test-certs.sh /tmp/moe-certs
#   kubectl -n moe create secret generic moe-tls --from-file=tls.crt=/tmp/moe-certs/server.crt \
#       --from-file=tls.key=/tmp/moe-certs/server.key --from-file=ca.crt=/tmp/moe-certs/ca.crt
set -euo pipefail

usage() { sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; }
[ $# -ge 1 ] || { usage >&2; exit 2; }
case "$1" in -h|--help) usage; exit 0 ;; esac
out=$1
shift
names=() release=demo ns=moe ca_from="" prefix=""
while [ $# -gt 0 ]; do
  case "$1" in
    --name) names+=("$2"); shift 2 ;;
    --release) release=$2; shift 2 ;;
    --namespace) ns=$2; shift 2 ;;
    --ca-from) ca_from=$2; shift 2 ;;
    --prefix) prefix="$2-"; shift 2 ;;
    *) echo "make-test-certs: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
command -v openssl >/dev/null || { echo "make-test-certs: openssl not found (apt-get install openssl)" >&2; exit 1; }
mkdir -p "$out"
cadir=${ca_from:-$out}
if [ ! -s "$cadir/ca.key" ] || [ ! -s "$cadir/ca.crt" ]; then
  [ -z "$ca_from" ] || { echo "make-test-certs: no ca.crt/ca.key in $ca_from" >&2; exit 1; }
  openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30 \
    -subj "/CN=moe-serve test CA" -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -keyout "$out/ca.key" -out "$out/ca.crt" 2>/dev/null
elif [ -n "$ca_from" ] && [ "$ca_from" != "$out" ]; then
  cp "$ca_from/ca.crt" "$out/ca.crt"
fi

full="$release-moe-serve"
sans="IP:127.0.0.1,IP:::1,DNS:localhost,DNS:moe-serve"
for svc in "$full-coordinator" "$full-coordinator-http" "$full-etcd" "*.$full-etcd-headless"; do
  for suffix in "" ".$ns" ".$ns.svc" ".$ns.svc.cluster.local"; do
    sans+=",DNS:$svc$suffix"
  done
done
for n in "${names[@]+"${names[@]}"}"; do sans+=",DNS:$n"; done

sign() { # NAME CN EKU SAN...
  local name=$1 cn=$2 eku=$3 san=${4:-}
  local ext
  ext=$(mktemp)
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature"
    echo "extendedKeyUsage=$eku"
    [ -z "$san" ] || echo "subjectAltName=$san"
  } >"$ext"
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$cn" \
    -keyout "$out/$prefix$name.key" -out "$out/$prefix$name.csr" 2>/dev/null
  openssl x509 -req -in "$out/$prefix$name.csr" -CA "$cadir/ca.crt" -CAkey "$cadir/ca.key" \
    -set_serial "0x$(openssl rand -hex 16)" -days 30 -extfile "$ext" \
    -out "$out/$prefix$name.crt" 2>/dev/null
  rm -f "$ext" "$out/$prefix$name.csr"
  chmod 600 "$out/$prefix$name.key"
}
sign server "moe-serve" "serverAuth,clientAuth" "$sans"
sign client "moe-serve client" "clientAuth"
cp "$out/${prefix}server.crt" "$out/${prefix}tls.crt"
cp "$out/${prefix}server.key" "$out/${prefix}tls.key"
echo "make-test-certs: CA, server and client certificates in $out" \
  "(server serial $(openssl x509 -in "$out/${prefix}server.crt" -noout -serial | cut -d= -f2))"
