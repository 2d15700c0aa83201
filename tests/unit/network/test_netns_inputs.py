"""What the namespace pinner checks and parses before it touches the host (no root needed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cri_shim.errors import Internal, InvalidArgument
from cri_shim.network.netns import NamespacePinner, PinnedNamespaces


@pytest.fixture
def pinner(tmp_path: Path) -> Iterator[NamespacePinner]:
    made = NamespacePinner(tmp_path / "run")
    yield made
    made.close()


async def test_pod_sharing_every_host_namespace_pins_nothing(pinner: NamespacePinner) -> None:
    pins = await pinner.pin("pod1", net=False, uts=False, ipc=False, hostname="")
    assert pins == PinnedNamespaces(None, None, None)
    assert pinner.pinned() == []


@pytest.mark.parametrize("pod_id", ["", ".", "..", "a/b", "../../etc/passwd", "a\0b"])
async def test_pod_ids_that_would_escape_the_pin_dir_are_refused(
    pinner: NamespacePinner, pod_id: str
) -> None:
    with pytest.raises(InvalidArgument, match="pod id"):
        await pinner.pin(pod_id, net=True, uts=False, ipc=False, hostname="")


@pytest.mark.parametrize("hostname", ["", "x" * 65])
async def test_hostname_must_fit_the_kernel_limit(pinner: NamespacePinner, hostname: str) -> None:
    with pytest.raises(InvalidArgument, match="hostname"):
        await pinner.pin("pod1", net=False, uts=True, ipc=False, hostname=hostname)


async def test_hostname_is_not_checked_when_uts_is_shared(pinner: NamespacePinner) -> None:
    pins = await pinner.pin("pod1", net=False, uts=False, ipc=False, hostname="")
    assert pins.paths() == []


async def test_unpin_only_accepts_pins(pinner: NamespacePinner, tmp_path: Path) -> None:
    for path in (tmp_path / "etc-passwd", pinner.run_root / "netns", pinner.run_root / "x/y"):
        with pytest.raises(InvalidArgument, match="not a namespace pin"):
            await pinner.unpin(path)


@pytest.mark.root  # umount2 answers EPERM before ENOENT to anyone else
async def test_unpin_of_a_pin_that_never_existed_succeeds(pinner: NamespacePinner) -> None:
    await pinner.unpin(pinner.run_root / "netns" / "never-pinned")


async def test_closed_pinner_refuses_work(pinner: NamespacePinner) -> None:
    pinner.close()
    pinner.close()  # closing twice is harmless
    with pytest.raises(Internal, match="closed"):
        await pinner.unpin(pinner.run_root / "netns" / "pod1")
