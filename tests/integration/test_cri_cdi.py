"""CDI devices through the real daemon and real containers: spec files the test writes into
`[cdi] spec_dirs`, a device asked for by `CDI_devices` or by a `cdi.k8s.io/` annotation as
device plugins do, and what the container then has (the node, the mount, the env)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from cri_shim.api.v1 import api_pb2
from tests.harness import Daemon
from tests.integration.cri_testkit import (
    container_config,
    create,
    import_image,
    output,
    pod,
    run_to_exit,
)

pytestmark = [pytest.mark.integration, pytest.mark.root]

DEVICE = "vendor.example/dev=null0"
SCRIPT = (
    "echo written > /dev/vendor-null0 && echo wrote; "
    "stat -c 'node %F %t:%T' /dev/vendor-null0; "
    "cat /vendor/data/hello.txt; "
    'echo "env $VENDOR_VISIBLE $VENDOR_CLASS"'
)


def vendor_spec(host_dir: Path, visible: str = "null0") -> dict[str, Any]:
    return {
        "cdiVersion": "0.6.0",
        "kind": "vendor.example/dev",
        "containerEdits": {"env": ["VENDOR_CLASS=dev"]},
        "devices": [
            {
                "name": "null0",
                "containerEdits": {
                    "deviceNodes": [{"path": "/dev/vendor-null0", "hostPath": "/dev/null"}],
                    "mounts": [
                        {
                            "hostPath": str(host_dir),
                            "containerPath": "/vendor/data",
                            "options": ["ro", "rbind"],
                        }
                    ],
                    "env": [f"VENDOR_VISIBLE={visible}"],
                },
            }
        ],
    }


@pytest.fixture
def cdi_dirs(short_tmp: Path) -> tuple[Path, Path]:
    """(the spec directory, the host directory a device mounts), the spec written."""
    spec_dir, host_dir = short_tmp / "cdi", short_tmp / "vendor-data"
    spec_dir.mkdir()
    host_dir.mkdir()
    (host_dir / "hello.txt").write_text("hello from the vendor\n")
    (spec_dir / "vendor.json").write_text(json.dumps(vendor_spec(host_dir)))
    return spec_dir, host_dir


@pytest.fixture
def cdi_daemon(make_daemon: Any, cdi_dirs: tuple[Path, Path], busybox_layout: Path) -> Daemon:
    daemon: Daemon = make_daemon(settings={"cdi": {"spec_dirs": [str(cdi_dirs[0])]}})
    daemon.start()
    import_image(daemon, busybox_layout)
    return daemon


@pytest.fixture
def p(cdi_daemon: Daemon, short_tmp: Path) -> Iterator[tuple[str, api_pb2.PodSandboxConfig]]:
    with pod(cdi_daemon, "cdi", short_tmp) as created:
        yield created


ASKED = {
    "cdi_devices": {"CDI_devices": [api_pb2.CDIDevice(name=DEVICE)]},
    "annotation": {"annotations": {"cdi.k8s.io/vendor-plugin": DEVICE}},
}


@pytest.mark.parametrize("how", sorted(ASKED))
def test_a_cdi_device_brings_its_node_mount_and_env(
    cdi_daemon: Daemon, p: tuple[str, api_pb2.PodSandboxConfig], how: str
) -> None:
    st = run_to_exit(cdi_daemon, p, container_config(f"dev-{how}", SCRIPT, **ASKED[how]))
    assert st.exit_code == 0, output(st, "stderr")
    assert output(st) == [
        "wrote",
        "node character special file 1:3",
        "hello from the vendor",
        "env null0 dev",
    ]


def test_unknown_devices_and_broken_spec_files_are_refused_leaving_nothing(
    cdi_daemon: Daemon, cdi_dirs: tuple[Path, Path], short_tmp: Path
) -> None:
    spec_dir, _ = cdi_dirs
    with pod(cdi_daemon, "cdi-bad", short_tmp) as p:
        unknown = container_config(
            "unknown", "true", CDI_devices=[{"name": "vendor.example/dev=gpu7"}]
        )
        with pytest.raises(grpc.RpcError) as err:
            create(cdi_daemon, p, unknown)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "vendor.example/dev=gpu7" in err.value.details()
        assert str(spec_dir) in err.value.details()

        broken = spec_dir / "zz-broken.json"
        broken.write_text(json.dumps({"cdiVersion": "0.6.0", "kind": "vendor.example/dev"}))
        with pytest.raises(grpc.RpcError) as err:
            create(
                cdi_daemon, p, container_config("broken", "true", CDI_devices=[{"name": DEVICE}])
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert DEVICE in err.value.details()
        assert str(broken) in err.value.details()
        assert not cdi_daemon.rows("containers")
    assert cdi_daemon.leaks() == {}


def test_an_edited_spec_file_is_used_by_the_next_creation(
    cdi_daemon: Daemon,
    cdi_dirs: tuple[Path, Path],
    p: tuple[str, api_pb2.PodSandboxConfig],
) -> None:
    spec_dir, host_dir = cdi_dirs

    def config(name: str) -> api_pb2.ContainerConfig:
        return container_config(name, "echo $VENDOR_VISIBLE", CDI_devices=[{"name": DEVICE}])

    assert output(run_to_exit(cdi_daemon, p, config("before"))) == ["null0"]
    (spec_dir / "vendor.json").write_text(json.dumps(vendor_spec(host_dir, visible="edited")))
    assert output(run_to_exit(cdi_daemon, p, config("after"))) == ["edited"]


def alias_bomb(kind: str, aliases: int = 3400) -> str:
    """27 KB of YAML: one 13.6 KB string, and a hook whose arguments name it `aliases`
    times, 46 MB once each alias is written out (as runc's config.json would have it)."""
    names = ", ".join(["*s"] * aliases)
    return (
        f'cdiVersion: "0.6.0"\nkind: {kind}\ndevices:\n- name: b0\n  containerEdits:\n'
        f"    hooks:\n    - hookName: poststop\n      path: /bin/true\n"
        f'      args: [&s "{"v" * aliases * 4}", {names}]\n'
    )


def small_spec(kind: str, device: str) -> str:
    edits = {"env": [f"FROM={device}"]}
    return json.dumps(
        {
            "cdiVersion": "0.6.0",
            "kind": kind,
            "devices": [{"name": device, "containerEdits": edits}],
        }
    )


def test_hostile_spec_files_break_only_their_own_devices(
    cdi_daemon: Daemon,
    cdi_dirs: tuple[Path, Path],
    p: tuple[str, api_pb2.PodSandboxConfig],
    short_tmp: Path,
) -> None:
    spec_dir, _ = cdi_dirs
    (spec_dir / "bomb.yaml").write_text(alias_bomb("vendor.example/bomb"))
    (spec_dir / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (spec_dir / "huge.json").write_text(small_spec("vendor.example/huge", "h0") + " " * (2 << 20))
    outside = short_tmp / "outside.json"
    outside.write_text(small_spec("vendor.example/outside", "o0"))
    (spec_dir / "escape.json").symlink_to(outside)
    # A symlink that stays inside the directory is read as the file it names.
    (spec_dir / "versions").mkdir()
    (spec_dir / "versions" / "v2.json").write_text(small_spec("vendor.example/linked", "l0"))
    (spec_dir / "linked.json").symlink_to("versions/v2.json")

    # Every other vendor's devices resolve as before.
    st = run_to_exit(
        cdi_daemon, p, container_config("good", SCRIPT, CDI_devices=[{"name": DEVICE}])
    )
    assert output(st)[-1] == "env null0 dev", output(st, "stderr")
    linked = container_config(
        "linked", "echo $FROM", CDI_devices=[{"name": "vendor.example/linked=l0"}]
    )
    assert output(run_to_exit(cdi_daemon, p, linked)) == ["l0"]

    refused = {
        "vendor.example/bomb=b0": ("bomb.yaml", "YAML aliases repeat what they name"),
        "vendor.example/outside=o0": ("escape.json", f"a symlink to {outside}, outside {spec_dir}"),
        "vendor.example/huge=h0": ("huge.json", f"larger than {1 << 20} bytes"),
    }
    for device, (name, problem) in refused.items():
        config = container_config(device.split("/")[1][:4], "true", CDI_devices=[{"name": device}])
        with pytest.raises(grpc.RpcError) as err:
            create(cdi_daemon, p, config)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        # Every unusable file is named, with what is wrong with it, the deep one too.
        named = blamed_files(err.value.details())
        assert problem in named[spec_dir / name], named
        assert "nested too deep to decode" in named[spec_dir / "deep.json"], named
    assert len(cdi_daemon.rows("containers")) == 2


def blamed_files(details: str) -> dict[Path, str]:
    """What an error says of each spec file it names ("CDI spec file PATH: problem")."""
    named = {}
    for part in details.split("CDI spec file ")[1:]:
        path, _, problem = part.partition(": ")
        named[Path(path)] = problem
    return named
