#!/usr/bin/env bash
# The CPU worker at the machine's limits (issue 19): on the benchmark-shape
# model (../shared/models/bench-moe-640M.config.json: vocab 32000, hidden 1024,
# 8 layers, 16 heads / 4 KV heads, 8 experts top-2, expert FFN 2816), the
# cells
#   prefill512   one 512-token prompt (tokens/s of the prefill), after one
#                untimed warm-up prefill of it (--warmup, as llama-bench warms
#                up; a build without the flag: cold)
#   prefill4096  one 4096-token prompt (eight 512-token chunks), the same
#   decode1      one sequence, 64 tokens after an 8-token prompt (decode tokens/s)
#   decode16     16 sequences of 8-token prompts, 64 tokens each (decode phase:
#                16 / mean TPOT)
# for bf16, int8 (and, with DTYPES, int4) weights, exact (--exact: f32 activations) and fast
# (bf16 / int8 activations on the dot-product paths), 1 and 2 threads; the
# configurations alternate inside each round, ROUNDS rounds, medians printed.
# A STREAM triad probe (bench-triad) runs at the start of every round; the
# decode cells are given as % of the roofline: bandwidth / bytes of weights
# read per token (decode1: attention + top-k experts + lm_head per layer;
# decode16: attention + the experts 16 tokens are expected to touch +
# lm_head, per step of 16 tokens). Decode only reads, so %read gives the
# same against bench-triad's read probes (the better of 1 and 4 streams a
# thread), which can be below triad. Prefill is compute-bound: GFLOP/s from
# 2 x active weights per token (+ attention) are printed instead; decode16
# prints its GFLOP/s too, and the header what it would need at the roofline
# (16 tokens a step multiply every weight read: on a core without dot-product
# instructions that, not the bytes, can be the limit; bench-kernels --peak
# gives the tiles' arithmetic ceiling on this core).
#
# On a processor with AMX, mode "noamx" (fast with MOE_CPU_ISA=avx512-dot:
# the AVX512-BF16 / VNNI paths alone) joins the default modes, so the AMX
# tiles are measured against the AVX-512 ones in the same rounds. On an Intel
# processor with AVX512-BF16 and no AMX, mode "dot" (the same setting) joins
# them instead: there vdpbf16ps is slower than f32 FMAs, so the default bf16
# fast path is the FMA kernels, and "dot" measures vdpbf16ps beside them.
#
# Mode "inv" (fast with --batch-invariant) is there to ask for: MODES="fast inv"
# prices batch invariance against the default in the same rounds.
#
# With BASE=DIR (a build directory of another commit, e.g. the one before
# issue 19), its moe-generate runs the same cells in the same rounds as
# "base" (no --exact flag there: its only mode).
#
#   bench/bench_cpu.sh [BUILD_DIR] [ROUNDS]
#   env: MODEL (checkpoint dir, made with moe-mkmodel when missing and
#        removed at the end unless KEEP_MODEL=1), CELLS (default all four),
#        DTYPES ("bf16 int8"), MODES ("exact fast"), THREADS ("1 2"), BASE
set -euo pipefail
build=${1:-build}
rounds=${2:-3}
model=${MODEL:-/tmp/moe-bench-cpu-model}
cells=${CELLS:-"prefill512 prefill4096 decode1 decode16"}
dtypes=${DTYPES:-"bf16 int8"}
has_amx=$(grep -q amx_tile /proc/cpuinfo && echo yes || echo no)
slow_dpbf16=$(grep -q GenuineIntel /proc/cpuinfo && grep -q avx512_bf16 /proc/cpuinfo && echo yes || echo no)
if [ "$has_amx" = yes ]; then modes=${MODES:-"exact fast noamx"}
elif [ "$slow_dpbf16" = yes ]; then modes=${MODES:-"exact fast dot"}
else modes=${MODES:-"exact fast"}; fi
threads_list=${THREADS:-"1 2"}
base=${BASE:-}
[ -n "$base" ] && modes="base $modes"

made_model=0
if [ ! -f "$model/config.json" ]; then
  "$build/bin/moe-mkmodel" --arch mixtral --out "$model" --vocab 32000 --hidden 1024 \
    --layers 8 --heads 16 --kv-heads 4 --experts 8 --top-k 2 --ffn 2816 --dtype bf16 \
    --seed 1 >/dev/null
  made_model=1
fi
tmp=$(mktemp -d /tmp/moe-bench-cpu-XXXXXX)
cleanup() {
  rm -rf "$tmp"
  if [ "$made_model" = 1 ] && [ "${KEEP_MODEL:-0}" != 1 ]; then rm -rf "$model"; fi
}
trap cleanup EXIT

ids() { awk -v n="$1" -v s="$2" 'BEGIN { srand(s); for (j = 0; j < n; j++) printf "%s%d", (j ? "," : ""), 1 + int(rand() * 31999) }'; }
ids512=$(ids 512 5)
ids4096=$(ids 4096 6)
ids8=$(ids 8 7)
awk 'BEGIN { srand(11); for (i = 0; i < 16; i++) { line = "{\"tokens\": [";
  for (j = 0; j < 8; j++) line = line (j ? "," : "") (1 + int(rand() * 31999));
  print line "], \"max_tokens\": 64}" } }' >"$tmp/p16.jsonl"

# run MODE DTYPE THREADS CELL: appends one tokens/s number to $tmp/CELL.DTYPE.MODE.THREADS
run() {
  local mode=$1 dt=$2 th=$3 cell=$4 bin=$build/bin/moe-generate flags=() isa=auto
  case $mode in
    base) bin=$base/bin/moe-generate ;;
    exact) flags=(--exact) ;;
    noamx | dot) isa=avx512-dot ;;
    inv) flags=(--batch-invariant) ;;
  esac
  local gen=(env MOE_CPU_ISA="$isa" "$bin" --model "$model" --device cpu --threads "$th" --dtype "$dt" --ignore-eos
             "${flags[@]}")
  local out v warm=()
  "$bin" --help 2>/dev/null | grep -q -- --warmup && warm=(--warmup)
  case $cell in
    prefill512) out=$("${gen[@]}" --tokens "$ids512" -n 1 "${warm[@]}" 2>/dev/null)
      v=$(echo "$out" | sed -n 's/^prefill: .* \([0-9.]*\) tokens\/s.*/\1/p') ;;
    prefill4096) out=$("${gen[@]}" --tokens "$ids4096" -n 1 "${warm[@]}" 2>/dev/null)
      v=$(echo "$out" | sed -n 's/^prefill: .* \([0-9.]*\) tokens\/s.*/\1/p') ;;
    decode1) out=$("${gen[@]}" --tokens "$ids8" -n 64 2>/dev/null)
      v=$(echo "$out" | sed -n 's/^decode: .* \([0-9.]*\) tokens\/s.*/\1/p') ;;
    decode16) out=$("${gen[@]}" --prompts-file "$tmp/p16.jsonl" -n 64 2>/dev/null)
      v=$(echo "$out" | sed -n 's/^latency: .*TPOT mean \([0-9.]*\) ms.*/\1/p' |
          awk '{ if ($1 > 0) printf "%.2f", 16000 / $1 }') ;;
  esac
  echo "${v:-nan}" >>"$tmp/$cell.$dt.$mode.$th"
}

echo "# $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs;" \
  "AMX: $has_amx," \
  "avx512_bf16: $(grep -q avx512_bf16 /proc/cpuinfo && echo yes || echo no)," \
  "avx512_vnni: $(grep -q avx512_vnni /proc/cpuinfo && echo yes || echo no)"
echo "# model $model; $rounds rounds; cells: $cells; dtypes: $dtypes; modes: $modes; threads: $threads_list"
echo "# load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq "$rounds"); do
  "$build/bin/bench-triad" --threads 2 --reps 10 | tee -a "$tmp/triad.txt" | sed "s/^/# round $r: /"
  for cell in $cells; do
    for th in $threads_list; do
      for dt in $dtypes; do
        for mode in $modes; do
          run "$mode" "$dt" "$th" "$cell"
        done
      done
    done
  done
  echo "# round $r done, load average $(cut -d' ' -f1-3 /proc/loadavg)"
done
echo "# load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$tmp" "$model/config.json" "$cells" "$dtypes" "$modes" "$threads_list" <<'EOF'
import json, os, re, statistics, sys
tmp, cfg_path, cells, dtypes, modes, threads = sys.argv[1], sys.argv[2], *[a.split() for a in sys.argv[3:]]
c = json.load(open(cfg_path))
d, L, V = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
H, KV = c["num_attention_heads"], c["num_key_value_heads"]
dh = c.get("head_dim") or d // H
E, k, ff = c["num_local_experts"], c["num_experts_per_tok"], c["intermediate_size"]
def lin(rows, cols, dt):  # bytes of a Linear weight as the engine holds it
    if dt == "bf16": return rows * cols * 2
    if dt == "int4": return rows * cols // 2 + rows * (cols // 32) * 4  # --group-size 32
    return rows * cols + rows * 4
def attn(dt): return lin(H * dh + 2 * KV * dh, d, dt) + lin(d, H * dh, dt)
def expert(dt): return lin(2 * ff, d, dt) + lin(d, ff, dt)
router = E * d * 2
per_tok = {dt: L * (attn(dt) + k * expert(dt) + router) + lin(V, d, dt) for dt in dtypes}
active16 = E * (1 - ((E - k) / E) ** 16)  # experts 16 random tokens touch, expected
per_step16 = {dt: L * (attn(dt) + active16 * expert(dt) + router) + lin(V, d, dt) for dt in dtypes}
flops_tok = 2 * (L * (H * dh + 2 * KV * dh) * d + L * d * H * dh + L * k * 3 * ff * d + V * d)
def attn_flops(n):  # causal attention per token, averaged over a prompt of n
    return L * H * dh * 4 * (n + 1) / 2
flops16 = flops_tok + attn_flops(79)  # decode16: 8-token prompts, 64 tokens: ~40 positions attended
triad, read = {}, {}
for line in open(os.path.join(tmp, "triad.txt")):
    m = re.match(r"triad threads (\d+): best ([0-9.]+) GB/s, median ([0-9.]+)", line)
    if m: triad.setdefault(m.group(1), []).append(float(m.group(2)))
    m = re.match(r"read threads (\d+) streams (\d+): best ([0-9.]+) GB/s", line)
    if m: read.setdefault(m.group(1), {}).setdefault(m.group(2), []).append(float(m.group(3)))
# The best of a round's repetitions (STREAM's convention; on a shared machine
# the others are other people's traffic), median over rounds.
bw = {t: statistics.median(v) * 1e9 for t, v in triad.items()}
print("# triad (median over rounds of each round's best): " + ", ".join(f"{t} thread(s) {bw[t]/1e9:.2f} GB/s" for t in sorted(bw)))
# Decode only reads: the better of bench-triad's two read probes (1 or 4
# streams a thread) is the read roofline, %read; %roof stays against triad.
rbw = {t: max(statistics.median(v) for v in s.values()) * 1e9 for t, s in read.items()}
print("# read (the better probe, median over rounds of each round's best): "
      + ", ".join(f"{t} thread(s) {rbw[t]/1e9:.2f} GB/s" for t in sorted(rbw)))
print(f"# bytes read per token, decode1: " + ", ".join(f"{dt} {per_tok[dt]/1e6:.1f} MB" for dt in dtypes)
      + f"; per 16-token step, decode16 ({active16:.2f} of {E} experts): "
      + ", ".join(f"{dt} {per_step16[dt]/1e6:.1f} MB" for dt in dtypes))
# A batch reads its weights once and multiplies them by every token: at the
# roofline, decode16 needs this much arithmetic (against bench-kernels --peak,
# which says what one core's tiles can do)
if "decode16" in cells:
    print("# decode16 at the triad roofline would compute: " + ", ".join(
        f"{dt} {bw[t] / (per_step16[dt] / 16) * flops16 / 1e9:.0f} GFLOP/s"
        f" ({t} thread(s))" for dt in dtypes for t in sorted(bw)))
print(f"{'cell':<12} {'dtype':<5} {'mode':<6} {'thr':>3} {'tok/s':>9} {'roofline':>9} {'%roof':>6} {'%read':>6} {'GFLOP/s':>8}  all rounds")
for cell in cells:
    for th in threads:
        for dt in dtypes:
            for mode in modes:
                f = os.path.join(tmp, f"{cell}.{dt}.{mode}.{th}")
                if not os.path.exists(f): continue
                vals = [float(x) for x in open(f).read().split()]
                ok = [v for v in vals if v == v]
                med = statistics.median(ok) if ok else float("nan")
                roof, pct, rpct, gf = "", "", "", ""
                if cell in ("decode1", "decode16") and th in bw:
                    per = per_tok[dt] if cell == "decode1" else per_step16[dt] / 16
                    rf = bw[th] / per; roof, pct = f"{rf:9.1f}", f"{100 * med / rf:5.0f}%"
                    if th in rbw:
                        rpct = f"{100 * med * per / rbw[th]:5.0f}%"
                    if cell == "decode16":
                        gf = f"{med * flops16 / 1e9:8.0f}"
                else:
                    n = 512 if cell == "prefill512" else 4096
                    gf = f"{med * (flops_tok + attn_flops(n)) / 1e9:8.0f}"
                print(f"{cell:<12} {dt:<5} {mode:<6} {th:>3} {med:9.1f} {roof:>9} {pct:>6} {rpct:>6} {gf:>8}  "
                      + " ".join(f"{v:.1f}" for v in vals))
EOF
