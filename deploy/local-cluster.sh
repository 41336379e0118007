#!/usr/bin/env bash
# A local cluster on the embedded defaults: etcd (when installed), two CPU
# workers on the bundled demo model (deploy/model/moe-tiny-en; Prometheus
# /metrics each) and a coordinator (gRPC, and the OpenAI-compatible HTTP API
# with /metrics), all on 127.0.0.1; sends one streaming request with
# moe-client, one with curl to /v1/completions and one to
# /v1/chat/completions (sampled, seeded: the same answers every run), prints
# the answers and the timings, then shuts everything down cleanly (SIGTERM:
# workers drain).
#
#   deploy/local-cluster.sh [--build DIR] [--model DIR] [--prompt TEXT] [--serve]
#     --serve   keep the cluster running until Ctrl-C (prints the address)
#     --no-etcd use the static --workers list even when etcd is installed
set -euo pipefail
caller=$PWD
cd "$(dirname "$0")/.."

build=build
model=deploy/model/moe-tiny-en
prompt="The secret of life is"
serve=0
use_etcd=1
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --prompt) prompt=$2; shift 2 ;;
    --serve) serve=1; shift ;;
    --no-etcd) use_etcd=0; shift ;;
    *) echo "local-cluster: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
case "$build" in /*) ;; *) [ -d "$build" ] || build="$caller/$build" ;; esac
bin=$build/bin
for b in moe-worker moe-coordinator moe-client; do
  [ -x "$bin/$b" ] || { echo "local-cluster: $bin/$b not built (run cmake --build $build)" >&2; exit 2; }
done

tmp=$(mktemp -d /tmp/moe-cluster-XXXXXX)
pids=()
cleanup() {
  # Workers and the coordinator drain on SIGTERM; etcd last.
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do
    for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null || true
  done
  rm -rf "$tmp"
}
trap cleanup EXIT INT TERM

# A free TCP port on 127.0.0.1 (bash's /dev/tcp tells us what is taken).
free_port() {
  local p
  while :; do
    p=$(( 20000 + RANDOM % 30000 ))
    (exec 3<>/dev/tcp/127.0.0.1/$p) 2>/dev/null || { echo $p; return; }
  done
}

# Waits until FILE contains PATTERN (or the process died); prints the line.
wait_line() {
  local file=$1 pattern=$2 pid=$3
  for _ in $(seq 300); do
    if grep -q "$pattern" "$file" 2>/dev/null; then grep -m1 "$pattern" "$file"; return 0; fi
    kill -0 "$pid" 2>/dev/null || { echo "local-cluster: process $pid exited:" >&2; cat "$file" >&2; return 1; }
    sleep 0.1
  done
  echo "local-cluster: timed out waiting for '$pattern' in $file" >&2; cat "$file" >&2; return 1
}

etcd_url=""
if [ $use_etcd = 1 ] && command -v etcd >/dev/null; then
  cport=$(free_port); pport=$(free_port)
  etcd --name local --data-dir "$tmp/etcd" --listen-client-urls "http://127.0.0.1:$cport" \
    --advertise-client-urls "http://127.0.0.1:$cport" --listen-peer-urls "http://127.0.0.1:$pport" \
    --initial-advertise-peer-urls "http://127.0.0.1:$pport" \
    --initial-cluster "local=http://127.0.0.1:$pport" --heartbeat-interval 10 \
    --election-timeout 100 >"$tmp/etcd.log" 2>&1 &
  pids+=($!)
  etcd_url="http://127.0.0.1:$cport"
  for _ in $(seq 100); do
    curl -fs "$etcd_url/health" >/dev/null 2>&1 && break; sleep 0.1
  done
  echo "etcd: $etcd_url"
fi

workers=()
for i in 1 2; do
  wargs=(--model "$model" --listen 127.0.0.1:0 --worker-id "worker-$i" --threads 1 --kv-memory 64
         --metrics-listen 127.0.0.1:0)
  [ -n "$etcd_url" ] && wargs+=(--etcd "$etcd_url" --lease-ttl 3)
  "$bin/moe-worker" "${wargs[@]}" >"$tmp/worker-$i.log" 2>"$tmp/worker-$i.err" &
  pids+=($!)
  line=$(wait_line "$tmp/worker-$i.log" "serving" "$!")
  echo "$line"
  wait_line "$tmp/worker-$i.log" "/metrics on" "$!"
  workers+=("$(echo "$line" | grep -o '127\.0\.0\.1:[0-9]*' | head -1)")
done

cargs=(--model "$model" --listen 127.0.0.1:0 --http-listen 127.0.0.1:0)
if [ -n "$etcd_url" ]; then cargs+=(--etcd "$etcd_url"); else cargs+=(--workers "$(IFS=,; echo "${workers[*]}")"); fi
"$bin/moe-coordinator" "${cargs[@]}" >"$tmp/coordinator.log" 2>"$tmp/coordinator.err" &
pids+=($!)
line=$(wait_line "$tmp/coordinator.log" "serving on" "$!")
echo "$line"
addr=$(echo "$line" | grep -o '127\.0\.0\.1:[0-9]*' | head -1)
line=$(wait_line "$tmp/coordinator.log" "HTTP API" "${pids[-1]}")
echo "$line"
http=$(echo "$line" | grep -o '127\.0\.0\.1:[0-9]*' | head -1)

# Wait until the coordinator sees both workers (etcd watch or first poll).
for _ in $(seq 50); do
  "$bin/moe-client" --addr "$addr" --info >/dev/null 2>&1 && break; sleep 0.1
done

echo "== moe-client --addr $addr --prompt \"$prompt\" =="
"$bin/moe-client" --addr "$addr" --prompt "$prompt" -n 32 --temperature 0.7 --top-p 0.9 --seed 1

echo "== curl http://$http/v1/completions =="
curl -s --noproxy '*' "http://$http/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$(basename "$model")\", \"prompt\": \"$prompt\", \"max_tokens\": 32,
       \"temperature\": 0.7, \"top_p\": 0.9, \"seed\": 2}"
echo
echo "== curl http://$http/v1/chat/completions =="
curl -s --noproxy '*' "http://$http/v1/chat/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$(basename "$model")\", \"max_tokens\": 32, \"temperature\": 0.7,
       \"top_p\": 0.9, \"seed\": 1,
       \"messages\": [{\"role\": \"user\", \"content\": \"Tell me something about computers.\"}]}"
echo

if [ $serve = 1 ]; then
  echo "cluster serving: gRPC on $addr, OpenAI HTTP API and /metrics on http://$http (Ctrl-C to stop)"
  wait "${pids[0]}"
fi
