#!/usr/bin/env bash
# int8 weights (--dtype int8) against bf16 on the benchmark-shape model, CPU,
# in one run so the ratios share the machine state: decode of one sequence
# (8-token prompt, 64 tokens), decode of 16 sequences together (16 prompts of
# 8 tokens, 64 tokens each) and prefill of a 512-token prompt. The pairs run
# alternated REPS times; the medians are printed. Commands are echoed.
#
#   bench/bench_int8.sh [BUILD_DIR] [REPS]     (env THREADS, default 2; MODEL)
set -euo pipefail
build=${1:-build}
reps=${2:-3}
threads=${THREADS:-2}
model=${MODEL:-/tmp/moe-bench-model}
gen=("$build/bin/moe-generate" --model "$model" --threads "$threads" --device cpu --ignore-eos)
tmp=$(mktemp -d /tmp/moe-bench-int8-XXXXXX)
trap 'rm -rf "$tmp"' EXIT

tokens8=1000,2000,3000,4000,5000,6000,7000,8000
awk 'BEGIN { srand(11); for (i = 0; i < 16; i++) { line = "{\"tokens\": [";
  for (j = 0; j < 8; j++) line = line (j ? "," : "") (1 + int(rand() * 31999));
  print line "], \"max_tokens\": 64}" } }' >"$tmp/p16.jsonl"
tokens512=$(awk 'BEGIN { srand(5); for (j = 0; j < 512; j++) printf "%s%d", (j ? "," : ""), 1 + int(rand() * 31999) }')

run() { # run NAME DTYPE ARGS...: appends one number (tokens/s) to $tmp/NAME.DTYPE
  local name=$1 dt=$2; shift 2
  local out
  out=$("${gen[@]}" --dtype "$dt" "$@" 2>/dev/null)
  case $name in
    decode1) echo "$out" | sed -n 's/^decode: .* \([0-9.]*\) tokens\/s.*/\1/p' ;;
    prefill) echo "$out" | sed -n 's/^prefill: .* \([0-9.]*\) tokens\/s.*/\1/p' ;;
    batch16) echo "$out" | sed -n 's/^throughput: \([0-9.]*\) .*/\1/p' | head -1 ;;
  esac >>"$tmp/$name.$dt"
}

echo "# model $model, $threads threads, $reps alternated reps per pair; commands:"
echo "#   ${gen[*]} --dtype D --tokens $tokens8 -n 64"
echo "#   ${gen[*]} --dtype D --prompts-file P16 -n 64   (16 prompts of 8 tokens, max_tokens 64)"
echo "#   ${gen[*]} --dtype D --tokens <512 ids> -n 1"
for r in $(seq "$reps"); do
  for dt in bf16 int8; do
    run decode1 "$dt" --tokens "$tokens8" -n 64
    run batch16 "$dt" --prompts-file "$tmp/p16.jsonl" -n 64
    run prefill "$dt" --tokens "$tokens512" -n 1
  done
done
median() { sort -g "$1" | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
printf "%-34s %10s %10s %7s   %s\n" "tokens/s (median)" bf16 int8 ratio "all runs bf16 | int8"
for name in decode1 batch16 prefill; do
  b=$(median "$tmp/$name.bf16") i=$(median "$tmp/$name.int8")
  label=$([ $name = decode1 ] && echo "decode, 1 sequence" || ([ $name = batch16 ] && echo "decode, 16 sequences (throughput)" || echo "prefill, 512-token prompt"))
  printf "%-34s %10.1f %10.1f %6.2fx   %s | %s\n" "$label" "$b" "$i" "$(awk -v a="$i" -v b="$b" 'BEGIN { print a / b }')" \
    "$(tr '\n' ' ' <"$tmp/$name.bf16")" "$(tr '\n' ' ' <"$tmp/$name.int8")"
done
