#!/usr/bin/env bash
# The test command of README.md (and of CI): installs the Debian packages,
# builds with warnings as errors (the CUDA backend too when nvcc is present,
# so every .cu file is compiled for sm_80 and sm_90), runs every CTest test,
# then rebuilds with AddressSanitizer + UndefinedBehaviorSanitizer and runs
# the unit and golden tests again.
#
#   tests/run.sh            everything
#   tests/run.sh --no-asan  skip the sanitizer pass
set -euo pipefail
cd "$(dirname "$0")/.."

asan=1
for arg in "$@"; do
  case "$arg" in
    --no-asan) asan=0 ;;
    *) echo "tests/run.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done

jobs=$(nproc 2>/dev/null || echo 2)
deploy/install-deps.sh
# Python packages of tests/python (python_client, http_api), unless present.
python3 -c 'import grpc, grpc_tools, google.protobuf, openai, prometheus_client' 2>/dev/null ||
  python3 -m pip install --quiet grpcio grpcio-tools protobuf openai prometheus_client
# jinja2: the oracle of the chat-template tests (golden/chat_templates_live,
# golden/chat_fuzz); transformers' apply_chat_template needs >= 3.1.6.
python3 -c 'import jinja2, sys; sys.exit(tuple(map(int, jinja2.__version__.split(".")[:3])) < (3, 1, 6))' 2>/dev/null ||
  python3 -m pip install --quiet 'jinja2>=3.1.6'

echo "== build (Release, -Werror) =="
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DMOE_WERROR=ON
cmake --build build -j"$jobs"
echo "== tests =="
ctest --test-dir build --output-on-failure -j"$jobs"

if [ "$asan" = 1 ]; then
  echo "== build (ASan + UBSan, CPU only) =="
  cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DMOE_WERROR=ON -DMOE_SANITIZE=ON -DMOE_CUDA=OFF
  cmake --build build-asan -j"$jobs"
  echo "== tests under ASan + UBSan =="
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build-asan --output-on-failure -j"$jobs" -L 'unit|golden|cli|integration|mpi'
fi
