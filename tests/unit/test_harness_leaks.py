"""What the harness counts as a daemon's own objects when it looks for what a daemon left."""

from __future__ import annotations

from tests.harness import ids_named

MINE = "a" * 64
OTHERS = "b" * 64


def test_an_id_the_daemon_only_answered_not_found_for_is_not_its_own() -> None:
    log = "\n".join(
        [
            f'ts=1 level=info msg="CreateContainer" container_id={MINE}',
            f"ts=2 level=info msg=\"ContainerStatus: NOT_FOUND: container '{MINE}' not found\"",
            # a kubelet asking about another daemon's container, seen in the host's cgroups
            f"ts=3 level=info msg=\"ContainerStatus: NOT_FOUND: container '{OTHERS}' not found\" "
            f"container_id={OTHERS}",
        ]
    )
    assert ids_named(log) == {MINE}
