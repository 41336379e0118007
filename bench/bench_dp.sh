#!/usr/bin/env bash
# Data-parallel attention against tensor-parallel attention on the
# DeepSeek-V3 shape (bench_mla.sh's model), W = 2 ranks under mpirun, the same
# KV memory per rank, in one run (interleaved rounds, medians):
#   tp2  heads split over both ranks; MLA's latent row is one per token and
#        shared by every head, so both ranks hold the whole latent cache;
#   ep   TP 1 without DP: every rank runs every sequence's attention;
#   dp   --dp-attention: each rank its own sequences over its own cache.
# The workload: N prompts of P tokens, M new tokens each, all at once
# through the engine (moe-generate --prompts-file), with a per-rank
# --kv-memory that holds about a third of them on one cache. Printed per
# mode: output tokens/s, sequences the pool held at once (peak running),
# preemptions, and the KV blocks the leader's pool has.
#
#   bench/bench_dp.sh [BUILD_DIR] [ROUNDS]     (N, P, M, KV_MIB from the environment)
set -euo pipefail
build=${1:-build}
rounds=${2:-3}
n=${N:-24} p=${P:-128} m=${M:-32} kv_mib=${KV_MIB:-6}
dsv3=${DSV3_MODEL:-/tmp/moe-bench-dsv3}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader
if [ ! -f "$dsv3/config.json" ]; then
  "$build/bin/moe-mkmodel" --arch deepseek_v3 --out "$dsv3" --vocab 32000 --hidden 1024 \
    --layers 8 --heads 16 --experts 64 --top-k 6 --ffn 256 --shared 2 --q-lora 384 \
    --kv-lora 256 --rope-dim 64 --nope-dim 64 --v-dim 64 --groups 8 --topk-groups 4 \
    --first-dense 1 --dense-ffn 2816 --dtype bf16 --seed 1
fi
prompts=$(mktemp /tmp/moe-bench-dp-XXXXXX.jsonl)
trap 'rm -f "$prompts"' EXIT
awk -v n="$n" -v p="$p" -v m="$m" 'BEGIN { srand(11); for (i = 0; i < n; i++) {
  printf "{\"tokens\": ["; for (j = 0; j < p; j++) printf "%s%d", (j ? ", " : ""), 1 + int(rand() * 31000)
  printf "], \"max_tokens\": %d}\n", m } }' >"$prompts"
echo "W=2, 1 thread per rank, $n prompts x $p tokens, $m new each, $kv_mib MiB KV per rank, $rounds rounds; $(lscpu | grep -m1 'Model name' | sed 's/  */ /g')"
declare -A tps peak pre blocks
for _ in $(seq "$rounds"); do
  for mode in tp2 ep dp; do
    case $mode in tp2) extra=(--tp 2) ;; ep) extra=(--tp 1) ;; dp) extra=(--dp-attention) ;; esac
    out=$(mpirun -np 2 "$build/bin/moe-generate" --model "$dsv3" --prompts-file "$prompts" \
          --threads 1 --ignore-eos --kv-memory "$kv_mib" "${extra[@]}" 2>/dev/null)
    tps[$mode]+="$(echo "$out" | awk '/^throughput:/ { print $2 }') "
    peak[$mode]=$(echo "$out" | grep -o 'peak running [0-9]*' | grep -o '[0-9]*$')
    pre[$mode]=$(echo "$out" | grep -o '[0-9]* preemptions' | grep -o '^[0-9]*')
    blocks[$mode]=$(echo "$out" | awk '/^engine:/ { print $2 }')
  done
done
median() { tr ' ' '\n' | grep . | sort -g | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }
printf "%-5s %16s %10s %12s %14s %8s\n" mode "output tok/s" "vs tp2" "peak running" "preemptions" "blocks"
base=$(echo "${tps[tp2]}" | median)
for mode in tp2 ep dp; do
  med=$(echo "${tps[$mode]}" | median)
  printf "%-5s %16s %9.2fx %12s %14s %8s\n" "$mode" "$med" "$(awk -v a="$med" -v b="$base" 'BEGIN { print a / b }')" \
    "${peak[$mode]}" "${pre[$mode]}" "${blocks[$mode]}"
done
