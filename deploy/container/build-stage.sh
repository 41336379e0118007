#!/usr/bin/env bash
# Runs inside the build stage of deploy/container/Containerfile{,.cuda}:
# configures and builds moe-serve from /src, then assembles everything the
# runtime stage takes into /out:
#   /out/usr/local/bin/   the binaries and the deploy/container helper scripts
#   /out/opt/moe-serve/models/moe-tiny-en   the bundled demo model (WITH_DEMO_MODEL=1)
#   /out/opt/moe-serve/models/draft-tiny-en-kd  its distilled draft (--draft-model)
#   /out/runtime-packages the Debian packages that own the shared libraries the
#                         binaries load (found with ldd + dpkg -S, so the list
#                         follows the build instead of being kept by hand; CUDA
#                         builds add the cuBLAS and NCCL they dlopen)
# Environment: MOE_CUDA (OFF|ON), JOBS, WITH_DEMO_MODEL (0|1),
# CUDA_ARCHITECTURES (CUDA builds).
set -euo pipefail
src=/src
build=/build
out=/out
jobs=${JOBS:-2}
cuda=${MOE_CUDA:-OFF}

cmake_args=(-S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DMOE_CUDA="$cuda")
if [ "$cuda" != OFF ] && [ -n "${CUDA_ARCHITECTURES:-}" ]; then
  cmake_args+=(-DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCHITECTURES")
fi
cmake "${cmake_args[@]}"

# The served binaries; moe-bench joins them once the tree has it.
targets=(moe-worker moe-coordinator moe-client moectl moe-generate moe-mkmodel)
if cmake --build "$build" --target help | grep -q '\bmoe-bench\b'; then targets+=(moe-bench); fi
cmake --build "$build" -j"$jobs" --target "${targets[@]}"

mkdir -p "$out/usr/local/bin" "$out/opt/moe-serve/models"
for t in "${targets[@]}"; do install -m 0755 "$build/bin/$t" "$out/usr/local/bin/$t"; done
for s in moe-rank moe-group moe-prestop moe-wait-etcd; do
  install -m 0755 "$src/deploy/container/$s" "$out/usr/local/bin/$s"
done
install -D -m 0644 "$src/deploy/container/sshd_config" "$out/etc/moe-serve/sshd_config"
install -D -m 0644 "$src/deploy/container/ssh_config" "$out/etc/ssh/ssh_config.d/moe-serve.conf"
if [ "${WITH_DEMO_MODEL:-1}" = 1 ]; then
  # the checkpoint with its model card (data source and license)
  cp -r "$src/deploy/model/moe-tiny-en" "$out/opt/moe-serve/models/moe-tiny-en"
  cp -r "$src/deploy/model/draft-tiny-en-kd" "$out/opt/moe-serve/models/draft-tiny-en-kd"
fi

# CUDA builds: the toolkit's libraries are found the way the runtime image
# finds them (its LD_LIBRARY_PATH), so that ldd names their packages.
if [ "$cuda" != OFF ]; then export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}; fi

# CUDA builds dlopen cuBLAS (when a CUDA backend starts) and NCCL (with the
# first NCCL communicator) instead of linking them (kernels/cuda/cublas_lazy.h),
# so ldd does not list them: they are looked up here as the runtime image's
# loader finds them (LD_LIBRARY_PATH, then its cache), with what they link.
dlopened=()
if [ "$cuda" != OFF ]; then
  for so in libcublas.so libnccl.so; do
    lib=""
    for d in ${LD_LIBRARY_PATH//:/ }; do
      lib=$(ls "$d/$so".[0-9]* 2>/dev/null | head -1) && [ -n "$lib" ] && break
    done
    [ -n "$lib" ] || lib=$(ldconfig -p | awk -v so="$so." 'index($1, so) == 1 { print $NF; exit }')
    if [ -z "$lib" ]; then echo "build-stage: $so (dlopened by the binaries) not found" >&2; exit 1; fi
    dlopened+=("$lib")
  done
fi

# Which Debian package owns each shared library the binaries load. A library
# ldd cannot find (libcuda.so.1: the host's driver, injected at run time by
# the NVIDIA container toolkit) is left out.
: >"$out/runtime-packages"
{
  for t in "${targets[@]}"; do
    ldd "$out/usr/local/bin/$t" | awk '$2 == "=>" && $3 ~ /^\// { print $3 }'
  done
  for lib in ${dlopened[@]+"${dlopened[@]}"}; do
    echo "$lib"
    ldd "$lib" | awk '$2 == "=>" && $3 ~ /^\// { print $3 }'
  done
} | sort -u | while read -r lib; do
  real=$(readlink -f "$lib")
  pkg=""
  for p in "$lib" "$real" "${lib#/usr}" "${real#/usr}" "/usr$lib" "/usr$real"; do
    if pkg=$(dpkg -S "$p" 2>/dev/null | head -1 | cut -d: -f1) && [ -n "$pkg" ]; then break; fi
  done
  if [ -z "$pkg" ]; then echo "build-stage: no package owns $lib" >&2; exit 1; fi
  echo "$pkg" >>"$out/runtime-packages"
done
sort -u -o "$out/runtime-packages" "$out/runtime-packages"
for t in "${targets[@]}"; do
  ldd "$out/usr/local/bin/$t" | awk '/not found/ { print "build-stage: '"$t"' needs " $1 " (from the host at run time)" }' >&2
done
echo "build-stage: runtime packages: $(tr '\n' ' ' <"$out/runtime-packages")"
