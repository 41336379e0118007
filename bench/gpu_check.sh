#!/usr/bin/env bash
# bench/gpu_check.sh: the one check to run on a machine with a GPU (< 8 min).
#
#   bench/gpu_check.sh            (from anywhere; writes $OUT/gpu_check.txt when OUT is set)
#
# 1. installs missing Debian packages when apt is usable (deploy/install-deps.sh;
#    a failure there is only a warning: the machine may be offline);
# 2. configures and builds with CUDA (Release, MOE_CUDA=ON, sm_90 only);
# 3. runs the op tests (every op on CPU and CUDA, tests/ops/test_ops.c: one table row per
#    op, the MoE ops permute, grouped_matmul, unpermute_combine, argmax, sample_top_p,
#    kv_gather/scatter_blocks, buf_zero and buf_copy included) and times the grouped expert
#    GEMM and sampling (tests/ops/time_ops.c); 3b. runs the KV data plane test
#    (tests/unit/test_kv_link.c) on CPU and CUDA caches;
# 4. runs the golden prompts with `moe-generate --device cuda` (Mixtral, Qwen3-MoE and
#    DeepSeek-V3 with its latent attention and grouped routing,
#    f32 and bf16 weights) and checks the prompt logits (max rel err <= 1e-4)
#    and the 32-token greedy paths with bench/compare_logits.c;
# 5. decode throughput on the benchmark-shape model (moe-mkmodel, the shape of
#    /work/shared/models/bench-moe-640M.config.json, bf16) at 1, 8 and 64
#    sequences, and the device copy bandwidth (bench-copy-gpu);
# 6. prints a table: op/golden pass-fail, tokens/s, achieved weight GB/s
#    (weights streamed per decode step / step time) against the copy bandwidth.
#
# The build is the compute core (-DMOE_SERVING=OFF: no gRPC, etcd or MPI). A GPU machine
# that cannot reach a package registry gets the core's three libraries as Debian
# packages in .gpudeps/ (ignored by git), made beside the checkout with
#   mkdir -p .gpudeps && cd .gpudeps && apt-get download libcjson1 libcjson-dev \
#       libpcre2-8-0 libpcre2-dev libunistring2 libunistring-dev
# and unpacked by this script into a private prefix (never into /).
#
# For a dry run of the script itself on a machine without a GPU:
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_SMALL=1 BUILD=build-x bench/gpu_check.sh
# (CPU backend, a small model instead of the benchmark shape).
set -euo pipefail

DEVICE=${GPU_CHECK_DEVICE:-cuda}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${BUILD:-$ROOT/build-gpucheck}
JOBS=$(nproc 2>/dev/null || echo 4)
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS
TABLE=()
STEP_T0=0

step() { STEP_T0=$SECONDS; echo; echo "=== [+$((SECONDS - START))s] $*"; }
done_step() { echo "--- $1: $((SECONDS - STEP_T0))s"; }
row() { TABLE+=("$(printf '%-34s %s' "$1" "$2")"); }

print_table() {
  {
    echo
    echo "gpu_check summary ($(date -u +%FT%TZ), total $((SECONDS - START))s)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
    for r in "${TABLE[@]}"; do echo "$r"; done
  } | tee "$WORK/table.txt"
  if [ -n "${OUT:-}" ]; then mkdir -p "$OUT" && cp "$WORK/table.txt" "$OUT/gpu_check.txt"; fi
}
trap 'print_table; rm -rf "$WORK"' EXIT

# ---- 1. dependencies --------------------------------------------------------------
step "dependencies"
CMAKE_EXTRA=()
if ls "$ROOT"/.gpudeps/*.deb >/dev/null 2>&1; then
  DEPS=$WORK/deps
  mkdir -p "$DEPS"
  for f in "$ROOT"/.gpudeps/*.deb; do dpkg -x "$f" "$DEPS"; done
  export LD_LIBRARY_PATH=$DEPS/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  CMAKE_EXTRA+=(-DCMAKE_PREFIX_PATH="$DEPS/usr" -DPKG_CONFIG_EXECUTABLE=/nonexistent)
  echo "using the carried packages: $(ls "$ROOT"/.gpudeps | tr '\n' ' ')"
elif command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ]; then
  timeout 300 "$ROOT/deploy/install-deps.sh" ||
    echo "warning: deploy/install-deps.sh failed; continuing with what is installed"
else
  echo "apt-get unusable here (or not root): skipping deploy/install-deps.sh"
fi
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi -L || echo "warning: nvidia-smi failed"
done_step dependencies

# ---- 2. build ---------------------------------------------------------------------
step "configure + build (Release, CUDA sm_90, -j$JOBS)"
if cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DMOE_CUDA=ON -DMOE_SERVING=OFF \
     -DCMAKE_CUDA_ARCHITECTURES=90 "${CMAKE_EXTRA[@]}" >"$WORK/configure.log" 2>&1 &&
   cmake --build "$BUILD" -j"$JOBS" --target test_ops time_ops moe-generate moe-mkmodel \
     compare-logits bench-copy-gpu test_kv_link >"$WORK/build.log" 2>&1; then
  row "build" "ok ($((SECONDS - STEP_T0))s)"
else
  tail -n 40 "$WORK/configure.log" "$WORK/build.log" || true
  row "build" "FAIL"
  exit 1
fi
BIN=$BUILD/bin
done_step build

# ---- 3. op tests ------------------------------------------------------------------
step "op tests (CPU vs CUDA)"
set +e
timeout 300 "$BUILD/tests/test_ops" >"$WORK/ops.log" 2>&1
rc=$?
set -e
grep -v '^ok ' "$WORK/ops.log" | tail -40 || true
n_ok=$(grep -c '^ok ' "$WORK/ops.log" || true)
n_fail=$(grep -c '^FAIL ' "$WORK/ops.log" || true)
case $rc in
  0) row "op tests" "PASS ($n_ok cases ok)" ;;
  77) row "op tests" "SKIPPED (no usable GPU: $(tail -1 "$WORK/ops.log"))" ;;
  *) row "op tests" "FAIL (rc $rc, $n_fail failing cases, $n_ok ok)" ;;
esac
# one row per op: cases ok / failing (refusal cases count as cases of their op)
if [ "$rc" != 77 ]; then
  for op in matmul rmsnorm rope kv_write attention attention_mla router router_grouped swiglu \
            gather_rows scatter_add_rows embed add grouped_matmul permute unpermute_combine argmax \
            sample_top_p kv_gather_blocks kv_scatter_blocks copy_cols buf_zero buf_copy; do
    o=$(grep -cE "^ok +$op \{" "$WORK/ops.log" || true)
    f=$(grep -cE "^FAIL +$op \{" "$WORK/ops.log" || true)
    if [ "$f" -eq 0 ] && [ "$o" -gt 0 ]; then row "  op $op" "pass ($o)"
    else row "  op $op" "FAIL ($f failing, $o ok)"; fi
  done
fi
# timings of the grouped expert GEMM and the sampling ops (tests/ops/time_ops.c)
if [ "$rc" = 0 ] && [ -x "$BUILD/tests/time_ops" ]; then
  timeout 120 "$BUILD/tests/time_ops" >"$WORK/time_ops.log" 2>&1 || true
  cat "$WORK/time_ops.log"
  [ -n "${OUT:-}" ] && cp "$WORK/time_ops.log" "$OUT/time_ops.log"
fi
[ -n "${OUT:-}" ] && mkdir -p "$OUT" && cp "$WORK/ops.log" "$OUT/ops.log"
done_step "op tests"

# ---- 3b. the KV data plane on device caches ----------------------------------------
step "KV data plane (disaggregated handoff) on CUDA caches"
set +e
timeout 120 "$BUILD/tests/test_kv_link" >"$WORK/kv_link.log" 2>&1
rc=$?
set -e
tail -3 "$WORK/kv_link.log"
if grep -q '^cuda: skipped' "$WORK/kv_link.log"; then
  row "KV data plane" "cuda SKIPPED ($(grep '^cuda: skipped' "$WORK/kv_link.log" | cut -c16- | head -c 80)"
elif [ "$rc" = 0 ] && grep -q '^cuda: the same cases' "$WORK/kv_link.log"; then
  row "KV data plane" "PASS on CPU and CUDA caches ($(tail -1 "$WORK/kv_link.log"))"
else
  row "KV data plane" "FAIL (rc $rc): $(grep -m3 'FAIL\|CHECK' "$WORK/kv_link.log" | head -c 200)"
fi
[ -n "${OUT:-}" ] && cp "$WORK/kv_link.log" "$OUT/kv_link.log"
done_step "KV data plane"

# ---- 4. golden prompts on CUDA -----------------------------------------------------
step "golden prompts with --device $DEVICE"
g_ok=0; g_fail=0
for model in mixtral qwen3_moe deepseek_v3; do
  dir=$ROOT/tests/golden/fixtures/$model
  for dtype in f32 bf16; do
    for p in 0 1 2 3; do
      ids=$("$BIN/compare-logits" --ids "$dir" "$p")
      want=$("$BIN/compare-logits" --greedy "$dir" "$dtype" "$p")
      set +e
      timeout 120 "$BIN/moe-generate" --model "$dir" --tokens "$ids" -n 32 --dtype "$dtype" \
        --device "$DEVICE" --temperature 0 --ignore-eos --logits-out "$WORK/logits.bin" \
        >"$WORK/gen.log" 2>&1
      grc=$?
      "$BIN/compare-logits" "$dir" "$dtype" "$p" "$WORK/logits.bin" >"$WORK/cmp.log" 2>&1
      crc=$?
      set -e
      got=$(sed -n 's/^tokens: //p' "$WORK/gen.log")
      if [ $grc -eq 0 ] && [ $crc -eq 0 ] && [ "$got" = "$want" ]; then
        g_ok=$((g_ok + 1)); echo "ok   $(cat "$WORK/cmp.log")"
      else
        g_fail=$((g_fail + 1))
        echo "FAIL $model $dtype prompt $p: moe-generate rc $grc; $(cat "$WORK/cmp.log")"
        if [ "$got" != "$want" ]; then echo "     greedy got  [$got]"; echo "     greedy want [$want]"; fi
        tail -3 "$WORK/gen.log"
      fi
    done
  done
done
if [ $g_fail -eq 0 ]; then row "golden ($DEVICE, 3 models x 2 dtypes x 4)" "PASS ($g_ok/24)"
else row "golden ($DEVICE, 3 models x 2 dtypes x 4)" "FAIL ($g_fail of 24 failed)"; fi
done_step golden

# ---- 5. copy bandwidth and decode benchmark -------------------------------------------
step "device copy bandwidth"
set +e
copy=$(timeout 60 "$BIN/bench-copy-gpu" 2048 | sed -n 's/^copy_gbps \([0-9.]*\).*/\1/p')
set -e
copy=${copy:-0}
row "device copy bandwidth (D2D)" "$copy GB/s (read + write)"
done_step copy

# Benchmark shape (bench-moe-640M.config.json): Mixtral layout, bf16 weights.
VOCAB=32000 HIDDEN=1024 LAYERS=8 HEADS=16 KV_HEADS=4 EXPERTS=8 TOPK=2 FFN=2816
if [ -n "${GPU_CHECK_SMALL:-}" ]; then VOCAB=1000 HIDDEN=128 LAYERS=2 FFN=256; fi
D_HEAD=$((HIDDEN / HEADS))
step "benchmark model (moe-mkmodel, bf16)"
timeout 300 "$BIN/moe-mkmodel" --arch mixtral --out "$WORK/bench" --vocab $VOCAB --hidden $HIDDEN \
  --layers $LAYERS --heads $HEADS --kv-heads $KV_HEADS --experts $EXPERTS --top-k $TOPK \
  --ffn $FFN --dtype bf16 >"$WORK/mk.log" 2>&1 || { tail "$WORK/mk.log"; row "bench model" "FAIL"; exit 1; }
done_step mkmodel

# Weight bytes read per decode step with B sequences: attention + router of
# every layer, the experts touched (expected distinct experts under uniform
# routing, E(B) = n_e (1 - (1 - k/n_e)^B): an estimate on random weights),
# and the lm_head; bf16 = 2 bytes. KV-cache reads are not counted.
step_bytes() {
  awk -v B="$1" -v d=$HIDDEN -v L=$LAYERS -v h=$HEADS -v kv=$KV_HEADS -v dh=$D_HEAD \
      -v ne=$EXPERTS -v k=$TOPK -v f=$FFN -v V=$VOCAB 'BEGIN {
    attn = d * (h * dh) * 2 + d * (kv * dh) * 2; router = ne * d; expert = 3 * f * d;
    E = ne * (1 - (1 - k / ne) ^ B);
    printf "%.0f", 2 * (L * (attn + router + E * expert) + V * d) }'
}

for B in 1 8 64; do
  step "decode benchmark: $B sequences"
  : >"$WORK/prompts.jsonl"
  for i in $(seq 1 "$B"); do
    t0=$((i * 17 % (VOCAB - 40) + 3))
    toks=$(seq -s, "$t0" $((t0 + 15)))  # 16 distinct tokens per prompt
    echo "{\"tokens\": [$toks], \"max_tokens\": 128}" >>"$WORK/prompts.jsonl"
  done
  set +e
  timeout 240 "$BIN/moe-generate" --model "$WORK/bench" --prompts-file "$WORK/prompts.jsonl" \
    --device "$DEVICE" --dtype bf16 --ignore-eos --no-prefix-cache --max-running "$B" -n 128 \
    >"$WORK/bench_$B.log" 2>&1
  brc=$?
  set -e
  grep -E '^(time|throughput|latency)' "$WORK/bench_$B.log" || tail -5 "$WORK/bench_$B.log"
  tps=$(sed -n 's/^throughput: \([0-9.]*\) output tokens\/s.*/\1/p' "$WORK/bench_$B.log")
  tpot=$(sed -n 's/.*TPOT mean \([0-9.]*\) ms.*/\1/p' "$WORK/bench_$B.log")
  if [ $brc -ne 0 ] || [ -z "$tps" ]; then
    row "decode batch $B" "FAIL (rc $brc)"
  else
    bytes=$(step_bytes "$B")
    # step time = B / tokens per second (B sequences advance one token per step)
    gbps=$(awk -v b="$bytes" -v t="$tps" -v B="$B" 'BEGIN { printf "%.0f", b * t / B / 1e9 }')
    pct=$(awk -v g="$gbps" -v c="$copy" 'BEGIN { if (c > 0) printf "%.0f%%", 100 * g / c; else print "n/a" }')
    row "decode batch $B" "$tps tok/s, TPOT ${tpot:-?} ms, $((bytes / 1000000)) MB weights/step, $gbps GB/s = $pct of copy bw"
  fi
  done_step "decode $B"
done
echo
echo "notes: tok/s = output tokens / wall time of the whole offline run (prefill of 16-token"
echo "prompts included); weight bytes per step estimated for uniform routing; copy bandwidth"
echo "counts read + write, the ceiling for a kernel that reads each weight byte once."
