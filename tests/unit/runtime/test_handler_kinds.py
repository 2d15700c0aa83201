"""Runtime handler kinds: which kind a binary is (the probe, with fake runtimes), what
each kind does differently, and that a backend asks its kind rather than its runtime's
name."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import FailedPrecondition, Internal
from cri_shim.runtime.conmon import RuntimeBackend
from cri_shim.runtime.container_files import ContainerFiles
from cri_shim.runtime.features import HandlerFeatures
from cri_shim.runtime.gvisor import kill_process_tree
from cri_shim.runtime.host_limits import HostLimits
from cri_shim.runtime.kinds.base import CONTAINER_TYPE, ContainerLimits, HandlerKind
from cri_shim.runtime.kinds.gvisor import GVISOR, GVisorKind, PodCgroupLimits
from cri_shim.runtime.kinds.kata import KATA, KataKind
from cri_shim.runtime.kinds.probe import kind_of
from cri_shim.runtime.sandbox_cgroups import recorded_overhead
from tests.unit.runtime.conftest import backend_over_doubles, create

REPO = Path(__file__).resolve().parents[3]


def fake_runtime(directory: Path, name: str, version: str, features: str = "") -> Path:
    """A runtime binary that answers `--version` and `features`, and counts its calls."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(
        "#!/bin/sh\n"
        f'echo "$1" >>"{directory}/calls"\n'
        f"case $1 in --version) echo '{version}' ;;\n"
        f"features) [ -n '{features}' ] && echo '{features}' || exit 1 ;; esac\n"
    )
    path.chmod(0o755)
    return path


def test_the_probe_knows_gvisor_by_its_version_and_asks_once(tmp_path: Path) -> None:
    runsc = fake_runtime(tmp_path / "bin", "my-sandbox", "runsc version release-20221219.0")
    assert type(kind_of(runsc)) is GVisorKind
    assert type(kind_of(runsc)) is GVisorKind
    assert (tmp_path / "bin" / "calls").read_text().split() == ["--version"]


def test_the_probe_knows_kata_by_its_binarys_name(tmp_path: Path) -> None:
    for name in ("kata-runtime", "containerd-shim-kata-v2"):
        kata = fake_runtime(tmp_path / name, name, "no OCI version")
        assert type(kind_of(kata)) is KataKind
        assert not (tmp_path / name / "calls").exists()  # not even asked


def test_any_other_runtime_is_the_oci_kind_with_the_features_it_lists(tmp_path: Path) -> None:
    listed = json.dumps({"mountOptions": ["rro"], "linux": {"namespaces": []}})
    crun = fake_runtime(tmp_path / "bin", "crun", "crun version 1.8", features=listed)
    kind = kind_of(crun)
    assert type(kind) is HandlerKind
    assert kind.features().engine == "runtime"
    assert kind.features().host_namespaces and kind.features().privileged


def test_a_sandboxed_kind_has_its_own_features_without_asking(tmp_path: Path) -> None:
    runsc = fake_runtime(tmp_path / "bin", "runsc", "runsc version release-20221219.0")
    assert kind_of(runsc).features() is GVISOR
    assert not GVISOR.host_namespaces and not GVISOR.privileged
    assert KataKind(Path("kata-runtime")).features() is KATA
    assert not KATA.host_namespaces and KATA.privileged
    assert (tmp_path / "bin" / "calls").read_text().split() == ["--version"]


def test_an_oci_daemon_does_not_load_the_gvisor_modules(tmp_path: Path) -> None:
    runc = fake_runtime(tmp_path / "bin", "runc", "runc version 1.1.12")
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; "
            "from cri_shim.runtime.conmon import RuntimeBackend; "
            "from cri_shim.runtime.kinds.probe import kind_of; "
            f"kind_of(Path({str(runc)!r})); "
            "print(sorted(m for m in sys.modules if 'gvisor' in m or 'kata' in m))",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout
    assert loaded.strip() == "[]"


def _context(tmp_path: Path) -> Any:
    """What a kind's limits are made from, without a runtime behind it."""
    return SimpleNamespace(
        handler_name="h", files=ContainerFiles(tmp_path), cgroup_root=tmp_path, oci=None
    )


def test_the_oci_kind_does_what_runc_does(tmp_path: Path) -> None:
    kind = HandlerKind(Path("/usr/bin/runc"))
    spec: dict[str, Any] = {"process": {"capabilities": {"bounding": ["CAP_BPF"]}}}
    assert kind.prepare_spec(spec) is spec
    assert (kind.pod_sandbox, kind.mounts_at_start) == (False, False)
    assert type(kind.limits(_context(tmp_path))) is ContainerLimits  # the runtime's `update`
    assert kind.inside is None
    assert kind.tty_options == ("--tty",)
    assert kind.exec_options(tmp_path) == []
    assert kind.start_env(tmp_path) == {}
    assert not kind.end_unstarted(tmp_path, Internal("container is in state created"))
    assert kind.relay_argv(tmp_path, [], "pod", 80) is None
    assert kind.conmon_runtime(tmp_path, "runc") == Path("/usr/bin/runc")


def _gvisor_bundle(tmp_path: Path, container_type: str, user: dict[str, Any]) -> Path:
    bundle = tmp_path / container_type
    bundle.mkdir()
    spec = {"annotations": {CONTAINER_TYPE: container_type}, "process": {"user": user}}
    (bundle / "config.json").write_text(json.dumps(spec))
    return bundle


def test_gvisor_runs_exec_as_the_containers_user_and_kills_inside(tmp_path: Path) -> None:
    kind = GVisorKind(Path("/usr/bin/runsc"))
    bundle = _gvisor_bundle(tmp_path, "container", {"uid": 1000, "gid": 10})
    assert kind.exec_options(bundle) == ["--user", "1000:10"]
    assert kind.inside is kill_process_tree
    assert kind.tty_options == ()  # runsc's console socket is its terminal option
    assert isinstance(kind.limits(_context(tmp_path)), PodCgroupLimits)


def test_gvisor_gives_runsc_a_spec_without_capabilities_it_does_not_know() -> None:
    spec: dict[str, Any] = {"process": {"capabilities": {"bounding": ["CAP_BPF", "CAP_KILL"]}}}
    given = GVisorKind(Path("runsc")).prepare_spec(spec)
    assert given["process"]["capabilities"]["bounding"] == ["CAP_KILL"]
    assert spec["process"]["capabilities"]["bounding"] == ["CAP_BPF", "CAP_KILL"]


def test_gvisor_starts_a_joining_container_with_its_waiters_stdio(tmp_path: Path) -> None:
    kind = GVisorKind(Path("runsc"))
    joining = _gvisor_bundle(tmp_path, "container", {})
    (joining / "pidfile").write_text("4242")
    sandbox = _gvisor_bundle(tmp_path, "sandbox", {})
    (sandbox / "pidfile").write_text("4343")
    assert kind.start_env(joining) == {"CRI_SHIM_STDIO_OF": "4242"}
    assert kind.start_env(sandbox) == {}


def test_gvisor_ends_an_unstarted_joining_container_by_its_waiter(tmp_path: Path) -> None:
    kind = GVisorKind(Path("runsc"))
    waiter = subprocess.Popen(["sleep", "60"])
    try:
        bundle = _gvisor_bundle(tmp_path, "container", {})
        (bundle / "pidfile").write_text(str(waiter.pid))
        assert not kind.end_unstarted(bundle, Internal("permission denied"))
        assert waiter.poll() is None
        assert kind.end_unstarted(bundle, Internal("container is in state created"))
        assert waiter.wait(timeout=10) < 0
    finally:
        waiter.kill()
        waiter.wait()


class FakeOci:
    """The runtime's command line as a kind sees it: records the deletes it is asked."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.deleted: list[str] = []

    async def delete(self, container_id: str, *, force: bool = False) -> None:
        self.deleted.append(container_id)


async def test_gvisor_deletes_with_runscs_leftover_locks(tmp_path: Path) -> None:
    oci = FakeOci(tmp_path)
    lock = tmp_path / "c1_sandbox:pod.lock"
    lock.touch()
    await GVisorKind(Path("runsc")).delete(oci, "c1", None)
    assert oci.deleted == ["c1"] and not lock.exists()
    kept = tmp_path / "c2_sandbox:pod.lock"
    kept.touch()
    await HandlerKind(Path("runc")).delete(oci, "c2", None)
    assert oci.deleted == ["c1", "c2"] and kept.exists()


def test_gvisors_pod_sandbox_records_the_pods_overhead(tmp_path: Path) -> None:
    pod = api_pb2.PodSandboxConfig(
        linux=api_pb2.LinuxPodSandboxConfig(
            overhead=api_pb2.LinuxContainerResources(memory_limit_in_bytes=64 << 20)
        )
    )
    gvisor_spec: dict[str, Any] = {"annotations": {}}
    GVisorKind(Path("runsc")).prepare_pod_sandbox(gvisor_spec, tmp_path, pod)
    assert recorded_overhead(gvisor_spec)["memory"]["limit"] == 64 << 20
    kata_spec: dict[str, Any] = {"annotations": {}}
    KataKind(Path("kata-runtime")).prepare_pod_sandbox(kata_spec, tmp_path, pod)
    assert kata_spec == {"annotations": {}}


def test_gvisor_explains_the_network_namespace_refusal_of_old_runsc() -> None:
    refused = Internal("cannot run with network enabled in root network namespace")
    explained = GVisorKind(Path("runsc")).start_refused("gv", refused)
    assert isinstance(explained, FailedPrecondition) and "--network=host" in str(explained)
    assert GVisorKind(Path("runsc")).start_refused("gv", Internal("other")) is None
    assert HandlerKind(Path("runc")).start_refused("runc", refused) is None


class FakeKind(HandlerKind):
    """A kind that marks the spec it is given and records what the backend asks of it."""

    pod_sandbox = True

    def __init__(self, runtime_path: Path) -> None:
        super().__init__(runtime_path)
        self.asked: list[str] = []

    def features(self) -> HandlerFeatures:
        return HandlerFeatures(engine="fake kernel")

    def prepare_spec(self, spec: dict[str, Any]) -> dict[str, Any]:
        self.asked.append("prepare_spec")
        return {**spec, "annotations": {**spec.get("annotations", {}), "fake": "kind"}}

    def exec_options(self, bundle: Path) -> list[str]:
        self.asked.append("exec_options")
        return ["--fake-user"]

    async def delete(self, oci: Any, container_id: str, bundle: Path | None) -> None:
        self.asked.append("delete")
        await super().delete(oci, container_id, bundle)


@pytest.fixture
async def fake_kind_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host: HostLimits
) -> AsyncIterator[RuntimeBackend]:
    kind = FakeKind(Path("fake-oci-runtime"))
    async for backend in backend_over_doubles(tmp_path, monkeypatch, host, kind=kind):
        yield backend


async def test_a_backend_asks_its_kind(fake_kind_backend: RuntimeBackend, tmp_path: Path) -> None:
    kind = fake_kind_backend.kind
    assert isinstance(kind, FakeKind)
    assert fake_kind_backend.pod_sandbox  # the kind's, where the configuration says nothing
    await create(fake_kind_backend, tmp_path, "exec sleep 30")
    config = json.loads((tmp_path / "bundles" / "c1" / "config.json").read_text())
    assert config["annotations"]["fake"] == "kind"
    assert fake_kind_backend.exec_options("c1") == ["--fake-user"]
    await fake_kind_backend.delete("c1")
    assert kind.asked == ["prepare_spec", "exec_options", "delete"]


async def test_the_configuration_overrides_the_kinds_pod_sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host: HostLimits
) -> None:
    kind = FakeKind(Path("fake-oci-runtime"))
    options = {"kind": kind, "pod_sandbox": False}
    async for backend in backend_over_doubles(tmp_path, monkeypatch, host, **options):
        assert not backend.pod_sandbox
