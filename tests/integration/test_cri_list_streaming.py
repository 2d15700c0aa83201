"""The six streaming list RPCs (KEP-5825) against the real daemon: each answers with the
items of its unary twin, one per message, with the same filter; streams a client leaves
unread neither take the reads' places nor stay open past their write timeout, and a
client that cancels one is no error."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from cri_shim.api.v1 import api_pb2, api_pb2_grpc
from tests.harness import Daemon, pod_config
from tests.integration.cri_testkit import container_config, create, import_image, pod, start
from tests.integration.test_operations import free_port, get, scrape
from tests.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.root]


def _streamed(call: Any, field: str) -> list[Any]:
    items = []
    for response in call:
        assert len(getattr(response, field)) == 1  # one item per message
        items.extend(getattr(response, field))
    return items


def test_every_stream_lists_what_its_unary_twin_lists(
    daemon: Daemon, busybox_layout: Path, short_tmp: Path
) -> None:
    import_image(daemon, busybox_layout)
    rt, images = daemon.runtime(), daemon.images()
    with pod(daemon, "streamed-a", short_tmp) as a, pod(daemon, "streamed-b", short_tmp) as b:
        for p, name in ((a, "one"), (a, "two"), (b, "three")):
            start(daemon, create(daemon, p, container_config(name, "exec sleep 300")))

        pods = rt.ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=10).items
        streamed = _streamed(
            rt.StreamPodSandboxes(api_pb2.StreamPodSandboxesRequest(), timeout=10),
            "pod_sandboxes",
        )
        assert sorted(p.id for p in streamed) == sorted(p.id for p in pods) == sorted([a[0], b[0]])

        only_a = api_pb2.ContainerFilter(pod_sandbox_id=a[0])
        unary = rt.ListContainers(api_pb2.ListContainersRequest(filter=only_a), timeout=10)
        streamed = _streamed(
            rt.StreamContainers(api_pb2.StreamContainersRequest(filter=only_a), timeout=10),
            "containers",
        )
        assert len(streamed) == 2 and list(unary.containers) == streamed

        stats_a = api_pb2.ContainerStatsFilter(pod_sandbox_id=a[0])
        unary_stats = rt.ListContainerStats(
            api_pb2.ListContainerStatsRequest(filter=stats_a), timeout=10
        ).stats
        streamed = _streamed(
            rt.StreamContainerStats(
                api_pb2.StreamContainerStatsRequest(filter=stats_a), timeout=10
            ),
            "container_stats",
        )
        assert [s.attributes.id for s in streamed] == [s.attributes.id for s in unary_stats]
        assert len(streamed) == 2

        pod_b = api_pb2.PodSandboxStatsFilter(id=b[0])
        streamed = _streamed(
            rt.StreamPodSandboxStats(
                api_pb2.StreamPodSandboxStatsRequest(filter=pod_b), timeout=10
            ),
            "pod_sandbox_stats",
        )
        assert [s.attributes.id for s in streamed] == [b[0]]
        assert len(streamed[0].linux.containers) == 1

        unary_metrics = rt.ListPodSandboxMetrics(
            api_pb2.ListPodSandboxMetricsRequest(), timeout=10
        ).pod_metrics
        streamed = _streamed(
            rt.StreamPodSandboxMetrics(api_pb2.StreamPodSandboxMetricsRequest(), timeout=10),
            "pod_sandbox_metrics",
        )
        assert (
            sorted(m.pod_sandbox_id for m in streamed)
            == sorted(m.pod_sandbox_id for m in unary_metrics)
            == sorted([a[0], b[0]])
        )

        unary_images = images.ListImages(api_pb2.ListImagesRequest(), timeout=10).images
        streamed = _streamed(
            images.StreamImages(api_pb2.StreamImagesRequest(), timeout=10), "images"
        )
        assert streamed == list(unary_images) and streamed
    assert daemon.leaks() == {}


# ---- streams a client does not read ----------------------------------------------------

HOST_NETWORK = api_pb2.LinuxPodSandboxConfig(
    security_context=api_pb2.LinuxSandboxSecurityContext(
        namespace_options=api_pb2.NamespaceOption(network=api_pb2.NODE)
    )
)


@contextmanager
def large_pods(daemon: Daemon, count: int) -> Iterator[list[str]]:
    """Pods of about 400 KB each (labels and annotations at their limits): one listed pod
    is more than the transport's window, so a stream whose client does not read waits."""
    runtime = daemon.runtime()
    ids = []
    try:
        for i in range(count):
            config = pod_config(
                f"large-{i}",
                uid=f"uid-large-{i}",
                linux=HOST_NETWORK,
                labels={"blob": "l" * 200_000},
                annotations={"blob": "a" * 200_000},
            )
            request = api_pb2.RunPodSandboxRequest(config=config)
            ids.append(runtime.RunPodSandbox(request, timeout=60).pod_sandbox_id)
        yield ids
    finally:
        for sandbox_id in ids:
            runtime.RemovePodSandbox(
                api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60
            )


def unread_channel(daemon: Daemon) -> grpc.aio.Channel:
    # No BDP probe: the client's window stays at its default, as a reader that reads nothing.
    return grpc.aio.insecure_channel(
        f"unix://{daemon.socket}", options=[("grpc.http2.bdp_probe", 0)]
    )


def streams_ended(port: int, code: str) -> float:
    return get(scrape(port), "cri_shim_rpc_requests_total", method="StreamPodSandboxes", code=code)


def test_unread_streams_leave_reads_answered_and_end_at_their_write_timeout(
    make_daemon: type, short_tmp: Path
) -> None:
    port = free_port()
    daemon: Daemon = make_daemon(
        settings={
            "requests": {
                "max_reads_in_flight": 8,
                "max_streams_in_flight": 4,
                "stream_write_timeout": "1s",
            },
            "metrics": {"listen": f"127.0.0.1:{port}"},
        }
    )
    daemon.start()

    async def scenario(runtime: api_pb2_grpc.RuntimeServiceStub) -> None:
        request = api_pb2.StreamPodSandboxesRequest()
        opened = [runtime.StreamPodSandboxes(request) for _ in range(10)]
        # Four are admitted and wait for a reader; the other six are refused at once.
        await until(lambda: sum(call.done() for call in opened) == 6, timeout=30)
        refused = [call for call in opened if call.done()]
        for call in refused:
            assert await call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_streams_in_flight" in await call.details()
        # The open streams take none of the eight places of the reads.
        for _ in range(3):
            await runtime.Version(api_pb2.VersionRequest(), timeout=10)
            await runtime.Status(api_pb2.StatusRequest(), timeout=10)
            await runtime.ListContainers(api_pb2.ListContainersRequest(), timeout=10)
            await runtime.ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=10)
        # Nobody reads: each stream ends at its write timeout and gives its place back.
        await until(lambda: streams_ended(port, "DEADLINE_EXCEEDED") == 4, 30, 0.2)
        listed = [r async for r in runtime.StreamPodSandboxes(request, timeout=30)]
        assert len(listed) == 2
        for call in opened:
            call.cancel()

    with large_pods(daemon, 2):
        asyncio.run(with_runtime(daemon, scenario))
    assert "stream_write_timeout" in daemon.log_path.read_text()
    assert daemon.leaks() == {}


def test_a_client_that_cancels_its_streams_is_no_error(make_daemon: type, short_tmp: Path) -> None:
    port = free_port()
    daemon: Daemon = make_daemon(settings={"metrics": {"listen": f"127.0.0.1:{port}"}})
    daemon.start()

    async def scenario(runtime: api_pb2_grpc.RuntimeServiceStub) -> None:
        calls = [runtime.StreamPodSandboxes(api_pb2.StreamPodSandboxesRequest()) for _ in range(3)]
        for call in calls:
            assert len((await call.read()).pod_sandboxes) == 1
        # The daemon waits to write each one's second pod when the client cancels.
        for call in calls:
            call.cancel()
        await until(lambda: streams_ended(port, "CANCELLED") == 3, 30, 0.2)

    with large_pods(daemon, 2):
        asyncio.run(with_runtime(daemon, scenario))
    assert streams_ended(port, "INTERNAL") == 0
    log = daemon.log_path.read_text()
    assert "level=error" not in log and "Traceback" not in log


async def with_runtime(
    daemon: Daemon, scenario: Callable[[api_pb2_grpc.RuntimeServiceStub], Awaitable[None]]
) -> None:
    async with unread_channel(daemon) as channel:
        await scenario(api_pb2_grpc.RuntimeServiceStub(channel))
