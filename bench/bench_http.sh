#!/usr/bin/env bash
# Latency the OpenAI HTTP front door adds over gRPC: one worker and one
# coordinator serving both, the same greedy streamed request sent ROUNDS
# times through each, alternated in one run:
#  1. bench-http: kept connections (one gRPC channel, one keep-alive HTTP
#     connection), every token one message / one SSE event; medians of
#     TTFT, per-token gap and end to end;
#  2. the stock clients, a new connection per request (moe-client, curl -N):
#     medians of TTFT and of the time per token after the first.
#
#   bench/bench_http.sh [BUILD_DIR] [ROUNDS] [TOKENS]
#   e.g. bench/bench_http.sh build 20 200
#   MODEL=DIR (default: the bundled tiny Qwen3-MoE; its decode steps are
#   ~0.1 ms, so the front door's own cost is what shows)
set -euo pipefail
build=${1:-build}
rounds=${2:-20}
tokens=${3:-200}
src=$(cd "$(dirname "$0")/.." && pwd)
model=${MODEL:-$src/tests/golden/fixtures/qwen3_moe}
bin=$build/bin
tmp=$(mktemp -d /tmp/moe-bench-http-XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT

wait_for() { # FILE REGEX: prints the first match's group 1
  for _ in $(seq 300); do
    if m=$(grep -oE "$2" "$1" 2>/dev/null | head -1) && [ -n "$m" ]; then
      echo "$m" | grep -oE '[0-9.]+:[0-9]+$'
      return 0
    fi
    sleep 0.1
  done
  echo "bench_http: no '$2' in $1:" >&2
  cat "$1" >&2
  return 1
}

"$bin/moe-worker" --model "$model" --listen 127.0.0.1:0 --dtype f32 --threads 1 \
  --kv-memory 64 >"$tmp/worker.log" 2>&1 &
pids+=($!)
worker=$(wait_for "$tmp/worker.log" 'serving [^ ]+ on [0-9.]+:[0-9]+')
"$bin/moe-coordinator" --model "$model" --listen 127.0.0.1:0 --workers "$worker" \
  --http-listen 127.0.0.1:0 >"$tmp/coord.log" 2>&1 &
pids+=($!)
http=$(wait_for "$tmp/coord.log" 'metrics on [0-9.]+:[0-9]+')
grpc=$(wait_for "$tmp/coord.log" 'serving on [0-9.]+:[0-9]+')
name=$(basename "$model")
prompt="The quick brown fox jumps over the lazy dog"
body="{\"model\":\"$name\",\"prompt\":\"$prompt\",\"max_tokens\":$tokens,\"temperature\":0,\
\"ignore_eos\":true,\"stream\":true}"
echo "model $model, $tokens tokens per request, $rounds rounds alternated; $(lscpu | grep 'Model name' | sed 's/ \+/ /g')"

echo "== kept connections (bench-http) =="
"$bin/bench-http" --grpc "$grpc" --http "$http" --model "$name" --requests "$rounds" \
  --tokens "$tokens"
echo "== a new connection per request (moe-client, curl -N) =="
# Warm-up (caches).
"$bin/moe-client" --addr "$grpc" --prompt "$prompt" -n "$tokens" >/dev/null
curl -s -N --noproxy '*' -o /dev/null -H 'Content-Type: application/json' -d "$body" "http://$http/v1/completions"

: >"$tmp/grpc.txt"
: >"$tmp/http.txt"
for _ in $(seq "$rounds"); do
  # moe-client: "client: TTFT 1.8 ms, TPOT 0.08 ms, end to end 86.0 ms"
  "$bin/moe-client" --addr "$grpc" --prompt "$prompt" -n "$tokens" |
    sed -n 's/^client: TTFT \([0-9.]*\) ms, TPOT \([0-9.]*\) ms.*/\1 \2/p' >>"$tmp/grpc.txt"
  # curl: the first body byte is the first token's event (the stream starts with it).
  curl -s -N --noproxy '*' -o /dev/null -H 'Content-Type: application/json' -d "$body" \
    -w '%{time_starttransfer} %{time_total}\n' "http://$http/v1/completions" |
    awk -v n="$tokens" '{ printf "%.3f %.4f\n", $1 * 1e3, ($2 - $1) * 1e3 / (n - 1) }' >>"$tmp/http.txt"
done

median() { sort -n | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
g_ttft=$(cut -d' ' -f1 "$tmp/grpc.txt" | median)
g_tpot=$(cut -d' ' -f2 "$tmp/grpc.txt" | median)
h_ttft=$(cut -d' ' -f1 "$tmp/http.txt" | median)
h_tpot=$(cut -d' ' -f2 "$tmp/http.txt" | median)
printf "%-28s %12s %16s\n" "front door (median)" "TTFT ms" "per token ms"
printf "%-28s %12.3f %16.4f\n" "gRPC (moe-client)" "$g_ttft" "$g_tpot"
printf "%-28s %12.3f %16.4f\n" "HTTP SSE (curl -N)" "$h_ttft" "$h_tpot"
awk -v a="$h_ttft" -v b="$g_ttft" -v c="$h_tpot" -v d="$g_tpot" \
  'BEGIN { printf "%-28s %+12.3f %+16.4f\n", "HTTP - gRPC", a - b, c - d }'
