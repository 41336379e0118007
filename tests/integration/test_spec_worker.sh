#!/usr/bin/env bash
# A worker started with --spec-tokens serves through the coordinator exactly
# what plain decoding gives (moe-generate without speculation): greedy and
# seeded sampling, prompts that repeat themselves so drafts are taken; the
# worker's counters (GetLoad -> moectl --json) show drafts proposed and
# accepted. With DRAFT_DIR the guesses come from that draft model
# (--draft-model) instead of n-gram lookup.
#
#   test_spec_worker.sh BIN_DIR MODEL_DIR [DRAFT_DIR]
set -uo pipefail
bin=$1 model=$2 draft=${3:-}
. "$(dirname "$0")/../lib.sh"
test_begin moe-spec

dflags=()
[ -n "$draft" ] && dflags=(--draft-model "$draft")
# --spec-policy acceptance: drafts follow acceptance alone, so the counters
# checked below do not hang on measured step times (the cost policy, which
# may stop drafting on a model this small, is tested with a fake clock in
# unit/test_spec.c)
"$bin/moe-worker" --model "$model" --dtype f32 --threads 1 --kv-memory 16 --spec-tokens 3 \
  --spec-policy acceptance "${dflags[@]}" --listen 127.0.0.1:0 >"$tmp/w.log" 2>"$tmp/w.err" &
pids+=($!)
wait_for "$tmp/w.log" "serving" || { bad "worker did not start: $(cat "$tmp/w.err")"; test_end; }
waddr=$(grep -o 'on 127\.0\.0\.1:[0-9]*' "$tmp/w.log" | head -1 | cut -c4-)
"$bin/moe-coordinator" --model "$model" --listen 127.0.0.1:0 --workers "$waddr" >"$tmp/c.log" 2>&1 &
pids+=($!)
wait_for "$tmp/c.log" "serving on" || { bad "coordinator did not start"; test_end; }
caddr=$(grep -o 'serving on 127\.0\.0\.1:[0-9]*' "$tmp/c.log" | grep -o '127.*')

# ids: the token ids moe-client reports (--logprobs 0 prints each on stderr)
ids() { grep -o '^\[token [0-9]*' | grep -o '[0-9]*$' | tr '\n' ' ' | sed 's/ $//'; }
pattern=$(for _ in 1 2 3 4; do printf '11,12,13,14,15,16,'; done)
prompts=("${pattern%,}" "$(seq -s, 40 60)" "7,8,9,7,8,9,7,8,9,7,8")
for p in "${prompts[@]}"; do
  for mode in greedy seeded; do
    flags=(--ignore-eos)
    [ $mode = seeded ] && flags+=(--temperature 0.8 --top-k 20 --seed 7)
    want=$("$bin/moe-generate" --model "$model" --dtype f32 --tokens "$p" -n 24 "${flags[@]}" \
           2>/dev/null | grep '^tokens:' | cut -d' ' -f2-)
    got=$(timeout 60 "$bin/moe-client" --addr "$caddr" --tokens "$p" -n 24 "${flags[@]}" \
          --logprobs 0 2>&1 >/dev/null | ids)
    [ -n "$want" ] && [ "$got" = "$want" ] && ok "$mode, prompt ${p:0:20}...: identical to plain decoding" ||
      bad "$mode, prompt ${p:0:20}...: speculative '$got', plain '$want'"
  done
done

# the coordinator's view, polled after the last request ended
read -r drafts accepted < <(fresh_workers "$bin/moectl" "$caddr" | python3 -c '
import json, sys
w = json.load(sys.stdin)["workers"][0]
print(w["spec_draft_tokens"], w["spec_accepted_tokens"])')
[ "${accepted:-0}" -gt 0 ] && [ "$drafts" -ge "$accepted" ] &&
  ok "drafts proposed $drafts, accepted $accepted" ||
  bad "speculation counters: drafts '$drafts', accepted '$accepted'"
test_end
