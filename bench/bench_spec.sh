#!/usr/bin/env bash
# N-gram speculative decoding on the benchmark-shape model (bf16): offline
# batches through moe-generate with --spec-tokens 0 and K, alternated REPS
# times so both see the same machine state; prints the median output
# tokens/s, TPOT, steps and the draft acceptance of each configuration.
#
# Two prompt sets of N prompts, OUT greedy output tokens each (ignore_eos):
#   repeat: a random 32-token passage written 4 times (128 tokens), the kind
#           of prompt where lookup drafts are meant to pay off;
#   random: 128 random tokens.
# A random-weight model does not copy the passage; what the drafts catch is
# its own repetitive greedy output. Each verify step routes up to K+1 tokens
# per sequence through the MoE layers, so it touches more experts than a
# one-token step and costs more: the numbers are the net of both.
#
#   bench/bench_spec.sh [BUILD_DIR] [K] [BATCHES]
#   e.g. bench/bench_spec.sh build 4 "1 8"
set -euo pipefail
build=${1:-build}
k=${2:-4}
batches=${3:-"1 8"}
threads=${THREADS:-2}
reps=${REPS:-2}
n=${N:-8}
out=${OUT:-64}
model=${MODEL:-/tmp/moe-bench-model}

if [ ! -f "$model/config.json" ]; then
  "$build/bin/moe-mkmodel" --arch mixtral --out "$model" --vocab 32000 --hidden 1024 \
    --layers 8 --heads 16 --kv-heads 4 --experts 8 --top-k 2 --ffn 2816 --dtype bf16 --seed 1
fi
dir=$(mktemp -d /tmp/moe-bench-spec-XXXXXX)
trap 'rm -rf "$dir"' EXIT
# Deterministic token ids (awk's srand is seeded).
awk -v n="$n" -v out="$out" 'BEGIN { srand(11);
  for (i = 0; i < n; i++) {
    for (j = 0; j < 32; j++) pat[j] = 3 + int(rand() * 31997);
    line = "{\"tokens\": [";
    for (j = 0; j < 128; j++) line = line (j ? "," : "") pat[j % 32];
    print line "], \"max_tokens\": " out ", \"ignore_eos\": true}" } }' >"$dir/repeat.jsonl"
awk -v n="$n" -v out="$out" 'BEGIN { srand(12);
  for (i = 0; i < n; i++) {
    line = "{\"tokens\": [";
    for (j = 0; j < 128; j++) line = line (j ? "," : "") (3 + int(rand() * 31997));
    print line "], \"max_tokens\": " out ", \"ignore_eos\": true}" } }' >"$dir/random.jsonl"

echo "model: $model (bench shape, bf16), $n prompts of 128 tokens, $out greedy output tokens," \
  "$threads threads, spec_tokens 0 vs $k alternated $reps times"
# One line per run: set batch k tok/s tpot_ms steps proposed accepted
for r in $(seq "$reps"); do
  for set in repeat random; do
    for b in $batches; do
      for s in 0 "$k"; do
        cmd=("$build/bin/moe-generate" --model "$model" --prompts-file "$dir/$set.jsonl" --dtype bf16
          --threads "$threads" --max-running "$b" --spec-tokens "$s")
        [ "$r" = 1 ] && [ "$set" = repeat ] && echo "# ${cmd[*]}" | sed "s|$dir/||" >>"$dir/cmds.txt"
        "${cmd[@]}" 2>/dev/null | awk -v set="$set" -v b="$b" -v s="$s" '
          /^time:/ { steps = $4 }
          /^speculation:/ { prop = $9; acc = $11 }
          /^throughput:/ { tps = $2 }
          /^latency:/ { tpot = $(NF - 1) }
          END { printf "%s %s %s %s %s %s %s %s\n", set, b, s, tps, tpot, steps, prop + 0, acc + 0 }'
      done
    done
  done
done >"$dir/runs.txt"
cat "$dir/cmds.txt"
awk '{ key = $1 " " $2 " " $3; n[key]++; tps[key, n[key]] = $4; tpot[key, n[key]] = $5;
       steps[key] = $6; prop[key] = $7; acc[key] = $8; if (!(key in seen)) { seen[key] = 1; order[++m] = key } }
  function median(a, key, c,   i, j, t, v) {
    for (i = 1; i <= c; i++) v[i] = a[key, i];
    for (i = 1; i <= c; i++) for (j = i + 1; j <= c; j++) if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t }
    return c % 2 ? v[(c + 1) / 2] : (v[c / 2] + v[c / 2 + 1]) / 2 }
  END {
    printf "%-7s %5s %4s %12s %9s %6s %17s\n", "prompts", "batch", "spec", "out tok/s", "TPOT ms", "steps", "drafts accepted"
    for (i = 1; i <= m; i++) {
      key = order[i]; split(key, f, " ")
      printf "%-7s %5s %4s %12.1f %9.1f %6d %8d/%-6d %s\n", f[1], f[2], f[3], median(tps, key, n[key]),
        median(tpot, key, n[key]), steps[key], acc[key], prop[key],
        prop[key] ? sprintf("%.0f%%", 100 * acc[key] / prop[key]) : "-"
      if (f[3] == 0) base[f[1] " " f[2]] = median(tps, key, n[key])
      else printf "%-7s %5s      speedup %.2fx\n", f[1], f[2], median(tps, key, n[key]) / base[f[1] " " f[2]]
    } }' "$dir/runs.txt"
