#!/usr/bin/env bash
# The test command of README.md (and of CI): installs the Debian packages,
# builds with warnings as errors (the CUDA backend too when nvcc is present,
# so every .cu file is compiled for sm_80 and sm_90) and runs every CTest
# test (the soak label too: bench/soak.sh for 1 minute, this pass only),
# then two sanitizer passes, each a CPU-only build of its own:
#   ASan + UBSan: the unit, golden, cli, integration and mpi labels (memory
#                 errors, leaks, undefined behaviour in every process);
#   TSan:         the unit, integration and mpi labels (data races and lock
#                 misuse in every process: test binaries, workers,
#                 coordinators, mpirun ranks). Suppressions, third-party
#                 libraries only, are in tests/sanitize/tsan.supp; a report
#                 from any process, even one a test killed, fails the pass.
#
#   fuzz:         the libFuzzer targets of tests/fuzz (clang, ASan + UBSan):
#                 their committed inputs replayed, then each target fuzzed
#                 for FUZZ_SECONDS (default 10) from its corpus; any crash,
#                 leak, timeout or UBSan report fails (tests/fuzz/run.sh).
#
#   tests/run.sh            everything
#   tests/run.sh --no-asan  skip the ASan + UBSan pass
#   tests/run.sh --no-tsan  skip the ThreadSanitizer pass
#   tests/run.sh --deploy   only the container pass: build the CPU image
#                           (deploy/container/build-image.sh), run a coordinator
#                           and two workers from it (tests/deploy/test_image.sh),
#                           and the Helm chart's rendered pods under podman kube
#                           play (tests/deploy/test_podman.py); minutes, root
#   tests/run.sh --no-fuzz  skip the fuzz pass
set -euo pipefail
# Each phase's header says when it started (seconds since this script did):
# CI has 30 minutes on a 2-core machine, and its log is where they go.
t_start=$(date +%s)
phase() { echo "== $1 (at $(($(date +%s) - t_start)) s) =="; }

cd "$(dirname "$0")/.."

asan=1
tsan=1
deploy=0
fuzz=1
for arg in "$@"; do
  case "$arg" in
    --no-asan) asan=0 ;;
    --no-tsan) tsan=0 ;;
    --deploy) deploy=1 ;;
    --no-fuzz) fuzz=0 ;;
    *) echo "tests/run.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done

jobs=$(nproc 2>/dev/null || echo 2)
if [ "$deploy" = 1 ]; then
  deploy/install-deps.sh --deploy
else
  deploy/install-deps.sh
fi
# Python packages of tests/python (python_client, http_api) and tests/deploy
# (deploy/chart: Helm v4's engine, the Kubernetes schemas), unless present.
python3 -c 'import grpc, grpc_tools, google.protobuf, openai, prometheus_client, helm_python, kubernetes_validate' 2>/dev/null ||
  python3 -m pip install --quiet grpcio grpcio-tools protobuf openai prometheus_client \
    helm-python-sdk kubernetes-validate
# jinja2: the oracle of the chat-template tests (golden/chat_templates_live,
# golden/chat_fuzz); transformers' apply_chat_template needs >= 3.1.6.
python3 -c 'import jinja2, sys; sys.exit(tuple(map(int, jinja2.__version__.split(".")[:3])) < (3, 1, 6))' 2>/dev/null ||
  python3 -m pip install --quiet 'jinja2>=3.1.6'

if [ "$deploy" = 1 ]; then
  # These machines use cgroup v1, which crun refuses (runc works), and the
  # runtimes cannot raise rlimits here: no default ulimits, explicit ones.
  conf=$(mktemp /tmp/moe-containers-XXXXXX.conf)
  trap 'rm -f "$conf"' EXIT
  printf '[containers]\ndefault_ulimits = []\n' >"$conf"
  export CONTAINERS_CONF=$conf PODMAN="podman --runtime /usr/sbin/runc"
  t0=$(date +%s)
  echo "== image (deploy/container/build-image.sh) =="
  deploy/container/build-image.sh --jobs "$jobs"
  t1=$(date +%s)
  echo "== a coordinator and two workers in containers (tests/deploy/test_image.sh) =="
  tests/deploy/test_image.sh
  t3=$(date +%s)
  echo "== the chart's pods under podman kube play (tests/deploy/test_podman.py) =="
  python3 tests/deploy/test_podman.py
  python3 tests/deploy/test_podman.py --values tests/deploy/podman-disagg-values.yaml
  t4=$(date +%s)
  echo "== deploy pass: image $((t1 - t0)) s, containers $((t3 - t1)) s," \
    "chart pods $((t4 - t3)) s, total $((t4 - t0)) s =="
  exit 0
fi

phase "build (Release, -Werror)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DMOE_WERROR=ON
cmake --build build -j"$jobs"
phase "tests"
ctest --test-dir build --output-on-failure -j"$jobs"

if [ "$asan" = 1 ]; then
  phase "build (ASan + UBSan, CPU only)"
  # -O1 -g, as the ASan documentation suggests: exact reports at about half
  # Debug's (-O0) test time (golden/perplexity 315 -> 155 s, test_spec 49 -> 18 s)
  cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g" \
    -DMOE_WERROR=ON -DMOE_SANITIZE=ON -DMOE_CUDA=OFF
  cmake --build build-asan -j"$jobs"
  phase "tests under ASan + UBSan"
  # MOE_TEST_SANITIZER=address: the mpirun tests that repeat one mechanism
  # per model architecture run one model per attention kind (as under TSan)
  MOE_TEST_SANITIZER=address \
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build-asan --output-on-failure -j"$jobs" -L 'unit|golden|cli|integration|mpi|fuzz'
fi

if [ "$tsan" = 1 ]; then
  phase "build (ThreadSanitizer, CPU only)"
  cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOE_WERROR=ON -DMOE_SANITIZE=thread \
    -DMOE_CUDA=OFF
  cmake --build build-tsan -j"$jobs"
  phase "tests under ThreadSanitizer"
  reports=$(mktemp -d /tmp/moe-tsan-XXXXXX)
  # Every process writes its reports to $reports/tsan.PID (also the ones a
  # test SIGKILLs, whose exit code nobody sees); exit code 66 fails a test
  # binary at once.
  tsan_rc=0
  # MOE_TEST_SANITIZER=thread: the tests that repeat one mechanism per model
  # architecture (mpi/model_parallel, unit/test_spec's draft batteries) run
  # one model per attention kind here; TSan is 10-20x slower and the races
  # it looks for are in the code every architecture shares
  MOE_TEST_SANITIZER=thread \
  TSAN_OPTIONS="suppressions=$PWD/tests/sanitize/tsan.supp halt_on_error=0 second_deadlock_stack=1 log_path=$reports/tsan" \
    ctest --test-dir build-tsan --output-on-failure -j"$jobs" -L 'unit|integration|mpi' || tsan_rc=$?
  if grep -l "ThreadSanitizer" "$reports"/tsan.* >/dev/null 2>&1; then
    phase "ThreadSanitizer reports"
    for f in $(grep -l "ThreadSanitizer" "$reports"/tsan.*); do echo "--- $f"; cat "$f"; done
    tsan_rc=1
  fi
  rm -rf "$reports"
  [ "$tsan_rc" = 0 ] || { echo "tests/run.sh: the ThreadSanitizer pass failed" >&2; exit 1; }
fi

if [ "$fuzz" = 1 ]; then
  phase "build (libFuzzer targets: clang, ASan + UBSan, CPU only)"
  cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOE_WERROR=ON \
    -DMOE_FUZZ=ON -DMOE_CUDA=OFF
  cmake --build build-fuzz -j"$jobs" --target moe_fuzz_all
  phase "fuzz: the committed inputs, then every target for ${FUZZ_SECONDS:-10} s"
  ctest --test-dir build-fuzz --output-on-failure -j"$jobs" -L fuzz
  tests/fuzz/run.sh build-fuzz "${FUZZ_SECONDS:-10}"
fi
phase "done"
