#!/usr/bin/env bash
# Installs every Debian package the project builds, tests and runs with.
# Idempotent: packages already present are not fetched again, and apt-get
# update runs only when something is missing. Run as root (or with sudo).
#
#   deploy/install-deps.sh            build, test and run
#   deploy/install-deps.sh --deploy   also what building and running the
#                                     container images needs (tests/run.sh --deploy)
#
# The CUDA toolkit and NCCL are not Debian packages here: the build uses them
# when nvcc is found (MOE_CUDA=AUTO) and builds the CPU backend alone otherwise.
set -euo pipefail

PACKAGES=(
  build-essential cmake pkg-config git     # toolchain
  libcjson-dev                             # JSON (config.json, safetensors headers, tokenizer.json)
  libpcre2-dev                             # tokenizer pre-tokenizer regexes (Unicode classes)
  libunistring-dev                         # tokenizer NFC normalisation
  libgrpc-dev protobuf-compiler-grpc       # gRPC C core
  libgrpc++-dev                            # gRPC's CMake config checks its C++ libraries exist
  libprotobuf-c-dev protobuf-c-compiler protobuf-compiler
  libcurl4-openssl-dev                     # etcd v3 HTTP/JSON gateway
  etcd-server etcd-client                  # cluster membership (tests start their own)
  libopenmpi-dev openmpi-bin               # worker groups under mpirun on the CPU
  libmicrohttpd-dev                        # HTTP front door (OpenAI API) and /metrics
  libssl-dev libgnutls28-dev openssl       # TLS (KV data plane, HTTPS), tokens, test certificates
  prometheus                               # tests: a real Prometheus scrapes /metrics
  libcairo2-dev libfontconfig-dev fonts-dejavu-core  # moe-bench --plot: PNG charts, labels
  clang libclang-rt-14-dev llvm            # tests/fuzz: libFuzzer + sanitizer runtimes, llvm-symbolizer
  iproute2                                 # tests: ip netns + veth pairs (fault_partition)
  curl                                     # tests: raw HTTP bodies (fault_input), bench/soak.sh
)
for arg in "$@"; do
  case "$arg" in
    --deploy)
      PACKAGES+=(
        podman buildah                     # build and run the images (deploy/container)
        runc                               # the OCI runtime on cgroup v1 hosts (crun refuses them)
        debootstrap                        # the Debian base image when no registry is reachable
      ) ;;
    *) echo "install-deps: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install-deps: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
