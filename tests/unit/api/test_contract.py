"""The CRI contract in protos/: the generated modules match it, it is wire-compatible with
the stubs the project used before (container-runtime-interface-api 2.0.1, read in a
subprocess: its descriptors would clash with ours in one process), and it carries what
CRI 1.36 added."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from cri_shim.api.v1 import api_pb2

REPO = Path(__file__).resolve().parents[3]

# Fields whose type changed upstream, on purpose and within one wire type.
UPSTREAM_CHANGES = {
    # k8s.io/cri-api v0.36: env values may be any bytes (a string must be UTF-8).
    "runtime.v1.KeyValue.value": (
        descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
        descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
    ),
}


def _shape(file: descriptor_pb2.FileDescriptorProto) -> dict[str, tuple[object, ...]]:
    """Every field, enum value and method by full name, with what the wire depends on."""
    shape: dict[str, tuple[object, ...]] = {}

    def message(msg: descriptor_pb2.DescriptorProto, prefix: str) -> None:
        name = f"{prefix}.{msg.name}"
        shape[name] = ("message",)
        for field in msg.field:
            shape[f"{name}.{field.name}"] = (field.number, field.type, field.label, field.type_name)
        for nested in msg.nested_type:
            message(nested, name)
        for nested_enum in msg.enum_type:
            enum(nested_enum, name)

    def enum(e: descriptor_pb2.EnumDescriptorProto, prefix: str) -> None:
        shape[f"{prefix}.{e.name}"] = ("enum",)
        for value in e.value:
            shape[f"{prefix}.{e.name}.{value.name}"] = (value.number,)

    prefix = f".{file.package}"
    for msg in file.message_type:
        message(msg, prefix)
    for e in file.enum_type:
        enum(e, prefix)
    for service in file.service:
        for method in service.method:
            shape[f"{prefix}.{service.name}/{method.name}"] = (
                method.input_type,
                method.output_type,
                method.client_streaming,
                method.server_streaming,
            )
    return shape


def _ours() -> descriptor_pb2.FileDescriptorProto:
    file = descriptor_pb2.FileDescriptorProto()
    api_pb2.DESCRIPTOR.CopyToProto(file)
    return file


def _old_package() -> descriptor_pb2.FileDescriptorProto:
    dump = (
        "import sys; from cri_api.v1 import api_pb2;"
        "sys.stdout.buffer.write(api_pb2.DESCRIPTOR.serialized_pb)"
    )
    raw = subprocess.run([sys.executable, "-c", dump], capture_output=True, check=True).stdout
    return descriptor_pb2.FileDescriptorProto.FromString(raw)


def test_every_old_field_enum_value_and_method_is_ours_on_the_wire() -> None:
    old, ours = _shape(_old_package()), _shape(_ours())
    assert len(old) > 800  # the comparison saw the whole file (833 names)
    missing = sorted(name for name in old if name not in ours)
    assert not missing, f"absent from protos/: {missing}"
    changed = {}
    for name, shape in old.items():
        if ours[name] == shape:
            continue
        number, kind, label, type_name = shape
        if UPSTREAM_CHANGES.get(name[1:]) == (kind, ours[name][1]):
            assert ours[name] == (number, ours[name][1], label, type_name), name
            continue
        changed[name] = (shape, ours[name])
    assert not changed, f"number, type or label differs: {changed}"


def test_what_cri_1_36_added_is_there() -> None:
    ours = _shape(_ours())
    string, optional = (
        descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
        descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
    )
    boolean = descriptor_pb2.FieldDescriptorProto.TYPE_BOOL
    assert ours[".runtime.v1.ImageSpec.image_ref"] == (20, string, optional, "")
    assert ours[".runtime.v1.RuntimeFeatures.user_namespaces_host_network"][:2] == (2, boolean)
    streams = {
        "RuntimeService/StreamPodSandboxes": "StreamPodSandboxes",
        "RuntimeService/StreamContainers": "StreamContainers",
        "RuntimeService/StreamContainerStats": "StreamContainerStats",
        "RuntimeService/StreamPodSandboxStats": "StreamPodSandboxStats",
        "RuntimeService/StreamPodSandboxMetrics": "StreamPodSandboxMetrics",
        "ImageService/StreamImages": "StreamImages",
    }
    for method, message in streams.items():
        assert ours[f".runtime.v1.{method}"] == (
            f".runtime.v1.{message}Request",
            f".runtime.v1.{message}Response",
            False,
            True,
        )


@pytest.mark.parametrize(
    ("package", "pattern"), [("cri_shim/api/v1", "api_pb2*"), ("cri_shim/nri/api", "*_pb2*")]
)
def test_regenerating_changes_nothing(tmp_path: Path, package: str, pattern: str) -> None:
    """The checked-in modules are what scripts/protos makes of protos/ today."""
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable}
    subprocess.run([REPO / "scripts" / "protos", tmp_path], check=True, env=env)
    fresh, checked_in = tmp_path / package, REPO / package
    names = sorted(p.name for p in fresh.iterdir())
    assert names == sorted(p.name for p in checked_in.glob(pattern))
    stale = [n for n in names if (fresh / n).read_bytes() != (checked_in / n).read_bytes()]
    assert not stale, f"run scripts/protos and commit: {stale} differ from protos/"


def test_the_daemon_imports_no_third_party_cri_stubs() -> None:
    probe = (
        "import sys, cri_shim.cli, cri_shim.daemon, cri_shim.server.services;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'cri_api'))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, check=True, text=True)
    assert out.stdout.strip() == "[]"
