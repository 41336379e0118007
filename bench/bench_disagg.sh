#!/usr/bin/env bash
# Disaggregated (1 prefill + 1 decode worker) versus mixed (2 mixed workers)
# serving under a mixed workload, in the same run: N_LONG long prompts and
# N_SHORT short ones arrive together (all at once, then again after a pause),
# streamed through moe-coordinator by a Python grpcio client. Prints TTFT and
# TPOT percentiles for the short and the long requests of each setup, the
# mean Timings.transfer_ms, and the KV transfer bandwidth from the prefill
# worker's counters (GetLoad: bytes out / time sending).
#
#   bench/bench_disagg.sh [BUILD_DIR] [N_LONG] [N_SHORT]
#   env: MODEL (default /tmp/moe-bench-model, the benchmark shape, made with
#        moe-mkmodel if missing), THREADS per worker (1), LONG_LEN (512),
#        SHORT_LEN (32), LONG_OUT (16), SHORT_OUT (48), ROUNDS (2), DTYPE (bf16),
#        VOCAB (32000: prompt ids are drawn below it)
# Needs python3 with grpcio and grpcio-tools (tests/run.sh installs them).
set -euo pipefail
build=$(cd "${1:-build}" && pwd)
n_long=${2:-4}
n_short=${3:-12}
src=$(cd "$(dirname "$0")/.." && pwd)
model=${MODEL:-/tmp/moe-bench-model}
threads=${THREADS:-1}
dtype=${DTYPE:-bf16}
if [ ! -f "$model/config.json" ]; then
  "$build/bin/moe-mkmodel" --arch mixtral --out "$model" --vocab 32000 --hidden 1024 \
    --layers 8 --heads 16 --kv-heads 4 --experts 8 --top-k 2 --ffn 2816 --dtype bf16 --seed 1
fi
tmp=$(mktemp -d /tmp/moe-bench-disagg-XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT

# start NAME VAR CMD...: runs CMD with stdout in $tmp/NAME.out and sets VAR to
# the address it prints.
start() {
  local name=$1 var=$2
  shift 2
  "$@" >"$tmp/$name.out" 2>"$tmp/$name.err" &
  pids+=($!)
  for _ in $(seq 1 600); do
    if grep -q " on " "$tmp/$name.out" 2>/dev/null; then
      printf -v "$var" '%s' "$(sed -n 's/.* on \([^ ]*\) .*/\1/p' "$tmp/$name.out" | head -1)"
      return 0
    fi
    sleep 0.1
  done
  echo "$name did not start:" >&2
  cat "$tmp/$name.err" >&2
  exit 1
}
worker() {
  start "$1" "$1" "$build/bin/moe-worker" --model "$model" --dtype "$dtype" \
    --threads "$threads" --role "$2" --kv-memory 512
}

python3 -m grpc_tools.protoc -I "$src/proto" --python_out="$tmp" --grpc_python_out="$tmp" \
  "$src"/proto/moe/v1/*.proto

echo "model: $model ($dtype), $threads thread(s) per worker, $(nproc) cores"
echo "workload: ${ROUNDS:-2} rounds of $n_long prompts of ${LONG_LEN:-512} tokens (${LONG_OUT:-16} out)" \
  "+ $n_short of ${SHORT_LEN:-32} tokens (${SHORT_OUT:-48} out), arriving together"
worker m1 mixed
worker m2 mixed
start cm cm "$build/bin/moe-coordinator" --model "$model" --listen 127.0.0.1:0 --workers "$m1,$m2" --poll-ms 50
worker pw prefill
worker dw decode
start cd cd_ "$build/bin/moe-coordinator" --model "$model" --listen 127.0.0.1:0 --workers "$pw,$dw" --poll-ms 50
echo "mixed: $m1 $m2 via $cm; disaggregated: prefill $pw, decode $dw via $cd_"

PYTHONPATH="$tmp" python3 - "$cm" "$cd_" "$pw" "$n_long" "$n_short" <<'EOF'
import os, sys, threading, time
import grpc
from moe.v1 import inference_pb2 as ipb, inference_pb2_grpc as igrpc
from moe.v1 import worker_pb2 as wpb

cm, cd, pw, n_long, n_short = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
L, S = int(os.environ.get("LONG_LEN", 512)), int(os.environ.get("SHORT_LEN", 32))
LO, SO = int(os.environ.get("LONG_OUT", 16)), int(os.environ.get("SHORT_OUT", 48))
rounds = int(os.environ.get("ROUNDS", 2))
V = int(os.environ.get("VOCAB", 32000))

def one(stub, k, n, out, res):
    ids = [1 + (k * 7919 + i * 104729) % (V - 1) for i in range(n)]
    rq = ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=ids),
                             sampling=ipb.SamplingParams(max_tokens=out, ignore_eos=True))
    t0 = time.monotonic(); first = last = None; ntok = 0; transfer = 0.0
    for m in stub.Generate(rq, timeout=600):
        if m.token_ids:
            now = time.monotonic()
            if first is None: first = now
            last = now; ntok += len(m.token_ids)
        if m.finish_reason: transfer = m.timings.transfer_ms
    res.append(("long" if n == L else "short", (first - t0) * 1e3,
                (last - first) * 1e3 / max(ntok - 1, 1), transfer, ntok == out))

def run(addr):
    ch = grpc.insecure_channel(addr); stub = igrpc.InferenceStub(ch)
    one(stub, 999, 8, 2, [])  # warm up
    res = []; t0 = time.monotonic()
    for r in range(rounds):
        th = []
        for i in range(n_long + n_short):
            n, out = (L, LO) if i < n_long else (S, SO)
            th.append(threading.Thread(target=one, args=(stub, 1000 * r + i, n, out, res)))
        for t in th: t.start()
        for t in th: t.join()
    ch.close()
    return res, time.monotonic() - t0

def pct(v, p):
    v = sorted(v); return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]

def report(name, res, wall):
    print(f"== {name}: {len(res)} requests in {wall:.1f} s, all complete: {all(r[4] for r in res)}")
    for kind in ("short", "long"):
        t = [r[1] for r in res if r[0] == kind]; p = [r[2] for r in res if r[0] == kind]
        if not t: continue
        print(f"  {kind:5s} TTFT ms p50 {pct(t,50):8.1f} p90 {pct(t,90):8.1f} max {max(t):8.1f}"
              f" | TPOT ms p50 {pct(p,50):7.1f} p90 {pct(p,90):7.1f} max {max(p):7.1f}")
    tr = [r[3] for r in res if r[3] > 0]
    if tr: print(f"  transfer_ms mean {sum(tr)/len(tr):.2f} max {max(tr):.2f} over {len(tr)} handoffs")

mixed, wm = run(cm)
report("2 mixed workers", mixed, wm)
dis, wd = run(cd)
report("1 prefill + 1 decode worker", dis, wd)
ch = grpc.insecure_channel(pw)
load = ch.unary_unary("/moe.v1.Worker/GetLoad", request_serializer=lambda m: m.SerializeToString(),
                      response_deserializer=wpb.WorkerLoad.FromString)(wpb.GetLoadRequest(), timeout=5)
if load.kv_transfer_ms > 0:
    print(f"KV transfer (prefill side): {load.kv_transfers_out} handoffs, "
          f"{load.kv_transfer_bytes_out / 2**20:.1f} MiB in {load.kv_transfer_ms:.1f} ms sending: "
          f"{load.kv_transfer_bytes_out / 2**20 / (load.kv_transfer_ms / 1e3):.0f} MiB/s, "
          f"failures {load.kv_transfer_failures}")
EOF
