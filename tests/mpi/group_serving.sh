#!/usr/bin/env bash
# A worker group under mpirun (2 ranks, TP 2, experts split over both) serves
# gRPC requests through the coordinator: the tokens equal moe-generate's on
# one rank; SIGTERM to mpirun drains the group and every rank exits.
#
#   group_serving.sh BIN_DIR MODEL_DIR MPIRUN...
set -uo pipefail
bin=$1 model=$2
shift 2
. "$(dirname "$0")/../lib.sh"
test_begin moe-gs

"$@" -np 2 "$bin/moe-worker" --model "$model" --dtype f32 --tp 2 --threads 1 --kv-memory 32 \
  --listen 127.0.0.1:0 >"$tmp/w.log" 2>"$tmp/w.err" &
pids+=($!)
wait_for "$tmp/w.log" "serving" || { bad "group did not start: $(cat "$tmp/w.err")"; test_end; }
grep -q "2 ranks, tp 2" "$tmp/w.log" && ok "group up: $(cat "$tmp/w.log")" || bad "group: $(cat "$tmp/w.log")"
waddr=$(grep -o '127\.0\.0\.1:[0-9]*' "$tmp/w.log" | head -1)
"$bin/moe-coordinator" --model "$model" --listen 127.0.0.1:0 --workers "$waddr" >"$tmp/c.log" 2>&1 &
pids+=($!)
wait_for "$tmp/c.log" "serving on" || bad "coordinator did not start"
caddr=$(grep -o 'serving on 127\.0\.0\.1:[0-9]*' "$tmp/c.log" | grep -o '127.*')

want=$("$bin/moe-generate" --model "$model" --tokens 5,6,7,8,9,10 -n 12 --dtype f32 --ignore-eos 2>/dev/null | grep '^tokens:' | cut -d' ' -f2-)
# moe-client prints no ids; ask for logprobs 0 so each token id goes to stderr
got=$("$bin/moe-client" --addr "$caddr" --tokens 5,6,7,8,9,10 -n 12 --ignore-eos --logprobs 0 2>&1 >/dev/null |
      grep -o '^\[token [0-9]*' | grep -o '[0-9]*$' | tr '\n' ' ' | sed 's/ $//')
[ -n "$want" ] && [ "$got" = "$want" ] && ok "group served through the coordinator: tokens $got" \
  || bad "tokens via the group: '$got', one rank: '$want'"
clients=()
for i in 1 2 3 4; do
  timeout 60 "$bin/moe-client" --addr "$caddr" --prompt "request $i" -n 6 --quiet >"$tmp/r$i.out" 2>&1 &
  clients+=($!)
done
wait "${clients[@]}"
n_ok=$(grep -l "finish: length, 6 tokens" "$tmp"/r*.out | wc -l)
[ "$n_ok" = 4 ] && ok "4 concurrent requests served by the group" || bad "$n_ok of 4 concurrent requests"

kill -TERM "${pids[1]}"  # coordinator
# SIGTERM to the leader (as Kubernetes would send it): it drains, then stops
# the followers, and mpirun ends with every rank's exit code 0.
leader=$(grep -o 'pid [0-9]*' "$tmp/w.log" | grep -o '[0-9]*')
kill -TERM "$leader"
# mpirun is our child: a zombie still answers kill -0, so ask ps for its state
gone() { local st; st=$(ps -o stat= -p "$1" 2>/dev/null) || return 0; [ "${st#Z}" != "$st" ]; }
for _ in $(seq 600); do gone "${pids[0]}" && break; sleep 0.1; done
if ! gone "${pids[0]}"; then
  bad "the group is still running 60 s after SIGTERM"
else
  wait "${pids[0]}"; rc=$?
  grep -q "draining" "$tmp/w.err" && [ $rc -eq 0 ] && ok "SIGTERM: the group drained and exited 0" \
    || bad "SIGTERM: exit $rc: $(grep -v CUDA "$tmp/w.err" | tail -3)"
fi
test_end
