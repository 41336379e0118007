#!/usr/bin/env bash
# moe-bench under mpirun: -np 1 and -np 3 at the same total rate and prompts
# against one fake gRPC server (fake_server.py). Same request count, the same
# global arrival schedule (the ranks' shares add up to it), disjoint request
# ids (request i on rank i % 3), records from every rank in rank 0's result,
# and throughput that does not depend on the number of ranks.
#
#   test_bench_mpi.sh BIN_DIR SOURCE_DIR MPIRUN...
set -uo pipefail
bin=$1 src=$2
shift 2
. "$src/tests/lib.sh"
py=python3
$py -c 'import grpc, grpc_tools' 2>/dev/null || { echo "SKIPPED: python3 grpcio / grpcio-tools missing"; exit 77; }
test_begin moe-bench-mpi
$py -m grpc_tools.protoc -I "$src/proto" --python_out="$tmp" --grpc_python_out="$tmp" \
  "$src/proto/moe/v1/inference.proto" || { bad "stubs"; test_end; }
$py "$src/tests/bench/fake_server.py" grpc --stubs "$tmp" --ttft-ms 50 --slow-ttft-ms 50 \
  --itl-ms 20 >"$tmp/fake.log" 2>&1 &
pids+=($!)
wait_for "$tmp/fake.log" "listening on" || { bad "fake server: $(cat "$tmp/fake.log")"; test_end; }
addr=$(sed -n 's/listening on //p' "$tmp/fake.log")
# a second target, told apart by its slower first token
$py "$src/tests/bench/fake_server.py" grpc --stubs "$tmp" --ttft-ms 400 --slow-ttft-ms 400 \
  --itl-ms 20 >"$tmp/fake2.log" 2>&1 &
pids+=($!)
wait_for "$tmp/fake2.log" "listening on" || { bad "fake server 2: $(cat "$tmp/fake2.log")"; test_end; }
addr2=$(sed -n 's/listening on //p' "$tmp/fake2.log")

args=(--base-url "$addr" --random-input-len 16 --random-output-len 5 --num-prompts 24
      --request-rate 12 --seed 7 --quiet)
for np in 1 3; do
  timeout 120 "$@" -np $np "$bin/moe-bench" "${args[@]}" --save-result "$tmp/np$np.json" \
    --save-requests "$tmp/np$np.jsonl" >"$tmp/np$np.out" 2>"$tmp/np$np.err"
  rc=$?
  [ $rc = 0 ] && ok "mpirun -np $np: exit 0" || bad "mpirun -np $np: exit $rc: $(tail -20 "$tmp/np$np.err")"
done
# --base-url A,B: ranks 0 and 2 drive A, rank 1 drives B
timeout 120 "$@" -np 3 "$bin/moe-bench" "${args[@]}" --base-url "$addr,$addr2" \
  --save-result "$tmp/two.json" --save-requests "$tmp/two.jsonl" >"$tmp/two.out" 2>"$tmp/two.err" ||
  bad "two targets: $(tail -5 "$tmp/two.err")"
grep -q "Ranks / targets:  *3 / " "$tmp/np3.out" && ok "the table names 3 ranks" || bad "table: $(head -5 "$tmp/np3.out")"
cat >"$tmp/check.py" <<'PYEOF'
import json, sys
t = sys.argv[1]
d1, d3 = (json.load(open(f"{t}/np{n}.json")) for n in (1, 3))
r1, r3 = ([json.loads(l) for l in open(f"{t}/np{n}.jsonl")] for n in (1, 3))
def check(what, cond):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        print("     np1:", d1["completed"], d1["request_throughput"], "np3:", d3["completed"],
              d3["request_throughput"], sorted(set(d3["ranks"])))
check("same request count: 24 completed with 1 and with 3 ranks",
      d1["completed"] == d3["completed"] == 24 and d1["failed"] == d3["failed"] == 0)
check("disjoint request ids, request i on rank i % 3",
      len(set(d3["request_ids"])) == 24 and set(d3["request_ids"]) == set(d1["request_ids"])
      and all(x["rank"] == x["index"] % 3 for x in r3) and all(x["rank"] == 0 for x in r1))
check("records from every rank in rank 0's result", sorted(set(d3["ranks"])) == [0, 1, 2]
      and d3["num_ranks"] == 3)
a1 = sorted(x["arrival_s"] for x in r1); a3 = sorted(x["arrival_s"] for x in r3)
check("the ranks' arrivals add up to the one-rank schedule (12/s, 2 s)",
      len(a3) == 24 and all(abs(x - y) < 1e-9 for x, y in zip(a1, a3)) and abs(a1[-1] - 2.0) < 1e-9)
per_rank = [sum(1 for x in r3 if x["rank"] == k) for k in range(3)]
check(f"each rank drove a third of the prompts {per_rank}", per_rank == [8, 8, 8])
check("requests left on time on every rank (start - arrival < 2 s: a hang guard)",
      all(x["start_s"] - x["arrival_s"] < 2.0 for x in r3))
rt1, rt3 = d1["request_throughput"], d3["request_throughput"]
check(f"request throughput independent of the rank count ({rt1:.2f} vs {rt3:.2f} req/s)",
      abs(rt1 - rt3) / rt1 < 0.5)
r2 = [json.loads(l) for l in open(f"{t}/two.jsonl")]
check("--base-url A,B: rank r drives target r % 2 (B scripts its first token at 400 ms, A at 50)",
      len(r2) == 24 and all(x["success"] and x["target"] == x["rank"] % 2 for x in r2)
      and all(x["server_timings"]["ttft_ms"] == (400 if x["rank"] == 1 else 50)
              and x["ttft_ms"] >= x["server_timings"]["ttft_ms"] for x in r2))
check("same prompts (input lengths) whichever rank sent them",
      [x["input_len"] for x in r1] == [x["input_len"] for x in sorted(r3, key=lambda x: x["index"])])
PYEOF
while IFS= read -r line; do
  case $line in
    "ok   "*) ok "${line#ok   }" ;;
    "FAIL "*) bad "${line#FAIL }" ;;
    *) echo "$line" ;;
  esac
done < <($py "$tmp/check.py" "$tmp" 2>&1 || echo "FAIL check.py exited $?")
test_end
