#!/usr/bin/env bash
# Serving benchmark with moe-bench on the benchmark-shape model (bf16, random
# weights; made with moe-mkmodel when missing), all in one run so the ratios
# are measured on the same machine state:
#   1. one mixed worker behind a coordinator: a short request-rate sweep
#   2. the same worker at --max-concurrency 8 (rate inf), goodput at the seed
#      document's targets TTFT 150 ms / TPOT 50 ms
#   3. mixed (2 mixed workers) against disaggregated (1 prefill + 1 decode
#      worker) pools on one workload, each worker with THREADS/2 threads
# Results (vLLM-style JSON, per-request JSONL, PNG charts) go to OUT.
#
#   bench/bench_serving.sh [BUILD_DIR] [OUT_DIR]
#   env: MODEL (/tmp/moe-bench-640M), THREADS (2), IN (128), OUT_LEN (32),
#        RATES ("1,2,4,8"), N_SWEEP (24), N_CONC (24), N_DISAGG (24), DTYPE (bf16)
set -euo pipefail
build=$(cd "${1:-build}" && pwd)
out=${2:-/tmp/moe-bench-serving}
model=${MODEL:-/tmp/moe-bench-640M}
threads=${THREADS:-2}
in_len=${IN:-128}
out_len=${OUT_LEN:-32}
rates=${RATES:-1,2,4,8}
dtype=${DTYPE:-bf16}
mkdir -p "$out"
if [ ! -f "$model/config.json" ]; then
  "$build/bin/moe-mkmodel" --arch mixtral --out "$model" --vocab 32000 --hidden 1024 \
    --layers 8 --heads 16 --kv-heads 4 --experts 8 --top-k 2 --ffn 2816 --dtype bf16 --seed 1
fi
tmp=$(mktemp -d /tmp/moe-bench-serving-XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
# start NAME VAR CMD...: runs CMD, sets VAR to the address it prints
start() {
  local name=$1 var=$2
  shift 2
  "$@" >"$tmp/$name.out" 2>&1 &
  pids+=($!)
  for _ in $(seq 1 1200); do
    if grep -q " on 127" "$tmp/$name.out" 2>/dev/null; then
      printf -v "$var" '%s' "$(grep -o ' on 127\.0\.0\.1:[0-9]*' "$tmp/$name.out" | head -1 | sed 's/ on //')"
      return 0
    fi
    sleep 0.1
  done
  echo "$name did not start:" >&2
  cat "$tmp/$name.out" >&2
  exit 1
}
worker() { # NAME ROLE THREADS
  start "$1" "$1" "$build/bin/moe-worker" --model "$model" --dtype "$dtype" --threads "$3" \
    --role "$2" --kv-memory 1024 --listen 127.0.0.1:0
}
stop_all() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  pids=()
}
bench() { # NAME ADDR ARGS...
  local name=$1 addr=$2
  shift 2
  echo "== $name: moe-bench --base-url $addr $* (load before: $(cut -d' ' -f1-3 /proc/loadavg))"
  "$build/bin/moe-bench" --quiet --base-url "$addr" --vocab-size 32000 --ignore-eos \
    --random-input-len "$in_len" --random-output-len "$out_len" --random-range-ratio 0.5 \
    --warmup 8 --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
    --goodput ttft:150 tpot:50 --save-result "$out/$name.json" --save-requests "$out/$name.jsonl" \
    --plot "$out/$name" "$@"
}

echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores (shared), load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "model: $model ($dtype), workload: random $in_len +-50% prompt tokens, $out_len +-50% output tokens, ignore_eos"

worker w1 mixed "$threads"
start c1 c1 "$build/bin/moe-coordinator" --model "$model" --listen 127.0.0.1:0 --workers "$w1" --poll-ms 50
bench sweep "$c1" --num-prompts "${N_SWEEP:-24}" --sweep-rates "$rates" --seed 1
# other seeds: prompts the prefix cache has not seen
bench conc8 "$c1" --num-prompts "${N_CONC:-24}" --max-concurrency 8 --seed 2
stop_all

half=$(( threads > 1 ? threads / 2 : 1 ))
worker m1 mixed "$half"
worker m2 mixed "$half"
start cm cm "$build/bin/moe-coordinator" --model "$model" --listen 127.0.0.1:0 --workers "$m1,$m2" --poll-ms 50
bench mixed2 "$cm" --num-prompts "${N_DISAGG:-24}" --max-concurrency 8 --seed 3
stop_all
worker pw prefill "$half"
worker dw decode "$half"
start cd cd_ "$build/bin/moe-coordinator" --model "$model" --listen 127.0.0.1:0 --workers "$pw,$dw" --poll-ms 50
bench disagg "$cd_" --num-prompts "${N_DISAGG:-24}" --max-concurrency 8 --seed 3
stop_all
echo "results and charts in $out"
