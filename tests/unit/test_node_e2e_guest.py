"""The node e2e runner's guest side: the installed unit's configuration gets only the
mirrors and `test-handler`, the cgroup subset names specs of the suite, and --serial
with --focus runs only the Serial specs it names."""

from __future__ import annotations

import argparse
import tomllib

import pytest

from tests.guest.node_e2e_site import configured
from tests.harness import REPO
from tests.node_e2e import CGROUP_SUBSET, KIT, SERIAL_SPECS, plan_runs, select_subset

INSTALLED = (REPO / "contrib" / "config.toml").read_text()


def test_the_installed_configuration_gets_the_mirrors_and_test_handler_only() -> None:
    data = tomllib.loads(configured(INSTALLED, "127.0.0.1:5123", ("registry.k8s.io", "gcr.io")))
    assert data["images"] == {
        "insecure_registries": ["127.0.0.1:5123"],
        "mirrors": {
            "registry.k8s.io": ["http://127.0.0.1:5123"],
            "gcr.io": ["http://127.0.0.1:5123"],
        },
    }
    assert data["runtime"]["handlers"]["test-handler"] == {"path": "runc"}
    # Everything else as installed: its defaults (commented out there), no key set.
    installed = tomllib.loads(INSTALLED)
    for table, value in data.items():
        if table not in ("images", "runtime"):
            assert value == installed[table], table
    assert "cgroup_manager" not in data  # `auto`: systemd's where systemd is PID 1


@pytest.mark.skipif(not (KIT / "nodeconformance-specs.txt").exists(), reason="no node e2e kit")
def test_the_cgroup_subset_names_specs_of_the_suite() -> None:
    from tests.node_e2e import read_spec_list

    specs = read_spec_list(KIT / "nodeconformance-specs.txt")
    chosen = select_subset(specs, CGROUP_SUBSET)
    assert len(chosen) == 27
    assert any("OOMKiller" in name for name in chosen)
    assert sum("Kubelet Cgroup Manager" in name for name in chosen) == 4


def test_serial_with_a_focus_runs_the_serial_specs_it_names() -> None:
    args = argparse.Namespace(serial=True, focus=["MirrorPodWithGracePeriod"], subset=None)
    runs = plan_runs(args, [])
    assert [run.wanted for run in runs] == [[SERIAL_SPECS[0]]]
    assert runs[0].nodes == 1
    args.focus = []
    assert len(plan_runs(args, [])) == 3
