#!/usr/bin/env bash
# Offline throughput of the engine on the benchmark-shape model (vocab 32000,
# hidden 1024, 8 layers, 16 heads, 4 KV heads, 8 experts, top-2, expert FFN
# 2816, bf16): N prompts with lengths drawn from 32..512 and 128 output tokens
# each (ignore_eos), at max running sequences 1, 8 and 32, all in one run so
# the ratios are measured on the same machine state. Also prints how many
# sequences fit a fixed KV budget with paging versus reserving the maximum
# length per sequence, and what a bf16 KV cache (--kv-dtype) does to the
# sequences that run at once in the same memory.
#
#   bench/bench_offline.sh [BUILD_DIR] [N_PROMPTS] [BATCHES]
#   e.g. bench/bench_offline.sh build 64 "1 8 32"
set -euo pipefail
build=${1:-build}
n=${2:-64}
batches=${3-"1 8 32"}  # "" skips the max-running sweep
threads=${THREADS:-2}
model=${MODEL:-/tmp/moe-bench-model}
out_tokens=128

if [ ! -f "$model/config.json" ]; then
  "$build/bin/moe-mkmodel" --arch mixtral --out "$model" --vocab 32000 --hidden 1024 \
    --layers 8 --heads 16 --kv-heads 4 --experts 8 --top-k 2 --ffn 2816 --dtype bf16 --seed 1
fi
prompts=$(mktemp /tmp/moe-bench-prompts-XXXXXX.jsonl)
trap 'rm -f "$prompts"' EXIT
# Deterministic lengths in [32, 512] and token ids (awk's srand is seeded).
awk -v n="$n" -v out="$out_tokens" 'BEGIN { srand(7);
  for (i = 0; i < n; i++) {
    len = 32 + int(rand() * 481); line = "{\"tokens\": [";
    for (j = 0; j < len; j++) line = line (j ? "," : "") (1 + int(rand() * 31999));
    print line "], \"max_tokens\": " out ", \"ignore_eos\": true}" } }' >"$prompts"

echo "model: $model (bench shape, bf16), $n prompts of 32..512 tokens, $out_tokens output tokens, $threads threads"
for b in $batches; do
  echo "== max running $b =="
  "$build/bin/moe-generate" --model "$model" --prompts-file "$prompts" --dtype bf16 \
    --threads "$threads" --max-running "$b" --max-batch-tokens 512 --kv-memory 1024 2>/dev/null |
    grep -E "^(time|throughput|latency|kv utilisation|engine)"
done

# KV element type: the same small --kv-memory as f32 and as bf16 (the CPU
# default), everything else equal. bf16 blocks are half the bytes, so twice
# as many fit and more sequences run at once (peak running) with fewer
# preemptions; the logits differ by the bf16 rounding of K and V only
# (tests/golden kvbf16).
kv_mib=${KV_MIB:-64}
for dt in f32 bf16; do
  echo "== --kv-dtype $dt, --kv-memory $kv_mib MiB, max running 64 =="
  "$build/bin/moe-generate" --model "$model" --prompts-file "$prompts" --dtype bf16 \
    --threads "$threads" --max-running 64 --max-batch-tokens 512 --kv-memory "$kv_mib" \
    --kv-dtype "$dt" 2>/dev/null | grep -E "^(time|throughput|engine)"
done

# Capacity of a fixed KV budget: paged (blocks held = ceil(len/16)) versus a
# reservation of max_position_embeddings (here 4096 in the generated config,
# or prompt+output max) per sequence, for the same prompt set.
awk -v out="$out_tokens" -v budget_blocks=1024 -v bs=16 'BEGIN{FS="[][]"}
  { n = split($2, a, ","); len[NR] = n + out }
  END {
    maxlen = 0; for (i in len) if (len[i] > maxlen) maxlen = len[i];
    used = 0; fit = 0;
    for (i = 1; i <= NR; i++) { b = int((len[i] + bs - 1) / bs); if (used + b > budget_blocks) break; used += b; fit++ }
    mean = 0; for (i in len) mean += len[i]; mean /= NR;
    printf "capacity of %d blocks x %d tokens: paged %d of %d sequences fit (mean %.0f tokens each, %.0f%% of slots used); reserving %d tokens per sequence fits %d\n",
      budget_blocks, bs, fit, NR, mean, 100 * mean * fit / (used * bs), maxlen, int(budget_blocks * bs / maxlen) }' "$prompts"
maxpos=$(grep -o '"max_position_embeddings": *[0-9]*' "$model/config.json" | grep -o '[0-9]*$')
echo "reserving max_position_embeddings ($maxpos tokens) per sequence fits $((1024 * 16 / maxpos)) sequences in the same budget"
