#!/usr/bin/env bash
# The three serving scenarios as flag sets, on the bundled model
# (deploy/model/moe-tiny-en) and its distilled draft, measured in one run:
#
#   chat        int8 weights + the distilled draft + speculative decoding,
#               few sequences at once (latency first)
#               --dtype int8 --draft-model deploy/model/draft-tiny-en-kd
#               --spec-tokens 4 --max-running 4
#   throughput  bf16 weights, paged bf16 KV, continuous batching of many
#               sequences with a large token budget, the tiled attention
#               --dtype bf16 --max-running 64 --max-batch-tokens 2048
#   edge        int4 weights of a model pruned to 6 of 8 experts per layer
#               (moe-prune on a calibration run's expert counts) + the
#               distilled draft
#               --dtype int4 --group-size 32 --draft-model ... --spec-tokens 4
#               --max-running 4
#
# Speed: held-out prompts (tests/golden/fixtures/tiny_en/heldout.txt), OUT
# tokens each, sampled at temperature 0.8 with fixed seeds, through
# moe-generate --prompts-file, as many at once as the scenario serves (chat
# and edge: 4, throughput: 64, so nothing queues): TTFT p50, TPOT, output
# tokens/s. Memory: the
# weights and the 64 MiB KV pool's blocks. Quality: perplexity on the
# held-out text (ctx 128) and KL divergence to the bf16 model.
#
#   bench/bench_presets.sh [BUILD_DIR]
set -euo pipefail
build=${1:-build}
threads=${THREADS:-2}
out=${OUT:-64}
here=$(cd "$(dirname "$0")/.." && pwd)
model=$here/deploy/model/moe-tiny-en
draft=$here/deploy/model/draft-tiny-en-kd
held=$here/tests/golden/fixtures/tiny_en/heldout.txt
gen=$build/bin/moe-generate
dir=$(mktemp -d /tmp/moe-bench-presets-XXXXXX)
trap 'rm -rf "$dir"' EXIT
for n in 4 64; do
  python3 - "$held" "$n" "$out" >"$dir/prompts$n.jsonl" <<'PY'
import json, sys
paras = [p.strip() for p in open(sys.argv[1], encoding="utf-8").read().split("\n\n") if p.strip()]
n, out = int(sys.argv[2]), int(sys.argv[3])
for i, p in enumerate(paras[::7][:n]):
    print(json.dumps({"prompt": " ".join(p.split()[:8]), "max_tokens": out, "ignore_eos": True,
                      "temperature": 0.8, "seed": 1000 + i}))
PY
done
ppl=(--perplexity "$held" --ctx 128 --threads "$threads")
# the bf16 base for KL, and the calibration run's expert counts for pruning
"$gen" --model "$model" "${ppl[@]}" --dtype bf16 --kl-save "$dir/base.kl" \
  --expert-stats "$dir/stats.json" >/dev/null 2>&1
"$build/bin/moe-prune" --model "$model" --stats "$dir/stats.json" --keep 6 \
  --out "$dir/pruned" >/dev/null
cp "$model"/tokenizer* "$dir/pruned/" 2>/dev/null || true
echo "moe-tiny-en, held-out prompts x $out tokens (temperature 0.8, seeded), $threads threads;" \
  "$(lscpu | grep -m1 'Model name' | sed 's/  */ /g')"
printf "%-10s %5s %10s %9s %9s %11s %9s %8s %9s\n" preset users "TTFT p50" "TPOT" "tok/s" \
  "weights" "KV blocks" "ppl" "KL"
run() { # NAME USERS MODEL FLAGS...
  local name=$1 users=$2 m=$3
  shift 3
  local res
  res=$("$gen" --model "$m" --prompts-file "$dir/prompts$users.jsonl" --kv-memory 64 \
        --threads "$threads" "$@" 2>/dev/null)
  local w
  w=$("$gen" --model "$m" --tokens 1 -n 1 "$@" 2>/dev/null | grep -o '[0-9.]* MiB of weights' |
      grep -o '^[0-9.]*')
  local q
  # shellcheck disable=SC2046 # the flags split into words on purpose
  q=$("$gen" --model "$m" "${ppl[@]}" --kl-base "$dir/base.kl" \
      $(echo "$@" | grep -o -- '--dtype [a-z0-9]*') \
      $(echo "$@" | grep -o -- '--group-size [0-9]*') 2>/dev/null)
  echo "$res" | awk -v name="$name" -v users="$users" -v w="$w" -v q="$q" '
    /^latency:/ { ttft = $7; tpot = $14 } # TTFT mean M s p50 P s p99 Q s, TPOT mean T ms
    /^throughput:/ { tps = $2 }
    /^engine:/ { blocks = $2 }
    END { split(q, lines, "\n"); p = "-"; kl = "-";
          for (i in lines) { if (lines[i] ~ /^ppl:/) { split(lines[i], f, " "); p = f[2] }
                             if (lines[i] ~ /^kl:/) { match(lines[i], /mean [0-9.e+-]+/);
                                                      kl = substr(lines[i], RSTART + 5, RLENGTH - 5) } }
          printf "%-10s %5d %8.1fms %7.2fms %9.1f %8s MiB %9s %8s %9s\n", name, users, 1e3 * ttft,
            tpot, tps, w,
            blocks, p, kl }'
}
run chat 4 "$model" --dtype int8 --draft-model "$draft" --spec-tokens 4 --max-running 4
run throughput 64 "$model" --dtype bf16 --max-running 64 --max-batch-tokens 2048
run edge 4 "$dir/pruned" --dtype int4 --group-size 32 --draft-model "$draft" --spec-tokens 4 \
  --max-running 4
echo "(chat and edge weights: the model's; the draft adds its own, printed by moe-generate at load)"
