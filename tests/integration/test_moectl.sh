#!/usr/bin/env bash
# moectl against real processes: a worker group of 2 ranks under mpirun (the
# tiny qwen3_moe fixture, experts split over both ranks) behind a
# moe-coordinator with a static --workers list; then, when etcd is
# installed, two coordinators sharing one etcd placement key.
#
#   test_moectl.sh BIN_DIR MODEL_DIR MPIRUN...
#
# Checks: status / workers list / drain work and --json parses; experts
# plan / apply / rollback move the epoch; a plan built on an old epoch, a
# plan naming a missing rank or expert, and a plan over the slot limit are
# refused with a reason; an unreachable coordinator gives the clear error;
# exit codes 0 / 1 / 2. The measured imbalance after apply needs the
# worker-side counters and switching (not checked here).
set -uo pipefail
bin=$1 model=$2
shift 2
. "$(dirname "$0")/../lib.sh"
test_begin moe-ctl
check() { # DESCRIPTION COMMAND...: passes when the command succeeds
  local what=$1
  shift
  if "$@"; then ok "$what"; else bad "$what"; fi
}
stop_clean() { # PID LOG NAME: SIGTERM, exit 0 and no sanitizer report in LOG
  kill -TERM "$1"
  wait "$1"
  local st=$?
  if [ $st = 0 ] && ! grep -qE "Sanitizer|runtime error" "$2"; then ok "$3 exits cleanly"
  else bad "$3: exit $st $(grep -E -A5 "Sanitizer|runtime error" "$2" | head -20)"; fi
}
py=python3
jq_() { # FILE EXPR: prints a Python expression over the JSON in FILE (as d)
  $py -c "import json,sys; d=json.load(open(sys.argv[1])); print($2)" "$1"
}
ctl() { # runs moectl; stdout to $tmp/out, stderr to $tmp/err; sets rc
  "$bin/moectl" --addr "$caddr" "$@" >"$tmp/out" 2>"$tmp/err"
  rc=$?
}

# ---- unreachable coordinator ----------------------------------------------------
port=$($py -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$bin/moectl" --addr "127.0.0.1:$port" --timeout-ms 3000 status >/dev/null 2>"$tmp/err"
rc=$?
[ $rc = 1 ] && grep -q "^moectl: cannot reach the coordinator at 127.0.0.1:$port: " "$tmp/err" &&
  ok "unreachable coordinator: exit 1, $(head -c 90 "$tmp/err")" ||
  bad "unreachable coordinator: rc $rc: $(cat "$tmp/err")"
"$bin/moectl" --bogus >/dev/null 2>&1
[ $? = 2 ] && ok "bad option: exit 2" || bad "bad option: not exit 2"

# ---- a 2-rank group and a static coordinator -------------------------------------
"$@" -np 2 "$bin/moe-worker" --model "$model" --dtype f32 --tp 2 --threads 1 --kv-memory 32 \
  --listen 127.0.0.1:0 >"$tmp/w.log" 2>"$tmp/w.err" &
pids+=($!)
wait_for "$tmp/w.log" "serving" || { bad "group did not start: $(cat "$tmp/w.err")"; test_end; }
waddr=$(grep -o '127\.0\.0\.1:[0-9]*' "$tmp/w.log" | head -1)
"$bin/moe-coordinator" --model "$model" --listen 127.0.0.1:0 --workers "$waddr" \
  --expert-slots 6 >"$tmp/c.log" 2>&1 &
pids+=($!)
wait_for "$tmp/c.log" "serving on" || { bad "coordinator did not start: $(cat "$tmp/c.log")"; test_end; }
caddr=$(grep -o 'serving on 127\.0\.0\.1:[0-9]*' "$tmp/c.log" | grep -o '127.*')
# until the first GetLoad poll the group size is unknown
for _ in $(seq 600); do
  ctl workers list --json
  [ "$(jq_ "$tmp/out" 'd["workers"][0]["ep_size"]' 2>/dev/null)" = 2 ] && break
  sleep 0.1
done

ctl status
[ $rc = 0 ] && grep -q "expert placement: epoch 0" "$tmp/out" && grep -q "$waddr" "$tmp/out" &&
  ok "status" || bad "status: rc $rc: $(cat "$tmp/out" "$tmp/err")"
ctl status --json
[ $rc = 0 ] && [ "$(jq_ "$tmp/out" 'd["model"], len(d["workers"]), d["placement_epoch"]')" = "qwen3_moe 1 0" ] &&
  ok "status --json parses" || bad "status --json: $(cat "$tmp/out" "$tmp/err")"
ctl workers list --json
[ $rc = 0 ] && [ "$(jq_ "$tmp/out" 'd["workers"][0]["state"], d["workers"][0]["ep_size"]')" = "serving 2" ] &&
  ok "workers list --json: serving, 2 ranks" || bad "workers list --json: $(cat "$tmp/out" "$tmp/err")"
ctl workers drain "$waddr"
[ $rc = 0 ] && grep -q draining "$tmp/out" && ok "workers drain" || bad "drain: $(cat "$tmp/out" "$tmp/err")"
ctl workers list
grep -q draining "$tmp/out" && ok "workers list shows draining" || bad "list after drain: $(cat "$tmp/out")"
ctl workers undrain "$waddr" --json
[ $rc = 0 ] && [ "$(jq_ "$tmp/out" 'd["state"]')" = serving ] && ok "workers undrain --json" ||
  bad "undrain: $(cat "$tmp/out" "$tmp/err")"
ctl workers drain nobody
[ $rc = 1 ] && grep -q "NOT_FOUND" "$tmp/err" && ok "drain of an unknown worker: exit 1, NOT_FOUND" ||
  bad "drain nobody: rc $rc $(cat "$tmp/err")"

ctl experts stats --json
[ $rc = 0 ] && [ "$(jq_ "$tmp/out" 'd["stats_layers"], d["stats_experts"], len(d["expert_tokens"])')" = "3 8 24" ] &&
  ok "experts stats --json: 3 layers x 8 experts" || bad "stats --json: $(cat "$tmp/out" "$tmp/err")"
ctl experts stats --layer 2
[ $rc = 0 ] && grep -q "layer 2" "$tmp/out" && ok "experts stats --layer 2" || bad "stats --layer: $(cat "$tmp/out" "$tmp/err")"
ctl experts stats --layer 9
[ $rc = 2 ] && ok "experts stats --layer 9: exit 2" || bad "stats --layer 9: rc $rc"
ctl experts show --json
[ $rc = 0 ] && [ "$(jq_ "$tmp/out" 'd["epoch"], d["n_rank"], d["slots_per_rank"], d["placement"]["layers"]["0"]')" = \
  "0 2 6 [[0], [0], [0], [0], [1], [1], [1], [1]]" ] && ok "experts show: epoch 0, default split" ||
  bad "show: $(cat "$tmp/out" "$tmp/err")"

# plan -> apply -> stale apply -> rollback
ctl experts plan --redundant 2 --dry-run -o "$tmp/plan.json"
[ $rc = 0 ] && grep -q "moves: 6 replicas" "$tmp/out" && [ "$(jq_ "$tmp/plan.json" 'd["base_epoch"], d["redundant"]')" = "0 2" ] &&
  ok "experts plan --redundant 2: 6 moves, plan file" || bad "plan: $(cat "$tmp/out" "$tmp/err")"
ctl experts show --json
[ "$(jq_ "$tmp/out" 'd["epoch"]')" = 0 ] && ok "plan changes nothing" || bad "plan changed the epoch"
ctl experts apply "$tmp/plan.json"
ctl experts show --json
[ "$(jq_ "$tmp/out" 'd["epoch"], d["redundant"], d["previous_epoch"]')" = "1 2 0" ] &&
  ok "experts apply: epoch 1 with 2 redundant replicas" || bad "apply: $(cat "$tmp/out" "$tmp/err")"
ctl experts apply "$tmp/plan.json"
[ $rc = 1 ] && grep -q "FAILED_PRECONDITION: plan built on epoch 0, current epoch is 1" "$tmp/err" &&
  ok "stale plan refused: $(cat "$tmp/err")" || bad "stale plan: rc $rc $(cat "$tmp/err")"

# plans that name a missing rank or expert, or overflow the slots (built on epoch 1)
edit() { # OUT PYTHON-STATEMENTS over p (the plan)
  $py -c "import json,sys; p=json.load(open(sys.argv[1])); p['base_epoch']=1; $2; json.dump(p, open(sys.argv[2],'w'))" \
    "$tmp/plan.json" "$1"
}
edit "$tmp/bad_rank.json" "p['placement']['layers']['1'][3]=[0,5]"
ctl experts apply "$tmp/bad_rank.json"
[ $rc = 1 ] && grep -q "INVALID_ARGUMENT: placement: layer 1 expert 3: rank 5 does not exist (the worker groups have 2 ranks)" "$tmp/err" &&
  ok "missing rank refused: $(cat "$tmp/err")" || bad "missing rank: rc $rc $(cat "$tmp/err")"
edit "$tmp/bad_expert.json" "p['placement']['layers']['2'].append([0])"
ctl experts apply "$tmp/bad_expert.json"
[ $rc = 1 ] && grep -q "layer 2: lists 9 experts, the model has 8 (expert 8 does not exist)" "$tmp/err" &&
  ok "missing expert refused: $(cat "$tmp/err")" || bad "missing expert: rc $rc $(cat "$tmp/err")"
edit "$tmp/short.json" "p['placement']['layers']['0'].pop()"
ctl experts apply "$tmp/short.json"
[ $rc = 1 ] && grep -q "expert 7 is missing" "$tmp/err" && ok "expert left out refused" ||
  bad "short layer: rc $rc $(cat "$tmp/err")"
edit "$tmp/full.json" "p['placement']['layers']['0']=[[0,1]]*8"
ctl experts apply "$tmp/full.json"
[ $rc = 1 ] && grep -q "layer 0 rank 0: holds 8 experts, more than its 6 slots" "$tmp/err" &&
  ok "slot overflow refused: $(cat "$tmp/err")" || bad "slot overflow: rc $rc $(cat "$tmp/err")"
ctl experts scale --redundant 5
[ $rc = 1 ] && grep -q "does not fit" "$tmp/err" && ok "scale that does not fit refused: $(cat "$tmp/err")" ||
  bad "scale 5: rc $rc $(cat "$tmp/out" "$tmp/err")"
echo '{"placement": 3}' >"$tmp/junk.json"
ctl experts apply "$tmp/junk.json"
[ $rc = 2 ] && ok "not a plan file: exit 2" || bad "junk plan: rc $rc"
ctl experts show --json
[ "$(jq_ "$tmp/out" 'd["epoch"]')" = 1 ] && ok "refused plans left epoch 1" || bad "epoch moved by a refused plan"

ctl experts rollback
ctl experts show --json
[ "$(jq_ "$tmp/out" 'd["epoch"], d["redundant"], d["placement"]["layers"]["0"]')" = \
  "2 0 [[0], [0], [0], [0], [1], [1], [1], [1]]" ] && ok "rollback: epoch 2 is the default split again" ||
  bad "rollback: $(cat "$tmp/out" "$tmp/err")"
ctl experts scale --redundant 3 --json
ctl experts show --json
[ "$(jq_ "$tmp/out" 'd["epoch"], d["redundant"]')" = "3 3" ] && ok "scale --redundant 3: epoch 3" ||
  bad "scale: $(cat "$tmp/out" "$tmp/err")"
ctl experts apply --auto
ctl status --json
[ "$(jq_ "$tmp/out" 'd["placement_epoch"]')" = 4 ] && ok "apply --auto: epoch 4 in status" ||
  bad "apply --auto: $(cat "$tmp/out" "$tmp/err")"
# the group still serves through the coordinator
"$bin/moe-client" --addr "$caddr" --prompt "hello" -n 4 --quiet >"$tmp/cl.out" 2>&1 &&
  grep -q "4 tokens" "$tmp/cl.out" && ok "requests still served" || bad "request: $(cat "$tmp/cl.out")"
stop_clean "${pids[1]}" "$tmp/c.log" "static coordinator"

# ---- etcd: two coordinators, one placement key -----------------------------------
if ! command -v etcd >/dev/null; then
  echo "skip etcd part: no etcd binary"
  test_end
fi
p1=$($py -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
p2=$($py -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
eurl=http://127.0.0.1:$p1
etcd --name n --data-dir "$tmp/etcd" --listen-client-urls "$eurl" --advertise-client-urls "$eurl" \
  --listen-peer-urls "http://127.0.0.1:$p2" --initial-advertise-peer-urls "http://127.0.0.1:$p2" \
  --initial-cluster "n=http://127.0.0.1:$p2" --heartbeat-interval 10 --election-timeout 100 \
  --log-level error >"$tmp/etcd.log" 2>&1 &
pids+=($!)
for _ in $(seq 600); do curl -sf "$eurl/health" >/dev/null && break; sleep 0.1; done
"$bin/moe-worker" --model "$model" --dtype f32 --threads 1 --kv-memory 16 --listen 127.0.0.1:0 \
  --etcd "$eurl" --worker-id w1 >"$tmp/w1.log" 2>&1 &
pids+=($!)
wait_for "$tmp/w1.log" "serving" || { bad "etcd worker did not start: $(cat "$tmp/w1.log")"; test_end; }
for i in 1 2; do
  "$bin/moe-coordinator" --model "$model" --listen 127.0.0.1:0 --etcd "$eurl" >"$tmp/e$i.log" 2>&1 &
  pids+=($!)
  wait_for "$tmp/e$i.log" "serving on" || { bad "etcd coordinator $i: $(cat "$tmp/e$i.log")"; test_end; }
done
a1=$(grep -o 'serving on 127\.0\.0\.1:[0-9]*' "$tmp/e1.log" | grep -o '127.*')
a2=$(grep -o 'serving on 127\.0\.0\.1:[0-9]*' "$tmp/e2.log" | grep -o '127.*')
caddr=$a1 ctl experts plan -o "$tmp/e_plan.json" --tolerance 0
caddr=$a2 ctl experts plan -o "$tmp/e_plan2.json"
caddr=$a1 ctl experts apply "$tmp/e_plan.json"
[ $rc = 0 ] && ok "etcd: apply through coordinator 1" || bad "etcd apply: $(cat "$tmp/err")"
caddr=$a2 ctl experts show --json
[ "$(jq_ "$tmp/out" 'd["epoch"], d["store"]')" = "1 /moe/placement/qwen3_moe" ] &&
  ok "etcd: coordinator 2 sees epoch 1 in /moe/placement/qwen3_moe" || bad "etcd show: $(cat "$tmp/out" "$tmp/err")"
caddr=$a2 ctl experts apply "$tmp/e_plan2.json"
[ $rc = 1 ] && grep -q "plan built on epoch 0, current epoch is 1" "$tmp/err" &&
  ok "etcd: coordinator 2's stale plan refused" || bad "etcd stale: rc $rc $(cat "$tmp/err")"
caddr=$a2 ctl experts rollback
caddr=$a1 ctl experts show --json
[ "$(jq_ "$tmp/out" 'd["epoch"], d["previous_epoch"]')" = "2 1" ] && ok "etcd: rollback seen by coordinator 1" ||
  bad "etcd rollback: $(cat "$tmp/out" "$tmp/err")"
ETCDCTL_API=3 etcdctl --endpoints "$eurl" get /moe/placement/qwen3_moe --print-value-only >"$tmp/key.json" 2>&1
[ "$(jq_ "$tmp/key.json" 'd["epoch"], d["previous"]["epoch"], d["placement"]["n_rank"], len(d["placement"]["layers"])')" = "2 1 1 3" ] &&
  ok "etcd key holds {epoch, placement, previous}" || bad "etcd key: $(head -c 300 "$tmp/key.json")"
n=${#pids[@]}
stop_clean "${pids[$((n - 2))]}" "$tmp/e1.log" "etcd coordinator 1"
stop_clean "${pids[$((n - 1))]}" "$tmp/e2.log" "etcd coordinator 2"
test_end
