#!/usr/bin/env bash
# moe-bench against a real local cluster: one moe-worker and a moe-coordinator
# serving the tiny qwen3_moe fixture on free loopback ports, over gRPC. For
# every workload (random, ShareGPT sample, prefix repetition, trace replay)
# every request completes and the token counts equal the server's usage:
# prompt tokens as sent (exact lengths from the model's tokenizer), output
# tokens as streamed and as asked (--ignore-eos).
#
#   test_bench_cluster.sh BIN_DIR SOURCE_DIR
set -uo pipefail
bin=$1 src=$2
. "$src/tests/lib.sh"
py=python3
test_begin moe-bench-cluster
model=$src/tests/golden/fixtures/qwen3_moe

"$bin/moe-worker" --model "$model" --dtype f32 --threads 1 --kv-memory 32 --listen 127.0.0.1:0 \
  >"$tmp/w.log" 2>&1 &
pids+=($!)
wait_for "$tmp/w.log" "serving" || { bad "worker did not start: $(cat "$tmp/w.log")"; test_end; }
waddr=$(grep -o 'on 127\.0\.0\.1:[0-9]*' "$tmp/w.log" | head -1 | grep -o '127.*')
# The OpenAI HTTP API too, where this moe-coordinator has it.
http=()
"$bin/moe-coordinator" --help 2>&1 | grep -q -- --http-listen && http=(--http-listen 127.0.0.1:0)
"$bin/moe-coordinator" --model "$model" --listen 127.0.0.1:0 --workers "$waddr" "${http[@]}" \
  >"$tmp/c.log" 2>&1 &
pids+=($!)
wait_for "$tmp/c.log" "serving on" || { bad "coordinator did not start: $(cat "$tmp/c.log")"; test_end; }
caddr=$(grep -o 'serving on 127\.0\.0\.1:[0-9]*' "$tmp/c.log" | grep -o '127.*')

# run NAME ARGS...: moe-bench against the coordinator, then the checks
run() {
  local name=$1
  shift
  "$bin/moe-bench" --quiet --base-url "$caddr" --tokenizer "$model" --ignore-eos "$@" \
    --save-result "$tmp/$name.json" --save-requests "$tmp/$name.jsonl" \
    >"$tmp/$name.out" 2>"$tmp/$name.err"
  local rc=$?
  [ $rc = 0 ] && ! grep -qE "Sanitizer|runtime error" "$tmp/$name.err" && ok "$name: exit 0" ||
    bad "$name: exit $rc: $(tail -20 "$tmp/$name.err")"
}
check() { # NAME DESCRIPTION EXPR (d: result JSON, r: requests)
  local out
  if out=$($py - "$tmp/$1" "$3" 2>&1 <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1] + ".json"))
r = [json.loads(l) for l in open(sys.argv[1] + ".jsonl")]
ok = eval(sys.argv[2])
if not ok:
    print("completed", d["completed"], "failed", d["failed"], d["errors"][:3],
          [(x["input_len"], x.get("server_prompt_tokens"), x["output_len"], x.get("server_completion_tokens"),
            x["counted_tokens"], x["expected_output_len"]) for x in r][:6])
sys.exit(0 if ok else 1)
PYEOF
  ); then ok "$1: $2"; else bad "$1: $2: $out"; fi
}
usage_ok='all(x["success"] and x["output_len"] == x["server_completion_tokens"] == x["counted_tokens"] == x["expected_output_len"] and x["input_len"] == x["server_prompt_tokens"] for x in r)'

run random --random-input-len 24 --random-output-len 12 --random-range-ratio 0.5 --num-prompts 16 \
  --request-rate 20 --seed 3
check random "16 complete, counts equal the server's usage" "d['completed'] == 16 and len(r) == 16 and $usage_ok"
check random "prompt lengths 12..36 as drawn, total input tokens add up" \
  'all(12 <= x["input_len"] <= 36 for x in r) and d["total_input_tokens"] == sum(x["input_len"] for x in r)'
check random "server Timings beside the client's" \
  'all("server_timings" in x for x in r) and d["server_timings"]["mean_server_ttft_ms"] > 0 and d["mean_ttft_ms"] >= d["server_timings"]["mean_server_ttft_ms"] * 0.5'

run sharegpt --dataset-name sharegpt --dataset-path "$src/bench/workloads/sharegpt_sample.json" \
  --num-prompts 10 --max-concurrency 4
check sharegpt "10 complete, counts equal the server's usage" "d['completed'] == 10 and $usage_ok"

run prefix --dataset-name prefix_repetition --prefix-repetition-prefix-len 32 \
  --prefix-repetition-suffix-len 8 --prefix-repetition-num-prefixes 3 --prefix-repetition-output-len 4 \
  --num-prompts 12 --request-rate 10 --seed 1
check prefix "12 complete, counts equal the server's usage" "d['completed'] == 12 and $usage_ok"
check prefix "repeated prefixes hit the prefix cache" \
  'sum(x["server_cached_tokens"] for x in r if x["index"] >= 3) >= 16 * 6'

run trace --dataset-name trace --dataset-path "$src/bench/workloads/trace_sample.jsonl" \
  --trace-block-size 16 --fixed-schedule
check trace "12 complete at the trace's times, counts equal the server's usage" \
  "d['completed'] == 12 and $usage_ok and [x['input_len'] for x in r][:3] == [40, 36, 20]"

# ---- the same cluster through its OpenAI HTTP API ------------------------------------------
if [ ${#http[@]} -gt 0 ]; then
  wait_for "$tmp/c.log" "OpenAI HTTP API" || bad "no HTTP address in $(cat "$tmp/c.log")"
  haddr=$(grep -o 'OpenAI HTTP API.* on 127\.0\.0\.1:[0-9]*' "$tmp/c.log" | grep -o '127\.0\.0\.1:[0-9]*$')
  # text prompts that re-tokenize to their length; token-id prompts
  run openai_text --backend openai --base-url "http://$haddr" --random-input-len 24 \
    --random-output-len 12 --num-prompts 12 --request-rate 20 --seed 4
  check openai_text "12 complete, counts equal the server's usage" \
    'd["completed"] == 12 and all(x["success"] and x["output_len"] == x["server_completion_tokens"] == x["expected_output_len"] and x["input_len"] == x["server_prompt_tokens"] == 24 for x in r)'
  run openai_ids --backend openai --prompt-format tokens --base-url "http://$haddr" \
    --random-input-len 24 --random-output-len 12 --num-prompts 12 --max-concurrency 4 --seed 5
  check openai_ids "token-id prompts: 12 complete, counts equal the server's usage" \
    'd["completed"] == 12 and all(x["success"] and x["output_len"] == x["server_completion_tokens"] == 12 and x["server_prompt_tokens"] == 24 for x in r)'
else
  echo "SKIPPED (part): this moe-coordinator has no --http-listen; the openai backend was not run"
fi
test_end
