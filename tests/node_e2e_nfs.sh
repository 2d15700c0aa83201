#!/bin/bash
# The stand-in for registry.k8s.io/e2e-test-images/volume/nfs:1.3, the NFS server of the
# MirrorPod Serial spec (tests/node_e2e.py builds it only where that spec is selected):
# Debian's nfs-kernel-server and rpcbind (mmdebstrap, from this host's Debian sources)
# with tests/fixtures/node-e2e-nfs/run_nfs as its entrypoint, tagged `volume-nfs` in a new
# OCI layout.
# Usage: tests/node_e2e_nfs.sh LAYOUT. Needs root, mmdebstrap and umoci.
set -euo pipefail
L=${1:?usage: node_e2e_nfs.sh LAYOUT}
SRC=$(dirname "$(readlink -f "$0")")/fixtures/node-e2e-nfs
W=$(mktemp -d "${TMPDIR:-/tmp}/node-e2e-nfs.XXXXXX")
trap 'rm -rf "$W"' EXIT
command -v mmdebstrap > /dev/null || { echo "node_e2e_nfs.sh: no mmdebstrap" >&2; exit 1; }
sources=()
for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do
    [ -s "$f" ] && grep -q '^[^#]*deb' "$f" && sources+=("$f")
done
((${#sources[@]})) || { echo "node_e2e_nfs.sh: no Debian apt sources on this host" >&2; exit 1; }

mmdebstrap --mode=root --variant=minbase --include=nfs-kernel-server,rpcbind,procps \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    bookworm "$W/rootfs" "${sources[@]}"
install -m 0755 "$SRC/run_nfs" "$W/rootfs/usr/local/bin/run_nfs"

H=(--history.author tests/node_e2e_nfs.sh --history.created 2024-01-01T00:00:00Z)
umoci init --layout "$L"
umoci new --image "$L:volume-nfs"
umoci unpack --image "$L:volume-nfs" "$W/bundle"
# Without mmdebstrap's device nodes in /dev (the runtime makes a container's; runtimes
# refuse device nodes in layers).
tar -C "$W/rootfs" --exclude='./dev/*' -c . | tar -C "$W/bundle/rootfs" -x --numeric-owner
umoci repack --image "$L:volume-nfs" "${H[@]}" \
    --history.created_by "Debian's nfs-kernel-server and rpcbind, run_nfs (tests/fixtures/node-e2e-nfs)" \
    "$W/bundle"
umoci config --image "$L:volume-nfs" "${H[@]}" \
    --history.created_by "entrypoint run_nfs" \
    --config.entrypoint /usr/local/bin/run_nfs --config.exposedports 2049/tcp \
    --config.exposedports 111/tcp --config.exposedports 111/udp
