"""Container events rendered where their records are (lifecycle/statuses.py): the CRI
message carries the pod's status and its containers' as they are at the transition, is
serialized once, and every subscriber is handed the same bytes."""

from __future__ import annotations

import asyncio
from pathlib import Path

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import NotFound
from cri_shim.lifecycle.events import CONTAINER_STARTED, CONTAINER_STOPPED, ContainerEvent, EventBus
from cri_shim.lifecycle.sandboxes import Pods
from cri_shim.lifecycle.statuses import EventMessages
from cri_shim.state.containers import ContainerRepository
from cri_shim.state.db import Database
from cri_shim.state.records import SandboxRecord
from cri_shim.state.sandboxes import SandboxRepository
from tests.unit.state.row_fixtures import add_container


def one_pod_two_containers(tmp_path: Path) -> tuple[Pods, ContainerRepository]:
    db = Database(tmp_path / "state.db")
    sandboxes, containers = SandboxRepository(db), ContainerRepository(db)
    config = api_pb2.PodSandboxConfig(
        metadata=api_pb2.PodSandboxMetadata(name="web", namespace="default", uid="u")
    )
    sandboxes.insert("s1", "k8s_POD_web", "sandbox storage", "runc", config, tmp_path)
    sandboxes.mark_ready("s1", ["10.88.0.2"], None)
    sandboxes.mark_visible("s1")
    for container_id in ("c1", "c2"):
        add_container(containers, container_id, "s1")
        containers.mark_visible(container_id)
    return Pods(sandboxes), containers


def test_an_event_carries_the_pods_status_and_its_containers(tmp_path: Path) -> None:
    pods, containers = one_pod_two_containers(tmp_path)
    render = EventMessages(pods.get, containers.list_visible_in)
    rendered = render(ContainerEvent("c1", "s1", CONTAINER_STARTED, 1234))
    assert isinstance(rendered, bytes)
    message = api_pb2.ContainerEventResponse.FromString(rendered)
    assert (message.container_id, message.container_event_type, message.created_at) == (
        "c1",
        api_pb2.CONTAINER_STARTED_EVENT,
        1234,
    )
    assert message.pod_sandbox_status.id == "s1"
    assert message.pod_sandbox_status.state == api_pb2.SANDBOX_READY
    assert message.pod_sandbox_status.network.ip == "10.88.0.2"
    assert sorted(s.id for s in message.containers_statuses) == ["c1", "c2"]


def test_an_event_of_a_pod_that_is_gone_is_dropped(tmp_path: Path) -> None:
    def gone(ref: str) -> SandboxRecord:
        raise NotFound(f"pod sandbox {ref} not found")

    render = EventMessages(gone, lambda sandbox_id: [])
    assert render(ContainerEvent("c1", "s1", CONTAINER_STOPPED, 1)) is None


async def test_every_subscriber_is_handed_the_bytes_rendered_once(tmp_path: Path) -> None:
    pods, containers = one_pod_two_containers(tmp_path)
    rendered: list[bytes | None] = []
    messages = EventMessages(pods.get, containers.list_visible_in)

    def render(event: ContainerEvent) -> bytes | None:
        rendered.append(messages(event))
        return rendered[-1]

    bus = EventBus(render=render)
    with bus.subscribe() as first, bus.subscribe() as second:
        bus.emit("c2", "s1", CONTAINER_STOPPED)
        got = await asyncio.gather(first.get(), second.get())
    assert len(rendered) == 1
    assert got[0] is got[1] is rendered[0]
