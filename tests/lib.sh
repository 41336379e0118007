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
    sleep 0.5
    for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
  fi
  rm -rf "$tmp"
}

ok() { pass=$((pass + 1)); echo "ok   $*"; }
bad() { fail=$((fail + 1)); echo "FAIL $*"; }

# wait_for FILE PATTERN: until FILE holds PATTERN (at most 30 s).
wait_for() {
  for _ in $(seq 300); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  return 1
}

test_end() {
  echo "$pass passed, $fail failed"
  [ "$fail" -eq 0 ]
  exit
}
