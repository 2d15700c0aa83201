"""CDI: spec files parsed and checked, devices resolved with the directories' precedence,
and their edits applied to an OCI spec."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import InvalidArgument
from cri_shim.runtime.cdi import (
    MAX_SPEC_BYTES,
    CdiRegistry,
    ContainerEdits,
    DeviceNode,
    Hook,
    Mount,
    apply_edits,
    parse_spec,
)
from cri_shim.runtime.cdi_request import requested_devices

NULL_RDEV = os.stat("/dev/null").st_rdev


def spec_data(
    kind: str = "vendor.example/dev",
    devices: dict[str, dict[str, Any]] | None = None,
    version: str = "0.6.0",
    **top: Any,
) -> dict[str, Any]:
    if devices is None:
        devices = {
            "null0": {"deviceNodes": [{"path": "/dev/vendor-null0", "hostPath": "/dev/null"}]}
        }
    return {
        "cdiVersion": version,
        "kind": kind,
        "devices": [{"name": n, "containerEdits": e} for n, e in devices.items()],
        **top,
    }


def write(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def empty_spec() -> dict[str, Any]:
    return {
        "process": {"env": ["PATH=/bin", "A=image"], "user": {"uid": 0, "gid": 0}},
        "mounts": [{"destination": "/data", "type": "tmpfs", "source": "tmpfs", "options": []}],
        "linux": {"devices": [], "resources": {"devices": [{"allow": False, "access": "rwm"}]}},
    }


# ---- parsing -------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.3.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0"])
def test_versions_current_plugins_write_are_accepted(version: str) -> None:
    spec = parse_spec(Path("/x.json"), spec_data(version=version))
    assert spec.kind == "vendor.example/dev"
    assert set(spec.devices) == {"null0"}


@pytest.mark.parametrize("version", ["0.2.0", "9.9.9", "latest"])
def test_unknown_versions_are_refused_naming_the_file(version: str) -> None:
    with pytest.raises(InvalidArgument, match=r"/x.json: cdiVersion: version .* not supported"):
        parse_spec(Path("/x.json"), spec_data(version=version))


def test_every_edit_is_parsed() -> None:
    edits = {
        "env": ["FOO=bar"],
        "deviceNodes": [
            {
                "path": "/dev/a",
                "hostPath": "/dev/null",
                "type": "c",
                "major": 1,
                "minor": 3,
                "fileMode": 0o666,
                "permissions": "rw",
                "uid": 1,
                "gid": 2,
            }
        ],
        "mounts": [{"hostPath": "/h", "containerPath": "/c", "type": "bind", "options": ["ro"]}],
        "hooks": [{"hookName": "createContainer", "path": "/bin/h", "args": ["h"], "timeout": 5}],
        "additionalGids": [44],
    }
    spec = parse_spec(
        Path("/x.json"), spec_data(devices={"d": edits}, containerEdits={"env": ["S=1"]})
    )
    assert spec.edits == ContainerEdits(env=("S=1",))
    assert spec.devices["d"] == ContainerEdits(
        env=("FOO=bar",),
        device_nodes=(DeviceNode("/dev/a", "/dev/null", "c", 1, 3, 0o666, "rw", 1, 2),),
        mounts=(Mount("/h", "/c", "bind", ("ro",)),),
        hooks=(Hook("createContainer", "/bin/h", ("h",), (), 5),),
        additional_gids=(44,),
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (spec_data(kind="novendor"), "kind: 'novendor' is not vendor.com/class"),
        ({"kind": "a.b/c", "devices": []}, "cdiVersion: is required"),
        (spec_data(devices={}), "devices: at least one device is required"),
        (spec_data(devices={"bad name": {"env": ["A=1"]}}), "is not a valid device name"),
        (spec_data(devices={"d": {}}), "needs at least one edit"),
        (spec_data(devices={"d": {"env": ["NOEQUALS"]}}), r"env\[0\]: 'NOEQUALS' is not KEY=value"),
        (
            spec_data(devices={"d": {"deviceNodes": [{"hostPath": "/dev/null"}]}}),
            r"deviceNodes\[0\].path: is required",
        ),
        (
            spec_data(devices={"d": {"deviceNodes": [{"path": "/dev/x", "major": "1"}]}}),
            "major: expected an integer",
        ),
        (
            spec_data(devices={"d": {"deviceNodes": [{"path": "/dev/x", "permissions": "rx"}]}}),
            "permissions: 'rx' is not in rwm",
        ),
        (
            spec_data(devices={"d": {"hooks": [{"hookName": "onBoot", "path": "/h"}]}}),
            "hookName: 'onBoot' is not one of",
        ),
        (
            spec_data(devices={"d": {"mounts": [{"hostPath": "/h", "containerPath": "rel"}]}}),
            "containerPath: 'rel' is not an absolute path",
        ),
        # intelRdt's values go into the OCI spec as they are: only what runc takes.
        (
            spec_data(devices={"d": {"intelRdt": {"closID": [["deep"]]}}}),
            "intelRdt.closID: expected a string",
        ),
        (
            spec_data(devices={"d": {"intelRdt": {"enableCMT": "yes"}}}),
            "intelRdt.enableCMT: expected true or false",
        ),
    ],
)
def test_bad_spec_files_are_refused_naming_file_and_field(data: Any, message: str) -> None:
    with pytest.raises(InvalidArgument, match=r"CDI spec file /x.json: .*" + message):
        parse_spec(Path("/x.json"), data)


# ---- resolution ----------------------------------------------------------------------


def test_names_come_from_cdi_devices_and_annotations_once_each() -> None:
    cfg = api_pb2.ContainerConfig(
        CDI_devices=[api_pb2.CDIDevice(name="a.b/c=one")],
        annotations={
            "cdi.k8s.io/plugin": "a.b/c=two, a.b/c=one",
            "other/key": "a.b/c=ignored",
        },
    )
    assert requested_devices(cfg) == ["a.b/c=one", "a.b/c=two"]


def test_a_device_resolves_with_its_spec_files_edits(tmp_path: Path) -> None:
    write(tmp_path / "etc" / "v.json", spec_data(containerEdits={"env": ["SPEC=1"]}))
    [device] = CdiRegistry([tmp_path / "etc"]).resolve(["vendor.example/dev=null0"])
    assert device.spec.edits.env == ("SPEC=1",)
    assert device.edits.device_nodes[0].path == "/dev/vendor-null0"


def test_a_later_directory_overrides_an_earlier_one(tmp_path: Path) -> None:
    write(tmp_path / "etc" / "v.json", spec_data(devices={"null0": {"env": ["FROM=etc"]}}))
    write(tmp_path / "run" / "v.json", spec_data(devices={"null0": {"env": ["FROM=run"]}}))
    registry = CdiRegistry([tmp_path / "etc", tmp_path / "run"])
    [device] = registry.resolve(["vendor.example/dev=null0"])
    assert device.edits.env == ("FROM=run",)
    assert device.spec.path == tmp_path / "run" / "v.json"


def test_one_device_in_two_files_of_a_directory_names_both(tmp_path: Path) -> None:
    write(tmp_path / "a.json", spec_data())
    write(tmp_path / "b.json", spec_data())
    with pytest.raises(InvalidArgument) as err:
        CdiRegistry([tmp_path]).resolve(["vendor.example/dev=null0"])
    assert "vendor.example/dev=null0" in str(err.value)
    assert str(tmp_path / "a.json") in str(err.value) and str(tmp_path / "b.json") in str(err.value)


def test_an_unknown_device_is_named_with_the_directories(tmp_path: Path) -> None:
    write(tmp_path / "v.json", spec_data())
    with pytest.raises(
        InvalidArgument, match=r"'vendor.example/dev=nope'.*unknown.*" + str(tmp_path)
    ):
        CdiRegistry([tmp_path]).resolve(["vendor.example/dev=nope"])


def test_a_name_that_is_not_fully_qualified_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="not a fully-qualified name"):
        CdiRegistry([tmp_path]).resolve(["null0"])


def test_a_broken_file_of_the_devices_kind_is_named(tmp_path: Path) -> None:
    write(tmp_path / "good.json", spec_data())
    write(tmp_path / "broken.json", spec_data(version="7.0.0"))
    with pytest.raises(InvalidArgument) as err:
        CdiRegistry([tmp_path]).resolve(["vendor.example/dev=null0"])
    assert "vendor.example/dev=null0" in str(err.value)
    assert str(tmp_path / "broken.json") in str(err.value)


def test_a_broken_file_in_an_earlier_directory_is_overridden(tmp_path: Path) -> None:
    write(tmp_path / "etc" / "broken.json", spec_data(version="7.0.0"))
    write(tmp_path / "run" / "good.json", spec_data())
    assert CdiRegistry([tmp_path / "etc", tmp_path / "run"]).resolve(["vendor.example/dev=null0"])


def test_an_unreadable_file_is_named_when_the_device_is_not_found(tmp_path: Path) -> None:
    (tmp_path / "broken.json").write_text("{ not json")
    with pytest.raises(InvalidArgument) as err:
        CdiRegistry([tmp_path]).resolve(["vendor.example/dev=null0"])
    assert "vendor.example/dev=null0" in str(err.value)
    assert f"{tmp_path / 'broken.json'}: not valid JSON" in str(err.value)


def test_a_broken_file_of_another_vendor_does_not_block_a_device(tmp_path: Path) -> None:
    write(tmp_path / "good.json", spec_data())
    write(tmp_path / "other.json", spec_data(kind="other.example/x", version="7.0.0"))
    assert CdiRegistry([tmp_path]).resolve(["vendor.example/dev=null0"])


def test_yaml_spec_files_are_read(tmp_path: Path) -> None:
    (tmp_path / "v.yaml").write_text(
        "cdiVersion: 0.8.0\n"
        "kind: vendor.example/dev\n"
        "devices:\n"
        "  - name: y0\n"
        "    containerEdits:\n"
        "      env: [FROM=yaml]\n"
    )
    [device] = CdiRegistry([tmp_path]).resolve(["vendor.example/dev=y0"])
    assert device.edits.env == ("FROM=yaml",)


def test_a_changed_file_is_read_again_and_a_removed_one_forgotten(tmp_path: Path) -> None:
    path = write(tmp_path / "v.json", spec_data(devices={"null0": {"env": ["V=1"]}}))
    registry = CdiRegistry([tmp_path])
    assert registry.resolve(["vendor.example/dev=null0"])[0].edits.env == ("V=1",)
    write(path, spec_data(devices={"null0": {"env": ["V=22"]}}))
    assert registry.resolve(["vendor.example/dev=null0"])[0].edits.env == ("V=22",)
    path.unlink()
    with pytest.raises(InvalidArgument, match="unknown"):
        registry.resolve(["vendor.example/dev=null0"])


def test_yaml_aliases_count_as_often_as_they_are_used(tmp_path: Path) -> None:
    # 5 KB of file, 3 MB of arguments once each alias is written out.
    names = ", ".join(["*s"] * 1000)
    (tmp_path / "bomb.yaml").write_text(
        "cdiVersion: 0.8.0\nkind: vendor.example/bomb\ndevices:\n- name: b0\n"
        "  containerEdits:\n    hooks:\n    - hookName: poststop\n      path: /bin/true\n"
        f'      args: [&s "{"v" * 3000}", {names}]\n'
    )
    write(tmp_path / "good.json", spec_data())
    registry = CdiRegistry([tmp_path])
    assert registry.resolve(["vendor.example/dev=null0"])
    with pytest.raises(InvalidArgument, match=r"bomb.yaml: decodes to more than \d+ values"):
        registry.resolve(["vendor.example/bomb=b0"])
    # Aliases used as often as a plain file could hold are fine.
    (tmp_path / "bomb.yaml").write_text(
        "cdiVersion: 0.8.0\nkind: vendor.example/bomb\nenv: &e [A=1]\ndevices:\n- name: b0\n"
        "  containerEdits:\n    env: *e\n- name: b1\n  containerEdits:\n    env: *e\n"
    )
    assert len(registry.resolve(["vendor.example/bomb=b0", "vendor.example/bomb=b1"])) == 2


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("deep.json", "[" * 100_000 + "]" * 100_000),  # past the decoder's recursion
        ("deep.yaml", "[" * 100_000 + "]" * 100_000),  # past libyaml's nesting limit
        ("deep-33.json", json.dumps(spec_data(x=json.loads("[" * 40 + "]" * 40)))),
        ("deep-33.yaml", "a:\n" + "".join("  " * i + "- \n" for i in range(1, 40))),
    ],
)
def test_a_file_nested_too_deep_breaks_only_itself(tmp_path: Path, name: str, text: str) -> None:
    (tmp_path / name).write_text(text)
    write(tmp_path / "good.json", spec_data())
    registry = CdiRegistry([tmp_path])
    assert registry.resolve(["vendor.example/dev=null0"])
    with pytest.raises(InvalidArgument) as err:
        registry.resolve(["vendor.example/dev=gpu0"])
    assert f"{tmp_path / name}: " in str(err.value)
    assert "nested" in str(err.value) or "nesting" in str(err.value)


def test_only_regular_files_inside_the_directory_of_a_sane_size_are_read(tmp_path: Path) -> None:
    specs, elsewhere = tmp_path / "cdi", tmp_path / "elsewhere"
    write(elsewhere / "outside.json", spec_data(kind="vendor.example/out"))
    write(specs / "versions" / "v2.json", spec_data(kind="vendor.example/linked"))
    (specs / "escape.json").symlink_to(elsewhere / "outside.json")
    (specs / "linked.json").symlink_to("versions/v2.json")
    (specs / "huge.json").write_text(
        json.dumps(spec_data(kind="vendor.example/huge")) + " " * MAX_SPEC_BYTES
    )
    os.mkfifo(specs / "fifo.json")  # never a regular file: skipped, never opened
    registry = CdiRegistry([specs])
    assert registry.resolve(["vendor.example/linked=null0"])
    with pytest.raises(InvalidArgument) as err:
        registry.resolve(["vendor.example/out=null0"])
    assert f"escape.json: a symlink to {elsewhere / 'outside.json'}, outside {specs}" in str(
        err.value
    )
    assert f"huge.json: cannot be read: larger than {MAX_SPEC_BYTES} bytes" in str(err.value)
    assert "fifo.json" not in str(err.value)


def test_files_of_other_suffixes_and_missing_directories_are_ignored(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("{ not a spec")
    write(tmp_path / "v.json", spec_data())
    registry = CdiRegistry([tmp_path / "absent", tmp_path])
    assert registry.resolve(["vendor.example/dev=null0"])


# ---- applying ------------------------------------------------------------------------


def test_inject_applies_spec_and_device_edits(tmp_path: Path) -> None:
    write(
        tmp_path / "v.json",
        spec_data(
            devices={
                "null0": {
                    "deviceNodes": [{"path": "/dev/vendor-null0", "hostPath": "/dev/null"}],
                    "mounts": [{"hostPath": str(tmp_path), "containerPath": "/vendor"}],
                    "env": ["A=device"],
                    "hooks": [{"hookName": "poststop", "path": "/bin/true"}],
                    "additionalGids": [0, 44],
                }
            },
            containerEdits={"env": ["VENDOR=1"]},
        ),
    )
    spec = empty_spec()
    cfg = api_pb2.ContainerConfig(CDI_devices=[api_pb2.CDIDevice(name="vendor.example/dev=null0")])
    CdiRegistry([tmp_path]).inject(spec, cfg)
    assert spec["process"]["env"] == ["PATH=/bin", "A=device", "VENDOR=1"]
    assert spec["linux"]["devices"] == [
        {
            "path": "/dev/vendor-null0",
            "type": "c",
            "major": os.major(NULL_RDEV),
            "minor": os.minor(NULL_RDEV),
            "fileMode": 0o666,
        }
    ]
    assert spec["linux"]["resources"]["devices"][-1] == {
        "allow": True,
        "type": "c",
        "major": os.major(NULL_RDEV),
        "minor": os.minor(NULL_RDEV),
        "access": "rwm",
    }
    assert spec["mounts"][-1] == {
        "destination": "/vendor",
        "type": "bind",
        "source": str(tmp_path),
        "options": ["rbind"],
    }
    assert spec["hooks"] == {"poststop": [{"path": "/bin/true"}]}
    assert spec["process"]["user"]["additionalGids"] == [44]


def test_inject_without_devices_changes_nothing(tmp_path: Path) -> None:
    spec = empty_spec()
    CdiRegistry([tmp_path / "absent"]).inject(spec, api_pb2.ContainerConfig())
    assert spec == empty_spec()


def test_given_numbers_are_kept_and_a_missing_host_node_needs_them() -> None:
    spec = empty_spec()
    node = DeviceNode("/dev/x", "/nonexistent", "b", 8, 1, permissions="r")
    apply_edits(spec, [("a.b/c=x", ContainerEdits(device_nodes=(node,)))])
    assert spec["linux"]["devices"] == [{"path": "/dev/x", "type": "b", "major": 8, "minor": 1}]
    assert spec["linux"]["resources"]["devices"][-1]["access"] == "r"
    with pytest.raises(InvalidArgument, match=r"'a.b/c=y'.*/nonexistent"):
        apply_edits(
            spec,
            [("a.b/c=y", ContainerEdits(device_nodes=(DeviceNode("/dev/y", "/nonexistent"),)))],
        )


def test_a_host_path_that_is_not_a_device_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="is not a device node"):
        apply_edits(
            empty_spec(),
            [("a.b/c=x", ContainerEdits(device_nodes=(DeviceNode("/dev/x", str(tmp_path)),)))],
        )


def test_a_mount_replaces_the_one_at_its_destination() -> None:
    spec = empty_spec()
    apply_edits(
        spec, [("a.b/c=x", ContainerEdits(mounts=(Mount("/h", "/data", "", ("ro", "bind")),)))]
    )
    assert spec["mounts"] == [
        {"destination": "/data", "type": "bind", "source": "/h", "options": ["ro", "bind"]}
    ]
