#!/usr/bin/env bash
# Builds the op tests (test_ops) and the kernel unit tests (test_kernels) with
# CUDA straight from nvcc and cc, without CMake and without the project's
# other dependencies (gRPC, cJSON, curl, ...): for a bare GPU machine that
# has only the CUDA toolkit. Usage:
#   tests/ops/build_standalone.sh OUTDIR [ARCH]     (ARCH default 90)
# then OUTDIR/test_ops (exit 77: no GPU), OUTDIR/test_kernels and OUTDIR/time_ops.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${1:?usage: build_standalone.sh OUTDIR [ARCH]}
ARCH=${2:-90}
JOBS=$(nproc 2>/dev/null || echo 4)
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
mkdir -p "$OUT/obj"
INC=(-I"$ROOT/common" -I"$ROOT/kernels" -I"$ROOT/tests/unit")
CFLAGS=(-O2 -std=c11 -D_GNU_SOURCE -DMOE_HAVE_CUDA=1 -DMOE_SOURCE_DIR="\"$ROOT\"" -Wall -Wextra
        -Wshadow -Wstrict-prototypes -Wmissing-prototypes -Wvla -Wno-unused-parameter -Werror
        "${INC[@]}")
NVFLAGS=(-O3 -std=c++17 -DMOE_HAVE_CUDA=1 -gencode=arch=compute_$ARCH,code=sm_$ARCH
         -Xcompiler=-Wall,-Wextra,-Wno-unused-parameter --Werror=all-warnings "${INC[@]}")
CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")
pids=()
objs=()
for f in "$ROOT"/kernels/cuda/*.cu; do
  o=$OUT/obj/$(basename "$f").o; objs+=("$o")
  nvcc "${NVFLAGS[@]}" -c "$f" -o "$o" & pids+=($!)
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 0.2; done
done
# kernels/cpu must not contract a*b+c (see kernels/CMakeLists.txt)
for f in "$ROOT"/kernels/backend_select.c "$ROOT"/kernels/cpu/*.c "$ROOT"/kernels/cuda/*.c \
         "$ROOT"/common/moe_error.c "$ROOT"/common/threadpool.c "$ROOT"/common/clock.c \
         "$ROOT"/common/dynlib.c; do
  o=$OUT/obj/$(basename "$f").o; objs+=("$o")
  cc "${CFLAGS[@]}" -ffp-contract=off -I"$CUDA_HOME/include" -c "$f" -o "$o" & pids+=($!)
done
for t in tests/ops/test_ops.c tests/ops/time_ops.c tests/unit/test_kernels.c tests/unit/testlib.c; do
  cc "${CFLAGS[@]}" -c "$ROOT/$t" -o "$OUT/obj/$(basename "$t").o" & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
LIBS=(-L"$CUDA_HOME/lib64" -L"$CUDA_HOME/lib" -lcublas -lcudart -lstdc++ -lpthread -ldl -lm)
for t in test_ops test_kernels time_ops; do
  cc -o "$OUT/$t" "$OUT/obj/$t.c.o" "$OUT/obj/testlib.c.o" "${objs[@]}" "${LIBS[@]}" \
     -Wl,-rpath,"$CUDA_HOME/lib64"
done
echo "built $OUT/test_ops $OUT/test_kernels $OUT/time_ops (sm_$ARCH)"
