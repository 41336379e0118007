#!/usr/bin/env bash
# moe-mkmodel --arch deepseek_v3 writes a checkpoint that loads and runs, and
# its latent KV cache is what the formula says: per token and layer one row
# of kv_lora_rank + qk_rope_head_dim, so a fixed --kv-memory holds
#   floor(MiB * 2^20 / (block_size * n_layer * (kv_lora + rope) * bytes))
# blocks (bf16 and f32): here 48 elements per token and layer, where K and
# V expanded per head (4 x (32 + 16) + 4 x 32) would take 320. Bad shapes are
# refused naming the flag.
#
#   tests/cli/mkmodel_mla.sh BUILD_BIN_DIR
set -uo pipefail
bin=$1
. "$(dirname "$0")/../lib.sh"
test_begin moe-mkmla

m=$tmp/dsv3
if "$bin/moe-mkmodel" --arch deepseek_v3 --out "$m" --vocab 512 --hidden 64 --layers 3 \
     --heads 4 --experts 8 --top-k 2 --ffn 32 --shared 2 --q-lora 32 --kv-lora 32 \
     --rope-dim 16 --nope-dim 32 --v-dim 32 --groups 4 --topk-groups 2 --first-dense 1 \
     --dense-ffn 96 --seed 3 >"$tmp/mk.out" 2>&1; then
  ok "moe-mkmodel deepseek_v3: $(tail -1 "$tmp/mk.out" | cut -c1-90)"
else
  bad "moe-mkmodel deepseek_v3: $(cat "$tmp/mk.out")"
fi
if out=$("$bin/moe-generate" --model "$m" --tokens 1,2,3,4 -n 6 --ignore-eos 2>&1) &&
   echo "$out" | grep -q '^tokens: \([0-9]* \)\{5\}[0-9]*$'; then
  ok "moe-generate runs it: $(echo "$out" | grep '^tokens:')"
else
  bad "moe-generate on the deepseek_v3 model: $(echo "$out" | tail -3)"
fi
for dt in bf16 f32; do
  size=2; [ $dt = f32 ] && size=4
  want=$(( (1 << 20) / (16 * 3 * (32 + 16) * size) ))
  eng=$(echo '{"tokens": [1, 2, 3], "max_tokens": 2}' |
        "$bin/moe-generate" --model "$m" --prompts-file /dev/stdin --kv-memory 1 --kv-dtype $dt \
          2>&1 | grep '^engine:')
  got=$(echo "$eng" | awk '{ print $2 }')
  bpt=$(echo "$eng" | grep -o '[0-9]* bytes per token' | grep -o '^[0-9]*')
  [ "$got" = "$want" ] && [ "$bpt" = $((3 * 48 * size)) ] &&
    ok "$dt: 1 MiB holds $got latent blocks, $bpt bytes per token (3 layers x 48 x $size B)" ||
    bad "$dt: 1 MiB holds '$got' blocks of '$bpt' bytes per token, the latent formula says $want of $((3 * 48 * size))"
done
expect_refusal() { # NAME SUBSTRING ARGS...
  local name=$1 sub=$2; shift 2
  if "$bin/moe-mkmodel" --arch deepseek_v3 --out "$tmp/x" --vocab 512 --hidden 64 --layers 2 \
       --heads 4 --experts 8 --top-k 2 --ffn 32 "$@" >"$tmp/r.out" 2>&1; then
    bad "$name: accepted"
  elif grep -q -- "$sub" "$tmp/r.out"; then
    ok "$name refused: $(head -1 "$tmp/r.out")"
  else
    bad "$name: $(head -2 "$tmp/r.out")"
  fi
}
expect_refusal "no latent sizes" "needs --kv-lora"
expect_refusal "groups" "--groups 3" --kv-lora 32 --rope-dim 16 --nope-dim 32 --v-dim 32 --groups 3
expect_refusal "dense without width" "--first-dense 1 needs --dense-ffn" --kv-lora 32 \
  --rope-dim 16 --nope-dim 32 --v-dim 32 --first-dense 1
expect_refusal "kv heads" "--kv-heads 2" --kv-lora 32 --rope-dim 16 --nope-dim 32 --v-dim 32 \
  --kv-heads 2
test_end
