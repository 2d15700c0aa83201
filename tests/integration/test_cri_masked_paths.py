"""Masked and read-only paths, seen from inside a running container.

critest's MaskedPaths spec masks /bin/ls and expects `ls` to fail; with Debian's
busybox-static the shell runs `ls` as a built-in, so that spec cannot tell a mask from none
and the conformance gate expects it to fail. This test shows what it cannot: a masked
file reads empty, a read-only path refuses writes, and a container without them sees the
file and may write. (The test image's applets are symlinks to busybox: masking one would
mask busybox itself, so a plain file is masked.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cri_shim.api.v1 import api_pb2
from tests.harness import Daemon
from tests.integration.cri_testkit import (
    container_config,
    create,
    exec_sync,
    import_image,
    pod,
    start,
)

pytestmark = [pytest.mark.integration, pytest.mark.root]

PROBE = "wc -c < /etc/passwd; touch /usr/written && echo wrote || echo refused"


@pytest.fixture
def p(daemon: Daemon, busybox_layout: Path, short_tmp: Path) -> Iterator[tuple[str, object]]:
    import_image(daemon, busybox_layout)
    with pod(daemon, "masks", short_tmp) as created:
        yield created


def probe(daemon: Daemon, p, name: str, **security: list[str]) -> list[str]:  # type: ignore[no-untyped-def]
    linux = api_pb2.LinuxContainerConfig(
        security_context=api_pb2.LinuxContainerSecurityContext(**security)  # type: ignore[arg-type]
    )
    container_id = create(daemon, p, container_config(name, "sleep 300", linux=linux))
    start(daemon, container_id)
    result = exec_sync(daemon, container_id, ["sh", "-c", PROBE])
    assert result.exit_code == 0, result
    return result.stdout.decode().split()


def test_a_masked_file_reads_empty_and_a_read_only_path_refuses_writes(daemon: Daemon, p) -> None:  # type: ignore[no-untyped-def]
    size, wrote = probe(daemon, p, "plain")
    assert int(size) > 0 and wrote == "wrote"
    size, wrote = probe(daemon, p, "masked", masked_paths=["/etc/passwd"], readonly_paths=["/usr"])
    assert (int(size), wrote) == (0, "refused")
