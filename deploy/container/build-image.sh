#!/usr/bin/env bash
# Builds the moe-serve image with podman on a machine with no registry: the
# Debian 12 base image is made with debootstrap and `podman import` when it
# is not there yet. Prints the time each step took.
#
#   deploy/container/build-image.sh [--cuda] [--tag IMAGE] [--base IMAGE] [--jobs N]
#                                   [--no-demo-model] [--no-etcd]
#     --tag   default localhost/moe-serve:dev (localhost/moe-serve-cuda:dev with --cuda)
#     --base  default localhost/debian-base:bookworm (made here if missing)
#
# Environment: PODMAN (default "podman"; these machines need
# "podman --runtime /usr/sbin/runc" with CONTAINERS_CONF pointing at a file
# with "[containers] default_ulimits = []": tests/deploy/podman.sh sets both),
# APT_MIRROR (default: the first deb.debian.org-style URI of this machine's
# /etc/apt sources, else http://deb.debian.org/debian).
set -euo pipefail
cd "$(dirname "$0")/../.."

cuda=0
tag=""
base=localhost/debian-base:bookworm
jobs=2
demo=1
etcd=1
while [ $# -gt 0 ]; do
  case "$1" in
    --cuda) cuda=1; shift ;;
    --tag) tag=$2; shift 2 ;;
    --base) base=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --no-demo-model) demo=0; shift ;;
    --no-etcd) etcd=0; shift ;;
    *) echo "build-image: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
[ -n "$tag" ] || { [ $cuda = 1 ] && tag=localhost/moe-serve-cuda:dev || tag=localhost/moe-serve:dev; }
read -r -a podman <<<"${PODMAN:-podman}"

if [ -z "${APT_MIRROR:-}" ]; then
  APT_MIRROR=$(grep -rhoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list \
    /etc/apt/sources.list.d/ 2>/dev/null | grep -oE 'https?://[^ ]+' | head -1 || true)
  APT_MIRROR=${APT_MIRROR:-http://deb.debian.org/debian}
fi
APT_SECURITY_MIRROR=${APT_SECURITY_MIRROR:-${APT_MIRROR%/debian*}/debian-security}

t0=$(date +%s)
if ! "${podman[@]}" image exists "$base"; then
  [ "$base" = localhost/debian-base:bookworm ] ||
    { echo "build-image: base image $base not found" >&2; exit 1; }
  command -v debootstrap >/dev/null ||
    { echo "build-image: debootstrap not installed (apt-get install debootstrap)" >&2; exit 1; }
  root=$(mktemp -d /var/tmp/moe-debootstrap-XXXXXX)
  trap 'rm -rf "$root"' EXIT
  echo "build-image: debootstrap bookworm from $APT_MIRROR"
  debootstrap --variant=minbase bookworm "$root" "$APT_MIRROR" >"$root.log" 2>&1 ||
    { tail -20 "$root.log" >&2; exit 1; }
  rm -f "$root.log"
  tar -C "$root" -c . | "${podman[@]}" import - "$base" >/dev/null
  rm -rf "$root"
  echo "build-image: base image $base made in $(($(date +%s) - t0)) s"
fi

t1=$(date +%s)
file=deploy/container/Containerfile
[ $cuda = 1 ] && file=deploy/container/Containerfile.cuda
echo "build-image: building $tag from $file (base $base, mirror $APT_MIRROR)"
"${podman[@]}" build --network host -f "$file" --ignorefile deploy/container/containerignore \
  --build-arg BASE="$base" --build-arg APT_MIRROR="$APT_MIRROR" \
  --build-arg APT_SECURITY_MIRROR="$APT_SECURITY_MIRROR" --build-arg JOBS="$jobs" \
  --build-arg WITH_DEMO_MODEL="$demo" --build-arg WITH_ETCD="$etcd" \
  --ulimit nofile=1024:1024 --ulimit nproc=4096:4096 -t "$tag" .
echo "build-image: $tag built in $(($(date +%s) - t1)) s" \
  "($("${podman[@]}" image inspect --format '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}'))"
