"""The driver chosen at the start reaches what depends on it: the graph refuses systemd
on a host without it, the runtime gets `--systemd-cgroup` with systemd's driver, and
RuntimeConfig tells kubelet the driver the daemon runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, cast

import pytest

from cri_shim.api.v1 import api_pb2
from cri_shim.composition import build_backends, build_graph
from cri_shim.config import Config, ConfigError, config_from_dict
from cri_shim.runtime.cgroup_driver import systemd_booted
from cri_shim.server.runtime_config import runtime_config


def config_in(tmp_path: Path, **keys: Any) -> Config:
    return config_from_dict(
        {"root": str(tmp_path / "root"), "run_root": str(tmp_path / "run"), **keys}
    )


@pytest.mark.skipif(systemd_booted(), reason="needs a host that systemd does not run")
def test_the_start_refuses_systemd_where_systemd_does_not_run(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r'^cgroup_manager: "systemd" is configured'):
        build_graph(config_in(tmp_path, cgroup_manager="systemd"))
    assert not (tmp_path / "root").exists(), "refused before anything was made"


@pytest.mark.skipif(systemd_booted(), reason="needs a host that systemd does not run")
def test_auto_runs_cgroupfs_where_systemd_does_not_run(tmp_path: Path) -> None:
    graph = build_graph(config_in(tmp_path))
    try:
        assert graph.config.cgroup_manager == "cgroupfs"
        assert graph.runtime_view.config.cgroup_manager == "cgroupfs"
    finally:
        graph.db.close()


def test_the_runtime_gets_systemd_cgroup_with_systemds_driver(tmp_path: Path) -> None:
    # Built as the graph builds them once the driver is resolved.
    systemd = dataclasses.replace(config_in(tmp_path), cgroup_manager="systemd")
    for backend in build_backends(systemd).values():
        assert backend.oci.conmon_runtime_args()[2] == "--systemd-cgroup"
        assert backend.oci.extra_args[0] == "--systemd-cgroup"
    cgroupfs = dataclasses.replace(config_in(tmp_path), cgroup_manager="cgroupfs")
    for backend in build_backends(cgroupfs).values():
        assert "--systemd-cgroup" not in backend.oci.conmon_runtime_args()


@pytest.mark.parametrize(
    ("manager", "driver"), [("systemd", api_pb2.SYSTEMD), ("cgroupfs", api_pb2.CGROUPFS)]
)
async def test_runtime_config_answers_the_running_driver(manager: str, driver: int) -> None:
    class View:
        config = Config(cgroup_manager=manager)

    response = await runtime_config(
        cast(Any, View()), api_pb2.RuntimeConfigRequest(), cast(Any, None)
    )
    assert response.linux.cgroup_driver == driver
