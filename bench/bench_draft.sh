#!/usr/bin/env bash
# Speculative decoding on the bundled model (deploy/model/moe-tiny-en, bf16)
# with its draft models, on held-out text: the first words of N held-out
# fortunes (tests/golden/fixtures/tiny_en/heldout.txt, never trained on) as
# prompts, OUT greedy tokens each (ignore_eos, so every configuration emits
# the same tokens), at max running sequences 1, 4 and 16. Configurations:
# no speculation, n-gram lookup, the student trained on the text alone
# (draft-tiny-en-text) and the distilled one (draft-tiny-en-kd), K drafts per
# step (K adapted to acceptance, the default --spec-policy), and n-gram and
# the distilled draft again under --spec-policy cost (K also weighs the
# measured step and draft costs: what that buys); alternated REPS times so
# all see the same machine state. Prints the median output tokens/s, its
# ratio to no speculation, and the acceptance; text vs kd is what
# distillation buys.
#
#   bench/bench_draft.sh [BUILD_DIR] [K] [BATCHES]
set -euo pipefail
build=${1:-build}
k=${2:-4}
batches=${3:-"1 4 16"}
threads=${THREADS:-2}
reps=${REPS:-3}
n=${N:-16}
out=${OUT:-64}
here=$(cd "$(dirname "$0")/.." && pwd)
model=$here/deploy/model/moe-tiny-en
held=$here/tests/golden/fixtures/tiny_en/heldout.txt
dir=$(mktemp -d /tmp/moe-bench-draft-XXXXXX)
trap 'rm -rf "$dir"' EXIT
# prompts: the first 8 words of every 7th held-out paragraph
python3 - "$held" "$n" "$out" >"$dir/prompts.jsonl" <<'PY'
import json, sys
paras = [p.strip() for p in open(sys.argv[1], encoding="utf-8").read().split("\n\n") if p.strip()]
n, out = int(sys.argv[2]), int(sys.argv[3])
for p in paras[::7][:n]:
    print(json.dumps({"prompt": " ".join(p.split()[:8]), "max_tokens": out, "ignore_eos": True}))
PY
kd=$here/deploy/model/draft-tiny-en-kd
configs=("none|--spec-tokens 0" "ngram|--spec-tokens $k"
         "text|--spec-tokens $k --draft-model $here/deploy/model/draft-tiny-en-text"
         "kd|--spec-tokens $k --draft-model $kd"
         "ngram-cost|--spec-tokens $k --spec-policy cost"
         "kd-cost|--spec-tokens $k --draft-model $kd --spec-policy cost")
echo "moe-tiny-en (bf16), $n held-out prompts, $out tokens each, K=$k, $threads threads," \
  "$reps alternated rounds; $(lscpu | grep -m1 'Model name' | sed 's/  */ /g')"
for _ in $(seq "$reps"); do
  for b in $batches; do
    for c in "${configs[@]}"; do
      name=${c%%|*} flags=${c#*|}
      # shellcheck disable=SC2086
      "$build/bin/moe-generate" --model "$model" --prompts-file "$dir/prompts.jsonl" \
        --dtype bf16 --threads "$threads" --max-running "$b" $flags 2>/dev/null |
        awk -v c="$name" -v b="$b" '
          /^speculation:/ { prop = $9; acc = $11 }
          /^throughput:/ { tps = $2 }
          END { printf "%s %s %s %s %s\n", c, b, tps, prop + 0, acc + 0 }' >>"$dir/runs.txt"
    done
  done
done
python3 - "$dir/runs.txt" "$batches" <<'PY'
import statistics, sys
runs = [l.split() for l in open(sys.argv[1]) if l.strip()]
print(f"{'draft':<9} {'batch':>5} {'tok/s':>12} {'vs none':>9} {'acceptance':>11}")
for b in sys.argv[2].split():
    def med(c):
        return statistics.median(float(r[2]) for r in runs if r[0] == c and r[1] == b)
    base = med("none")
    for c in ("none", "ngram", "text", "kd", "ngram-cost", "kd-cost"):
        rs = [r for r in runs if r[0] == c and r[1] == b]
        prop = sum(float(r[3]) for r in rs)
        acc = sum(float(r[4]) for r in rs)
        a = f"{100 * acc / prop:.1f}%" if prop else "-"
        print(f"{c:<9} {b:>5} {med(c):12.1f} {med(c) / base:8.2f}x {a:>11}")
PY
