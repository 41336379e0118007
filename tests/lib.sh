# Shared by the shell tests (sourced): a private temporary folder, processes
# started in the background that are stopped on exit, pass/fail counting.
#
#   . "$(dirname "$0")/../lib.sh"; test_begin moe-xyz
#   ... pids+=($!) ...; ok "what passed"; bad "what failed"
#   test_end            prints "N passed, M failed", exits non-zero on a failure
# shellcheck shell=bash

# test_begin PREFIX: makes $tmp (/tmp/PREFIX-XXXXXX); on exit every pid in
# pids gets SIGTERM, then SIGKILL half a second later, and $tmp goes.
test_begin() {
  tmp=$(mktemp -d "/tmp/$1-XXXXXX")
  pids=()
  pass=0 fail=0
  trap test_cleanup EXIT
}

test_cleanup() {
  if [ ${#pids[@]} -gt 0 ]; then
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
    # until each has exited (a zombie counts as gone), at most 10 s
    for _ in $(seq 100); do
      running=0
      for p in "${pids[@]}"; do
        st=$(ps -o stat= -p "$p" 2>/dev/null) && [ "${st#Z}" = "$st" ] && running=1
      done
      [ $running = 0 ] && break
      sleep 0.1
    done
    for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
  fi
  [ -n "${KEEP_TMP:-}" ] || rm -rf "$tmp"
}

ok() { pass=$((pass + 1)); echo "ok   $*"; }
bad() { fail=$((fail + 1)); echo "FAIL $*"; }

# wait_for FILE PATTERN: until FILE holds PATTERN (at most 60 s: only bounds a hang).
wait_for() {
  for _ in $(seq 600); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  return 1
}

# fresh_workers MOECTL COORD_ADDR: prints `moectl --json workers list` once the
# coordinator has polled every worker after this call, so the counters in it
# include everything that finished before (at most 60 s).
fresh_workers() {
  local t0 before out
  t0=$(date +%s%3N)
  for _ in $(seq 600); do
    before=$(date +%s%3N)
    if out=$("$1" --addr "$2" --json workers list 2>/dev/null) &&
       python3 -c '
import json, sys
t0, before = int(sys.argv[1]), int(sys.argv[2])
ws = json.load(sys.stdin)["workers"]
# polled at (answer time - ago) >= (before - ago): later than t0 for every worker?
sys.exit(0 if ws and all(w.get("last_seen_ms_ago") is not None and
                         before - w["last_seen_ms_ago"] > t0 for w in ws) else 1)' \
         "$t0" "$before" <<<"$out"; then
      echo "$out"
      return 0
    fi
    sleep 0.05
  done
  return 1
}

test_end() {
  echo "$pass passed, $fail failed"
  [ "$fail" -eq 0 ]
  exit
}
