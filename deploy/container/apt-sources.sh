#!/bin/sh
# Points apt at APT_MIRROR (and APT_SECURITY_MIRROR) for Debian 12, in the
# deb822 format of a stock bookworm image; used by both stages of the
# Containerfiles. The defaults are the mirrors Debian itself publishes.
set -eu
mirror=${APT_MIRROR:-http://deb.debian.org/debian}
security=${APT_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
rm -f /etc/apt/sources.list
mkdir -p /etc/apt/sources.list.d
cat >/etc/apt/sources.list.d/debian.sources <<SOURCES
Types: deb
URIs: $mirror
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
# No recommends and no docs in an image.
printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' \
  >/etc/apt/apt.conf.d/90moe-serve
