#!/usr/bin/env bash
# Soak: a small cluster under steady load for a long time, sampling the
# resident memory (RSS), the open file descriptors and the KV blocks in use
# of every process; fails if any of them grows without bound.
#
#   bench/soak.sh [--minutes N] [--build DIR] [--interval S] [--out DIR]
#     --minutes N   how long the load runs (default 60; CI runs 1)
#     --build DIR   the build folder with bin/ (default build)
#     --interval S  seconds between samples (default 5)
#     --out DIR     where samples.csv and the processes' logs stay (default: a
#                   temporary folder, removed on success)
#
# The cluster: the bundled tiny Qwen3-MoE on a prefill worker, a decode
# worker (every request is a KV handoff) and a mixed worker, behind one
# coordinator with the HTTP API on. The load: moe-bench over gRPC (40
# requests/s, at most 4 in flight, random lengths) and a curl loop over HTTP
# (completions streamed and not, chat, a refused request), all the time.
#
# The rule (what "grows without bound" means here): for every process and
# series, a least-squares line is fitted to the samples of the second half
# of the run (the first half is warm-up: caches, allocator arenas, gRPC
# channels); the series fails when the line's rise over that half exceeds
# its tolerance:
#   RSS       max(4 MiB, 5% of its mean over the half)
#   open fds  4
#   KV blocks in use (workers, sampled under load)  max(8, 10% of the pool)
# and, once the load has stopped, every worker's pool must be whole (no block
# used, no handoff pending) within 30 s. At least 6 samples in the half are
# needed (shorter runs are refused). Exit 0 when all hold, 1 otherwise, with
# one line per series either way.
set -euo pipefail
cd "$(dirname "$0")/.."

minutes=60
build=build
interval=5
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --minutes) minutes=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --interval) interval=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
    *) echo "bench/soak.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
case "$minutes$interval" in
  *[!0-9.]*) echo "bench/soak.sh: --minutes and --interval take numbers" >&2; exit 2 ;;
esac
bin=$(cd "$build/bin" && pwd)
model=$PWD/tests/golden/fixtures/qwen3_moe
seconds=$(awk -v m="$minutes" 'BEGIN { printf "%d", m * 60 }')
if [ "$((seconds / interval))" -lt 12 ]; then
  echo "bench/soak.sh: $minutes min at one sample every $interval s gives fewer than 12 samples" >&2
  exit 2
fi
keep=1
if [ -z "$out" ]; then
  out=$(mktemp -d /tmp/moe-soak-XXXXXX)
  keep=0
fi
mkdir -p "$out"

pids=()
names=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

# start NAME VAR CMD...: runs CMD (logs in $out/NAME.log), sets VAR to the
# address it prints on its first " on HOST:PORT" line
start() {
  local name=$1 var=$2
  shift 2
  "$@" >"$out/$name.out" 2>"$out/$name.log" &
  pids+=($!)
  names+=("$name")
  for _ in $(seq 1 300); do
    if grep -q " on 127" "$out/$name.out" 2>/dev/null; then
      printf -v "$var" '%s' "$(grep -o ' on 127\.0\.0\.1:[0-9]*' "$out/$name.out" | head -1 | sed 's/ on //')"
      return 0
    fi
    sleep 0.1
  done
  echo "bench/soak.sh: $name did not start (log $out/$name.log)" >&2
  exit 1
}
worker() { # NAME ROLE
  start "$1" "$1" "$bin/moe-worker" --model "$model" --dtype f32 --threads 1 --role "$2" \
    --kv-blocks 256 --listen 127.0.0.1:0
}
worker prefill prefill
worker decode decode
worker mixed mixed
http_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
start coordinator coord "$bin/moe-coordinator" --model "$model" --listen 127.0.0.1:0 \
  --workers "$prefill,$decode,$mixed" --poll-ms 200 --http-listen "127.0.0.1:$http_port"
echo "soak: ${minutes} min, a sample every ${interval} s; processes ${names[*]} (pids ${pids[*]}); out $out"

# the load
"$bin/moe-bench" --quiet --base-url "$coord" --vocab-size 790 --ignore-eos \
  --random-input-len 48 --random-output-len 24 --random-range-ratio 0.5 \
  --request-rate 40 --max-concurrency 4 --duration "$seconds" --seed 7 \
  --save-result "$out/bench.json" >"$out/bench.out" 2>&1 &
bench_pid=$!
(
  end=$(( $(date +%s) + seconds ))
  i=0
  while [ "$(date +%s)" -lt "$end" ]; do
    i=$((i + 1))
    case $((i % 4)) in
      0) body='{"model": "qwen3_moe", "prompt": "Hello soak '"$i"'", "max_tokens": 8, "stream": true}' ;;
      1) body='{"model": "qwen3_moe", "prompt": "Hello soak '"$i"'", "max_tokens": 8}' ;;
      2) body='{"model": "qwen3_moe", "messages": [{"role": "user", "content": "hi '"$i"'"}], "max_tokens": 6}' ;;
      3) body='{"model": "qwen3_moe", "prompt": "x", "max_tokens": -1}' ;; # refused, 400
    esac
    path=/v1/completions
    [ $((i % 4)) = 2 ] && path=/v1/chat/completions
    curl -s -o /dev/null -m 10 -H 'Content-Type: application/json' -d "$body" \
      "http://127.0.0.1:$http_port$path" || true
    sleep 0.05
  done
) &
curl_pid=$!

# the samples: t, name, rss_kb, fds, kv_used (workers; -1 for the coordinator)
csv=$out/samples.csv
echo "t,name,rss_kb,fds,kv_used,kv_total" >"$csv"
kv_of() { # prints "used total" per worker address, from the coordinator's view
  "$bin/moectl" --addr "$coord" --json workers list 2>/dev/null |
    python3 -c 'import json, sys
for w in json.load(sys.stdin).get("workers", []):
    print(w["address"], int(w["kv_blocks_used"]), int(w["kv_blocks_total"]))' 2>/dev/null || true
}
sample() {
  local t=$1 kv
  kv=$(kv_of)
  for k in "${!pids[@]}"; do
    local p=${pids[$k]} n=${names[$k]} rss fds used=-1 total=-1 addr
    rss=$(awk '/^VmRSS:/ { print $2 }' "/proc/$p/status" 2>/dev/null || echo -1)
    fds=$(ls "/proc/$p/fd" 2>/dev/null | wc -l)
    [ -n "$rss" ] || rss=-1
    addr=${!n:-}
    if [ "$n" != coordinator ] && [ -n "$addr" ]; then
      read -r used total < <(echo "$kv" | awk -v a="$addr" '$1 == a { print $2, $3 }') || true
      used=${used:--1}
      total=${total:--1}
    fi
    echo "$t,$n,$rss,$fds,$used,$total" >>"$csv"
  done
}
t0=$(date +%s)
while kill -0 "$bench_pid" 2>/dev/null; do
  sample $(( $(date +%s) - t0 ))
  for p in "${pids[@]}"; do
    kill -0 "$p" 2>/dev/null || { echo "bench/soak.sh: process $p died (logs in $out)" >&2; exit 1; }
  done
  sleep "$interval"
done
wait "$bench_pid" || { echo "bench/soak.sh: moe-bench failed:" >&2; cat "$out/bench.out" >&2; exit 1; }
wait "$curl_pid" || true
grep -E "Successful requests|Failed requests|Request throughput" "$out/bench.out" || true

# after the load: every pool whole
whole=0
for _ in $(seq 1 300); do
  if [ "$(kv_of | awk '$2 != 0 { n++ } END { print n + 0 }')" = 0 ] && [ -n "$(kv_of)" ]; then
    whole=1
    break
  fi
  sleep 0.1
done

rc=0
python3 - "$csv" "$whole" <<'EOF' || rc=$?
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
whole = sys.argv[2] == "1"
t_end = max(int(r["t"]) for r in rows)
half = t_end / 2.0
bad = 0
def fit(pts):  # least-squares slope per second
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return (sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else 0.0), my
for name in sorted({r["name"] for r in rows}):
    mine = [r for r in rows if r["name"] == name and int(r["t"]) >= half]
    if len(mine) < 6:
        print("soak: %s: only %d samples in the second half" % (name, len(mine)))
        bad += 1
        continue
    span = int(mine[-1]["t"]) - int(mine[0]["t"])
    for key, label, tol in (("rss_kb", "RSS", None), ("fds", "open fds", None),
                            ("kv_used", "KV blocks", None)):
        pts = [(int(r["t"]), float(r[key])) for r in mine if float(r[key]) >= 0]
        if len(pts) < 6:
            continue
        slope, mean = fit(pts)
        rise = slope * span
        if key == "rss_kb":
            limit = max(4096.0, 0.05 * mean)
            unit = "KiB"
        elif key == "fds":
            limit = 4.0
            unit = "fds"
        else:
            total = max(float(r["kv_total"]) for r in mine)
            limit = max(8.0, 0.1 * total)
            unit = "blocks"
        ok = rise <= limit
        bad += not ok
        print("soak: %-11s %-9s mean %10.1f, rise over the second half %+9.1f %s (limit %.1f): %s"
              % (name, label, mean, rise, unit, limit, "ok" if ok else "GROWS"))
print("soak: every KV pool whole after the load: %s" % ("yes" if whole else "NO"))
sys.exit(1 if bad or not whole else 0)
EOF
if [ "$rc" = 0 ] && [ "$keep" = 0 ]; then
  cleanup
  trap - EXIT
  rm -rf "$out"
else
  echo "soak: samples and logs in $out"
fi
exit "$rc"
