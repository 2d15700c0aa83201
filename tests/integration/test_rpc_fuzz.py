"""Every RPC with generated messages against ONE running daemon.

A small hypothesis strategy builds a random message from any protobuf descriptor (random
and hostile strings, unicode, extreme numbers, unknown enum values, missing and
conflicting fields, nested messages, maps and lists). Each example sends one RuntimeService
or ImageService call, chosen from the API's own service descriptors so that an RPC added to
the API is fuzzed too. The daemon must stay up; every answer must be a proper status code
(never UNKNOWN, never an unexpected exception turned INTERNAL, never a stack trace in the
details); afterwards, once the test has removed what succeeded, nothing is left: no object,
mount, namespace, reservation, journal entry or address.

Fields that would reach outside the test are drawn from safe sets instead: directories the
daemon would create (log_directory), host paths it would mount, host ports it would map,
stop timeouts it would wait out, and image references it would pull (only the unreachable
127.0.0.1:1). IDs are drawn from the real pod and container as well as at random, so the
calls reach the objects and not only NOT_FOUND.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cri_shim.api.v1 import api_pb2
from tests.harness import CniTestNetwork, Daemon, import_image, make_test_network, pod_config
from tests.imagebuild import cached_oci_layout
from tests.refused_calls import IMAGE, container_config, create_request

pytestmark = [
    pytest.mark.integration,
    pytest.mark.root,
    pytest.mark.slow,
    # Hypothesis describes the nested descriptor strategies at length; harmless.
    pytest.mark.filterwarnings("ignore:Generating overly large repr"),
]

SERVICES = ("RuntimeService", "ImageService")
METHODS: list[MethodDescriptor] = [
    method
    for service in SERVICES
    for method in api_pb2.DESCRIPTOR.services_by_name[service].methods
]
CALL_TIMEOUT = 20.0
STREAM_TIMEOUT = 0.5  # GetContainerEvents never ends by itself

HOSTILE_STRINGS = [
    "",
    "/",
    ".",
    "..",
    "../../../../etc/passwd",
    "/etc/shadow",
    "/dev/zero",
    "/proc/self/mem",
    "a\nb",
    "x\x00y",
    "%",
    "_",
    "*",
    "?",
    "\\",
    "$(reboot)",
    "; rm -rf /",
    "😀" * 8,
    "\u202e\u0000\ufeff",
    "k8s_POD_x_y_z_0",
    "x" * 70,
    "x" * 5000,
]
INT_EDGES = [0, 1, -1, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63), 65535, 65536]


@dataclass
class World:
    """The one daemon, and the pod and container the fuzz aims at. Calls may stop or
    remove them (that is part of the fuzz); `ensure_target` brings them back."""

    daemon: Daemon
    base: Path
    layout: Path
    volume: Path
    sandbox_id: str = ""
    sandbox_config: api_pb2.PodSandboxConfig = field(default_factory=api_pb2.PodSandboxConfig)
    container_id: str = ""
    resets: int = 0
    answers: list[tuple[str, grpc.StatusCode, str]] = field(default_factory=list)

    def real_ids(self) -> list[str]:
        return [self.sandbox_id, self.sandbox_id[:12], self.container_id, self.container_id[:12]]

    def ensure_target(self) -> None:
        """A ready pod with a running container, as the fuzz expects to find them."""
        runtime, images = self.daemon.runtime(), self.daemon.images()
        try:
            pod = runtime.PodSandboxStatus(
                api_pb2.PodSandboxStatusRequest(pod_sandbox_id=self.sandbox_id), timeout=10
            ).status
            container = runtime.ContainerStatus(
                api_pb2.ContainerStatusRequest(container_id=self.container_id), timeout=10
            ).status
            if pod.state == api_pb2.SANDBOX_READY and container.state == api_pb2.CONTAINER_RUNNING:
                return
        except grpc.RpcError:
            pass
        if self.sandbox_id:
            runtime.RemovePodSandbox(
                api_pb2.RemovePodSandboxRequest(pod_sandbox_id=self.sandbox_id), timeout=120
            )
        image = images.ImageStatus(
            api_pb2.ImageStatusRequest(image=api_pb2.ImageSpec(image=IMAGE)), timeout=10
        )
        if not image.image.id:  # a fuzzed RemoveImage took it
            import_image(self.daemon, self.layout)
        self.resets += 1
        self.sandbox_config = pod_config(
            "fuzz-target", attempt=self.resets, log_directory=str(self.base / "logs")
        )
        self.sandbox_id = runtime.RunPodSandbox(
            api_pb2.RunPodSandboxRequest(config=self.sandbox_config), timeout=60
        ).pod_sandbox_id
        self.container_id = runtime.CreateContainer(
            create_request(
                (self.sandbox_id, self.sandbox_config), container_config("target", "sleep 600")
            ),
            timeout=60,
        ).container_id
        runtime.StartContainer(
            api_pb2.StartContainerRequest(container_id=self.container_id), timeout=30
        )


# --- a random message from a descriptor ------------------------------------------------------
def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind == FieldDescriptor.TYPE_STRING:
        return st.one_of(
            st.text(max_size=24),
            st.sampled_from(HOSTILE_STRINGS),
            st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=300),
        )
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_ENUM:
        known = [value.number for value in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-3, 1000))
    if kind in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.floats(allow_nan=True, allow_infinity=True, width=32)
    bits = 64 if kind in _64_BIT else 32
    low, high = (0, 2**bits - 1) if kind in _UNSIGNED else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    edges = [v for v in INT_EDGES if low <= v <= high]
    return st.one_of(st.sampled_from(edges), st.integers(low, high), st.integers(max(low, -2), 100))


_64_BIT = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}
_UNSIGNED = {
    FieldDescriptor.TYPE_UINT32,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_FIXED32,
    FieldDescriptor.TYPE_FIXED64,
}


def _is_map(f: FieldDescriptor) -> bool:
    return f.message_type is not None and f.message_type.GetOptions().map_entry


def field_strategy(
    owner: Descriptor,
    f: FieldDescriptor,
    overrides: dict[str, st.SearchStrategy[Any]],
    depth: int,
) -> st.SearchStrategy[Any] | None:
    """Values for the field `f` of `owner` (None: nesting too deep to go on)."""
    key = f"{owner.name}.{f.name}"
    if key in overrides:
        return overrides[key]
    if _is_map(f):
        value_field = f.message_type.fields_by_name["value"]
        value_s = (
            message_strategy(value_field.message_type, overrides, depth + 1)
            if value_field.message_type is not None
            else _scalar(value_field)
        )
        return st.dictionaries(_scalar(f.message_type.fields_by_name["key"]), value_s, max_size=3)
    if f.message_type is not None:
        if depth >= 4:
            return None
        item = message_strategy(f.message_type, overrides, depth + 1)
        return st.lists(item, max_size=3) if _repeated(f) else item
    return st.lists(_scalar(f), max_size=4) if _repeated(f) else _scalar(f)


def assign(message: Message, f: FieldDescriptor, value: Any) -> None:
    """Set field `f` of `message` to `value`, whatever kind of field it is."""
    target = getattr(message, f.name)
    if _is_map(f):
        target.clear()
        for key, item in value.items():
            if isinstance(item, Message):
                target[key].CopyFrom(item)
            else:
                target[key] = item
    elif _repeated(f):
        del target[:]
        target.extend(value)
    elif isinstance(value, Message):
        target.CopyFrom(value)
    else:
        setattr(message, f.name, value)


def message_strategy(
    descriptor: Descriptor, overrides: dict[str, st.SearchStrategy[Any]], depth: int = 0
) -> st.SearchStrategy[Message]:
    """Random messages of `descriptor`'s type: each field present or not; `overrides`
    replaces the strategy of a field by its `Message.field` name."""
    cls = message_factory.GetMessageClass(descriptor)
    optional = {
        f.name: strategy
        for f in descriptor.fields
        if (strategy := field_strategy(descriptor, f, overrides, depth)) is not None
    }

    def build(values: dict[str, Any]) -> Message:
        message = cls()
        for name, value in values.items():
            assign(message, descriptor.fields_by_name[name], value)
        return message

    return st.fixed_dictionaries({}, optional=optional).map(build)


def leaf_fields(
    descriptor: Descriptor, path: tuple[str, ...] = (), depth: int = 0
) -> list[tuple[tuple[str, ...], Descriptor, FieldDescriptor]]:
    """Every field reachable through singular sub-messages: (path to its owner, owner,
    field). What a mutation may change."""
    found = []
    for f in descriptor.fields:
        found.append((path, descriptor, f))
        if f.message_type is not None and not _is_map(f) and not _repeated(f) and depth < 3:
            found += leaf_fields(f.message_type, (*path, f.name), depth + 1)
    return found


def mutated(
    base: Callable[[], Message], overrides: dict[str, st.SearchStrategy[Any]]
) -> st.SearchStrategy[Message]:
    """A valid request with one to three of its fields (at any depth) set at random:
    deeper than a wholly random message gets, since most of it still makes sense."""
    leaves = leaf_fields(base().DESCRIPTOR)
    if not leaves:  # a request without fields
        return st.builds(base)

    @st.composite
    def draw(data: st.DrawFn) -> Message:
        message = base()
        for path, owner, f in data(st.lists(st.sampled_from(leaves), min_size=1, max_size=3)):
            strategy = field_strategy(owner, f, overrides, 2)
            if strategy is None:
                continue
            target = message
            for name in path:
                target = getattr(target, name)
            assign(target, f, data(strategy))
        return message

    return draw()


def _repeated(f: FieldDescriptor) -> bool:
    return bool(f.is_repeated)


def overrides_for(world: World) -> dict[str, st.SearchStrategy[Any]]:
    """Safe or interesting values for the fields that act on the host or name objects."""
    real_ids = st.integers(0, 3).map(lambda i: world.real_ids()[i])  # read at draw time
    ids = st.one_of(real_ids, st.text(max_size=70), st.sampled_from(HOSTILE_STRINGS))
    logs = world.base / "fuzz-logs"
    id_fields = {
        f"{name}.{f.name}": ids
        for name, message in api_pb2.DESCRIPTOR.message_types_by_name.items()
        for f in message.fields
        if f.name in ("pod_sandbox_id", "container_id") and f.type == FieldDescriptor.TYPE_STRING
    }
    return {
        **id_fields,
        "PodSandboxConfig.log_directory": st.sampled_from(
            ["", str(logs / "a"), "relative", f"{logs}/../x", "/", str(logs) + "/\x00"]
        ),
        "PortMapping.host_port": st.sampled_from([0, -1, 65536, 2**31 - 1]),
        "Mount.host_path": st.sampled_from(
            ["", "relative", str(world.volume), str(world.base / "missing"), "/dev/zero"]
        ),
        "Device.host_path": st.sampled_from(["", "/dev/null", "dev/null", "/", "/dev"]),
        "ContainerConfig.log_path": st.sampled_from(["", "x.log", "../x", "/abs", "./", "a/b"]),
        "ContainerConfig.image": st.sampled_from(
            [api_pb2.ImageSpec(image=IMAGE), api_pb2.ImageSpec(image="nope"), api_pb2.ImageSpec()]
        ),
        "StopContainerRequest.timeout": st.sampled_from([0, 1, -1]),
        "ExecSyncRequest.timeout": st.sampled_from([0, 1, 2, -1]),
        "ExecSyncRequest.cmd": st.lists(st.sampled_from(["true", "/bin/true", "", "\x00"])),
        "SecurityProfile.localhost_ref": st.sampled_from(
            ["", "/dev/zero", "relative.json", str(world.base / "missing.json")]
        ),
        "LinuxContainerSecurityContext.seccomp_profile_path": st.sampled_from(
            ["", "unconfined", "runtime/default", "localhost//dev/zero", "bogus"]
        ),
    }


def pull_reference() -> st.SearchStrategy[str]:
    # Only the unreachable loopback registry: the daemon must not reach any other host.
    tail = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789._-/:@", max_size=40)
    return tail.map(lambda t: f"127.0.0.1:1/{t}")


# --- the one daemon ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    base = Path(tempfile.mkdtemp(prefix="cs-f-", dir="/tmp"))
    network: CniTestNetwork = make_test_network(base, 90, slow=False)
    daemon = Daemon(base / "d", network)
    daemon.base.mkdir()
    daemon.start()
    try:
        layout = cached_oci_layout(tmp_path_factory.getbasetemp() / "images")
        import_image(daemon, layout)
        volume = base / "volume"
        volume.mkdir()
        made = World(daemon, base, layout, volume)
        made.ensure_target()
        yield made
    finally:
        daemon.stop()
        network.remove()
        _unmount_below(base)
        shutil.rmtree(base, ignore_errors=True)


def valid_request(world: World, method: MethodDescriptor, n: int) -> Message:
    """A request `method` would accept, aimed at the world's pod and container (or at a
    new pod `n`, a few names so that duplicates happen too)."""
    cls = message_factory.GetMessageClass(method.input_type)
    if method.name == "RunPodSandbox":
        config = pod_config(f"fz-{n}", uid=f"uid-fz-{n}", log_directory=str(world.base / "fz"))
        return api_pb2.RunPodSandboxRequest(config=config)
    if method.name == "CreateContainer":
        return create_request(
            (world.sandbox_id, world.sandbox_config), container_config(f"fz-{n}", "true")
        )
    values: dict[str, Any] = {
        "pod_sandbox_id": world.sandbox_id,
        "container_id": world.container_id,
        "image": api_pb2.ImageSpec(image=IMAGE),
        "cmd": ["true"],
        "timeout": 5,
        "port": [80],
    }
    if method.name in ("RemoveImage", "StopContainer"):
        values.pop("image")  # RemoveImage of the test image would only slow the fuzz down
        values["timeout"] = 0
    fields = method.input_type.fields_by_name
    message = cls()
    for name, value in values.items():
        if name in fields and not (name == "image" and fields[name].message_type is None):
            assign(message, fields[name], value)
    return message


def _unmount_below(path: Path) -> None:
    import subprocess

    for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
        point = line.split()[4]
        if point.startswith(str(path)):
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)


def call(world: World, method: MethodDescriptor, request: Message) -> tuple[grpc.StatusCode, str]:
    channel = world.daemon.channel()
    path = f"/{method.containing_service.full_name}/{method.name}"
    response_class = message_factory.GetMessageClass(method.output_type)
    try:
        if method.server_streaming:
            stream = channel.unary_stream(
                path,
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=response_class.FromString,
            )(request, timeout=STREAM_TIMEOUT)
            for _ in stream:
                pass
        else:
            channel.unary_unary(
                path,
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=response_class.FromString,
            )(request, timeout=CALL_TIMEOUT)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def improper(rpc: str, code: grpc.StatusCode, details: str) -> str | None:
    """Why an answer is not a proper status, or None when it is."""
    if code == grpc.StatusCode.UNKNOWN:
        return "UNKNOWN"
    if "Traceback" in details or 'File "' in details:
        return "a stack trace in the details"
    # The rpc wrapper's answer to an exception no domain code expected (a missing check).
    if code == grpc.StatusCode.INTERNAL and details.startswith(f"{_handler(rpc)} failed: "):
        return "an unexpected exception"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and rpc != "GetContainerEvents":
        return "no answer within the deadline"
    return None


def _handler(rpc: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in rpc).lstrip("_")


def test_every_rpc_with_generated_messages(world: World) -> None:
    overrides = overrides_for(world)
    random_requests = {m.full_name: message_strategy(m.input_type, overrides) for m in METHODS}

    def requests_for(method: MethodDescriptor, n: int) -> st.SearchStrategy[Message]:
        return st.one_of(
            random_requests[method.full_name],
            mutated(lambda: valid_request(world, method, n), overrides),
        )

    @settings(
        max_examples=int(os.environ.get("CRI_SHIM_FUZZ_EXAMPLES", "400")),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data())
    def one_call(data: st.DataObject) -> None:
        world.ensure_target()
        method = data.draw(st.sampled_from(METHODS), label="rpc")
        n = data.draw(st.integers(0, 3), label="pod number")
        request = data.draw(requests_for(method, n), label="request")
        if method.name == "PullImage":
            request.image.image = data.draw(pull_reference(), label="image")
        code, details = call(world, method, request)
        world.answers.append((method.name, code, details))
        problem = improper(method.name, code, details)
        assert problem is None, f"{method.name}: {problem}: {code.name}: {details[:500]}"
        assert world.daemon.proc is not None and world.daemon.proc.poll() is None, "daemon died"

    started = time.monotonic()
    one_call()
    elapsed = time.monotonic() - started
    daemon = world.daemon
    # Still up and serving, and it kept no record of an unexpected failure.
    assert daemon.runtime().Version(api_pb2.VersionRequest(), timeout=5).runtime_name
    log = daemon.log_path.read_text(errors="replace")
    assert "failed unexpectedly" not in log and "Traceback" not in log, daemon.log()
    called = {rpc for rpc, _, _ in world.answers}
    assert len(called) >= len(METHODS) // 2, sorted(called)
    codes = Counter(code.name for _, code, _ in world.answers)
    if os.environ.get("CRI_SHIM_FUZZ_VERBOSE"):
        print(sorted(Counter((rpc, code.name) for rpc, code, _ in world.answers).items()))
        print([a for a in world.answers if a[1] == grpc.StatusCode.INTERNAL])
    print(
        f"{len(world.answers)} calls in {elapsed:.1f}s over {len(called)} RPCs "
        f"({world.resets} target resets): {codes}"
    )

    # What succeeded is the test's to remove; then nothing at all may be left.
    runtime = daemon.runtime()
    for sandbox in runtime.ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=30).items:
        runtime.StopPodSandbox(api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox.id), timeout=60)
        runtime.RemovePodSandbox(
            api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox.id), timeout=120
        )
    assert daemon.leaks() == {}
    assert (world.volume).exists() and list(world.volume.iterdir()) == []
