"""The runtime handlers' section of docs/configuration.md: what each kind of handler does
with a pod, what gVisor refuses, and critest's tally under it (measured, kept here so the
generated reference says it)."""

from __future__ import annotations

# critest (cri-tools, the kit in ../shared/conformance) against this daemon, offline, with
# NRI on: `--runtime-handler=runsc` beside the default handler (runc).
CRITEST_TALLY = (
    ("runc (default)", "126", "2", "14"),
    ("runsc (gVisor 2022-12-19)", "94", "28", "20"),
)

# Each spec that fails under runsc, and why. "Refused": the daemon answers
# INVALID_ARGUMENT or FAILED_PRECONDITION naming the handler before anything is made.
CRITEST_RUNSC_FAILURES = (
    (
        "public image with digest should be pulled and removed; MaskedPaths",
        "cannot pass offline, under runc too (upstream's digest; busybox's `ls` is a "
        "shell built-in)",
    ),
    (
        "Privileged is true; OOMKilled reason; 5 readonly-mount specs; 3 mount-propagation "
        "specs; a seccomp profile ignored when privileged (11)",
        "refused: privileged pods (gVisor gives a pod no host devices or capabilities; "
        "these specs make their pod privileged)",
    ),
    (
        "HostPID; HostIpc is true; HostNetwork is true; portforward in host network (4)",
        "refused: the host's PID, IPC and network namespaces (the pod runs in gVisor's own kernel)",
    ),
    (
        "safe sysctls; unsafe sysctls",
        "gVisor's /proc/sys has no kernel.shm_rmid_forced, no fs.mqueue",
    ),
    (
        "listing pod sandbox metrics",
        "a container's processes live in gVisor's kernel, not the host's: no file "
        "descriptor, socket or memory-limit figures per container",
    ),
    ("adding capability (`brctl addbr`)", "gVisor has no bridge ioctls"),
    ("dropping capability (`ping`)", "gVisor has no raw sockets unless runsc runs with --net-raw"),
    ("ReadonlyPaths", "runsc leaves the spec's readonlyPaths writable"),
    (
        "SupplementalGroupsPolicy Merge",
        "gVisor lists the supplementary groups in another order (1000 50000 1234)",
    ),
    (
        "NoNewPrivs: allow privilege escalation when false",
        "gVisor does not honour the image's set-user-ID file",
    ),
    (
        "seccomp default; seccomp localhost profile; a profile that blocks sethostname (3)",
        "runsc applies no OCI seccomp profile to the pod's containers (with --oci-seccomp "
        "neither), and its /proc shows no Seccomp mode",
    ),
)


_GVISOR_UPDATES = """\
UpdateContainerResources under gVisor: runsc (before 2026) has no `update`, and gVisor's
kernel neither gives a container a cgroup of its own (all of a sandbox's tasks share its
root cgroup) nor enforces the memory and CPU values of its cgroupfs (stubs, and only with
`--cgroupfs`): no container has a limit of its own inside gVisor. Every process of the
pod runs in the Sentry and its gofers, host processes in the host cgroup of the pod's
sandbox container (`<cgroup_parent>/cri-shim-<pod ID>`). So the daemon writes host
cgroups itself: the sandbox's gets the pod's total (the sum of its containers' memory,
swap, pids and CPU quota limits, unlimited where one container is unlimited; the sum of
their CPU shares; the union of their CPU sets, the parent's where one has none; plus
the pod's overhead from kubelet, `linux.overhead`, as kubelet sizes the pod's cgroup),
again at each update and each container's creation; the container's own host cgroup (which
runsc makes for tools such as cAdvisor, with no process in it) gets its limits as given;
its spec (`linux.resources`, ContainerStatus verbose `runtimeSpec`) records them. The
kernel enforces the total on the pod as a whole: a pod at its memory limit loses its
sandbox to the host's OOM killer, every container with it; CPU is throttled for the pod.
gVisor's own memory (Sentry, gofers) counts against that total, as it counts against
kubelet's pod cgroup above it: give gVisor's RuntimeClass an overhead for it. Refused
by name: `unified` and block-I/O settings (no sum of them means anything); hugepage
limits are ignored (gVisor's kernel takes no host hugepages).

"""


_NETSTACK = """\
gVisor's own network stack (netstack, runsc's default `--network=sandbox`) is not tested
here: this runsc cannot run it on this kernel. Before it starts netstack, runsc
2022-12-19 tells the host's network namespace from another by whether
`/proc/sys/net/core/rmem_default` exists, which only the initial namespace had before
Linux 6.11; from 6.11 every namespace has it, so `runsc start` of the pod's sandbox
fails with "cannot run with network enabled in root network namespace", and
RunPodSandbox answers FAILED_PRECONDITION naming the handler and both ways out (a newer
runsc, or `--network=host`). Untested therefore: netstack taking over the interfaces,
addresses and routes CNI set up in the pod's namespace, the port-forward relay reaching
a pod's loopback inside netstack, and critest's network specs under it.

"""

_KATA = """\
Kata Containers: a handler whose `path` is named `kata-runtime` or
`containerd-shim-kata-v2` gets `pod_sandbox` (the sandbox container starts the pod's VM,
which its containers join), and Status lists it without the host's PID, IPC and network
namespaces, which are refused by name as under gVisor; privileged pods are not refused.
Nothing else is specific to Kata, and none of it is tested: no Kata is installed here
(Debian packages none) and this machine's CPU advertises no virtualisation (no vmx or
svm). cri-shim drives a runtime through the OCI command line under conmon (`create`,
`start`, `state`, `kill`, `delete`, `exec`, `update`): Kata 1.x's `kata-runtime` has
those commands, but Kata 2.0 removed them (its `kata-runtime` checks and diagnoses), and
`containerd-shim-kata-v2` speaks containerd's shim v2 API over ttrpc, not the OCI command
line; so with Kata 2 or later the handler is recognised, and its pods cannot start.
"""


def runtime_handlers_markdown() -> str:
    tally = "\n".join(f"| {name} | {p} | {f} | {s} |" for name, p, f, s in CRITEST_TALLY)
    failures = "\n".join(f"| {spec} | {why} |" for spec, why in CRITEST_RUNSC_FAILURES)
    return f"""
## Runtime handlers

`[runtime.handlers.NAME]` names a runtime a pod can ask for (`runtime_handler`, kubelet's
RuntimeClass); `Status.runtime_handlers` lists each with what it supports. A pod that
names none runs under `[runtime] default_handler` (`runc`): set it to a gVisor handler
to run such pods under gVisor, kubelet's static pods among them (without an API server
they cannot name a RuntimeClass).

- **runc, crun**: a pod is its pinned namespaces and a directory; no process runs for it
  unless it shares its PID namespace (then the static pause program is its PID 1).
- **gVisor (`runsc`), Kata** (`pod_sandbox`, on by default for those kinds): the pod
  is one sandbox. RunPodSandbox starts the pod's sandbox container (the static pause
  program, `io.kubernetes.cri.container-type: sandbox`) through the handler under conmon,
  in the pod's network namespace once CNI has set it up; the pod's containers join it
  (`container`, `io.kubernetes.cri.sandbox-id`), and StopPodSandbox removes it once they
  have stopped. (Kata is recognised by its binaries' names; only gVisor is tested here,
  see below.) Its steps are journaled like every other (`pause_delete`), with fault
  points `sandbox:pod-sandbox-journaled`, `-created`, `-started`; a restart adopts it.

`path = "/usr/bin/runsc"` is all gVisor needs, except on Linux 6.11 and newer with a runsc
released before August 2024 (Debian's is 2022-12-19): there runsc mistakes every network
namespace for the host's and refuses to start its own network stack, and RunPodSandbox
says so. `runtime_args = ["--network=host"]` then gives the pod the kernel's network
stack in its own namespace (the pod keeps its namespace and address; its sockets are the
kernel's). A dial from the node's side of the namespace never arrives in gVisor's own
network stack, so port-forward goes through the sandbox: `runsc exec` of busybox's `nc`
(the static `/bin/busybox` of busybox-static, bound read-only into the sandbox container)
to 127.0.0.1:port inside the pod, its stdio the connection. Without that program, and
without `--network=host`, port-forward is refused naming the handler.

{_NETSTACK}conmon cannot wait for a gVisor container (its processes are not the host's): conmon
runs runsc through a generated script that, for a container joining a sandbox, starts a
waiter (`runsc wait`) conmon waits for instead, and whose streams the container gets
when it starts. ExecSync and exec run as the container's user (runsc's exec would run as
root); a command past its timeout, or a streaming exec whose client went away, is killed
inside the sandbox by its pids there (a host signal never reaches it), with its
descendants and its process group and session: one `runsc exec` of busybox's shell in
the sandbox container (the program the relay uses) stops them all, then kills them at
once, whatever their number; at most two such kills run at once on the node. Without
that program, runsc signals one pid per call: four calls at a time, and past 64
processes (or for a tree still growing after 20 looks) the container is killed whole.
What the daemon starts for an exec runs without its OOM protection. Exec with a
terminal gets one from runsc's console socket (`runsc exec --detach --console-socket`:
runsc has no `--tty`, the socket is its terminal option): runsc sends the master of a
host pty whose replica gVisor's kernel takes as the command's controlling terminal, so
`[ -t 0 ]`, line editing, echo and resizing (`stty size`) work; `tty` prints "not a
tty", as gVisor names that terminal `host:[N]`, not `/dev/pts/N`. Refused under gVisor,
naming the handler: the host's PID, IPC and network namespaces, privileged pods and
containers, user namespaces.

{_GVISOR_UPDATES}`Status.runtime_handlers` lists runsc with neither recursive read-only mounts
nor user namespaces.

{_KATA}
critest with `--runtime-handler=runsc` (`runtime_args = ["--network=host"]`), beside the
default handler:

| handler | passed | failed | skipped |
|---|---|---|---|
{tally}

Skipped under runsc: 9 AppArmor specs (AppArmor is off on the test host, as under runc),
6 user-namespace specs (runsc maps no user namespace), 5 not selected (as under runc).
What fails under runsc, and why:

| spec | why |
|---|---|
{failures}
"""
