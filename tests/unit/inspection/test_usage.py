"""The usage of pods and containers, read through the one HostReader from fake cgroup v2
trees: what a pod adds up, CPU rates between samples, what a listing forgets, and the
figures of the metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import NotFound
from cri_shim.inspection.cpu_rates import CpuRates
from cri_shim.inspection.host import HostReader
from cri_shim.inspection.layer_usage import LayerUsageCache
from cri_shim.inspection.usage import PodFigures, UsageCollector
from cri_shim.runtime.cgroup_layout import CgroupLayout, cgroup_layout
from cri_shim.state.records import ContainerRecord, SandboxRecord

T = TypeVar("T")
POD = "p" * 64


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@dataclass
class FakeBackend:
    """A runtime handler as the reader uses it: where a container's cgroup is."""

    cgroup_root: Path

    @property
    def cgroup_layout(self) -> CgroupLayout:
        return cgroup_layout(self.cgroup_root, v2=True)

    def cgroups_path(self, container_id: str) -> str | None:
        return f"/pods/{container_id}"

    def set_cpu(self, container_id: str, usage_usec: int, working_set: int) -> None:
        group = self.cgroup_root / "pods" / container_id
        write(group / "cpu.stat", f"usage_usec {usage_usec}\n")
        write(group / "memory.current", f"{working_set}\n")
        write(group / "memory.stat", "anon 1\ninactive_file 0\n")


def sandbox(state: str = "ready") -> SandboxRecord:
    return SandboxRecord(
        id=POD,
        name="k8s_POD_web_default_uid_0",
        phase="visible",
        stage="sandbox ready",
        state=state,
        created_at=0,
        runtime_handler="runc",
        config=api_pb2.PodSandboxConfig(
            metadata=api_pb2.PodSandboxMetadata(name="web", namespace="default")
        ),
        sandbox_dir=Path("/nonexistent"),
        netns_path=None,
        ipc_path=None,
        uts_path=None,
        userns_path=None,
        ips=[],
        cni_result=None,
    )


def container(tmp_path: Path, name: str, state: str = "running") -> ContainerRecord:
    bundle = tmp_path / "bundles" / name
    (bundle / "upper").mkdir(parents=True, exist_ok=True)
    return ContainerRecord(
        id=name,
        name=f"k8s_{name}_web_default_uid_0",
        sandbox_id=POD,
        phase="visible",
        stage="container created",
        state=state,
        created_at=0,
        started_at=0,
        finished_at=0,
        exit_code=0,
        reason="",
        message="",
        image_id="sha256:" + "a" * 64,
        image_ref="busybox",
        config=api_pb2.ContainerConfig(metadata=api_pb2.ContainerMetadata(name=name)),
        log_path="",
        bundle_dir_raw=str(bundle),
        rootfs_raw=str(bundle / "rootfs"),
        pid=0,
    )


@dataclass
class FakeLifecycle:
    """The sandboxes and containers lifecycles as the collector reads them."""

    sandboxes: list[SandboxRecord] = field(default_factory=list)
    containers: list[ContainerRecord] = field(default_factory=list)

    def get(self, ref: str) -> SandboxRecord:
        for s in self.sandboxes:
            if s.id == ref:
                return s
        raise NotFound(ref)

    def list(self) -> list[SandboxRecord]:
        return list(self.sandboxes)

    def ids(self) -> set[str]:
        return {s.id for s in self.sandboxes} | {c.id for c in self.containers}


@dataclass
class FakeContainers:
    of: FakeLifecycle

    def get(self, ref: str) -> ContainerRecord:
        return next(c for c in self.of.containers if c.id == ref)

    def list(self, sandbox_id: str | None = None) -> list[ContainerRecord]:
        return [c for c in self.of.containers if sandbox_id in (None, c.sandbox_id)]

    def ids(self) -> set[str]:
        return {c.id for c in self.of.containers}


def collector(
    tmp_path: Path, objects: FakeLifecycle, rates: CpuRates, layers: LayerUsageCache | None = None
) -> tuple[UsageCollector, FakeBackend]:
    backend = FakeBackend(tmp_path / "cgroup")
    layers = layers if layers is not None else LayerUsageCache(max_age=0)
    reader = HostReader(lambda c: backend, layers)  # type: ignore[arg-type, return-value]
    return UsageCollector(objects, FakeContainers(objects), reader, rates), backend


async def listed(items: AsyncIterator[T]) -> list[T]:
    return [item async for item in items]


async def test_a_pod_uses_what_its_running_containers_use_with_rates(tmp_path: Path) -> None:
    objects = FakeLifecycle([sandbox()])
    objects.containers = [container(tmp_path, "a"), container(tmp_path, "b", state="exited")]
    usage, backend = collector(tmp_path, objects, CpuRates())
    backend.set_cpu("a", usage_usec=1_000, working_set=300)
    backend.set_cpu("b", usage_usec=9_000, working_set=900)  # exited: not read
    first = await usage.pod(POD)
    assert (first.cpu_usage_ns, first.memory_working_set_bytes) == (1_000_000, 300)
    assert first.cpu_nano_cores is None  # nothing to compare with yet
    assert [c.cgroup is not None for c in first.containers] == [True, False]
    assert first.network is None  # no namespace of its own to read
    backend.set_cpu("a", usage_usec=2_000, working_set=300)
    second = await usage.pod(POD)
    assert second.cpu_nano_cores is not None and second.cpu_nano_cores > 0
    assert second.containers[0].cpu_nano_cores is not None


async def test_a_listing_forgets_the_samples_and_layer_figures_of_removed_objects(
    tmp_path: Path,
) -> None:
    objects = FakeLifecycle([sandbox()])
    objects.containers = [container(tmp_path, "a"), container(tmp_path, "b")]
    rates = CpuRates()
    layers = LayerUsageCache(max_age=3600)
    usage, backend = collector(tmp_path, objects, rates, layers)
    for name in ("a", "b"):
        backend.set_cpu(name, usage_usec=1_000, working_set=1)
    await listed(usage.containers(objects.containers))
    assert (len(rates), len(layers)) == (2, 2)
    objects.containers = objects.containers[:1]  # "b" is removed
    read = await listed(usage.containers(objects.containers))
    assert [u.record.id for u in read] == ["a"]
    assert (len(rates), len(layers)) == (1, 1)


async def test_metrics_figures_are_read_for_ready_pods_with_device_names(
    tmp_path: Path,
) -> None:
    objects = FakeLifecycle([sandbox()])
    objects.containers = [container(tmp_path, "a"), container(tmp_path, "b", state="created")]
    usage, backend = collector(tmp_path, objects, CpuRates())
    backend.set_cpu("a", usage_usec=1_000, working_set=1)
    write(tmp_path / "cgroup" / "pods" / "a" / "io.stat", "8:0 rbytes=512 wbytes=0 rios=1\n")
    pods: list[PodFigures] = await listed(usage.pods_figures(lambda pod: pod))
    [pod] = pods
    [figures] = pod.containers  # the created container has no processes to measure
    assert figures.record.id == "a"
    assert figures.figures.io_bytes[(8, 0)]["Read"] == 512
    assert set(figures.device_names) == {(8, 0)}
    assert figures.filesystem is not None  # the writable layer's
    objects.sandboxes = [sandbox(state="notready")]
    assert await listed(usage.pods_figures(lambda pod: pod)) == []
