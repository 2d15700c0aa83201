"""Fixtures for the runtime layer: a host with this machine's quirks, an image rootfs with
its own /etc/passwd, and a backend over the conmon-stub and fake-oci-runtime test doubles
(which keep conmon's and runc's contracts: sync pipe, pid files, exit file, CRI log,
control FIFO; runc's verbs and error output), with the helpers its tests share."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from runtime_spec_inputs import GROUP, PASSWD, STUB_DIR, container_config

from cri_shim.api.v1 import api_pb2
from cri_shim.host import spawn
from cri_shim.runtime.capabilities import ALL_CAPABILITIES
from cri_shim.runtime.conmon import RuntimeBackend
from cri_shim.runtime.host_limits import HostLimits
from cri_shim.runtime.spec import ImageConfigView, SandboxContext, build_spec
from tests.crilog import Stream, join_partials, read_records


@pytest.fixture
def host() -> HostLimits:
    """Like this machine: no CAP_SYS_RESOURCE in the bounding set, NOFILE hard 20000, no
    hugetlb controller."""
    return HostLimits(
        capability_bounding_set=frozenset(ALL_CAPABILITIES) - {"CAP_SYS_RESOURCE"},
        oom_score_adj=0,
        nofile_hard=20000,
        cgroup_v2=False,
        swap_accounting=False,
        hugetlb=False,
    )


@pytest.fixture
def rootfs(tmp_path: Path) -> Path:
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "passwd").write_text(PASSWD)
    (root / "etc" / "group").write_text(GROUP)
    return root


@pytest.fixture
def spec_of(rootfs: Path, host: HostLimits) -> Callable[..., dict[str, Any]]:
    """build_spec with defaults for whatever the test does not care about."""

    def build(
        cfg: api_pb2.ContainerConfig | None = None,
        sandbox: SandboxContext | None = None,
        image: ImageConfigView | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        return build_spec(
            cfg if cfg is not None else container_config(),
            sandbox or SandboxContext(pod_id="pod1"),
            image or ImageConfigView(),
            rootfs,
            container_id=kwargs.pop("container_id", "c1"),
            host=kwargs.pop("host", host),
            **kwargs,
        )

    return build


async def backend_over_doubles(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    host: HostLimits,
    timeout: float = 10,
    **options: Any,
) -> AsyncIterator[RuntimeBackend]:
    """A RuntimeBackend over the test doubles, with `options` for its constructor.
    Whatever a test leaves is deleted after it."""
    # The doubles are `#!/usr/bin/env python3` scripts; this interpreter starts fastest.
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    backend = RuntimeBackend(
        "stub",
        STUB_DIR / "fake-oci-runtime",
        tmp_path / "runtime-root",
        STUB_DIR / "conmon-stub",
        tmp_path / "state",
        cgroup_root=tmp_path / "cgroup",
        host=host,
        call_timeout=timeout,
        create_timeout=timeout,
        **options,
    )
    yield backend
    for leftover in (tmp_path / "state" / "containers").iterdir():
        await backend.delete(leftover.name)


@pytest.fixture
async def stub_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host: HostLimits
) -> AsyncIterator[RuntimeBackend]:
    """A RuntimeBackend over the test doubles."""
    async for backend in backend_over_doubles(tmp_path, monkeypatch, host):
        yield backend


@pytest.fixture
def protected_daemon(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process as the installed daemon, which its unit protects from the OOM killer
    (OOMScoreAdjust=-999): here, where lowering a score needs the missing CAP_SYS_RESOURCE,
    it runs at 500 instead (what a helper would inherit) and its own reads as -999."""
    own = Path("/proc/self/oom_score_adj")
    before = own.read_text()
    own.write_text("500")
    monkeypatch.setattr(spawn, "daemon_oom_score_adj", lambda: -999, raising=False)
    try:
        yield
    finally:
        own.write_text(before)


def spec_for(tmp_path: Path, script: str) -> dict[str, Any]:
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir(exist_ok=True)
    return {
        "ociVersion": "1.0.2",
        "process": {
            "args": ["/bin/sh", "-c", script],
            "cwd": "/",
            "env": ["PATH=/usr/bin:/bin", "GREETING=hello"],
        },
        "root": {"path": str(rootfs)},
        "linux": {"cgroupsPath": "/cri-shim/c1"},
    }


async def create(
    backend: RuntimeBackend, tmp_path: Path, script: str, cid: str = "c1", **kwargs: Any
) -> int:
    return await backend.create(
        cid,
        tmp_path / "bundles" / cid,
        spec_for(tmp_path, script),
        tmp_path / "logs" / f"{cid}.log",
        kwargs.get("tty", False),
        kwargs.get("stdin", False),
    )


def lines(path: Path) -> list[tuple[Stream, bytes]]:
    return [(m.stream, m.content) for m in join_partials(read_records(path))]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
