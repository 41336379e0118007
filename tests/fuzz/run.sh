#!/usr/bin/env bash
# Fuzzes every target of a -DMOE_FUZZ=ON build for a bounded time, starting
# from its committed corpus and regressions (never written to: new inputs
# go to a scratch directory). Fails on any crash, leak, timeout, out-of-
# memory or UBSan report, and keeps the input that caused it under
# BUILD/fuzz-artifacts/<target>/ with the log.
#
#   tests/fuzz/run.sh BUILD_DIR [SECONDS_PER_TARGET] [TARGET ...]
#
# Targets run FUZZ_JOBS at a time (default: the CPU count, at most 2).
# Environment: FUZZ_TIMEOUT (seconds one input may take, default 10),
# FUZZ_RSS_MB (default 2560).
set -euo pipefail
src="$(cd "$(dirname "$0")" && pwd)"
build="${1:?usage: tests/fuzz/run.sh BUILD_DIR [SECONDS] [TARGET ...]}"
secs="${2:-20}"
shift $(($# < 2 ? $# : 2))
build="$(cd "$build" && pwd)"
bin="$build/fuzz"
[ -d "$bin" ] || { echo "tests/fuzz/run.sh: no $bin: build with -DMOE_FUZZ=ON first" >&2; exit 2; }

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  for f in "$bin"/fuzz_*; do targets+=("$(basename "$f" | sed 's/^fuzz_//')"); done
fi
jobs="${FUZZ_JOBS:-$(nproc 2>/dev/null || echo 2)}"
[ "$jobs" -gt 2 ] && [ -z "${FUZZ_JOBS:-}" ] && jobs=2
timeout_s="${FUZZ_TIMEOUT:-10}"
rss_mb="${FUZZ_RSS_MB:-2560}"
scratch="$(mktemp -d /tmp/moe-fuzz-XXXXXX)"
trap 'rm -rf "$scratch"' EXIT
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:allocator_may_return_null=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"

# Larger inputs where the seeds are larger (whole tokenizer.json files,
# templates with their conversations).
max_len() {
  case "$1" in
    tokenizer_json) echo 65536 ;;
    chat_template) echo 16384 ;;
    safetensors | etcd | request) echo 16384 ;;
    *) echo 8192 ;;
  esac
}

run_one() {
  local t="$1" exe="$bin/fuzz_$1" work="$scratch/$1"
  mkdir -p "$work/new"
  local dirs=("$work/new" "$src/$t/corpus")
  [ -d "$src/$t/regressions" ] && dirs+=("$src/$t/regressions")
  local dict=()
  [ -f "$src/$t.dict" ] && dict=(-dict="$src/$t.dict")
  local start=$SECONDS rc=0
  # TMPDIR: a target's own files (fuzz_safetensors_index) go with the scratch space
  TMPDIR="$work" "$exe" -max_total_time="$secs" -timeout="$timeout_s" -rss_limit_mb="$rss_mb" \
    -max_len="$(max_len "$t")" -print_final_stats=1 -artifact_prefix="$work/" \
    "${dict[@]}" "${dirs[@]}" >"$work/log" 2>&1 || rc=$?
  local runs
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$work/log" | grep -o '[0-9]*$' || true)
  local new
  new=$(find "$work/new" -type f | wc -l)
  if [ "$rc" != 0 ] || ls "$work"/crash-* "$work"/leak-* "$work"/timeout-* "$work"/oom-* \
    >/dev/null 2>&1; then
    local keep="$build/fuzz-artifacts/$t"
    mkdir -p "$keep"
    cp "$work"/log "$keep/log"
    cp "$work"/crash-* "$work"/leak-* "$work"/timeout-* "$work"/oom-* "$keep/" 2>/dev/null || true
    echo "FAIL fuzz_$t (exit $rc after $((SECONDS - start)) s); input and log in $keep/:"
    grep -E "ERROR|WARNING|runtime error|fuzz check failed|SUMMARY|Test unit written" \
      "$work/log" | head -20
    return 1
  fi
  printf 'ok   fuzz_%-18s %3d s, %8s runs, %4d new inputs\n' "$t" $((SECONDS - start)) \
    "${runs:-?}" "$new"
}

echo "== fuzzing ${#targets[@]} targets for ${secs} s each, $jobs at a time =="
for t in "${targets[@]}"; do
  [ -x "$bin/fuzz_$t" ] || { echo "tests/fuzz/run.sh: no target fuzz_$t in $bin" >&2; exit 2; }
  (
    rc=0
    run_one "$t" >"$scratch/$t.result" 2>&1 || rc=$?
    echo "$rc" >"$scratch/$t.rc"
  ) &
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
done
wait
failed=0
for t in "${targets[@]}"; do
  cat "$scratch/$t.result"
  [ "$(cat "$scratch/$t.rc" 2>/dev/null)" = 0 ] || failed=$((failed + 1))
done
if [ "$failed" != 0 ]; then
  echo "tests/fuzz/run.sh: $failed target(s) failed; add the input that broke one to" \
    "tests/fuzz/<target>/regressions/ once fixed" >&2
  exit 1
fi
