#!/usr/bin/env bash
# The README's main command: installs the packages, builds, and runs a local
# cluster on the embedded defaults -- etcd (when installed), a coordinator and
# two CPU workers serving the bundled tiny model -- sends one streaming
# request with moe-client, prints the answer and its timings, and shuts the
# cluster down cleanly.
#
#   deploy/quickstart.sh            the above
#   deploy/quickstart.sh --serve    keep the cluster serving until Ctrl-C
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc 2>/dev/null || echo 2)" --target moe-worker moe-coordinator moe-client moe-generate
exec deploy/local-cluster.sh --build build "$@"
