"""conmon's launch (runtime/conmon_launch.py): the arguments that give the container a
terminal or stdin, the spec in the bundle, conmon's identity recorded, and the container's
pid (or the reason it has none) read from conmon's report.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from runtime_spec_inputs import STUB_DIR

from cri_shim.errors import DeadlineExceeded, Internal
from cri_shim.runtime.conmon import RuntimeBackend
from cri_shim.runtime.conmon_launch import ConmonLauncher
from cri_shim.runtime.container_files import ContainerFiles
from cri_shim.runtime.handler_runtime import HandlerRuntime
from cri_shim.runtime.kinds.base import HandlerKind
from cri_shim.runtime.oci import OciRuntime
from tests.crilog import Stream
from tests.unit.runtime.conftest import alive, create, lines, spec_for
from tests.waiting import until


async def test_tty_output_is_logged_as_stdout(stub_backend: RuntimeBackend, tmp_path: Path) -> None:
    await create(stub_backend, tmp_path, "[ -t 1 ] && echo on-a-tty", tty=True)
    assert (
        json.loads((tmp_path / "bundles" / "c1" / "config.json").read_text())["process"]["terminal"]
        is True
    )
    await stub_backend.start("c1")
    assert (await stub_backend.wait_exit("c1", 5))[0] == 0
    await until(lambda: lines(tmp_path / "logs" / "c1.log"))
    assert lines(tmp_path / "logs" / "c1.log") == [(Stream.STDOUT, b"on-a-tty\r")]


async def test_stdin_is_held_open(stub_backend: RuntimeBackend, tmp_path: Path) -> None:
    # With stdin requested, `cat` waits for input instead of seeing EOF at once.
    await create(stub_backend, tmp_path, "exec cat", stdin=True)
    await stub_backend.start("c1")
    with pytest.raises(DeadlineExceeded):
        await stub_backend.wait_exit("c1", 0.3)
    await create(stub_backend, tmp_path, "exec cat", cid="c2", stdin=False)
    await stub_backend.start("c2")
    assert (await stub_backend.wait_exit("c2", 5))[0] == 0


async def test_create_writes_the_tty_flag_into_the_bundle_not_into_the_callers_spec(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    spec = spec_for(tmp_path, "exit 0")
    before = json.dumps(spec, sort_keys=True)
    bundle = tmp_path / "bundles" / "c1"
    await stub_backend.create("c1", bundle, spec, tmp_path / "c1.log", True, False)
    assert json.dumps(spec, sort_keys=True) == before
    written = json.loads((bundle / "config.json").read_text())
    assert written["process"]["terminal"] is True
    assert written["process"]["args"] == spec["process"]["args"]
    await stub_backend.delete("c1")


def _launcher(tmp_path: Path, conmon: Path) -> tuple[ConmonLauncher, ContainerFiles]:
    """A launcher of `conmon` over the fake runtime, without the backend around it."""
    runtime_path = STUB_DIR / "fake-oci-runtime"
    files = ContainerFiles(tmp_path / "state")
    for directory in (files.exits, files.containers, tmp_path / "root", tmp_path / "logs"):
        directory.mkdir(parents=True)
    oci = OciRuntime(runtime_path, tmp_path / "root", log_dir=tmp_path / "logs")
    runtime = HandlerRuntime("stub", HandlerKind(runtime_path), oci, files, tmp_path / "cgroup")
    return ConmonLauncher(runtime, conmon, runtime_path, 10.0, "info"), files


async def _launch(launcher: ConmonLauncher, files: ContainerFiles, tmp_path: Path) -> int:
    cdir = files.containers / "c1"
    (cdir / "persist").mkdir(parents=True)
    spec = spec_for(tmp_path, "exec sleep 30")
    log_path = tmp_path / "c1.log"
    return await launcher.launch(
        "c1", cdir, tmp_path / "bundle", spec, log_path, False, False, True
    )


@pytest.fixture
def launched(tmp_path: Path) -> Iterator[None]:
    """Whatever a launch started (conmon, the container's first process waiting for its
    start) is killed after the test, passed or failed: no backend deletes it."""
    yield
    for pid_file in (tmp_path / "bundle" / "pidfile", tmp_path / "state/containers/c1/conmon.pid"):
        with contextlib.suppress(OSError, ValueError):
            pid = int(pid_file.read_text())
            # Only this test's (its arguments name its directory), never a pid reused.
            if str(tmp_path).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)


@pytest.mark.usefixtures("launched")
async def test_the_launch_records_conmons_identity_beside_the_containers_pid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    launcher, files = _launcher(tmp_path, STUB_DIR / "conmon-stub")
    pid = await _launch(launcher, files, tmp_path)
    assert int((tmp_path / "bundle" / "pidfile").read_text()) == pid
    conmon = files.conmon_ref("c1")
    assert conmon is not None and alive(conmon.pid)
    assert conmon.pid == int((files.containers / "c1" / "conmon.pid").read_text())
    meta = files.read_meta("c1")
    assert meta is not None and meta.cgroups_path == "/cri-shim/c1"


@pytest.mark.parametrize(
    ("report", "error"),
    [
        (
            '{"data": -1, "message": "{\\"level\\":\\"error\\",\\"msg\\":\\"no such binary\\"}"}',
            "creating container c1 failed: no such binary",
        ),
        ("not json", "conmon for c1 sent an unreadable report: b'not json\\n'"),
        ("", "conmon for c1 exited without reporting the container's pid: said why"),
    ],
)
async def test_a_failed_report_names_the_reason(tmp_path: Path, report: str, error: str) -> None:
    conmon = tmp_path / "reporting-conmon"
    line = f"{report}\n" if report else ""
    conmon.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        f"os.write(int(os.environ['_OCI_SYNCPIPE']), {line!r}.encode())\n"
        "print('said why', file=sys.stderr)\n"
    )
    conmon.chmod(0o755)
    launcher, files = _launcher(tmp_path, conmon)
    with pytest.raises(Internal) as failed:
        await _launch(launcher, files, tmp_path)
    assert str(failed.value) == error
