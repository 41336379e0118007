#!/usr/bin/env bash
# moe-bench against scripted fake servers (fake_server.py): gRPC and OpenAI
# HTTP (completions and chat, SSE). The servers answer with known delays, so
# TTFT / TPOT / ITL / E2EL / goodput must come out as constructed. What a
# loaded machine cannot change is checked exactly: the server never sends
# early, so TTFT and E2EL are at least the scripted values; TPOT, ITL and
# E2EL must agree with each other by vLLM's definitions (TPOT with / n
# instead of / (n - 1) fails; so does a chat stream's role-only chunk
# counted as a token: TTFT ~0); goodput thresholds sit just under the slow
# requests' floor. Upper bounds only catch unit mistakes (ms vs s): a busy
# machine may delay any token.
#
#   test_bench_fake.sh BIN_DIR SOURCE_DIR
set -uo pipefail
bin=$1 src=$2
. "$src/tests/lib.sh"
py=python3
$py -c 'import grpc, grpc_tools' 2>/dev/null || { echo "SKIPPED: python3 grpcio / grpcio-tools missing"; exit 77; }
test_begin moe-bench-fake
bench=$bin/moe-bench
tok=$src/tests/golden/fixtures/qwen3_moe

$py -m grpc_tools.protoc -I "$src/proto" --python_out="$tmp" --grpc_python_out="$tmp" \
  "$src/proto/moe/v1/inference.proto" || { bad "stubs"; test_end; }

# serve NAME ARGS...: starts a fake server, sets ADDR_<NAME> to host:port
serve() {
  local name=$1
  shift
  $py "$src/tests/bench/fake_server.py" "$@" >"$tmp/$name.log" 2>&1 &
  pids+=($!)
  wait_for "$tmp/$name.log" "listening on" || { bad "$name did not start: $(cat "$tmp/$name.log")"; test_end; }
  printf -v "ADDR_$name" '%s' "$(sed -n 's/listening on //p' "$tmp/$name.log")"
}
# check FILE DESCRIPTION EXPR: EXPR over d (the result JSON) and r (the
# per-request JSONL beside it, FILE with .jsonl), true to pass
check() {
  local out
  if out=$($py - "$1" "$3" 2>&1 <<'EOF'
import json, os, statistics as st, sys
d = json.load(open(sys.argv[1]))
jl = sys.argv[1][:-5] + ".jsonl"
r = [json.loads(l) for l in open(jl)] if os.path.exists(jl) else []
ok = eval(sys.argv[2])
if not ok:
    print("completed", d["completed"], "failed", d["failed"], "ttfts", [round(x * 1e3) for x in d["ttfts"]],
          "mean tpot", d["mean_tpot_ms"], "goodput", d["request_goodput"], d.get("failures_by_status"))
sys.exit(0 if ok else 1)
EOF
  ); then ok "$2"; else bad "$2: $out"; fi
}
run() { # NAME ARGS...: moe-bench with results in $tmp/NAME.json[l]; sets rc
  local name=$1
  shift
  "$bench" --quiet --save-result "$tmp/$name.json" --save-requests "$tmp/$name.jsonl" "$@" \
    >"$tmp/$name.out" 2>"$tmp/$name.err"
  rc=$?
  if grep -qE "Sanitizer|runtime error" "$tmp/$name.err"; then bad "$name: sanitizer: $(head -20 "$tmp/$name.err")"; fi
}

serve grpc grpc --stubs "$tmp"
serve http http
serve grpcfail grpc --stubs "$tmp" --fail-every 4
serve httpfail http --fail-every 5 --http-503-every 7

# Scripted: TTFT 150 ms (even request numbers) / 450 ms (odd), then 3 more
# tokens 60 ms apart: TPOT = ITL = 60, E2EL = TTFT + 180.
common=(--random-input-len 8 --random-output-len 4 --num-prompts 8 --percentile-metrics ttft,tpot,itl,e2el)
timing='all((150 <= t * 1e3 <= 5150) if i % 2 == 0 else (450 <= t * 1e3 <= 5450) for i, t in enumerate(d["ttfts"]))'
tpot='all(abs(x["tpot_ms"] - (x["e2el_ms"] - x["ttft_ms"]) / (x["output_len"] - 1)) < 1e-6 for x in r) and 20 <= d["mean_tpot_ms"] <= 2000'
itl='all(len(x) == 3 for x in d["itls"]) and all(len(x["itl_ms"]) == 3 and abs(sum(x["itl_ms"]) - (x["e2el_ms"] - x["ttft_ms"])) < 1e-6 for x in r) and 20 <= d["median_itl_ms"] <= 2000'
e2el='all(x["e2el_ms"] >= (330 if x["index"] % 2 == 0 else 630) and x["e2el_ms"] - x["ttft_ms"] <= 5180 for x in r)'

# ---- gRPC ------------------------------------------------------------------------
run grpc --base-url "$ADDR_grpc" "${common[@]}" --goodput ttft:440 --plot "$tmp/plots"
[ $rc = 0 ] && ok "grpc: exit 0" || bad "grpc: exit $rc: $(cat "$tmp/grpc.err")"
check "$tmp/grpc.json" "grpc: 8 completed, lengths from the server's usage" \
  'd["completed"] == 8 and d["failed"] == 0 and d["output_lens"] == [4] * 8 and d["input_lens"] == [8] * 8'
check "$tmp/grpc.json" "grpc: TTFT 150 / 450 ms as scripted (never less)" "$timing"
check "$tmp/grpc.json" "grpc: TPOT = (E2EL - TTFT) / (n - 1) = 60 ms" "$tpot"
check "$tmp/grpc.json" "grpc: ITL 60 ms, 3 gaps per request" "$itl"
check "$tmp/grpc.json" "grpc: E2EL >= TTFT + 180 ms as scripted" "$e2el"
check "$tmp/grpc.json" "grpc: goodput ttft:440 = the 4 fast requests / duration" \
  'abs(d["request_goodput"] * d["duration"] - 4) < 1e-6'
check "$tmp/grpc.json" "grpc: the server's Timings beside the client's (mean server TTFT 300)" \
  'abs(d["server_timings"]["mean_server_ttft_ms"] - 300) < 1e-6 and all(abs(x["server_timings"]["ttft_ms"] - (150 if x["index"] % 2 == 0 else 450)) < 1e-6 for x in r)'
check "$tmp/grpc.json" "grpc: vLLM result keys" \
  'all(k in d for k in ("completed", "total_input_tokens", "total_output_tokens", "request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "std_ttft_ms", "mean_tpot_ms", "p99_itl_ms", "mean_e2el_ms", "itls", "ttfts", "input_lens", "output_lens", "errors", "max_concurrent_requests"))'
grep -q "Mean TTFT (ms):" "$tmp/grpc.out" && grep -q "Request goodput (req/s):" "$tmp/grpc.out" &&
  grep -q "Server Timings" "$tmp/grpc.out" && ok "grpc: summary table" || bad "grpc: table: $(cat "$tmp/grpc.out")"
for f in ttft_cdf itl_cdf throughput; do
  if [ "$(head -c 8 "$tmp/plots/$f.png" 2>/dev/null | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ] &&
    [ "$(stat -c %s "$tmp/plots/$f.png")" -gt 10000 ]; then ok "plot $f.png"; else bad "plot $f.png missing or empty"; fi
done
run grpc_tpot --base-url "$ADDR_grpc" "${common[@]}" --goodput e2el:300
check "$tmp/grpc_tpot.json" "grpc: goodput e2el:300 = 0 (no E2EL is under 330)" 'd["request_goodput"] == 0'
run grpc_e2el --base-url "$ADDR_grpc" "${common[@]}" --goodput tpot:400 e2el:620
check "$tmp/grpc_e2el.json" "grpc: goodput tpot:400 e2el:620 = the 4 fast ones" \
  'abs(d["request_goodput"] * d["duration"] - 4) < 1e-6'

# ---- OpenAI HTTP -----------------------------------------------------------------
run http --backend openai --base-url "http://$ADDR_http" --tokenizer "$tok" "${common[@]}" --goodput ttft:440
[ $rc = 0 ] && ok "openai completions: exit 0" || bad "openai completions: exit $rc: $(cat "$tmp/http.err")"
check "$tmp/http.json" "openai completions: 8 completed, 4 tokens each, model from /v1/models" \
  'd["completed"] == 8 and d["output_lens"] == [4] * 8 and d["model_id"] == "fake-http"'
check "$tmp/http.json" "openai completions: TTFT 150 / 450 ms" "$timing"
check "$tmp/http.json" "openai completions: TPOT 60 ms" "$tpot"
check "$tmp/http.json" "openai completions: ITL 60 ms" "$itl"
check "$tmp/http.json" "openai completions: E2EL >= TTFT + 180 ms" "$e2el"
check "$tmp/http.json" "openai completions: goodput 4 / duration" \
  'abs(d["request_goodput"] * d["duration"] - 4) < 1e-6'
run chat --backend openai --endpoint /v1/chat/completions --base-url "http://$ADDR_http/v1" \
  --tokenizer "$tok" "${common[@]}"
check "$tmp/chat.json" "openai chat: the role-only first chunk is not the first token" "$timing and $tpot and $itl"
run toks --backend openai --prompt-format tokens --base-url "http://$ADDR_http" --tokenizer "$tok" "${common[@]}"
check "$tmp/toks.json" "openai token-id prompts: the server counts 8 prompt tokens" \
  'd["input_lens"] == [8] * 8 and d["completed"] == 8'

# ---- client-side concurrency limit, closed loop, trace schedule, sweep --------------
run conc --base-url "$ADDR_grpc" "${common[@]}" --max-concurrency 2
check "$tmp/conc.json" "--max-concurrency 2: peak 2 in flight, later requests queue" \
  'd["max_concurrent_requests"] == 2 and d["completed"] == 8 and max(d["queue_times"]) > 0.5 and d["max_concurrency"] == 2'
run loop --base-url "$ADDR_grpc" --random-input-len 8 --random-output-len 4 --duration 1.5 --max-concurrency 2
check "$tmp/loop.json" "--duration 1.5 closed loop: requests sent only before 1.5 s" \
  'd["completed"] >= 4 and all(x["arrival_s"] < 1.5 for x in r) and d["num_prompts"] is None'
run trace --base-url "$ADDR_grpc" --dataset-name trace --dataset-path "$src/bench/workloads/trace_sample.jsonl" \
  --trace-block-size 16 --fixed-schedule
check "$tmp/trace.json" "trace --fixed-schedule: every line at its timestamp, its lengths" \
  'd["completed"] == 12 and all(abs(x["arrival_s"] - t / 1e3) < 1e-6 and x["start_s"] - x["arrival_s"] < 2.0 for x, t in zip(r, [0, 120, 250, 260, 400, 610, 700, 905, 1000, 1150, 1400, 1420])) and [x["input_len"] for x in r][:3] == [40, 36, 20] and [x["output_len"] for x in r][:3] == [6, 4, 8]'
"$bench" --quiet --base-url "$ADDR_grpc" "${common[@]}" --random-range-ratio 0.5 --sweep-rates 8,16 \
  --save-result "$tmp/sweep.json" --save-requests "$tmp/sweep.jsonl" --plot "$tmp/sweep" >"$tmp/sweep.out" 2>&1
[ $? = 0 ] && [ -f "$tmp/sweep-rate8.json" ] && [ -f "$tmp/sweep-rate16.json" ] && [ -s "$tmp/sweep/sweep.png" ] &&
  [ -s "$tmp/sweep/throughput_2.png" ] && grep -q "out tok/s" "$tmp/sweep.out" &&
  ok "--sweep-rates 8,16: a result per rate, sweep.png, the sweep table" || bad "sweep: $(ls "$tmp" "$tmp/sweep"; cat "$tmp/sweep.out")"
check "$tmp/sweep-rate8.json" "sweep: rate 8 recorded" 'd["request_rate"] == 8 and d["completed"] == 8'
check "$tmp/sweep-rate8.json" "sweep: each rate sends other prompts (no prefix-cache carry-over)" \
  'd["input_lens"] != json.load(open(sys.argv[1].replace("rate8", "rate16")))["input_lens"]'

# ---- failing targets are counted, not fatal --------------------------------------------
run gfail --base-url "$ADDR_grpcfail" "${common[@]}"
[ $rc = 0 ] && ok "grpc failures mid-stream: exit 0" || bad "grpc failures: exit $rc"
check "$tmp/gfail.json" "grpc: requests 3 and 7 fail UNAVAILABLE, 6 complete" \
  'd["completed"] == 6 and d["failed"] == 2 and d["failures_by_status"] == {"UNAVAILABLE": 2} and d["errors"][3].startswith("UNAVAILABLE")'
run hfail --backend openai --base-url "http://$ADDR_httpfail" --tokenizer "$tok" \
  --random-input-len 8 --random-output-len 4 --num-prompts 10
[ $rc = 0 ] && ok "http failures: exit 0" || bad "http failures: exit $rc"
check "$tmp/hfail.json" "http: 2 streams cut, 1 answered 503, 7 complete" \
  'd["completed"] == 7 and d["failed"] == 3 and d["failures_by_status"].get("HTTP 503") == 1 and not r[6]["success"] and r[6]["status"] == "HTTP 503" and not r[4]["success"] and not r[9]["success"]'

# ---- bad input: one line naming it ----------------------------------------------------------
free_port=$($py -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
expect() { # DESCRIPTION EXIT PATTERN ARGS...
  local what=$1 want=$2 pat=$3
  shift 3
  "$bench" --quiet "$@" >"$tmp/bad.out" 2>"$tmp/bad.err"
  local got=$?
  if [ $got = "$want" ] && grep -qE -- "$pat" "$tmp/bad.err"; then ok "$what: exit $got, $(head -c 110 "$tmp/bad.err" | head -1)"
  else bad "$what: exit $got (want $want): $(cat "$tmp/bad.err")"; fi
}
expect "unreachable gRPC target" 1 "cannot reach the gRPC target 127.0.0.1:$free_port" --base-url "127.0.0.1:$free_port" --num-prompts 2
expect "unreachable OpenAI server" 1 "cannot reach the OpenAI server at http://127.0.0.1:$free_port" \
  --backend openai --base-url "http://127.0.0.1:$free_port" --num-prompts 2
expect "rate 0" 2 "--request-rate: '0' must be a number > 0 or 'inf'" --base-url "$ADDR_grpc" --request-rate 0
expect "rate nan" 2 "--request-rate: 'nan' must be a number > 0" --base-url "$ADDR_grpc" --request-rate nan
expect "sweep rate -1" 2 "--sweep-rates: '-1' must be a number > 0" --base-url "$ADDR_grpc" --sweep-rates 2,-1
expect "missing dataset file" 1 "/nonexistent/x.json: cannot open" --base-url "$ADDR_grpc" --tokenizer "$tok" \
  --dataset-name sharegpt --dataset-path /nonexistent/x.json
echo '[{"id": "a", "conversations": [], "lang": "en"}]' >"$tmp/badfield.json"
expect "unknown ShareGPT field" 1 "entry 0: unknown field 'lang'" --base-url "$ADDR_grpc" --tokenizer "$tok" \
  --dataset-name sharegpt --dataset-path "$tmp/badfield.json"
echo '{"timestamp": 0, "input_len": 3, "output_length": 2}' >"$tmp/badtrace.jsonl"
expect "unknown trace field" 1 "badtrace.jsonl:1: unknown field 'input_len'" --base-url "$ADDR_grpc" \
  --dataset-name trace --dataset-path "$tmp/badtrace.jsonl"
expect "sharegpt without a tokenizer" 2 "counts tokens: give --tokenizer" --base-url "$ADDR_grpc" \
  --dataset-name sharegpt --dataset-path "$src/bench/workloads/sharegpt_sample.json"
expect "bad endpoint" 2 "--endpoint '/v1/embeddings': must be" --backend openai --base-url "http://$ADDR_http" \
  --endpoint /v1/embeddings
expect "openai URL without a scheme" 2 "starts with http:// or https://" --backend openai --base-url "$ADDR_http"
expect "--fixed-schedule without a trace" 2 "--fixed-schedule replays a trace" --base-url "$ADDR_grpc" --fixed-schedule
expect "--duration at rate inf without a limit" 2 "needs --max-concurrency" --base-url "$ADDR_grpc" --duration 3
expect "bad goodput key" 2 "--goodput: unknown metric 'ttfb'" --base-url "$ADDR_grpc" --goodput ttfb:100
expect "unknown option" 2 "unknown option '--bogus'" --base-url "$ADDR_grpc" --bogus 1
test_end
