#!/usr/bin/env bash
# moe-generate's offline summary reports the steady-state decode step: the
# steps in which every request runs one token, after two warm-up steps.
# Eight requests of 12 tokens: the first token comes from the prefill, then
# 11 decode steps at batch 8, 9 counted; one request that stops after 3
# tokens leaves 2 full-batch decode steps, both warm-up: no line.
#
#   tests/cli/offline_summary.sh BUILD_BIN_DIR FIXTURES_DIR
set -uo pipefail
bin=$1 fixtures=$2
. "$(dirname "$0")/../lib.sh"
test_begin moe-offline

m=$fixtures/mixtral
for i in 1 2 3 4 5 6 7 8; do
  echo "{\"tokens\": [$((i * 3)), $((i * 5 + 1)), 7, 9], \"max_tokens\": 12}"
done >"$tmp/p.jsonl"
out=$("$bin/moe-generate" --model "$m" --prompts-file "$tmp/p.jsonl" --ignore-eos --dtype f32 2>&1)
line=$(echo "$out" | grep '^decode step at batch')
if echo "$line" | grep -Eq '^decode step at batch 8: median [0-9.]+ ms \(p10 [0-9.]+, p90 [0-9.]+\) over 9 steps'; then
  ok "$line"
else
  bad "steady-state line: '$line': $(echo "$out" | tail -3)"
fi
sed -i '1s/"max_tokens": 12/"max_tokens": 3/' "$tmp/p.jsonl"
out=$("$bin/moe-generate" --model "$m" --prompts-file "$tmp/p.jsonl" --ignore-eos --dtype f32 2>&1)
if echo "$out" | grep -q '^throughput:' && ! echo "$out" | grep -q '^decode step at batch'; then
  ok "no full-batch decode step after warm-up: no line"
else
  bad "with one short request: $(echo "$out" | grep -E '^(decode step|throughput)')"
fi
test_end
