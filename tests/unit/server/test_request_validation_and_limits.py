"""Request validation and admission at the gRPC edge, without a daemon: every
RPC goes through them, hostile fields are named, and a flood is queued or refused."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys

import pytest

from cri_shim.api.v1 import api_pb2
from cri_shim.config import RequestsConfig
from cri_shim.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted
from cri_shim.server import validation
from cri_shim.server.limits import READ_RPCS, RequestLimiter
from cri_shim.server.rpc import cri_method_name
from cri_shim.server.services import ImageService, RuntimeService
from cri_shim.server.validation import validate_request
from tests.waiting import until


def test_every_served_rpc_is_admitted_under_its_own_name() -> None:
    # The admission layer finds an RPC's validator and class from the handler's name: a
    # handler renamed away from its RPC would silently skip both.
    for cls, service in ((RuntimeService, "RuntimeService"), (ImageService, "ImageService")):
        methods = api_pb2.DESCRIPTOR.services_by_name[service].methods_by_name
        for name in methods:
            wrapped = getattr(getattr(cls, name), "__wrapped__", None)
            if wrapped is not None:  # served (unimplemented ones do nothing)
                assert cri_method_name(wrapped.__name__) == name
    assert READ_RPCS <= set(
        api_pb2.DESCRIPTOR.services_by_name["RuntimeService"].methods_by_name
    ) | set(api_pb2.DESCRIPTOR.services_by_name["ImageService"].methods_by_name)


def pod(**fields: object) -> api_pb2.RunPodSandboxRequest:
    config = api_pb2.PodSandboxConfig(
        metadata=api_pb2.PodSandboxMetadata(name="web", namespace="default", uid="u1"),
        hostname="web",
    )
    for key, value in fields.items():
        target = config
        *parents, leaf = key.split(".")
        for parent in parents:
            target = getattr(target, parent)
        if isinstance(value, dict):
            getattr(target, leaf).update(value)
        elif isinstance(value, list):
            getattr(target, leaf).extend(value)
        else:
            setattr(target, leaf, value)
    return api_pb2.RunPodSandboxRequest(config=config)


HOST_NET = {"linux.security_context.namespace_options.network": api_pb2.NODE}


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"log_directory": "relative/logs"}, "log_directory"),
        ({"log_directory": "/var/log/pods/../../../etc"}, "log_directory"),
        ({"hostname": "web\n10.0.0.1 kubernetes"}, "hostname"),
        ({"hostname": "h" * 65}, "hostname"),
        ({"dns_config.servers": ["8.8.8.8\nnameserver 6.6.6.6"]}, "dns_config.servers[0]"),
        ({"dns_config.searches": ["corp evil.example"]}, "dns_config.searches[0]"),
        ({"dns_config.options": ["ndots:5\nnameserver 1.1.1.1"]}, "dns_config.options[0]"),
        ({"linux.sysctls": {"../../proc/sys/kernel/panic": "1"}}, "linux.sysctls"),
        ({"annotations": {"big": "x" * (300 * 1024)}}, "annotations"),
        ({"labels": {"k" * 400: "v"}}, "labels"),
        ({"labels": {"app\x00": "v"}}, "labels key"),
        ({"annotations": {"note": "a\x00b"}}, "annotations['note']"),
        ({"port_mappings": [api_pb2.PortMapping(host_port=70000)]}, "port_mappings[0].host_port"),
        ({"port_mappings": [api_pb2.PortMapping(host_ip="nope")]}, "port_mappings[0].host_ip"),
        ({"linux.cgroup_parent": "/kubepods/../../.."}, "cgroup_parent"),
        ({"metadata.name": "web\x00"}, "metadata.name"),
        ({"linux.security_context.namespace_options.network": 99}, "namespace_options.network"),
        ({"port_mappings": [api_pb2.PortMapping(protocol=7)]}, "port_mappings[0].protocol"),
    ],
)
def test_hostile_sandbox_fields_are_named(fields: dict[str, object], named: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(named)):
        validate_request("RunPodSandbox", pod(**fields))


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"log_directory": "/var/log/pods/default_web_u1"},
        {"dns_config.servers": ["10.96.0.10", "fd00::a"], "dns_config.options": ["ndots:5"]},
        {"dns_config.searches": ["default.svc.cluster.local", "cluster.local."]},
        {"linux.sysctls": {"net.ipv4.ip_unprivileged_port_start": "0", "kernel.sem": "1 2 3 4"}},
        {"linux.sysctls": {"net/ipv4/conf/eth0/rp_filter": "1"}},
        {"hostname": "", **HOST_NET, "metadata.name": "Any_Name.is-fine_on-the-host-network"},
        # No hostname: the pod's is derived from its ID, whatever its name (critest's are
        # longer than a hostname may be).
        {"hostname": "", "metadata.name": "PodSandbox-for-a-test-" + "x" * 60},
        {"annotations": {"kubectl.kubernetes.io/last-applied-configuration": "x" * 200_000}},
    ],
)
def test_what_kubelet_sends_is_accepted(fields: dict[str, object]) -> None:
    validate_request("RunPodSandbox", pod(**fields))


def test_checking_maps_loads_no_descriptor_protos() -> None:
    """Reading a map field's options would import descriptor_pb2, 0.3 MiB resident."""
    code = (
        "import sys; from tests.unit.server.test_request_validation_and_limits import pod;"
        " from cri_shim.server.validation import validate_request;"
        " validate_request('RunPodSandbox', pod(labels={'app': 'web'}, annotations={'a': 'b'}));"
        " print('google.protobuf.descriptor_pb2' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def container(**fields: object) -> api_pb2.CreateContainerRequest:
    config = api_pb2.ContainerConfig(
        metadata=api_pb2.ContainerMetadata(name="app"),
        image=api_pb2.ImageSpec(image="busybox"),
        log_path="app/0.log",
    )
    for key, value in fields.items():
        field = getattr(config, key)
        if isinstance(value, list):
            field.extend(value)
        elif isinstance(value, dict):
            field.update(value)
        else:
            setattr(config, key, value)
    return api_pb2.CreateContainerRequest(pod_sandbox_id="abc", config=config)


def test_hostile_container_fields_are_named() -> None:
    cases: list[tuple[dict[str, object], str]] = [
        ({"log_path": "/etc/cron.d/evil"}, "log_path"),
        ({"log_path": "../../escape.log"}, "log_path"),
        ({"log_path": "app/"}, "log_path"),
        ({"working_dir": "relative"}, "working_dir"),
        ({"mounts": [api_pb2.Mount(container_path="/data", host_path="rel")]}, "host_path"),
        ({"mounts": [api_pb2.Mount(container_path="d", host_path="/tmp")]}, "container_path"),
        ({"mounts": [api_pb2.Mount(container_path="/../etc", host_path="/tmp")]}, "'..'"),
        (
            {"mounts": [api_pb2.Mount(container_path="/d", host_path="/tmp", propagation=9)]},
            "propagation",
        ),
        ({"envs": [api_pb2.KeyValue(key="A=B", value=b"x")]}, "envs[0].key"),
        ({"envs": [api_pb2.KeyValue(key="A", value=b"x\x00y")]}, "envs[0].value"),
        ({"devices": [api_pb2.Device(host_path="dev/null", container_path="/dev/x")]}, "devices"),
        ({"command": ["/bin/sh\x00-c"]}, "command[0]"),
        ({"args": ["x" * (200 * 1024)]}, "args[0]"),
        ({"annotations": {"a": "x" * (300 * 1024)}}, "annotations"),
        ({"stop_signal": 999}, "stop_signal"),
    ]
    for fields, named in cases:
        with pytest.raises(InvalidArgument, match=re.escape(named)):
            validate_request("CreateContainer", container(**fields))
    hostile = container()
    hostile.config.linux.resources.unified["../cgroup.procs"] = "1"
    with pytest.raises(InvalidArgument, match="unified"):
        validate_request("CreateContainer", hostile)
    hostile = container()
    hostile.config.linux.security_context.run_as_user.value = -1
    with pytest.raises(InvalidArgument, match="run_as_user"):
        validate_request("CreateContainer", hostile)
    hostile = container()
    hostile.config.linux.security_context.run_as_group.value = 1000
    with pytest.raises(InvalidArgument, match="run_as_group is set without run_as_user"):
        validate_request("CreateContainer", hostile)
    for user in ("run_as_user", "run_as_username"):
        paired = container()
        sc = paired.config.linux.security_context
        sc.run_as_group.value = 1000
        if user == "run_as_user":
            sc.run_as_user.value = 1000
        else:
            sc.run_as_username = "app"
        validate_request("CreateContainer", paired)


@pytest.mark.parametrize("name", ["uidMappings", "gidMappings"])
def test_mount_id_mappings_are_refused_before_the_request_is_walked(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    mappings = [api_pb2.IDMapping(host_id=100000, container_id=0, length=1)] * 100_000
    mounts = [
        api_pb2.Mount(container_path="/a", host_path="/tmp"),
        api_pb2.Mount(container_path="/b", host_path="/tmp", **{name: mappings}),
    ]

    def walked(*args: object) -> None:
        raise AssertionError("the mappings were walked before they were refused")

    monkeypatch.setattr(validation, "check_message", walked)
    with pytest.raises(InvalidArgument, match=rf"mounts\[1\]\.{name}: 100000 ID mappings") as info:
        validate_request("CreateContainer", container(mounts=mounts))
    assert "not supported" in str(info.value)


def test_secrets_are_never_echoed_in_validation_errors() -> None:
    request = api_pb2.PullImageRequest(
        image=api_pb2.ImageSpec(image="busybox"),
        auth=api_pb2.AuthConfig(username="u", password="s3cret\x00-Zz9"),
    )
    with pytest.raises(InvalidArgument, match=r"auth\.password") as info:
        validate_request("PullImage", request)
    assert "s3cret" not in str(info.value)


def test_other_rpcs_check_ids_ports_and_timeouts() -> None:
    with pytest.raises(InvalidArgument, match="container_id"):
        validate_request("StartContainer", api_pb2.StartContainerRequest(container_id="x" * 500))
    with pytest.raises(InvalidArgument, match=r"port\[0\]"):
        validate_request("PortForward", api_pb2.PortForwardRequest(pod_sandbox_id="p", port=[0]))
    with pytest.raises(InvalidArgument, match="timeout"):
        validate_request("ExecSync", api_pb2.ExecSyncRequest(container_id="c", timeout=-5))
    with pytest.raises(InvalidArgument, match=r"image\.image"):
        validate_request(
            "ImageStatus", api_pb2.ImageStatusRequest(image=api_pb2.ImageSpec(image="x" * 5000))
        )


# --- admission ------------------------------------------------------------------------------------
async def test_work_calls_queue_then_are_refused_and_reads_pass() -> None:
    limiter = RequestLimiter(RequestsConfig(max_in_flight=2, max_queued=2, max_reads_in_flight=3))
    release = asyncio.Event()
    order: list[int] = []

    async def work(number: int) -> None:
        async with limiter.admit("StopContainer", None):
            order.append(number)
            await release.wait()

    running = [asyncio.create_task(work(n)) for n in range(4)]
    await until(lambda: (limiter.working, limiter.queued) == (2, 2))
    with pytest.raises(ResourceExhausted, match="max_in_flight, max_queued"):
        await work(99)
    # Reads do not wait behind the work calls.
    async with limiter.admit("ListContainers", None):
        pass
    release.set()
    await asyncio.gather(*running)
    assert order == [0, 1, 2, 3]  # queued calls run in arrival order
    assert (limiter.working, limiter.queued, limiter.refused) == (0, 0, 1)


async def test_reads_are_capped_and_streams_are_not() -> None:
    limiter = RequestLimiter(RequestsConfig(max_reads_in_flight=1))
    async with limiter.admit("Status", None):
        with pytest.raises(ResourceExhausted, match="max_reads_in_flight"):
            async with limiter.admit("Version", None):
                pass
        async with limiter.admit("GetContainerEvents", None):
            pass


async def test_a_queued_call_gives_up_at_its_deadline() -> None:
    limiter = RequestLimiter(RequestsConfig(max_in_flight=1, max_queued=5))
    release = asyncio.Event()

    async def hold() -> None:
        async with limiter.admit("StopPodSandbox", None):
            await release.wait()

    holder = asyncio.create_task(hold())
    await asyncio.sleep(0)
    deadline = asyncio.get_running_loop().time() + 0.05
    with pytest.raises(DeadlineExceeded, match="nothing was done"):
        async with limiter.admit("RemovePodSandbox", deadline):
            pass
    assert limiter.queued == 0
    release.set()
    await holder


async def test_creations_still_running_detached_hold_back_new_ones() -> None:
    running = {"count": 0}
    limiter = RequestLimiter(RequestsConfig(max_in_flight=2), lambda: running["count"])
    async with limiter.admit("RunPodSandbox", None):
        pass
    running["count"] = 2  # two creations whose requests timed out
    with pytest.raises(ResourceExhausted, match="creations are still running"):
        async with limiter.admit("CreateContainer", None):
            pass
    async with limiter.admit("StopContainer", None):  # other work is not held back
        pass


@pytest.mark.parametrize(
    "auth",
    [
        {"registry_token": "tok\r\nX-Injected: 1"},  # would add a header to the request
        {"registry_token": "t\u00e9"},  # cannot be encoded in a header at all
        {"auth": "\u00fc\u00fc\u00fc"},  # not base64, and not even ASCII
    ],
)
def test_credentials_that_cannot_be_sent_are_refused_without_echo(auth: dict[str, str]) -> None:
    from cri_shim.images.auth import Credentials

    with pytest.raises(InvalidArgument, match="auth config") as info:
        Credentials.from_auth_config(**auth)
    assert next(iter(auth.values())) not in str(info.value)


def test_resource_fields_of_a_shape_no_cgroup_takes_are_named() -> None:
    """Their ranges and the CPUs online are the operation's rules
    (tests/unit/lifecycle/test_operation_rules.py)."""
    for resources, named in (
        (api_pb2.LinuxContainerResources(cpu_period=-1), "cpu_period: must not be negative"),
        (api_pb2.LinuxContainerResources(cpu_quota=-2), "cpu_quota: must be -1"),
    ):
        request = api_pb2.UpdateContainerResourcesRequest(container_id="c", linux=resources)
        with pytest.raises(InvalidArgument, match=named):
            validate_request("UpdateContainerResources", request)
    ok = api_pb2.LinuxContainerResources(cpu_period=100_000, cpu_quota=-1, cpu_shares=2)
    validate_request("UpdateContainerResources", api_pb2.UpdateContainerResourcesRequest(linux=ok))
