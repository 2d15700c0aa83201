"""Pod PID namespace sharing (`shareProcessNamespace`): a pause process as the pod's PID 1.

Sandboxes have no infra container: network, IPC and UTS namespaces are pinned as files.
A PID namespace cannot be pinned that way: it lives only while its first process (its
init) lives, and it cannot be created empty and entered later with `setns` by runc. So a
pod that asks for one shared PID namespace gets a tiny init: a runc container in the
pod's other namespaces, under conmon like every container, whose program does what an
init must do in a PID namespace: reap the orphans that get re-parented to it (a zombie
there would fill the pod's process table), and exit on SIGTERM or SIGINT.

The program is 102 bytes of x86-64 machine code in a minimal static ELF, written into a
directory of its own under the sandbox directory, so that no image (Kubernetes' pause
image) has to be pulled and no binary of the host is trusted inside the pod. Its
assembly is in `_PAUSE_X86_64`. Other architectures are refused with a clear message.

Each container of the pod then joins `/proc/<pause pid>/ns/pid`; runc checks that pid
against the container's recorded start time (`runc state`), so a recycled pid is never
joined. The pause container is journaled (`pause_delete`) before it is created, and
StopPodSandbox removes it after the pod's containers have stopped.

The same container is the pod's sandbox under a handler that runs a pod as one sandbox
(gVisor's `runsc`, Kata: the handler's kind, or `[runtime.handlers.NAME] pod_sandbox`),
which adds to its spec what the kind needs (runtime/kinds/): marked
`io.kubernetes.cri.container-type: sandbox`, it is what the runtime starts the sandbox
with, and each container of the pod (marked `container`, with the pod's ID as
`io.kubernetes.cri.sandbox-id`) joins it. Such a pod always has one, whether or not it
shares its PID namespace, started once the pod's network is set up: gVisor's netstack
takes over the interfaces it finds in the namespace when the sandbox starts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import struct
from pathlib import Path
from typing import Any

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import CriError, FailedPrecondition, InvalidArgument
from cri_shim.faults import fault_point
from cri_shim.runtime.conmon import RuntimeBackend
from cri_shim.runtime.kinds.base import CONTAINER_TYPE, SANDBOX_ID
from cri_shim.runtime.spec import ImageConfigView, SandboxContext, build_spec
from cri_shim.state.journal import Journal
from cri_shim.state.records import SandboxRecord

log = logging.getLogger("cri_shim.sandbox")

PAUSE_ACTION = "pause_delete"
PAUSE_PROGRAM = "pause"
# Kubernetes' pause image runs as 65535 ("nobody"); the program needs no privilege.
PAUSE_UID = 65535

# The pause program, x86-64 (Linux system call numbers in comments):
#
#   _start: lea  rsi, [rip+mask]        ; rt_sigprocmask(SIG_BLOCK, &mask, NULL, 8)
#           xor  edi, edi               ;   keeps SIGCHLD, SIGTERM and SIGINT pending
#           xor  edx, edx               ;   for rt_sigtimedwait (a PID 1 with no handler
#           mov  r10d, 8                ;   would otherwise never see them)
#           mov  eax, 14
#           syscall
#   reap:   mov  edi, -1                ; wait4(-1, NULL, WNOHANG | __WALL, NULL)
#           xor  esi, esi
#           mov  edx, 0x40000001
#           xor  r10d, r10d
#           mov  eax, 61
#           syscall
#           test rax, rax
#           jg   reap                   ; reaped one: look for another
#   wait:   lea  rdi, [rip+mask]        ; rt_sigtimedwait(&mask, NULL, NULL, 8)
#           xor  esi, esi
#           xor  edx, edx
#           mov  r10d, 8
#           mov  eax, 128
#           syscall
#           cmp  eax, 17                ; SIGCHLD: reap
#           je   reap
#           test rax, rax               ; interrupted: wait again
#           js   wait
#           xor  edi, edi               ; SIGTERM or SIGINT: exit_group(0)
#           mov  eax, 231
#           syscall
#   mask:   .quad 0x14002               ; SIGCHLD (17), SIGTERM (15), SIGINT (2)
_PAUSE_X86_64 = bytes.fromhex(
    "488d355700000031ff31d241ba08000000b80e0000000f05"
    "bfffffffff31f6ba010000404531d2b83d0000000f054885c07fe5"
    "488d3d2400000031f631d241ba08000000b8800000000f05"
    "83f81174c84885c078de31ffb8e70000000f05"
    "0240010000000000"
)
_LOAD_ADDRESS = 0x400000


def pause_program(machine: str | None = None) -> bytes:
    """A complete static ELF executable: the ELF header, one loadable segment (the whole
    file, read + execute) and the code right after the headers."""
    machine = machine or platform.machine()
    if machine != "x86_64":
        raise InvalidArgument(
            "security_context.namespace_options.pid: sharing the pod's PID namespace needs "
            f"the pause program, which cri-shim has only for x86_64 (this node is {machine})"
        )
    header_size, segment_header_size = 64, 56
    entry = _LOAD_ADDRESS + header_size + segment_header_size
    size = header_size + segment_header_size + len(_PAUSE_X86_64)
    elf_header = struct.pack(
        "<4sBBBBB7sHHIQQQIHHHHHH",
        b"\x7fELF",
        2,  # 64-bit
        1,  # little endian
        1,  # ELF version
        0,  # System V ABI
        0,
        b"\0" * 7,
        2,  # ET_EXEC
        62,  # EM_X86_64
        1,
        entry,
        header_size,  # program headers right after this header
        0,  # no section headers
        0,
        header_size,
        segment_header_size,
        1,
        0,
        0,
        0,
    )
    segment = struct.pack(
        "<IIQQQQQQ",
        1,  # PT_LOAD
        5,  # PF_R | PF_X
        0,
        _LOAD_ADDRESS,
        _LOAD_ADDRESS,
        size,
        size,
        0x1000,
    )
    return elf_header + segment + _PAUSE_X86_64


def shares_pid_namespace(config: api_pb2.PodSandboxConfig) -> bool:
    """kubelet always sends the namespace options (pid CONTAINER unless the pod sets
    shareProcessNamespace). Without any, as from a bare `crictl runp`, POD is only the
    protobuf default and not a request: such a pod gets no pause process, as the
    container side (spec.container_namespaces) treats a missing option the same way."""
    security = config.linux.security_context
    return security.HasField("namespace_options") and (
        security.namespace_options.pid == api_pb2.POD
    )


class SandboxContainers:
    """Starts, finds and removes the pause process of pods sharing a PID namespace, and
    the sandbox container of pods whose handler needs one."""

    def __init__(
        self,
        journal: Journal,
        backends: dict[str, RuntimeBackend],
    ) -> None:
        self._journal = journal
        self._backends = backends
        journal.register(PAUSE_ACTION, self._undo)

    def is_pod_sandbox(self, handler: str) -> bool:
        """Whether pods of `handler` get a sandbox container their containers join."""
        backend = self._backends.get(handler)
        return backend is not None and backend.pod_sandbox

    def runs_pause(self, sandbox: SandboxRecord) -> bool:
        """Whether the pod has a pause container (its PID 1, or its sandbox container)."""
        return shares_pid_namespace(sandbox.config) or self.is_pod_sandbox(sandbox.runtime_handler)

    async def start(
        self,
        sandbox_id: str,
        sandbox_dir: Path,
        config: api_pb2.PodSandboxConfig,
        handler: str,
        context: SandboxContext,
    ) -> int:
        """Create and start the pause container in the pod's namespaces; its pid."""
        backend = self._backend(handler)
        bundle = sandbox_dir / "pause"
        rootfs = bundle / "rootfs"
        rootfs.mkdir(parents=True, exist_ok=True)
        program = rootfs / PAUSE_PROGRAM
        program.write_bytes(pause_program())
        os.chmod(program, 0o555)
        if context.userns is not None:
            # runc makes the mount points from inside the pod's user namespace, as the
            # pod's root: the directory must be that root's (the program stays the host's).
            os.chown(rootfs, *context.userns.root_ids())
        spec = build_spec(
            _pause_container_config(config, sandbox=self.is_pod_sandbox(handler)),
            context,
            # No /etc in this root: nothing to look a user up in.
            ImageConfigView(read_etc=lambda _path: None),
            rootfs,
            container_id=sandbox_id,
        )
        if self.is_pod_sandbox(handler):
            backend.kind.prepare_pod_sandbox(spec, rootfs, config)
        # The sandbox's own ID: runsc and Kata make the sandbox of a `sandbox` container,
        # and join the pod's containers to the one whose ID they carry.
        spec["annotations"][CONTAINER_TYPE] = "sandbox"
        spec["annotations"][SANDBOX_ID] = sandbox_id
        # Journaled before runc (or runsc) is asked: a crash in `create` leaves a
        # container that only this entry knows of.
        self._journal.record(sandbox_id, PAUSE_ACTION, handler=handler, id=sandbox_id)
        fault_point("sandbox:pod-sandbox-journaled")
        pid = await backend.create(
            sandbox_id, bundle, spec, bundle / "pause.log", tty=False, stdin=False
        )
        fault_point("sandbox:pod-sandbox-created")
        try:
            await backend.start(sandbox_id)
        except CriError as err:
            explained = backend.kind.start_refused(handler, err)
            if explained is None:
                raise
            raise explained from None
        fault_point("sandbox:pod-sandbox-started")
        if self.is_pod_sandbox(handler):
            log.info("sandbox %s: sandbox container started (pid %d)", sandbox_id, pid)
        else:
            log.info("sandbox %s: pause process %d is the pod's PID 1", sandbox_id, pid)
        return pid

    async def join(self, sandbox: SandboxRecord, context: SandboxContext) -> SandboxContext:
        """The context a container of `sandbox` is built with: for a pod sharing its PID
        namespace, with the pause process's namespace to join."""
        if not shares_pid_namespace(sandbox.config):
            return context
        backend = self._backend(sandbox.runtime_handler)
        if backend.kind.pid_namespace_of_sandbox:
            # runsc puts a container whose spec names no PID namespace in the sandbox's
            # own, where the sandbox container (this program) is PID 1; a path would
            # make it a namespace of the containers alone.
            return dataclasses.replace(context, host_pid=True)
        state: Any = None
        try:
            state = await backend.oci.state(sandbox.id)
        except Exception as err:  # any failure to find it means there is nothing to join
            log.warning("sandbox %s: no pause process: %s", sandbox.id, err)
        if state is None or state.status != "running" or state.pid <= 0:
            raise FailedPrecondition(
                f"pod sandbox {sandbox.id} shares one PID namespace, but its pause process "
                "is not running (stop and recreate the pod)"
            )
        return dataclasses.replace(context, pid_ns_path=Path(f"/proc/{state.pid}/ns/pid"))

    def exited(self, sandbox: SandboxRecord) -> bool:
        """Whether the pod's pause process, or its sandbox container, has exited (conmon
        recorded it): the pod's containers went with it."""
        if not self.runs_pause(sandbox):
            return False
        backend = self._backends.get(sandbox.runtime_handler)
        return backend is not None and backend.exit_status(sandbox.id) is not None

    async def _undo(self, args: dict[str, Any]) -> None:
        # Killing a PID namespace's init kills every process left in it.
        await self._backend(args["handler"]).delete(args["id"])

    def _backend(self, handler: str) -> RuntimeBackend:
        try:
            return self._backends[handler]
        except KeyError:
            raise FailedPrecondition(f"runtime handler {handler!r} is not configured") from None


def _pause_container_config(
    pod: api_pb2.PodSandboxConfig, *, sandbox: bool = False
) -> api_pb2.ContainerConfig:
    """The pause container as if kubelet had asked for it: no capabilities, no new
    privileges, read-only root, the runtime's default seccomp profile. A pod's sandbox
    container keeps the default capabilities: runsc gives them to the sandbox itself,
    whose host sockets (`--network=host`) bind the pod's low ports with them."""
    drop = [] if sandbox else ["ALL"]
    return api_pb2.ContainerConfig(
        metadata=api_pb2.ContainerMetadata(name="POD"),
        command=[f"/{PAUSE_PROGRAM}"],
        linux=api_pb2.LinuxContainerConfig(
            security_context=api_pb2.LinuxContainerSecurityContext(
                capabilities=api_pb2.Capability(drop_capabilities=drop),
                run_as_user=api_pb2.Int64Value(value=PAUSE_UID),
                run_as_group=api_pb2.Int64Value(value=PAUSE_UID),
                readonly_rootfs=True,
                no_new_privs=True,
                seccomp=api_pb2.SecurityProfile(
                    profile_type=api_pb2.SecurityProfile.RuntimeDefault
                ),
            )
        ),
    )
