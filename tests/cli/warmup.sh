#!/usr/bin/env bash
# moe-generate --warmup: the prompt's prefill runs once first, untimed and
# uncounted. With it the same tokens, the same per-expert token counts
# (--expert-stats) and the same number of profiled forwards (--profile) as
# without; with --prompts-file it is refused by name.
#
#   tests/cli/warmup.sh BUILD_BIN_DIR FIXTURES_DIR
set -uo pipefail
bin=$1 fixtures=$2
. "$(dirname "$0")/../lib.sh"
test_begin moe-warmup

m=$fixtures/qwen3_moe
run() { # OUT_PREFIX FLAGS...
  local out=$1
  shift
  "$bin/moe-generate" --model "$m" --tokens 5,17,33,2,9,41,8,3 -n 6 --ignore-eos --profile \
    --expert-stats "$out.json" "$@" >"$out.txt" 2>&1
}
if run "$tmp/plain" && run "$tmp/warm" --warmup; then
  ok "both runs finished"
else
  bad "a run failed: $(tail -3 "$tmp/plain.txt" "$tmp/warm.txt")"
fi
a=$(grep '^tokens:' "$tmp/plain.txt") b=$(grep '^tokens:' "$tmp/warm.txt")
if [ -n "$a" ] && [ "$a" = "$b" ]; then ok "same tokens ($a)"; else bad "tokens '$a' vs '$b'"; fi
if [ -s "$tmp/plain.json" ] && cmp -s "$tmp/plain.json" "$tmp/warm.json"; then
  ok "same expert statistics: the warm-up's tokens not counted"
else
  bad "expert statistics differ: $(diff "$tmp/plain.json" "$tmp/warm.json" | head -4)"
fi
fa=$(grep -o 'profile rank 0: [0-9]* forwards, [0-9]* tokens' "$tmp/plain.txt")
fb=$(grep -o 'profile rank 0: [0-9]* forwards, [0-9]* tokens' "$tmp/warm.txt")
if [ -n "$fa" ] && [ "$fa" = "$fb" ]; then ok "same profile count ($fa)"; else bad "profile '$fa' vs '$fb'"; fi
echo '{"tokens": [1, 2, 3], "max_tokens": 2}' >"$tmp/p.jsonl"
out=$("$bin/moe-generate" --model "$m" --prompts-file "$tmp/p.jsonl" --warmup 2>&1)
rc=$?
if [ "$rc" != 0 ] && echo "$out" | grep -q -- '--warmup goes with --prompt TEXT or --tokens IDS'; then
  ok "--warmup with --prompts-file refused by name"
else
  bad "--warmup with --prompts-file: rc $rc, '$out'"
fi
test_end
