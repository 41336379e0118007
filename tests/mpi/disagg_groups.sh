#!/usr/bin/env bash
# Disaggregated serving between multi-rank worker groups (mpirun): each TP
# rank of the prefill group sends its own KV heads to the decode ranks that
# hold them, across different TP sizes and block sizes:
#   A: prefill 2 ranks tp 2 (16-token blocks)  -> decode 1 rank (8-token blocks)
#   B: prefill 1 rank (16)                     -> decode 2 ranks tp 2 (4)
#   C: prefill 2 ranks tp 2 (16)               -> decode 2 ranks tp 2 (4)
#   D: prefill 2 ranks tp 2 (16)               -> decode 2 ranks tp 1 (16): attention
#      replicated, both decode ranks hold every head
#   E: prefill 2 ranks DP attention (16)       -> decode 2 ranks DP attention (8): a
#      sequence lives on one DP rank on each side; only that rank sends / receives
#   F: prefill 2 ranks tp 2 (16)               -> decode 2 ranks DP attention (8)
#   G: prefill 2 ranks DP attention (16)       -> decode 2 ranks tp 2 (4)
# Greedy tokens through each pair equal moe-generate's on one process, every
# request is handed off (no recompute), the transfer counters agree, and the
# block pools are whole afterwards; both DP ranks of each DP worker ran
# handed-off sequences (their /metrics). With a DeepSeek-V3 model (latent cache:
# one row per token on every rank) each decode rank receives the whole row
# once, from one prefill rank. With DRAFT_MODEL set, the decode workers
# speculate with that draft (--spec-tokens 3): a handed-off sequence arrives
# without the draft's K/V, which the first proposal computes, and the tokens
# stay those of plain decoding.
#
#   [DRAFT_MODEL=DIR] disagg_groups.sh BIN_DIR MODEL_DIR MPIRUN...
set -uo pipefail
bin=$1 model=$2
shift 2
. "$(dirname "$0")/../lib.sh"
test_begin moe-dg

# start NAME ROLE RANKS TP BLOCK_SIZE [MPIRUN...]: a worker (a group under mpirun when RANKS > 1)
start() {
  local name=$1 role=$2 np=$3 tp=$4 bs=$5
  shift 5
  local args=(--model "$model" --dtype f32 --threads 1 --kv-memory 16 --block-size "$bs"
              --role "$role" --listen 127.0.0.1:0 --worker-id "$name")
  [ -n "${DP:-}" ] && args+=(--dp-attention --metrics-listen 127.0.0.1:0)
  if [ "$role" = decode ] && [ -n "${DRAFT_MODEL:-}" ]; then
    # acceptance alone: the kept-draft count checked below must not hang on
    # measured step times (the cost policy has its own test, unit/test_spec.c)
    args+=(--spec-tokens 3 --draft-model "$DRAFT_MODEL" --spec-policy acceptance)
  fi
  if [ "$np" -gt 1 ]; then
    "$@" -np "$np" "$bin/moe-worker" "${args[@]}" --tp "$tp" >"$tmp/$name.log" 2>"$tmp/$name.err" &
  else
    "$bin/moe-worker" "${args[@]}" >"$tmp/$name.log" 2>"$tmp/$name.err" &
  fi
  pids+=($!)
}
mpirun=("$@")
start P2 prefill 2 2 16 "${mpirun[@]}"
start D1 decode 1 1 8
start P1 prefill 1 1 16
start D2 decode 2 2 4 "${mpirun[@]}"
start D3 decode 2 1 16 "${mpirun[@]}"
DP=1 start P3 prefill 2 1 16 "${mpirun[@]}"
DP=1 start D4 decode 2 1 8 "${mpirun[@]}"
declare -A addr
for w in P2 D1 P1 D2 D3 P3 D4; do
  wait_for "$tmp/$w.log" "serving" || { bad "$w did not start: $(grep -v CUDA "$tmp/$w.err" | tail -3)"; test_end; }
  addr[$w]=$(grep -o 'on 127\.0\.0\.1:[0-9]*' "$tmp/$w.log" | head -1 | cut -c4-)
done
ok "workers up: P2 ${addr[P2]} D1 ${addr[D1]} P1 ${addr[P1]} D2 ${addr[D2]} D3 ${addr[D3]} P3 ${addr[P3]} D4 ${addr[D4]}"

# coordinator NAME WORKER... -> its address in caddr[NAME]
declare -A caddr
coordinator() {
  local name=$1
  shift
  local list
  list=$(for w in "$@"; do printf '%s,' "${addr[$w]}"; done)
  "$bin/moe-coordinator" --model "$model" --listen 127.0.0.1:0 --workers "${list%,}" \
    >"$tmp/c$name.log" 2>&1 &
  pids+=($!)
  wait_for "$tmp/c$name.log" "serving on" || bad "coordinator $name did not start"
  caddr[$name]=$(grep -o 'serving on 127\.0\.0\.1:[0-9]*' "$tmp/c$name.log" | grep -o '127.*')
}
coordinator A P2 D1
coordinator B P1 D2
coordinator C P2 D2
coordinator D P2 D3
coordinator E P3 D4
coordinator F P2 D4
coordinator G P3 D2

# Prompts of 3, 17 and 41 tokens: inside one block, across blocks of every size.
prompts=("5,6,7" "$(seq -s, 20 36)" "$(seq -s, 100 3 220)")
declare -A want
for i in "${!prompts[@]}"; do
  want[$i]=$("$bin/moe-generate" --model "$model" --tokens "${prompts[$i]}" -n 10 --dtype f32 \
             --ignore-eos 2>/dev/null | grep '^tokens:' | cut -d' ' -f2-)
done
ask() { # COORD PROMPT -> token ids on stdout
  timeout 60 "$bin/moe-client" --addr "${caddr[$1]}" --tokens "$2" -n 10 --ignore-eos \
    --logprobs 0 2>&1 >/dev/null | grep -o '^\[token [0-9]*' | grep -o '[0-9]*$' | tr '\n' ' ' |
    sed 's/ $//'
}
for c in A B C D E F G; do
  for i in "${!prompts[@]}"; do
    got=$(ask "$c" "${prompts[$i]}")
    [ -n "${want[$i]}" ] && [ "$got" = "${want[$i]}" ] &&
      ok "$c: prompt of $(echo "${prompts[$i]}" | tr ',' '\n' | wc -l) tokens: $got" ||
      bad "$c: prompt $i: got '$got', one process: '${want[$i]}'"
  done
done

# 8 concurrent requests through C, and through E (DP to DP).
for c in C E; do
  clients=()
  for i in 1 2 3 4 5 6 7 8; do
    timeout 60 "$bin/moe-client" --addr "${caddr[$c]}" --prompt "concurrent request number $i" -n 6 \
      --ignore-eos --quiet >"$tmp/r$c$i.out" 2>&1 &
    clients+=($!)
  done
  wait "${clients[@]}"
  n_ok=$(grep -l "finish: length, 6 tokens" "$tmp"/r$c*.out | wc -l)
  [ "$n_ok" = 8 ] && ok "8 concurrent requests through $c" || bad "$n_ok of 8 concurrent requests through $c"
done

if grep -q "recomputing" "$tmp"/c*.log; then
  bad "a handoff failed and was recomputed: $(grep -h recomputing "$tmp"/c*.log | head -2)"
else
  ok "every request was handed off (no recompute)"
fi

# The counters (each coordinator's view, polled after the last request ended)
# and whole pools.
stats() { # COORD -> "ADDRESS in out bytes failures used" per worker (static workers: id = address)
  fresh_workers "$bin/moectl" "${caddr[$1]}" | python3 -c '
import json, sys
for w in json.load(sys.stdin)["workers"]:
    print(w["address"], w["kv_transfers_in"], w["kv_transfers_out"], w["kv_transfer_bytes"],
          w["kv_transfer_failures"], w["kv_blocks_used"], w["spec_accepted_tokens"])'
}
stats A >"$tmp/sA"
stats B >"$tmp/sB"
stats C >"$tmp/sC"
stats D >"$tmp/sD"
stats E >"$tmp/sE"
stats F >"$tmp/sF"
stats G >"$tmp/sG"
cat "$tmp"/s[A-G] | sort -u >"$tmp/s"
echo "worker in out bytes failures blocks-used:"
sed 's/^/  /' "$tmp/s"
read -r _ p2in p2out p2bytes p2fail _ < <(grep "^${addr[P2]} " "$tmp/s" | head -1)
read -r _ p1in p1out p1bytes p1fail _ < <(grep "^${addr[P1]} " "$tmp/s" | head -1)
read -r _ d1in d1out d1bytes d1fail _ < <(grep "^${addr[D1]} " "$tmp/s" | head -1)
read -r _ d2in d2out d2bytes d2fail _ < <(grep "^${addr[D2]} " "$tmp/s" | head -1)
read -r _ d3in d3out d3bytes d3fail _ < <(grep "^${addr[D3]} " "$tmp/s" | head -1)
read -r _ p3in p3out p3bytes p3fail _ < <(grep "^${addr[P3]} " "$tmp/s" | head -1)
read -r _ d4in d4out d4bytes d4fail _ < <(grep "^${addr[D4]} " "$tmp/s" | head -1)
[ "$d1in" = 3 ] && [ "$d2in" = 17 ] && [ "$d3in" = 3 ] && [ "$d4in" = 14 ] && [ "$p1out" = 3 ] &&
  [ "$p2out" = 20 ] && [ "$p3out" = 14 ] &&
  ok "handoffs: P2 -> 20 out, P1 -> 3, P3 -> 14; D1 <- 3 in, D2 <- 17, D3 <- 3, D4 <- 14" ||
  bad "handoff counts: P2 out $p2out, P1 out $p1out, P3 out $p3out, D1 in $d1in, D2 in $d2in, D3 in $d3in, D4 in $d4in"
# D3's two ranks both hold every head: it receives twice what was computed
# once; a DP worker's sequence is on one of its ranks: it receives it once
sent=$((p1bytes + p2bytes + p3bytes)) got=$((d1bytes + d2bytes + d3bytes + d4bytes))
[ "$sent" = "$got" ] && [ "$p2bytes" -gt 0 ] && [ "$d3bytes" -gt 0 ] && [ "$d4bytes" -gt 0 ] &&
  [ "$p3bytes" -gt 0 ] && ok "bytes sent ($sent) = bytes received" || bad "bytes sent $sent, received $got"
[ $((p1fail + p2fail + p3fail + d1fail + d2fail + d3fail + d4fail)) = 0 ] && ok "no transfer failures" ||
  bad "transfer failures: $p2fail $p1fail $p3fail $d1fail $d2fail $d3fail $d4fail"
# both DP ranks of P3 (prefill) and D4 (decode) ran handed-off sequences
for w in P3 D4; do
  murl=http://$(grep -o '/metrics on 127\.0\.0\.1:[0-9]*' "$tmp/$w.log" | grep -o '127.*')/metrics
  m=$(curl -sf "$murl")
  r0=$(echo "$m" | grep -E '^moe_dp_rank_computed_tokens_total\{(.*,)?dp_rank="0"\}' | awk '{print $2}')
  r1=$(echo "$m" | grep -E '^moe_dp_rank_computed_tokens_total\{(.*,)?dp_rank="1"\}' | awk '{print $2}')
  [ -n "$r0" ] && [ -n "$r1" ] && [ "${r0%.*}" -gt 0 ] && [ "${r1%.*}" -gt 0 ] &&
    ok "$w: tokens run on DP rank 0 and 1: $r0, $r1" || bad "$w per DP rank: '$r0' '$r1'"
done
if [ -n "${DRAFT_MODEL:-}" ]; then # the handed-off sequences were decoded speculatively
  acc=$(awk -v a="${addr[D1]} ${addr[D2]} ${addr[D3]} ${addr[D4]}" 'BEGIN { n = split(a, w, " ") }
        { for (i = 1; i <= n; i++) if ($1 == w[i]) s += $7 } END { print s + 0 }' "$tmp/s")
  [ "$acc" -gt 0 ] && ok "decode pools kept $acc draft tokens after the handoffs" ||
    bad "decode pools kept no draft token"
fi
whole=1
for _ in $(seq 300); do
  whole=1
  for c in A B C D E F G; do stats $c | awk '$6 != 0 { exit 1 }' || whole=0; done
  [ $whole = 1 ] && break
  sleep 0.1
done
[ $whole = 1 ] && ok "every block pool is whole" || bad "blocks still used: $(stats C)"
test_end
