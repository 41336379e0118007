#!/usr/bin/env bash
# Data-parallel attention (--dp-attention): every DP group (one rank with
# TP 1, or TP consecutive ranks splitting its heads) runs attention for its
# own sequences over its own KV cache, the experts stay split over all ranks
# and the MoE layers exchange the groups' distinct rows. Against one rank,
# for a Mixtral (GQA cache) and a DeepSeek-V3 (latent cache, shared experts,
# a dense first layer) fixture, W = 2 and 4 with TP 1, and W = 4 as 2 DP
# groups of TP 2:
#   - a batch of prompts through the engine gives identical outputs, with
#     sequences on every DP group (tokens run per group, all non-zero);
#   - per-rank KV caches small enough to preempt give the same outputs;
#   - n-gram speculation on top changes nothing, nor does the leader's
#     distilled draft model proposing for sequences on both ranks;
#   - one sequence (the other DP groups idle, serving only their experts)
#     gives the same greedy tokens and f32 logits within 1e-5;
#   - the routed-token statistics the leader reports (--expert-stats) are the
#     whole group's, equal to one rank's;
# a DP group served through the coordinator (moe-worker --dp-attention)
# answers concurrent gRPC requests with one rank's tokens (requests that
# come one at a time go round the DP groups), reports each rank's load in
# /metrics and `moectl workers`, and drains on SIGTERM; and --dp-attention
# without a group is refused by name. (Handoffs into and out of DP groups:
# disagg_groups.sh.)
#
#   dp_attention.sh BIN_DIR FIXTURES_DIR CMP_LOGITS MPIRUN...
set -uo pipefail
bin=$1 fixtures=$2 cmp=$3
shift 3
mpirun=("$@")
. "$(dirname "$0")/../lib.sh"
test_begin moe-dp

comm_timeout=60000 # a hang guard: sanitized ranks on two cores are slow

errs() { grep -v "CUDA\|MiB of weights" "$1" | head -12; }

run() { # run OUTFILE W ARGS...: moe-generate on W ranks (1: alone)
  local out=$1 w=$2; shift 2
  if [ "$w" = 1 ]; then
    "$bin/moe-generate" "$@" >"$out" 2>"$out.err"
  else
    timeout 300 "${mpirun[@]}" -np "$w" "$bin/moe-generate" --dp-attention \
      --comm-timeout-ms "$comm_timeout" "$@" >"$out" 2>"$out.err"
  fi
}

# mixed lengths: some longer than a block, several that grow into a new
# block while decoding (what preempts with small caches)
cat >"$tmp/prompts.jsonl" <<'JSONL'
{"tokens": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], "max_tokens": 12}
{"tokens": [100, 200, 300], "max_tokens": 9}
{"tokens": [42], "max_tokens": 14}
{"tokens": [7, 7, 7, 7, 7, 7, 7, 7], "max_tokens": 10}
{"tokens": [31, 41, 59, 26, 53, 58, 97, 93, 23, 84, 62, 64, 33, 83], "max_tokens": 10}
{"tokens": [27, 18, 28, 18, 28, 45, 90, 45, 23, 53, 60, 28, 74, 71], "max_tokens": 10}
JSONL

models="mixtral deepseek_v3" shapes="2:1 4:1 4:2" one_shapes="2:1 4:2" # W:TP
if [ -n "${MOE_TEST_SANITIZER:-}" ]; then
  # the sanitizer passes (tests/run.sh, 3-20x slower): the latent-cache model,
  # DP over TP groups for the batches and DP over single ranks for the one
  # sequence (W=2 with TP 1 also runs the speculation case); the code paths
  # are the same for every model and width
  models=deepseek_v3 shapes="4:2" one_shapes="2:1"
  echo "($MOE_TEST_SANITIZER sanitizer pass: $models, W:TP = $shapes)"
fi
for model in $models; do
  m=$fixtures/$model
  b=(--model "$m" --prompts-file "$tmp/prompts.jsonl" --dtype f32 --kv-dtype f32 --ignore-eos
     --max-batch-tokens 16 --print-outputs)
  run "$tmp/ref.all" 1 "${b[@]}" --expert-stats "$tmp/ref.stats" ||
    { bad "$model W=1 batch failed: $(errs "$tmp/ref.all.err")"; continue; }
  grep '^request' "$tmp/ref.all" >"$tmp/ref"
  for shape in $shapes; do
    w=${shape%:*} tp=${shape#*:} groups=$((${shape%:*} / ${shape#*:}))
    name="$model DP W=$w TP=$tp"
    if ! run "$tmp/dp.all" "$w" "${b[@]}" --tp "$tp" --expert-stats "$tmp/dp.stats"; then
      bad "$name: exit non-zero: $(errs "$tmp/dp.all.err")"; continue
    fi
    per_rank=$(grep -o 'tokens run per group:.*' "$tmp/dp.all")
    grep '^request' "$tmp/dp.all" >"$tmp/dp"
    if cmp -s "$tmp/dp" "$tmp/ref"; then
      ok "$name: batch of 6 identical to one rank ($per_rank)"
    else
      bad "$name: batch differs"; diff "$tmp/dp" "$tmp/ref" | head -4
    fi
    # every DP group ran some of the batch
    ran=$(echo "$per_rank" | awk -F: '{n = 0; for (i = 1; i <= split($2, v, " "); i++) n += v[i] > 0; print n}')
    [ "$ran" = "$groups" ] && ok "$name: sequences on all $groups DP groups" || bad "$name: only $ran of $groups DP groups ran tokens ($per_rank)"
    # the leader's routed-token counts are the group's
    if grep -Eq '"expert_tokens": \[.*[1-9]' "$tmp/ref.stats" &&
       cmp -s <(grep -o '"expert_tokens".*' "$tmp/dp.stats") <(grep -o '"expert_tokens".*' "$tmp/ref.stats"); then
      ok "$name: --expert-stats equals one rank's"
    else
      bad "$name: expert stats differ: $(head -c 200 "$tmp/dp.stats") vs $(head -c 200 "$tmp/ref.stats")"
    fi
    # 2 blocks of 16 tokens per DP group: sequences wait and are preempted
    if run "$tmp/pre.all" "$w" "${b[@]}" --tp "$tp" --kv-blocks 2 && grep '^request' "$tmp/pre.all" | cmp -s - "$tmp/ref"; then
      ok "$name: 2 KV blocks per DP group, identical ($(grep -o '[0-9]* preemptions' "$tmp/pre.all"))"
    else
      bad "$name: small caches: $(errs "$tmp/pre.all.err")"; grep '^request' "$tmp/pre.all" | diff - "$tmp/ref" | head -4
    fi
  done
  # speculation on top (n-gram drafts verified on the drafting rank)
  if run "$tmp/spec.all" 2 "${b[@]}" --spec-tokens 3 && grep '^request' "$tmp/spec.all" | cmp -s - "$tmp/ref"; then
    ok "$model DP W=2 with --spec-tokens 3: identical ($(grep -o '[0-9]* proposed, [0-9]* accepted' "$tmp/spec.all"))"
  else
    bad "$model DP W=2 spec: $(errs "$tmp/spec.all.err")"
  fi
  # one sequence: DP group 0 runs it, the others only serve their experts
  g=(--model "$m" --tokens 3,14,15,92,65,35,89,79,32,38,46 -n 16 --dtype f32 --kv-dtype f32 --ignore-eos)
  run "$tmp/g1" 1 "${g[@]}" --logits-out "$tmp/g1.bin"
  for shape in $one_shapes; do
    w=${shape%:*} tp=${shape#*:}
    if run "$tmp/g2" "$w" "${g[@]}" --tp "$tp" --logits-out "$tmp/g2.bin" &&
       [ "$(grep '^tokens:' "$tmp/g2")" = "$(grep '^tokens:' "$tmp/g1")" ] &&
       r=$("$cmp" "$tmp/g2.bin" "$tmp/g1.bin" 1e-5); then
      ok "$model DP W=$w TP=$tp, one sequence (DP group 1 idle): tokens identical, $r"
    else
      bad "$model DP W=$w TP=$tp one sequence: $(errs "$tmp/g2.err") ${r:-}"
    fi
  done
done

# A draft model on the leader (its KV over the pool's global block ids)
# proposing for sequences on both ranks: the trained tiny model and its
# distilled draft; outputs are plain decoding's.
tiny=$(dirname "$0")/../../deploy/model
if [ -f "$tiny/moe-tiny-en/config.json" ] && [ -f "$tiny/draft-tiny-en-kd/config.json" ]; then
  d=(--model "$tiny/moe-tiny-en" --prompts-file "$tmp/prompts.jsonl" --dtype f32 --kv-dtype f32
     --ignore-eos --max-batch-tokens 16 --print-outputs)
  if run "$tmp/dref.all" 1 "${d[@]}" &&
     run "$tmp/ddp.all" 2 "${d[@]}" --draft-model "$tiny/draft-tiny-en-kd" --spec-tokens 3 \
       --spec-policy acceptance &&
     cmp -s <(grep '^request' "$tmp/ddp.all") <(grep '^request' "$tmp/dref.all") &&
     grep -q '^speculation:.* [1-9][0-9]* accepted' "$tmp/ddp.all"; then
    ok "moe-tiny-en DP W=2 with the distilled draft: identical to plain decoding ($(grep -o '[0-9]* proposed, [0-9]* accepted' "$tmp/ddp.all"))"
  else
    bad "DP with a draft model: $(errs "$tmp/ddp.all.err") $(grep '^speculation' "$tmp/ddp.all")"
  fi
else
  bad "deploy/model/moe-tiny-en or draft-tiny-en-kd missing"
fi

# Served: a DP group of 2 behind the coordinator, 4 requests at once.
m=$fixtures/mixtral
"${mpirun[@]}" -np 2 "$bin/moe-worker" --model "$m" --dtype f32 --kv-dtype f32 --dp-attention \
  --threads 1 --kv-memory 8 --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 \
  --comm-timeout-ms "$comm_timeout" >"$tmp/w.log" 2>"$tmp/w.err" &
pids+=($!)
if wait_for "$tmp/w.log" "/metrics on"; then
  grep -q "2 ranks, tp 1, dp attention" "$tmp/w.log" && ok "DP group up: $(head -1 "$tmp/w.log")" ||
    bad "DP group: $(head -1 "$tmp/w.log")"
  waddr=$(grep -o 'serving .* on 127\.0\.0\.1:[0-9]*' "$tmp/w.log" | grep -o '127.*')
  murl=http://$(grep -o '/metrics on 127\.0\.0\.1:[0-9]*' "$tmp/w.log" | grep -o '127.*')/metrics
  "$bin/moe-coordinator" --model "$m" --listen 127.0.0.1:0 --workers "$waddr" >"$tmp/c.log" 2>&1 &
  pids+=($!)
  wait_for "$tmp/c.log" "serving on" || bad "coordinator did not start"
  caddr=$(grep -o 'serving on 127\.0\.0\.1:[0-9]*' "$tmp/c.log" | grep -o '127.*')
  clients=()
  for i in 1 2 3 4; do
    toks=$((i * 11)),$((i * 7 + 3)),$((i + 40)),5,6
    "$bin/moe-generate" --model "$m" --tokens "$toks" -n 8 --dtype f32 --kv-dtype f32 --ignore-eos \
      2>/dev/null | grep '^tokens:' | cut -d' ' -f2- >"$tmp/want$i"
    # moe-client prints no ids; logprobs 0 sends each token id to stderr
    timeout 60 "$bin/moe-client" --addr "$caddr" --tokens "$toks" -n 8 --ignore-eos --logprobs 0 \
      >/dev/null 2>"$tmp/got$i.raw" &
    clients+=($!)
  done
  wait "${clients[@]}"
  same=0
  for i in 1 2 3 4; do
    grep -o '^\[token [0-9]*' "$tmp/got$i.raw" | grep -o '[0-9]*$' | tr '\n' ' ' | sed 's/ $//' >"$tmp/got$i"
    echo >>"$tmp/got$i"
    [ -s "$tmp/want$i" ] && cmp -s "$tmp/got$i" "$tmp/want$i" && same=$((same + 1))
  done
  [ $same = 4 ] && ok "4 concurrent requests through the coordinator: tokens identical to one rank" ||
    bad "$same of 4 served requests match one rank: $(cat "$tmp/got1") vs $(cat "$tmp/want1")"
  metrics=$(curl -sf "$murl")
  r0=$(echo "$metrics" | grep -E '^moe_dp_rank_computed_tokens_total\{(.*,)?dp_rank="0"\}' | awk '{print $2}')
  r1=$(echo "$metrics" | grep -E '^moe_dp_rank_computed_tokens_total\{(.*,)?dp_rank="1"\}' | awk '{print $2}')
  if [ -n "$r0" ] && [ -n "$r1" ] && [ "${r0%.*}" -gt 0 ] && [ "${r1%.*}" -gt 0 ]; then
    ok "/metrics: tokens run per DP group $r0 and $r1"
  else
    bad "/metrics per DP rank: '$r0' '$r1': $(echo "$metrics" | grep moe_dp | head -4)"
  fi
  # the coordinator polls the worker's load: wait for the per-rank line
  for _ in $(seq 300); do
    "$bin/moectl" --addr "$caddr" workers >"$tmp/ctl" 2>&1 && grep -q "dp attention over 2 groups" "$tmp/ctl" && break
    sleep 0.2
  done
  grep -q "dp attention over 2 groups, each [0-9]* KV blocks; used: [0-9]* [0-9]*; running: [0-9]* [0-9]*" "$tmp/ctl" &&
    ok "moectl workers: $(grep -o 'dp attention.*' "$tmp/ctl")" || bad "moectl workers: $(cat "$tmp/ctl")"
  leader=$(grep -o 'pid [0-9]*' "$tmp/w.log" | grep -o '[0-9]*')
  kill -TERM "$leader"
  gone() { local st; st=$(ps -o stat= -p "$1" 2>/dev/null) || return 0; [ "${st#Z}" != "$st" ]; }
  for _ in $(seq 600); do gone "${pids[0]}" && break; sleep 0.1; done
  if gone "${pids[0]}"; then
    wait "${pids[0]}"; rc=$?
    [ $rc = 0 ] && ok "SIGTERM: the DP group drained and exited 0" || bad "DP group exit $rc: $(errs "$tmp/w.err")"
  else
    bad "the DP group is still running 60 s after SIGTERM"
  fi
else
  bad "DP group did not start: $(errs "$tmp/w.err")"
fi

# refused by name
if "$bin/moe-generate" --model "$m" --tokens 3,14 -n 2 --dp-attention >"$tmp/one.out" 2>&1; then
  bad "--dp-attention without mpirun was accepted"
else
  grep -q "dp-attention and --placement need a group: run under mpirun" "$tmp/one.out" &&
    ok "--dp-attention without mpirun refused" || bad "--dp-attention alone: $(head -3 "$tmp/one.out")"
fi

test_end
