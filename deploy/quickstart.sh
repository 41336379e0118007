#!/usr/bin/env bash
# The README's main command: installs the packages, builds, and runs the
# bundled tiny model. For now that is the offline runner moe-generate; the
# local cluster (coordinator + workers over gRPC) replaces it when it lands.
#
#   deploy/quickstart.sh [extra moe-generate options]
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc 2>/dev/null || echo 2)" --target moe-generate
model=tests/golden/fixtures/qwen3_moe
echo "== build/bin/moe-generate --model $model =="
build/bin/moe-generate --model "$model" --prompt "The quick brown fox" -n 24 --dtype bf16 "$@"
