#!/bin/sh
# usage: run_dead.sh MAX_SECONDS EXPECTED_REGEX COMMAND...
# Runs COMMAND (an mpirun of test_comm_dead) under `timeout 120`, and passes
# when it fails (a rank died), finishes within MAX_SECONDS (never a hang), and
# its output (survivors' or mpirun's) matches EXPECTED_REGEX.
max=$1
expect=$2
shift 2
out=$(mktemp)
start=$(date +%s%N)
timeout 120 "$@" >"$out" 2>&1
rc=$?
end=$(date +%s%N)
ms=$(( (end - start) / 1000000 ))
cat "$out"
echo "run_dead.sh: exit code $rc after $ms ms"
fail=0
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 -a "$ms" -ge 120000 ]; then
    echo "run_dead.sh: FAIL: hung (killed by timeout 120)"; fail=1
elif [ "$rc" -eq 0 ]; then
    echo "run_dead.sh: FAIL: exit code 0 although a rank died"; fail=1
fi
if [ "$ms" -gt $((max * 1000)) ]; then
    echo "run_dead.sh: FAIL: took $ms ms, more than $max s"; fail=1
fi
if ! grep -Eq "$expect" "$out"; then
    echo "run_dead.sh: FAIL: output does not match: $expect"; fail=1
fi
rm -f "$out"
exit $fail
