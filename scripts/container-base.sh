#!/usr/bin/env bash
# The Debian 12 base image the container tests build Ballast's Dockerfile on,
# made here from Debian's packages (no image registry is reachable from the
# test machines): debootstrap's minbase of bookworm, with the packages the
# Dockerfile's runtime stage installs already in it (its apt-get then has
# nothing to fetch), imported into podman's local storage. Built once per
# machine and version; prints the image's name on stdout, progress on stderr.
#
#   scripts/container-base.sh          -> localhost/ballast-debian12:<version>
#   scripts/container-base.sh --name   prints that name, builds nothing
set -euo pipefail
VERSION=1  # bump when the package list changes
INCLUDE=ca-certificates,python3,python3-venv,python3-torch
MIRROR=${BALLAST_DEBIAN_MIRROR:-http://deb.debian.org/debian}
image="localhost/ballast-debian12:$VERSION"
if [ "${1:-}" = "--name" ]; then echo "$image"; exit 0; fi
for tool in debootstrap podman buildah; do
  command -v "$tool" >/dev/null || {
    echo "ballast: $tool is missing: scripts/install-deps.sh installs it (Debian's $tool)" >&2; exit 1; }
done
if podman image exists "$image"; then echo "$image"; exit 0; fi
root=$(mktemp -d /tmp/ballast-debian12.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "ballast: debootstrap bookworm (minbase + $INCLUDE) from $MIRROR into $root (once; ~3 min)" >&2
debootstrap --variant=minbase --include="$INCLUDE" bookworm "$root/rootfs" "$MIRROR" >"$root/debootstrap.log" 2>&1 || {
  tail -20 "$root/debootstrap.log" >&2; echo "ballast: debootstrap failed (mirror $MIRROR reachable?)" >&2; exit 1; }
rm -rf "$root"/rootfs/var/cache/apt/archives/*.deb "$root"/rootfs/var/lib/apt/lists/*
tar -C "$root/rootfs" -c . | podman import --quiet - "$image" >/dev/null
echo "ballast: $image imported ($(du -sh "$root/rootfs" | cut -f1))" >&2
echo "$image"
