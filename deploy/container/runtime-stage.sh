#!/usr/bin/env bash
# Runs inside the runtime stage of deploy/container/Containerfile{,.cuda}:
# installs the shared libraries the build stage listed (/out/runtime-packages)
# plus what the pods run besides the binaries, and creates the non-root user.
#   openmpi-bin      mpirun/orted: every worker group runs under mpirun
#   openssh-*        multi-pod groups: the leader starts ranks over ssh (as the
#                    MPI Operator does); sshd runs as the non-root user
#   tini             PID 1: forwards signals and reaps orphans
#   etcd-server      optional (WITH_ETCD=1): the chart's etcd members can run
#                    from this image when no registry has an etcd image
#   ca-certificates  TLS to an external etcd or model store
# Environment: WITH_ETCD (0|1), MOE_UID.
set -euo pipefail
extra=(openmpi-bin openssh-client openssh-server tini ca-certificates procps)
if [ "${WITH_ETCD:-1}" = 1 ]; then extra+=(etcd-server); fi
apt-get update -qq
# shellcheck disable=SC2046
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(cat /tmp/runtime-packages) "${extra[@]}"
apt-get clean
rm -rf /var/lib/apt/lists/* /usr/share/doc/* /usr/share/man/* /etc/ssh/ssh_host_*
# The image's sshd runs as the user, never as root: no host keys of its own.
uid=${MOE_UID:-1000}
groupadd --gid "$uid" moe
useradd --uid "$uid" --gid "$uid" --create-home --home-dir /home/moe --shell /bin/bash moe
# no password, but not a locked account: sshd (UsePAM no) refuses locked ones
usermod -p '*' moe
mkdir -p /home/moe/.ssh /run/sshd /var/lib/etcd
chown moe:moe /home/moe/.ssh /var/lib/etcd
chmod 0700 /home/moe/.ssh
