#!/usr/bin/env bash
# The coordinator's added latency: one worker on the bundled tiny model and a
# coordinator in front of it on 127.0.0.1; bench-hop alternates direct and
# coordinated requests in one run.
#
#   bench/bench_hop.sh [BUILD_DIR] [REQUESTS] [TOKENS]
set -euo pipefail
build=${1:-build}
n=${2:-100}
tok=${3:-32}
model=tests/golden/fixtures/qwen3_moe
cd "$(dirname "$0")/.."
tmp=$(mktemp -d /tmp/moe-hop-XXXXXX)
pids=()
trap 'for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; rm -rf "$tmp"' EXIT
"$build/bin/moe-worker" --model "$model" --listen 127.0.0.1:0 --threads 1 --kv-memory 64 >"$tmp/w.log" 2>/dev/null &
pids+=($!)
for _ in $(seq 100); do grep -q serving "$tmp/w.log" && break; sleep 0.1; done
w=$(grep -o '127\.0\.0\.1:[0-9]*' "$tmp/w.log" | head -1)
"$build/bin/moe-coordinator" --model "$model" --listen 127.0.0.1:0 --workers "$w" >"$tmp/c.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do grep -q "serving on" "$tmp/c.log" && break; sleep 0.1; done
c=$(grep -o 'serving on 127\.0\.0\.1:[0-9]*' "$tmp/c.log" | grep -o '127.*')
sleep 0.5
"$build/bin/bench-hop" --coordinator "$c" --worker "$w" --requests "$n" --tokens "$tok"
