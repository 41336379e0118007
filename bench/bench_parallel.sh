#!/usr/bin/env bash
# Expert/tensor parallel on the CPU under mpirun: for W = 1, 2, 4 ranks (TP 1
# unless TP is set), the forward-time split (attention, router, dispatch,
# expert compute, combine, other) and the bytes moved by dispatch + combine
# per token per MoE layer, measured against the formula
#   top_k * (W-1)/W * (4*d_model [row out] + 4 [expert id] + 4*d_model [row back])
# which assumes experts spread evenly, so a routed row leaves its rank with
# probability (W-1)/W. All runs happen in one invocation (ratios, not
# absolutes: this 2-core machine runs 4 ranks oversubscribed).
#
#   bench/bench_parallel.sh [BUILD_DIR] [MODEL_DIR]
set -euo pipefail
build=${1:-build}
model=${2:-/tmp/moe-bench-model}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader
if [ ! -f "$model/config.json" ]; then
  "$build/bin/moe-mkmodel" --arch mixtral --out "$model" --vocab 32000 --hidden 1024 \
    --layers 8 --heads 16 --kv-heads 4 --experts 8 --top-k 2 --ffn 2816 --dtype bf16 --seed 1
fi
d=$(grep -o '"hidden_size": *[0-9]*' "$model/config.json" | grep -o '[0-9]*$')
k=$(grep -o '"num_experts_per_tok": *[0-9]*' "$model/config.json" | grep -o '[0-9]*$')
tokens=$(awk 'BEGIN { srand(3); for (i = 0; i < 64; i++) printf "%s%d", (i ? "," : ""), 1 + int(rand() * 31000) }')
tp=${TP:-1}
printf "%-3s %-3s %9s %7s %7s %7s %7s %7s %7s %12s %12s\n" W TP "fwd_s" attn router dispatch experts combine other "B/tok/layer" formula
for w in 1 2 4; do
  threads=$(( w == 1 ? 2 : 1 ))
  t=$tp; [ "$w" -lt "$tp" ] && t=1
  run=("$build/bin/moe-generate" --model "$model" --tokens "$tokens" -n 32 --dtype bf16 --ignore-eos
       --threads "$threads" --profile)
  if [ "$w" = 1 ]; then out=$("${run[@]}" 2>&1); else out=$(mpirun -np "$w" "${run[@]}" --tp "$t" 2>&1); fi
  echo "$out" | grep '^profile rank' | awk -v w="$w" -v t="$t" -v d="$d" -v k="$k" '
    { for (i = 1; i <= NF; i++) {
        if ($i == "attention") at += $(i+1); if ($i == "router") ro += $(i+1);
        if ($i == "dispatch") di += $(i+1); if ($i == "experts") ex += $(i+1);
        if ($i == "combine") co += $(i+1); if ($i == "other") ot += $(i+1);
        if ($i == "ep_bytes_sent") by += $(i+1); if ($i == "moe_layer_tokens" && !mt) mt = $(i+1); }
      n++ }
    END { tot = at + ro + di + ex + co + ot;
          printf "%-3d %-3d %9.3f %6.0f%% %6.0f%% %6.0f%% %6.0f%% %6.0f%% %6.0f%% %12.1f %12.1f\n",
            w, t, tot / n, 100*at/tot, 100*ro/tot, 100*di/tot, 100*ex/tot, 100*co/tot, 100*ot/tot,
            (mt ? by / mt : 0), k * (w - 1) / w * (8 * d + 4) }'
done
