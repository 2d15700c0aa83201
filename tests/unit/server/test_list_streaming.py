"""The list RPCs and their streaming twins (KEP-5825) over a real gRPC socket, with the
servicer of the daemon in front of an in-memory set of containers."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from cri_shim.api.v1 import api_pb2, api_pb2_grpc
from cri_shim.config import Config
from cri_shim.metrics import Metrics
from cri_shim.server.limits import RequestLimiter
from cri_shim.server.listing import MAX_REPLY_BYTES
from cri_shim.server.services import ImageService, RuntimeService, add_to_server
from cri_shim.state.records import ContainerRecord
from cri_shim.tracing import NO_TRACER

N = 2000


def record(index: int, annotation_bytes: int = 0) -> ContainerRecord:
    pod = f"pod{index % 20:02d}"
    return ContainerRecord(
        id=hashlib.sha256(str(index).encode()).hexdigest(),
        name=f"k8s_c{index}_{pod}_default_uid_0",
        sandbox_id=pod,
        phase="visible",
        stage="done",
        state="running" if index % 3 else "exited",
        created_at=1_700_000_000_000_000_000 + index,
        started_at=0,
        finished_at=0,
        exit_code=0,
        reason="",
        message="",
        image_id="sha256:" + "a" * 64,
        image_ref="docker.io/library/busybox:latest",
        config=api_pb2.ContainerConfig(
            metadata=api_pb2.ContainerMetadata(name=f"c{index}"),
            labels={"app": "even" if index % 2 == 0 else "odd", "n": str(index)},
            annotations={"blob": "x" * annotation_bytes} if annotation_bytes else {},
        ),
        log_path="",
        bundle_dir_raw="/nonexistent",
        rootfs_raw="/nonexistent",
        pid=0,
    )


@dataclass
class CountingContainers:
    """The containers service as the list handlers see it; counts the records handed out,
    which is how far a listing has got."""

    records: list[ContainerRecord]
    handed_out: int = 0

    def list(self, sandbox_id: str | None = None) -> Iterator[ContainerRecord]:
        for r in self.records:
            if sandbox_id is None or r.sandbox_id == sandbox_id:
                self.handed_out += 1
                yield r


@dataclass
class Served:
    stub: api_pb2_grpc.RuntimeServiceStub
    containers: CountingContainers
    extra: dict[str, Any] = field(default_factory=dict)


@pytest.fixture
async def serve(tmp_path: Path) -> AsyncIterator[Any]:
    servers: list[grpc.aio.Server] = []
    channels: list[grpc.aio.Channel] = []

    async def start(records: list[ContainerRecord]) -> Served:
        containers = CountingContainers(records)
        config = Config()
        services = SimpleNamespace(
            config=config,
            rpc_metrics=Metrics(),
            limiter=RequestLimiter(config.requests),
            names=None,  # no list request names an object by ID
            containers=containers,
            tracer=NO_TRACER,
            loop_monitor=None,
        )
        servicer = RuntimeService()
        servicer.view = services  # type: ignore[assignment]
        server = grpc.aio.server()
        add_to_server(server, servicer, ImageService())
        socket = tmp_path / f"cri{len(servers)}.sock"
        server.add_insecure_port(f"unix://{socket}")
        await server.start()
        servers.append(server)
        # As kubelet: 16 MiB replies; no BDP probe, so the window stays at its default.
        channel = grpc.aio.insecure_channel(
            f"unix://{socket}",
            options=[
                ("grpc.max_receive_message_length", MAX_REPLY_BYTES),
                ("grpc.http2.bdp_probe", 0),
            ],
        )
        channels.append(channel)
        return Served(api_pb2_grpc.RuntimeServiceStub(channel), containers)  # type: ignore[no-untyped-call]

    yield start
    for channel in channels:
        await channel.close()
    for server in servers:
        await server.stop(None)


async def streamed(call: Any) -> list[api_pb2.Container]:
    items = []
    async for response in call:
        assert len(response.containers) == 1  # one item per message
        items.extend(response.containers)
    return items


async def test_2000_containers_list_the_same_both_ways(serve: Any) -> None:
    served = await serve([record(i) for i in range(N)])
    started = time.perf_counter()
    unary = await served.stub.ListContainers(api_pb2.ListContainersRequest())
    unary_s = time.perf_counter() - started
    started = time.perf_counter()
    stream = await streamed(served.stub.StreamContainers(api_pb2.StreamContainersRequest()))
    stream_s = time.perf_counter() - started
    assert len(unary.containers) == N
    assert list(unary.containers) == stream
    print(f"{N} containers: unary {unary_s * 1000:.0f} ms, stream {stream_s * 1000:.0f} ms")


@pytest.mark.parametrize(
    "flt",
    [
        api_pb2.ContainerFilter(pod_sandbox_id="pod07"),
        api_pb2.ContainerFilter(id=record(1234).id[:12]),
        api_pb2.ContainerFilter(state=api_pb2.ContainerStateValue(state=api_pb2.CONTAINER_EXITED)),
        api_pb2.ContainerFilter(label_selector={"app": "even"}),
        api_pb2.ContainerFilter(pod_sandbox_id="pod04", label_selector={"app": "even"}),
    ],
)
async def test_the_stream_applies_the_same_filter(serve: Any, flt: api_pb2.ContainerFilter) -> None:
    served = await serve([record(i) for i in range(N)])
    unary = await served.stub.ListContainers(api_pb2.ListContainersRequest(filter=flt))
    stream = await streamed(
        served.stub.StreamContainers(api_pb2.StreamContainersRequest(filter=flt))
    )
    assert 0 < len(stream) < N
    assert list(unary.containers) == stream


async def test_a_reply_past_the_limit_names_the_stream(serve: Any) -> None:
    # 2000 containers of 10 KiB each: 20 MB, past the 16 MiB kubelet accepts.
    served = await serve([record(i, annotation_bytes=10 << 10) for i in range(N)])
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await served.stub.ListContainers(api_pb2.ListContainersRequest())
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "StreamContainers" in str(refused.value.details())
    stream = await streamed(served.stub.StreamContainers(api_pb2.StreamContainersRequest()))
    assert len(stream) == N


async def test_a_slow_reader_holds_the_listing_back(serve: Any) -> None:
    served = await serve([record(i, annotation_bytes=10 << 10) for i in range(N)])
    call = served.stub.StreamContainers(api_pb2.StreamContainersRequest())
    first = await call.read()
    assert isinstance(first, api_pb2.StreamContainersResponse)
    # Timed on purpose: a reader that reads nothing more for a while is what is tested.
    await asyncio.sleep(0.5)
    held = served.containers.handed_out
    # The transport's window and socket buffers hold a few hundred KB: far from 20 MB.
    assert held < N // 4, f"{held} of {N} listed while the client read one"
    rest = 0
    while (response := await call.read()) is not grpc.aio.EOF:
        rest += len(response.containers)
    assert rest == N - 1
    print(f"slow reader: {held} of {N} items made while it read one (10 KiB each)")


async def test_a_client_that_goes_away_ends_the_listing(serve: Any) -> None:
    served = await serve([record(i, annotation_bytes=10 << 10) for i in range(N)])
    call = served.stub.StreamContainers(api_pb2.StreamContainersRequest())
    await call.read()
    call.cancel()

    async def settled() -> int:
        # Timed on purpose: that the listing makes no more progress is checked over a
        # while, again until it holds (a busy machine passes the cancellation on late).
        while True:
            held = served.containers.handed_out
            await asyncio.sleep(0.3)
            if served.containers.handed_out == held:
                return held

    assert await asyncio.wait_for(settled(), 10) < N
