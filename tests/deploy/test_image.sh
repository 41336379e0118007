#!/usr/bin/env bash
# The CPU image on its own: two moe-worker containers and a moe-coordinator
# container (host network, free ports, the bundled demo model), the image's
# moe-client answering a request through the coordinator, then SIGTERM
# (podman stop): every server drains and exits 0.
#
#   tests/deploy/test_image.sh [IMAGE]    default localhost/moe-serve:dev
# Environment: PODMAN (default "podman --runtime /usr/sbin/runc"),
# CONTAINERS_CONF (tests/run.sh --deploy sets both).
set -euo pipefail
image=${1:-localhost/moe-serve:dev}
read -r -a podman <<<"${PODMAN:-podman --runtime /usr/sbin/runc}"
if ! command -v "${podman[0]}" >/dev/null; then echo "SKIPPED: podman not installed"; exit 77; fi
"${podman[@]}" image exists "$image" ||
  { echo "test_image: image $image not found (deploy/container/build-image.sh)" >&2; exit 1; }
if [ -z "${CONTAINERS_CONF:-}" ]; then
  CONTAINERS_CONF=$(mktemp /tmp/moe-containers-XXXXXX.conf)
  printf '[containers]\ndefault_ulimits = []\n' >"$CONTAINERS_CONF"
  export CONTAINERS_CONF
fi
tag=moe-image-test-$$
names=()
cleanup() {
  for n in "${names[@]}"; do "${podman[@]}" rm -f -t 1 "$n" >/dev/null 2>&1 || true; done
}
trap cleanup EXIT
run() { # NAME ARGS...: a detached container on the host network
  local name=$tag-$1
  shift
  names+=("$name")
  "${podman[@]}" run -d --name "$name" --network host --ulimit nofile=1024:1024 \
    --ulimit nproc=4096:4096 "$image" "$@" >/dev/null
}
# Waits for PATTERN in NAME's log (or its exit); prints the matching line.
wait_log() {
  local name=$tag-$1 pattern=$2
  for _ in $(seq 300); do
    if "${podman[@]}" logs "$name" 2>&1 | grep -m1 "$pattern"; then return 0; fi
    if [ "$("${podman[@]}" inspect -f '{{.State.Running}}' "$name")" != true ]; then
      echo "test_image: $name exited:" >&2; "${podman[@]}" logs "$name" >&2; return 1
    fi
    sleep 0.1
  done
  echo "test_image: no '$pattern' from $name" >&2; "${podman[@]}" logs "$name" >&2; return 1
}
t0=$(date +%s.%N)
model=/opt/moe-serve/models/moe-tiny-en
workers=()
for i in 1 2; do
  run "worker-$i" moe-worker --model $model --listen 127.0.0.1:0 --worker-id "image-worker-$i" \
    --threads 1 --kv-memory 64
  line=$(wait_log "worker-$i" "serving")
  workers+=("$(grep -o '127\.0\.0\.1:[0-9]*' <<<"$line" | head -1)")
done
run coordinator moe-coordinator --model $model --listen 127.0.0.1:0 \
  --workers "$(IFS=,; echo "${workers[*]}")"
line=$(wait_log coordinator "serving on")
addr=$(grep -o '127\.0\.0\.1:[0-9]*' <<<"$line" | head -1)
echo "test_image: workers ${workers[*]}, coordinator $addr"
out=$("${podman[@]}" run --rm --network host "$image" moe-client --addr "$addr" \
  --prompt "The quick brown fox" -n 24 --ignore-eos)
echo "$out"
grep -q "finish: length, 24 tokens" <<<"$out" || { echo "test_image: FAILED: no 24-token answer" >&2; exit 1; }
for n in coordinator worker-1 worker-2; do
  "${podman[@]}" stop -t 30 "$tag-$n" >/dev/null
  code=$("${podman[@]}" inspect -f '{{.State.ExitCode}}' "$tag-$n")
  [ "$code" = 0 ] || { echo "test_image: FAILED: $n exited $code after SIGTERM" >&2; "${podman[@]}" logs "$tag-$n" >&2; exit 1; }
done
grep -q "draining" <<<"$("${podman[@]}" logs "$tag-worker-1" 2>&1)" ||
  { echo "test_image: FAILED: worker-1 did not drain on SIGTERM" >&2; exit 1; }
echo "test_image: PASSED in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s" \
  "(servers drained and exited 0 on SIGTERM)"
