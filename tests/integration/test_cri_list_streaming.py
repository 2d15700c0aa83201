"""The six streaming list RPCs (KEP-5825) against the real daemon: each answers with the
items of its unary twin, one per message, with the same filter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cri_shim.api.v1 import api_pb2
from tests.harness import Daemon
from tests.integration.cri_testkit import container_config, create, import_image, pod, start

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
