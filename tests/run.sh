#!/usr/bin/env bash
# The test command of README.md (and of CI): installs the Debian packages,
# builds with warnings as errors (the CUDA backend too when nvcc is present,
# so every .cu file is compiled for sm_80 and sm_90), runs every CTest test,
# then rebuilds with AddressSanitizer + UndefinedBehaviorSanitizer and runs
# the unit and golden tests again.
#
#   tests/run.sh            everything
#   tests/run.sh --no-asan  skip the sanitizer pass
#   tests/run.sh --deploy   only the container pass: build the CPU image
#                           (deploy/container/build-image.sh), run a coordinator
#                           and two workers from it (tests/deploy/test_image.sh),
#                           and the Helm chart's rendered pods under podman kube
#                           play (tests/deploy/test_podman.py); minutes, root
set -euo pipefail
cd "$(dirname "$0")/.."

asan=1
deploy=0
for arg in "$@"; do
  case "$arg" in
    --no-asan) asan=0 ;;
    --deploy) deploy=1 ;;
    *) echo "tests/run.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done

jobs=$(nproc 2>/dev/null || echo 2)
if [ "$deploy" = 1 ]; then
  deploy/install-deps.sh --deploy
else
  deploy/install-deps.sh
fi
# Python packages of tests/python (integration/python_client) and
# tests/deploy (deploy/chart: Helm v4's engine, the Kubernetes schemas), unless present.
python3 -c 'import grpc, grpc_tools, google.protobuf, helm_python, kubernetes_validate' 2>/dev/null ||
  python3 -m pip install --quiet grpcio grpcio-tools protobuf helm-python-sdk kubernetes-validate

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
