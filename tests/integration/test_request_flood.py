"""Floods of concurrent calls against the real daemon: every call is answered
(or refused with RESOURCE_EXHAUSTED), the daemon stays up, reads are answered, and a normal
pod lifecycle goes through during the flood. Clients are grpc.aio, as many in flight at
once as the test asks."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from cri_shim.api.v1 import api_pb2, api_pb2_grpc
from tests.harness import CniTestNetwork, Daemon, import_image, pod_config, wait_until
from tests.refused_calls import container_config, create_request
from tests.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.root, pytest.mark.slow]

FLOOD = 500
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


async def outcome(call: Awaitable[Any]) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def with_retries(make_call: Callable[[], Awaitable[Any]], what: str) -> Any:
    """As kubelet does: a call refused as RESOURCE_EXHAUSTED is tried again shortly."""
    for attempt in range(100):
        try:
            return await make_call()
        except grpc.aio.AioRpcError as exc:
            if exc.code() != EXHAUSTED:
                raise AssertionError(f"{what}: {exc.code().name}: {exc.details()}") from exc
            await asyncio.sleep(min(0.05 * (attempt + 1), 0.5))
    raise AssertionError(f"{what}: still refused after 100 tries")


async def pod_lifecycle(runtime: api_pb2_grpc.RuntimeServiceStub, logs: Path) -> float:
    """RunPodSandbox → CreateContainer → Start → ExecSync → Stop → Remove, timed."""
    started = time.monotonic()
    config = pod_config("lifecycle", uid="uid-lifecycle", log_directory=str(logs))
    sandbox_id = (
        await with_retries(
            lambda: runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=config), timeout=60),
            "RunPodSandbox",
        )
    ).pod_sandbox_id
    request = create_request((sandbox_id, config), container_config("app", "sleep 60"))
    container_id = (
        await with_retries(lambda: runtime.CreateContainer(request, timeout=60), "CreateContainer")
    ).container_id
    await with_retries(
        lambda: runtime.StartContainer(
            api_pb2.StartContainerRequest(container_id=container_id), timeout=30
        ),
        "StartContainer",
    )
    result = await with_retries(
        lambda: runtime.ExecSync(
            api_pb2.ExecSyncRequest(container_id=container_id, cmd=["echo", "alive"], timeout=10),
            timeout=30,
        ),
        "ExecSync",
    )
    assert result.stdout == b"alive\n"
    await with_retries(
        lambda: runtime.StopContainer(
            api_pb2.StopContainerRequest(container_id=container_id, timeout=0), timeout=30
        ),
        "StopContainer",
    )
    await with_retries(
        lambda: runtime.RemovePodSandbox(
            api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60
        ),
        "RemovePodSandbox",
    )
    return time.monotonic() - started


def flood_calls(
    runtime: api_pb2_grpc.RuntimeServiceStub,
    images: api_pb2_grpc.ImageServiceStub,
    index: int,
    logs: Path,
) -> tuple[str, Awaitable[Any]]:
    """The index-th call of the flood: mostly cheap reads and calls on unknown objects,
    some real sandbox creations, in a fixed mix."""
    bogus = f"{index:064x}"
    kind = index % 10
    if kind == 0:
        config = pod_config(f"flood-{index}", uid=f"uid-flood-{index}", log_directory=str(logs))
        return "RunPodSandbox", runtime.RunPodSandbox(
            api_pb2.RunPodSandboxRequest(config=config), timeout=60
        )
    calls: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
        ("Version", lambda: runtime.Version(api_pb2.VersionRequest(), timeout=60)),
        ("Status", lambda: runtime.Status(api_pb2.StatusRequest(verbose=True), timeout=60)),
        (
            "ListPodSandbox",
            lambda: runtime.ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=60),
        ),
        (
            "ListContainers",
            lambda: runtime.ListContainers(api_pb2.ListContainersRequest(), timeout=60),
        ),
        (
            "ContainerStatus",
            lambda: runtime.ContainerStatus(
                api_pb2.ContainerStatusRequest(container_id=bogus), timeout=60
            ),
        ),
        (
            "StopPodSandbox",
            lambda: runtime.StopPodSandbox(
                api_pb2.StopPodSandboxRequest(pod_sandbox_id=bogus), timeout=60
            ),
        ),
        (
            "RemoveContainer",
            lambda: runtime.RemoveContainer(
                api_pb2.RemoveContainerRequest(container_id=bogus), timeout=60
            ),
        ),
        ("ListImages", lambda: images.ListImages(api_pb2.ListImagesRequest(), timeout=60)),
        ("ImageFsInfo", lambda: images.ImageFsInfo(api_pb2.ImageFsInfoRequest(), timeout=60)),
    ]
    name, make = calls[(kind - 1) % len(calls)]
    return name, make()


def test_a_flood_of_500_mixed_calls_while_a_pod_lives(
    daemon: Daemon, busybox_layout: Path, short_tmp: Path
) -> None:
    import_image(daemon, busybox_layout)
    logs = short_tmp / "logs"

    async def scenario() -> tuple[Counter[tuple[str, str]], float]:
        async with grpc.aio.insecure_channel(f"unix://{daemon.socket}") as channel:
            runtime = api_pb2_grpc.RuntimeServiceStub(channel)
            images = api_pb2_grpc.ImageServiceStub(channel)
            named = [flood_calls(runtime, images, i, logs) for i in range(FLOOD)]
            flood = asyncio.gather(*(outcome(call) for _, call in named))
            lifecycle = asyncio.create_task(pod_lifecycle(runtime, logs / "lifecycle"))
            codes = await flood
            took = await lifecycle
        answers = Counter((name, code.name) for (name, _), code in zip(named, codes, strict=True))
        return answers, took

    answers, lifecycle_seconds = asyncio.run(scenario())
    print(f"lifecycle took {lifecycle_seconds:.2f}s during the flood: {sorted(answers.items())}")
    allowed = {"OK", "NOT_FOUND", "RESOURCE_EXHAUSTED"}
    assert {code for _, code in answers} <= allowed, answers
    assert sum(answers.values()) == FLOOD
    # Every pod the flood created works and goes away; then nothing is left.
    assert daemon.proc is not None and daemon.proc.poll() is None
    runtime = daemon.runtime()
    created = runtime.ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=30).items
    assert len(created) == answers[("RunPodSandbox", "OK")]
    for sandbox in created:
        runtime.RemovePodSandbox(
            api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox.id), timeout=60
        )
    assert lifecycle_seconds < 60
    assert daemon.leaks() == {}


def test_beyond_the_limits_calls_are_refused_and_reads_are_still_answered(
    make_daemon: type, test_network: CniTestNetwork, short_tmp: Path
) -> None:
    """Sandbox creations held at the network step (the CNI plugin waits) fill two slots
    and three queue places: the rest of a burst is refused at once, reads are answered
    meanwhile, and creations whose requests gave up still count until they finish."""
    daemon: Daemon = make_daemon(
        settings={
            "requests": {"max_in_flight": 2, "max_queued": 3},
            "creation": {"claim_grace": "1s"},
        }
    )
    daemon.start()
    logs = short_tmp / "logs"

    async def scenario() -> tuple[list[grpc.StatusCode], list[grpc.StatusCode]]:
        async with grpc.aio.insecure_channel(f"unix://{daemon.socket}") as channel:
            runtime = api_pb2_grpc.RuntimeServiceStub(channel)
            with test_network.held():
                burst = [
                    asyncio.ensure_future(
                        outcome(
                            runtime.RunPodSandbox(
                                api_pb2.RunPodSandboxRequest(
                                    config=pod_config(
                                        f"burst-{i}", uid=f"u-burst-{i}", log_directory=str(logs)
                                    )
                                ),
                                timeout=60,
                            )
                        )
                    )
                    for i in range(20)
                ]
                # Two creations hold the slots at the network step and three wait in the
                # queue; the other fifteen are refused at once.
                await until(lambda: sum(call.done() for call in burst) == 15, timeout=30)
                await until(lambda: test_network.adds() == 2, timeout=30)
                reads = []
                for _ in range(5):
                    listing = runtime.ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=10)
                    reads.append(await outcome(listing))
                    reads.append(
                        await outcome(runtime.Version(api_pb2.VersionRequest(), timeout=10))
                    )
                # Answered while no creation could finish: not queued behind them.
                assert sum(call.done() for call in burst) == 15
            return await asyncio.gather(*burst), reads

    codes, reads = asyncio.run(scenario())
    counts = Counter(code.name for code in codes)
    assert counts["OK"] == 5 and counts["RESOURCE_EXHAUSTED"] == 15, counts
    assert set(reads) == {grpc.StatusCode.OK}, reads
    runtime = daemon.runtime()
    for sandbox in runtime.ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=30).items:
        runtime.RemovePodSandbox(
            api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox.id), timeout=60
        )

    # Two requests give up early; their creations go on (DESIGN §2) and hold the slots
    # they freed: a third creation is refused until they have finished.
    with test_network.held():
        for i in range(2):
            config = pod_config(f"detached-{i}", uid=f"u-detached-{i}")
            with pytest.raises(grpc.RpcError) as info:
                runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=config), timeout=0.5)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(grpc.RpcError) as info:
            runtime.RunPodSandbox(
                api_pb2.RunPodSandboxRequest(config=pod_config("third", uid="u-third")),
                timeout=10,
            )
        assert info.value.code() == EXHAUSTED
        assert "creations are still running" in info.value.details()
    # Unclaimed, the detached creations expire (claim_grace 1s) and leave nothing.
    wait_until(lambda: daemon.leaks() == {}, timeout=60, interval=0.5)
    assert daemon.runtime().Version(api_pb2.VersionRequest(), timeout=5).runtime_name
