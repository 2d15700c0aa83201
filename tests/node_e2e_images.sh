#!/bin/bash
# What the node e2e stand-ins need beyond the kit's images.sh, added on top of its OCI
# layout (one new layer per image, tags replaced in place):
# - busybox:1.29-4 (tag busybox-e2e): a /bin/sh that keeps environment names that are not
#   identifiers (`sh -c env` of the ConfigMap and Secret "via the environment" specs must
#   show `data-1=value-1`, as upstream's busybox 1.29 does; Debian's busybox 1.35 ash drops
#   it): busybox's ash, whose messages other specs read, or static bash (POSIX mode) where
#   such a name is in the environment (fixtures/node-e2e/sh.c).
# - agnhost:2.45: /bin/sh is static bash. Debian's busybox ash is built with standalone
#   applets: `nc` in a script is always its own applet, never the command on PATH, where
#   upstream's agnhost (alpine's busybox) runs what PATH finds. On PATH, in /usr/bin
#   before busybox's /bin: a UDP-capable nc (`echo hostName | nc -w 1 -u IP PORT`, node-pod udp:
#   Debian's busybox nc has no -u) and a curl of its own that does plain HTTP GETs
#   (`curl -g -q -s --max-time 15 --connect-timeout 1 http://IP:PORT/hostName`, the
#   networking specs; upstream's image has curl).
# Usage: tests/node_e2e_images.sh LAYOUT (images.sh's WORKDIR/oci). Needs gcc (static
# glibc), umoci, /bin/bash-static (Debian's bash-static).
set -euo pipefail
L=${1:?usage: node_e2e_images.sh LAYOUT}
SRC=$(dirname "$(readlink -f "$0")")/fixtures/node-e2e
W=$(mktemp -d "${TMPDIR:-/tmp}/node-e2e-images.XXXXXX")
trap 'rm -rf "$W"' EXIT
H=(--history.author tests/node_e2e_images.sh --history.created 2024-01-01T00:00:00Z)
[ -x /bin/bash-static ] || { echo "node_e2e_images.sh: no /bin/bash-static (apt-get install bash-static)" >&2; exit 1; }
for p in sh nc curl; do
  gcc -static -Os -Wall -Wextra -o "$W/$p" "$SRC/$p.c" 2> "$W/$p.log" || { cat "$W/$p.log" >&2; exit 1; }
  strip "$W/$p"
done

umoci unpack --image "$L:busybox-e2e" "$W/busybox"
R=$W/busybox/rootfs
mkdir -p "$R/usr/libexec"
install -m 0755 /bin/bash-static "$R/usr/libexec/bash-static"
rm -f "$R/bin/sh"
install -m 0755 "$W/sh" "$R/bin/sh"
umoci repack --image "$L:busybox-e2e" "${H[@]}" \
  --history.created_by "sh keeping non-identifier environment names (tests/fixtures/node-e2e/sh.c)" "$W/busybox"

umoci unpack --image "$L:agnhost" "$W/agnhost"
R=$W/agnhost/rootfs
rm -f "$R/bin/sh"
install -m 0755 /bin/bash-static "$R/bin/sh"
install -m 0755 "$W/nc" "$R/usr/bin/nc"
install -m 0755 "$W/curl" "$R/usr/bin/curl"
umoci repack --image "$L:agnhost" "${H[@]}" \
  --history.created_by "static bash as /bin/sh, nc with -u, curl for plain HTTP (tests/fixtures/node-e2e)" "$W/agnhost"
