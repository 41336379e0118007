#!/usr/bin/env bash
# A model replica over W ranks gives what one rank gives: for the tiny
# models (Mixtral, Qwen3-MoE, Qwen2-MoE with its q/k/v biases sliced by TP
# and its shared expert on every rank, OLMoE at TP = 1, DeepSeek-V3 with its
# latent attention's heads split by TP, the latent row computed on every
# rank, shared experts replicated), W = 2 and 4, TP = 1 and 2, experts over all
# ranks: the greedy tokens are identical and the f32 logits of every prompt
# position are within 1e-5 of W = 1 (with an f32 KV cache; with the default
# bf16 cache a 1e-6 difference in K can round to the other bf16 neighbour,
# so that case is held to 1e-4); a batch of prompts through the engine
# gives identical outputs; an uneven placement and one with replicated
# experts change nothing; a rank that dies mid-run makes the job end with a
# clear error within the communicator timeout.
#
#   model_parallel.sh BIN_DIR FIXTURES_DIR CMP_LOGITS MPIRUN...
set -uo pipefail
bin=$1 fixtures=$2 cmp=$3
shift 3
mpirun=("$@")
. "$(dirname "$0")/../lib.sh"
test_begin moe-mp

# A hang guard for the group's collectives: 4 ranks of a sanitized build on
# two cores can spend seconds between two steps (the dead-rank case below
# sets its own short timeout on purpose).
comm_timeout=60000

errs() { # errs FILE: what a failed run said, without the start-up banners
  grep -v "CUDA\|MiB of weights" "$1" | head -12
}

gen() { # gen OUTFILE LOGITS W ARGS...: tokens line into OUTFILE
  local out=$1 logits=$2 w=$3; shift 3
  if [ "$w" = 1 ]; then
    "$bin/moe-generate" "$@" --logits-out "$logits" >"$out" 2>"$out.err"
  else
    timeout 300 "${mpirun[@]}" -np "$w" "$bin/moe-generate" "$@" --logits-out "$logits" \
      --comm-timeout-ms "$comm_timeout" >"$out" 2>"$out.err"
  fi
}

batch() { # batch OUTFILE W ARGS...: request lines into OUTFILE
  local out=$1 w=$2; shift 2
  local run=("$bin/moe-generate")
  [ "$w" != 1 ] && run=(timeout 300 "${mpirun[@]}" -np "$w" "$bin/moe-generate"
                        --comm-timeout-ms "$comm_timeout")
  "${run[@]}" "$@" --print-outputs >"$out.all" 2>"$out.err"
  local rc=$?
  grep '^request' "$out.all" >"$out"
  return $rc
}

# Prompts: several lengths, including one longer than a KV block.
cat >"$tmp/prompts.jsonl" <<'JSONL'
{"tokens": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], "max_tokens": 12}
{"tokens": [100, 200, 300], "max_tokens": 9}
{"tokens": [42], "max_tokens": 14}
{"tokens": [7, 7, 7, 7, 7, 7, 7, 7], "max_tokens": 10}
JSONL

models="mixtral qwen3_moe qwen2_moe olmoe deepseek_v3 deepseek_v3_lite"
if [ -n "${MOE_TEST_SANITIZER:-}" ]; then
  # the sanitizer passes (tests/run.sh): one model per attention kind; the
  # plain pass holds every architecture to one rank
  models="mixtral deepseek_v3"
  echo "($MOE_TEST_SANITIZER sanitizer pass: models $models)"
fi
for model in $models; do
  m=$fixtures/$model
  common=(--model "$m" --tokens 3,14,15,92,65,35,89,79,32,38,46 -n 16 --dtype f32 --kv-dtype f32 --ignore-eos)
  gen "$tmp/ref.out" "$tmp/ref.bin" 1 "${common[@]}" || { bad "$model W=1 failed: $(cat "$tmp/ref.out.err")"; continue; }
  ref_tokens=$(grep '^tokens:' "$tmp/ref.out")
  bcommon=(--model "$m" --prompts-file "$tmp/prompts.jsonl" --dtype f32 --kv-dtype f32 --ignore-eos --max-batch-tokens 16)
  batch "$tmp/bref.out" 1 "${bcommon[@]}" || bad "$model batch W=1 failed"
  tps="1 2"
  [ "$model" = olmoe ] && tps=1 # its q/k norms span all heads: TP is refused (checked below)
  for w in 2 4; do
    for tp in $tps; do
      # DeepSeek-V3: expert parallel over 4 ranks, and TP 2 (heads split,
      # the latent row on both) with experts over 2 (CI time, x3 sanitized)
      case "$model:$w:$tp" in deepseek*:2:1 | deepseek*:4:2) continue ;; esac
      # sanitizer passes: W=4 as TP 2 x 2 is the W=2 TP=2 code twice over
      # (mpi/dp_attention runs 4:2 as well)
      [ -n "${MOE_TEST_SANITIZER:-}" ] && [ "$w:$tp" = 4:2 ] && continue
      # ThreadSanitizer looks for races inside a process, and a rank's
      # threads run the same code at W=4 as at W=2: W=2 alone there (4
      # TSan processes on two cores made this the CI's longest test, 128 s)
      [ "${MOE_TEST_SANITIZER:-}" = thread ] && [ "$w" = 4 ] && continue
      name="$model W=$w TP=$tp"
      if ! gen "$tmp/w.out" "$tmp/w.bin" "$w" "${common[@]}" --tp "$tp"; then
        bad "$name: exit non-zero: $(errs "$tmp/w.out.err")"; continue
      fi
      [ "$(grep '^tokens:' "$tmp/w.out")" = "$ref_tokens" ] && ok "$name: greedy tokens identical" \
        || bad "$name: tokens differ: $(grep '^tokens:' "$tmp/w.out") vs $ref_tokens"
      r=$("$cmp" "$tmp/w.bin" "$tmp/ref.bin" 1e-5) && ok "$name: logits $r" || bad "$name: logits $r"
      if batch "$tmp/b.out" "$w" "${bcommon[@]}" --tp "$tp" && cmp -s "$tmp/b.out" "$tmp/bref.out"; then
        ok "$name: batch of 4 through the engine identical"
      else
        bad "$name: batch differs"; diff "$tmp/b.out" "$tmp/bref.out" | head -4
      fi
    done
  done
  # the default bf16 KV cache; DeepSeek-V3's one latent row feeds every
  # head's K and V, so an element that rounds to the other bf16 neighbour
  # moves more logits (measured 1.9e-4 on the lite fixture): 1e-3 there
  ktol=1e-4
  case $model in deepseek*) ktol=1e-3 ;; esac
  kcommon=(--model "$m" --tokens 3,14,15,92,65,35,89,79,32,38,46 -n 16 --dtype f32 --kv-dtype bf16 --ignore-eos)
  if gen "$tmp/kref.out" "$tmp/kref.bin" 1 "${kcommon[@]}" &&
     gen "$tmp/k.out" "$tmp/k.bin" 2 "${kcommon[@]}" --tp "${tps##* }" &&
     [ "$(grep '^tokens:' "$tmp/k.out")" = "$(grep '^tokens:' "$tmp/kref.out")" ] &&
     r=$("$cmp" "$tmp/k.bin" "$tmp/kref.bin" "$ktol"); then
    ok "$model bf16 KV W=2 TP=${tps##* }: greedy tokens identical to W=1, $r"
  else
    bad "$model bf16 KV W=2 TP=${tps##* }: $(errs "$tmp/k.out.err") $(grep '^tokens:' "$tmp/k.out") ${r:-}"
  fi
done
# OLMoE under TP: refused at load, naming why
if gen "$tmp/o.out" "$tmp/o.bin" 2 --model "$fixtures/olmoe" --tokens 3,14,15 -n 2 --tp 2; then
  bad "olmoe --tp 2 was accepted"
else
  grep -q "q_norm and k_norm span all heads" "$tmp/o.out.err" && ok "olmoe --tp 2 refused: $(grep -m1 -o "OLMoE's.*implemented" "$tmp/o.out.err")" \
    || bad "olmoe --tp 2: $(errs "$tmp/o.out.err")"
fi

# Placements on the Qwen3-MoE and DeepSeek-V3 models (8 experts, 2 ranks; the
# DeepSeek one's shared experts on both): 5 + 3, a hot expert replicated on
# both ranks, and a live change to the replicated one while a batch runs.
placement_models="qwen3_moe deepseek_v3"
# sanitizer passes: the same placement code on the model that has more (shared experts, MLA)
[ -n "${MOE_TEST_SANITIZER:-}" ] && placement_models=deepseek_v3
for pm in $placement_models; do
  m=$fixtures/$pm
  common=(--model "$m" --tokens 3,14,15,92,65,35,89,79,32,38,46 -n 16 --dtype f32 --kv-dtype f32 --ignore-eos)
  gen "$tmp/ref.out" "$tmp/ref.bin" 1 "${common[@]}"
  ref_tokens=$(grep '^tokens:' "$tmp/ref.out")
  echo '{"n_rank": 2, "experts": [[0],[0],[0],[0],[0],[1],[1],[1]]}' >"$tmp/uneven.json"
  echo '{"n_rank": 2, "experts": [[0,1],[0],[0],[0],[1],[1],[1],[0,1]]}' >"$tmp/replicated.json"
  for pl in uneven replicated; do
    if gen "$tmp/w.out" "$tmp/w.bin" 2 "${common[@]}" --placement "$tmp/$pl.json" &&
       [ "$(grep '^tokens:' "$tmp/w.out")" = "$ref_tokens" ] &&
       r=$("$cmp" "$tmp/w.bin" "$tmp/ref.bin" 1e-5); then
      ok "$pm placement $pl: tokens identical, $r"
    else
      bad "$pm placement $pl: $(errs "$tmp/w.out.err") $(grep '^tokens:' "$tmp/w.out")"
    fi
  done
  # Moving experts while running (live placement change at a step boundary):
  # the batch's outputs do not change and the new epoch is in force at the end.
  bcommon=(--model "$m" --prompts-file "$tmp/prompts.jsonl" --dtype f32 --ignore-eos --max-batch-tokens 16)
  batch "$tmp/bref.out" 1 "${bcommon[@]}"
  if batch "$tmp/b.out" 2 "${bcommon[@]}" --placement-switch "$tmp/replicated.json" &&
     cmp -s "$tmp/b.out" "$tmp/bref.out" && grep -q "placement: epoch 1 in force" "$tmp/b.out.all"; then
    ok "$pm live placement switch: outputs unchanged; $(grep -m1 'placement: epoch' "$tmp/b.out.all")"
  else
    bad "$pm live placement switch: $(errs "$tmp/b.out.err")"; diff "$tmp/b.out" "$tmp/bref.out" | head -4
  fi
done
m=$fixtures/qwen3_moe
# int8 weights: W = 2 equals W = 1 (the same quantized rows, summed in the
# one-rank order), and experts gained by a live placement change are
# quantized as at load (outputs unchanged).
common8=(--model "$m" --tokens 3,14,15,92,65,35,89,79,32,38,46 -n 16 --dtype int8 --ignore-eos)
if gen "$tmp/ref8.out" "$tmp/ref8.bin" 1 "${common8[@]}" &&
   gen "$tmp/w8.out" "$tmp/w8.bin" 2 "${common8[@]}" &&
   [ "$(grep '^tokens:' "$tmp/w8.out")" = "$(grep '^tokens:' "$tmp/ref8.out")" ] &&
   r=$("$cmp" "$tmp/w8.bin" "$tmp/ref8.bin" 1e-5); then
  ok "int8 W=2: tokens identical to W=1, $r"
else
  bad "int8 W=2: $(errs "$tmp/w8.out.err") $(grep '^tokens:' "$tmp/w8.out")"
fi
bcommon8=(--model "$m" --prompts-file "$tmp/prompts.jsonl" --dtype int8 --ignore-eos --max-batch-tokens 16)
batch "$tmp/bref8.out" 1 "${bcommon8[@]}"
if batch "$tmp/b8.out" 2 "${bcommon8[@]}" --placement-switch "$tmp/replicated.json" &&
   cmp -s "$tmp/b8.out" "$tmp/bref8.out" && grep -q "placement: epoch 1 in force" "$tmp/b8.out.all"; then
  ok "int8 live placement switch: outputs unchanged"
else
  bad "int8 live placement switch: $(errs "$tmp/b8.out.err")"; diff "$tmp/b8.out" "$tmp/bref8.out" | head -4
fi
echo '{"n_rank": 2, "experts": [[0],[0],[0],[0],[0],[1],[1],[7]]}' >"$tmp/bad.json"
if gen "$tmp/w.out" "$tmp/w.bin" 2 "${common[@]}" --placement "$tmp/bad.json"; then
  bad "a placement naming rank 7 was accepted"
else
  grep -q "expert 7: rank 7 is not in \[0, 2)" "$tmp/w.out.err" && ok "bad placement refused: $(grep -m1 'rank 7' "$tmp/w.out.err")" \
    || bad "bad placement: $(cat "$tmp/w.out.err" | grep -v CUDA | head -3)"
fi

# Devices: every rank names what it opened (its local rank picks its GPU);
# a rank that cannot open its device makes the whole group fail at once,
# naming the rank and why (not hang in the NCCL set-up): here --device cuda
# on a machine without a GPU, or with fewer GPUs than ranks.
dcommon=(--model "$fixtures/mixtral" --tokens 3,14,15 -n 2 --dtype f32)
if gen "$tmp/d.out" "$tmp/d.bin" 2 "${dcommon[@]}" --device cpu &&
   grep -q "moe: rank 0 of 2 (local rank 0 of 2 on this node): cpu (" "$tmp/d.out.err" &&
   grep -q "moe: rank 1 of 2 (local rank 1 of 2 on this node): cpu (" "$tmp/d.out.err"; then
  ok "W=2 --device cpu: $(grep -m1 'moe: rank 1 of 2' "$tmp/d.out.err")"
else
  bad "W=2 device lines: $(errs "$tmp/d.out.err")"
fi
if gen "$tmp/d.out" "$tmp/d.bin" 2 "${dcommon[@]}" --device cuda; then
  grep -q "cuda:1" "$tmp/d.out.err" && ok "W=2 --device cuda: two GPUs, rank 1 on cuda:1" \
    || bad "W=2 --device cuda ran, but not on cuda:0 and cuda:1: $(errs "$tmp/d.out.err")"
else
  rc=$?
  if [ "$rc" != 124 ] && grep -Eq "rank [01]: " "$tmp/d.out.err"; then
    ok "W=2 --device cuda without a GPU per rank: the group refuses at once: $(grep -Em1 -o 'rank [01]: .{0,90}' "$tmp/d.out.err")"
  else
    bad "W=2 --device cuda (rc $rc): $(errs "$tmp/d.out.err")"
  fi
fi

# A rank dies mid-run. mpirun is told not to kill the job itself, so the
# survivors must notice through the 2 s communicator timeout, say so, and
# abort the job: the command must end by itself (not by the 120 s guard),
# non-zero.
start=$(date +%s)
MOE_TEST_FAULTS=1 MOE_FAULT_RANK=3 MOE_FAULT_AFTER_STEPS=5 timeout 120 "${mpirun[@]}" \
  --mca orte_abort_on_non_zero_status 0 -x MOE_TEST_FAULTS -x MOE_FAULT_RANK \
  -x MOE_FAULT_AFTER_STEPS -np 4 \
  "$bin/moe-generate" --model "$m" --tokens 5,6,7 -n 60 --dtype f32 --ignore-eos \
  --comm-timeout-ms 2000 >"$tmp/dead.out" 2>&1
rc=$?
took=$(( $(date +%s) - start ))
if [ $rc -ne 0 ] && [ $rc -ne 124 ] &&
   grep -q "timed out after 2000 ms waiting for rank 3" "$tmp/dead.out"; then
  ok "dead rank: job ended in ${took}s: $(grep -m1 'timed out' "$tmp/dead.out")"
else
  bad "dead rank: rc $rc after ${took}s"; grep -v CUDA "$tmp/dead.out" | head -8
fi

test_end
