#!/usr/bin/env bash
# DeepSeek-V3-shaped model on the CPU beside the Mixtral benchmark shape,
# in one run: prefill (512 tokens) and decode (64 tokens) speed, medians of
# interleaved rounds; the KV bytes per token each one's cache holds (the
# latent row of kv_lora_rank + qk_rope_dim per layer against K and V of the
# KV heads), and how many 16-token blocks a fixed --kv-memory gives each;
# then the expert-parallel traffic per token at W = 2 and 4 against the
# formula (bench_parallel.sh).
#
#   DeepSeek-V3 shape: vocab 32000, hidden 1024, 8 layers (the first dense,
#   FFN 2816), 16 heads, q_lora_rank 384, kv_lora_rank 256, qk_rope 64,
#   qk_nope 64, v 64, 64 routed experts of 256 in 8 groups (best 4 kept),
#   top-6, 2 shared experts; bf16.
#   Mixtral shape: bench_offline.sh's (8 experts of 2816, top-2, 4 KV heads).
#
#   bench/bench_mla.sh [BUILD_DIR] [ROUNDS]
set -euo pipefail
build=${1:-build}
rounds=${2:-3}
threads=${THREADS:-2}
dsv3=${DSV3_MODEL:-/tmp/moe-bench-dsv3}
mix=${MODEL:-/tmp/moe-bench-model}
if [ ! -f "$dsv3/config.json" ]; then
  "$build/bin/moe-mkmodel" --arch deepseek_v3 --out "$dsv3" --vocab 32000 --hidden 1024 \
    --layers 8 --heads 16 --experts 64 --top-k 6 --ffn 256 --shared 2 --q-lora 384 \
    --kv-lora 256 --rope-dim 64 --nope-dim 64 --v-dim 64 --groups 8 --topk-groups 4 \
    --first-dense 1 --dense-ffn 2816 --dtype bf16 --seed 1
fi
if [ ! -f "$mix/config.json" ]; then
  "$build/bin/moe-mkmodel" --arch mixtral --out "$mix" --vocab 32000 --hidden 1024 \
    --layers 8 --heads 16 --kv-heads 4 --experts 8 --top-k 2 --ffn 2816 --dtype bf16 --seed 1
fi
prompt=$(awk 'BEGIN { srand(5); for (i = 0; i < 512; i++) printf "%s%d", (i ? "," : ""), 1 + int(rand() * 31000) }')
echo "threads $threads, $rounds interleaved rounds, bf16 weights, bf16 KV; $(lscpu | grep -m1 'Model name' | sed 's/  */ /g')"
declare -A pre dec
for _ in $(seq "$rounds"); do
  for m in dsv3 mix; do
    dir=$dsv3; [ "$m" = mix ] && dir=$mix
    out=$("$build/bin/moe-generate" --model "$dir" --tokens "$prompt" -n 65 --ignore-eos \
          --threads "$threads" 2>/dev/null)
    pre[$m]+="$(echo "$out" | awk '/^prefill:/ { print $(NF-1) }') "
    dec[$m]+="$(echo "$out" | awk '/^decode:/ { print $(NF-1) }') "
  done
done
median() { tr ' ' '\n' | grep . | sort -g | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }
printf "%-12s %14s %14s %12s %14s\n" model "prefill tok/s" "decode tok/s" "KV B/token" "blocks/64MiB"
for m in dsv3 mix; do
  dir=$dsv3; [ "$m" = mix ] && dir=$mix
  # the engine's own account of a 64 MiB pool: blocks and MiB
  eng=$(echo '{"tokens": [1, 2, 3], "max_tokens": 1}' |
        "$build/bin/moe-generate" --model "$dir" --prompts-file /dev/stdin --kv-memory 64 \
          --threads "$threads" 2>/dev/null | grep '^engine:')
  blocks=$(echo "$eng" | awk '{ print $2 }')
  bpt=$(echo "$eng" | grep -o '[0-9]* bytes per token' | grep -o '^[0-9]*')
  printf "%-12s %14s %14s %12s %14s\n" "$m" "$(echo "${pre[$m]}" | median)" \
    "$(echo "${dec[$m]}" | median)" "$bpt" "$blocks"
done
# what a per-head cache of the DeepSeek shape would hold (K: 16 x (64 + 64),
# V: 16 x 64 per layer, as transformers expands them) against the latent row
awk 'BEGIN { lat = 8 * (256 + 64) * 2; full = 8 * (16 * 128 + 16 * 64) * 2;
  printf "DeepSeek shape: latent %d B/token, expanded per-head K+V %d B/token: %.1fx the tokens per byte\n", lat, full, full / lat }'
echo "== expert-parallel traffic, DeepSeek shape =="
"$(dirname "$0")/bench_parallel.sh" "$build" "$dsv3"
