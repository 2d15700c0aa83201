"""Pinned pod namespaces (network, UTS, IPC, user) as bind-mounted files.

A sandbox's namespaces must outlive any process, so each is pinned by bind-mounting its
nsfs file onto an empty file under the run root; runc then joins them by path. All work
happens in one dedicated thread that `unshare`s, pins, and `setns`es back to the namespaces
it started in. Forking the daemon (what `ip netns` and pyroute2's `netns.create` do) costs
ten times more and is unsafe in a process that runs gRPC threads (DESIGN §6).

A pod with a user namespace of its own is the exception: the kernel lets no thread of a
multithreaded process `unshare` or `setns` a user namespace, so a helper process
(util-linux's `unshare` running `sleep`, spawned and exec'd, never a fork of the daemon)
unshares the user namespace together with the pod's network, UTS and IPC namespaces in
one call, and the kernel makes those owned by the new user namespace. The daemon sees the
helper's user namespace change, writes the mappings, sets the hostname and brings up `lo`
from its pinning thread (`setns` into those namespaces is allowed: the daemon's root is
privileged over every child user namespace), pins the four files and kills the helper. It
costs about 2 ms more than a pod without one (a Python helper took 22 ms).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import errno
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from cri_shim.errors import Internal, InvalidArgument
from cri_shim.host import mounts, netlink
from cri_shim.host.idmap import UserNamespaceMappings
from cri_shim.host.namespaces import (
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWUTS,
    sethostname,
    setns,
    unshare,
)

log = logging.getLogger(__name__)

_T = TypeVar("_T")

USERNS_DIR = "userns"
# util-linux's unshare(1) flag for each pinned kind (it makes them in one unshare call).
_UNSHARE_FLAGS = {"net": "--net", "uts": "--uts", "ipc": "--ipc"}
# How long the helper may take to make its namespaces; it takes about 2 ms.
_HELPER_TIMEOUT = 5.0
# HOST_NAME_MAX on Linux; sethostname fails with EINVAL beyond it.
_HOSTNAME_MAX = 64

# Namespace kind (its name under /proc/<tid>/ns) -> (pin directory under run_root, clone flag).
_KINDS: dict[str, tuple[str, int]] = {
    "net": ("netns", CLONE_NEWNET),
    "uts": ("utsns", CLONE_NEWUTS),
    "ipc": ("ipcns", CLONE_NEWIPC),
}


def _unlink_missing_ok(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


@dataclass
class PinnedNamespaces:
    """Paths of a sandbox's pinned namespaces; None where the pod shares the host's."""

    net: Path | None
    uts: Path | None
    ipc: Path | None
    user: Path | None = None

    def paths(self) -> list[Path]:
        return [p for p in (self.net, self.uts, self.ipc, self.user) if p is not None]


class _PinThread:
    """One worker thread that remembers the namespaces it started in.

    The thread changes its own namespaces for the length of a pin, so it must never run
    anything else at the same time; a single-thread executor gives that for free.
    """

    def __init__(self) -> None:
        self.home: dict[str, int] = {}
        # Set when the thread could not return to the host namespaces: it is then retired,
        # so that no later pin (or a pyroute2 socket) is ever made from a pod's namespace.
        self.stranded = False
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="ns-pinner", initializer=self._open_home
        )

    def _open_home(self) -> None:
        for kind in _KINDS:
            self.home[kind] = os.open(f"/proc/thread-self/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)

    def go_home(self, kinds: list[str]) -> None:
        for kind in kinds:
            setns(self.home[kind], _KINDS[kind][1], f"setns back to host {kind}")

    def close(self, wait: bool) -> None:
        self.executor.shutdown(wait=wait)
        if wait:
            for fd in self.home.values():
                os.close(fd)
            self.home.clear()


class NamespacePinner:
    """Creates, pins and removes pod namespaces under `run_root`."""

    def __init__(self, run_root: Path) -> None:
        self.run_root = Path(run_root)
        self._dirs = {kind: self.run_root / sub for kind, (sub, _) in _KINDS.items()}
        self._dirs["user"] = self.run_root / USERNS_DIR
        self._dirs_ready = False
        self._lock = threading.Lock()
        self._thread: _PinThread | None = _PinThread()

    # ---- public async API -------------------------------------------------------------

    async def pin(
        self,
        pod_id: str,
        *,
        net: bool,
        uts: bool,
        ipc: bool,
        hostname: str,
        userns: UserNamespaceMappings | None = None,
    ) -> PinnedNamespaces:
        """Create the requested namespaces and pin them as `<run_root>/<kind>ns/<pod_id>`.

        Either every requested namespace is pinned or nothing is left behind. `hostname` is
        set in the new UTS namespace and ignored when `uts` is false. With `userns`, a new
        user namespace with those mappings is pinned too, and owns the others.
        """
        _validate_pod_id(pod_id)
        kinds = [k for k, wanted in (("net", net), ("uts", uts), ("ipc", ipc)) if wanted]
        if uts:
            _validate_hostname(hostname)
        if userns is not None:
            mappings = userns
            return await self._run(
                lambda thread: self._pin_in_thread(thread, pod_id, kinds, hostname, mappings),
                undo=self._undo_pin,
            )
        if not kinds:
            return PinnedNamespaces(None, None, None)
        return await self._run(
            lambda thread: self._pin_in_thread(thread, pod_id, kinds, hostname),
            undo=self._undo_pin,
        )

    async def unpin(self, path: Path) -> None:
        """Unmount and remove one pin. A pin that is already gone counts as removed."""
        path = Path(path)
        if path.parent not in self._dirs.values() or path.name in ("", ".", ".."):
            raise InvalidArgument(f"{path} is not a namespace pin under {self.run_root}")
        await self._run(lambda _thread: _unpin_now(path))

    def pinned(self) -> list[Path]:
        """Every pin file under run_root, mounted or not, for the orphan scan at start."""
        found: list[Path] = []
        for directory in self._dirs.values():
            try:
                found.extend(p for p in directory.iterdir() if not p.is_dir())
            except FileNotFoundError:
                continue
        return sorted(found)

    def close(self) -> None:
        """Stop the worker thread after pending work. Pins stay: they belong to live pods."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.close(wait=True)

    # ---- thread plumbing --------------------------------------------------------------

    async def _run(
        self,
        work: Callable[[_PinThread], _T],
        undo: Callable[[_T], None] | None = None,
    ) -> _T:
        with self._lock:
            if self._thread is None:
                raise Internal("namespace pinner is closed")
            thread = self._thread
            # In the caller's context, so that the thread's log lines are about its pod.
            context = contextvars.copy_context()
            future = thread.executor.submit(context.run, self._guarded, thread, work)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # A running syscall sequence cannot be interrupted. Queue the undo behind it on
            # the same thread so that a cancelled pin leaks nothing and nobody has to wait.
            if undo is not None and not future.cancelled():
                try:
                    thread.executor.submit(_undo_after, future, undo)
                except RuntimeError:  # the thread was retired meanwhile: undo right here
                    _undo_after(future, undo)
            raise

    def _guarded(self, thread: _PinThread, work: Callable[[_PinThread], _T]) -> _T:
        if thread.stranded:
            raise Internal("namespace pinner thread was retired; try again")
        try:
            return work(thread)
        finally:
            if thread.stranded:
                with self._lock:
                    if self._thread is thread:
                        self._thread = _PinThread()
                thread.close(wait=False)

    def _undo_pin(self, pins: PinnedNamespaces) -> None:
        for path in pins.paths():
            _unpin_now(path)

    # ---- work done in the pinning thread ----------------------------------------------

    def _ensure_dirs(self) -> None:
        """Make every pin directory a shared mount point, as `ip netns` does for /run/netns.

        With shared propagation, unmounting a pin also unmounts the copies that mount
        namespaces created meanwhile (containers, services with a private /tmp) hold;
        without it such a copy would keep the namespace, its veth and its IP alive.

        Each is a peer group of its own. A bind of a directory on a shared `/` (every
        systemd node) joins `/`'s group: every pin would then be mounted twice (once
        hidden under the directory, on `/`) and copied wherever `/` is copied. So a fresh
        one is made private before it is made shared. (A copy of the directory, a host
        path mount of `/run` say, is still a peer: runtime/mount_sources.py keeps it from
        passing unmounts back.)
        """
        if self._dirs_ready:
            return
        for directory in self._dirs.values():
            directory.mkdir(parents=True, exist_ok=True, mode=0o755)
            propagation = mounts.propagation(directory.resolve())
            if propagation is None:
                mounts.mount(str(directory), directory, None, mounts.MS_BIND | mounts.MS_REC)
                mounts.mount(None, directory, None, mounts.MS_PRIVATE)
                propagation = ""
            if "shared:" not in propagation:
                mounts.mount(None, directory, None, mounts.MS_SHARED | mounts.MS_REC)
        self._dirs_ready = True

    def _pin_in_thread(
        self,
        thread: _PinThread,
        pod_id: str,
        kinds: list[str],
        hostname: str,
        userns: UserNamespaceMappings | None = None,
    ) -> PinnedNamespaces:
        try:
            self._ensure_dirs()
        except OSError as exc:
            raise Internal(f"cannot prepare namespace pin directories: {exc}") from exc

        pinned = [*kinds, "user"] if userns is not None else kinds
        targets = {kind: self._dirs[kind] / pod_id for kind in pinned}
        created: list[Path] = []
        mounted: list[Path] = []
        failure: BaseException | None = None
        try:
            for target in targets.values():
                if os.path.ismount(target):
                    raise Internal(f"namespace pin {target} already exists")
                os.close(os.open(target, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o444))
                created.append(target)
            if userns is None:
                self._unshare_and_pin(thread, kinds, hostname, targets, mounted)
            else:
                self._pin_from_helper(thread, kinds, hostname, userns, targets, mounted)
        except BaseException as exc:
            failure = exc

        if failure is None:
            return PinnedNamespaces(
                net=targets.get("net"),
                uts=targets.get("uts"),
                ipc=targets.get("ipc"),
                user=targets.get("user"),
            )

        # Unmounting works from any network namespace: only the mount namespace matters,
        # and a thread never leaves the daemon's.
        for target in mounted:
            try:
                mounts.detach(target)
            except OSError:
                log.exception("undo of a failed pin: unmount %s", target)
        for target in created:
            _unlink_missing_ok(target)
        if isinstance(failure, Internal):
            raise failure
        raise Internal(f"pinning namespaces for pod {pod_id} failed: {failure}") from failure

    def _unshare_and_pin(
        self,
        thread: _PinThread,
        kinds: list[str],
        hostname: str,
        targets: dict[str, Path],
        mounted: list[Path],
    ) -> None:
        flags = 0
        for kind in kinds:
            flags |= _KINDS[kind][1]
        unshare(flags)
        try:
            if "uts" in kinds:
                sethostname(hostname.encode())
            if "net" in kinds:
                netlink.loopback_up()
            for kind, target in targets.items():
                mounts.mount(f"/proc/thread-self/ns/{kind}", target, None, mounts.MS_BIND)
                mounted.append(target)
        finally:
            _return_home(thread, kinds)

    def _pin_from_helper(
        self,
        thread: _PinThread,
        kinds: list[str],
        hostname: str,
        userns: UserNamespaceMappings,
        targets: dict[str, Path],
        mounted: list[Path],
    ) -> None:
        unshare = shutil.which("unshare")
        if unshare is None:
            raise OSError(errno.ENOENT, "unshare(1) from util-linux is not installed")
        helper = subprocess.Popen(
            [unshare, "--user", *(_UNSHARE_FLAGS[k] for k in kinds), "--", "sleep", "infinity"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            _wait_for_new_userns(helper)
            ns_dir = f"/proc/{helper.pid}/ns"
            for kind in ("uid", "gid"):
                with open(f"/proc/{helper.pid}/{kind}_map", "w") as map_file:
                    map_file.write(userns.map_text(kind))
            if "uts" in kinds:
                _inside(thread, "uts", f"{ns_dir}/uts", lambda: sethostname(hostname.encode()))
            if "net" in kinds:
                _inside(thread, "net", f"{ns_dir}/net", netlink.loopback_up)
            for kind, target in targets.items():
                mounts.mount(f"{ns_dir}/{kind}", target, None, mounts.MS_BIND)
                mounted.append(target)
        finally:
            _stop_helper(helper)


def _return_home(thread: _PinThread, kinds: list[str]) -> None:
    try:
        thread.go_home(kinds)
    except OSError:
        thread.stranded = True
        raise


def _inside(thread: _PinThread, kind: str, ns_path: str, work: Callable[[], None]) -> None:
    """Run `work` with the pinning thread in the namespace at `ns_path`, then return."""
    fd = os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns(fd, _KINDS[kind][1], f"setns {kind}")
    finally:
        os.close(fd)
    try:
        work()
    finally:
        _return_home(thread, [kind])


def _wait_for_new_userns(helper: subprocess.Popen[str]) -> None:
    """Until the helper is in a user namespace other than the daemon's (its one unshare
    call made them all), or has failed saying why."""
    own = os.readlink("/proc/self/ns/user")
    deadline = time.monotonic() + _HELPER_TIMEOUT
    pause = 0.0002
    while True:
        if helper.poll() is not None:
            stderr = helper.stderr.read().strip() if helper.stderr is not None else ""
            raise OSError(errno.EPERM, f"creating the user namespace: {stderr or 'failed'}")
        try:
            if os.readlink(f"/proc/{helper.pid}/ns/user") != own:
                return
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise OSError(errno.ETIMEDOUT, "creating the user namespace: unshare(1) hangs")
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def _stop_helper(helper: subprocess.Popen[str]) -> None:
    helper.kill()
    helper.wait()
    if helper.stderr is not None:
        helper.stderr.close()


def _unpin_now(path: Path) -> None:
    try:
        mounts.detach(path)
        _unlink_missing_ok(path)
    except OSError as exc:
        raise Internal(f"removing namespace pin {path} failed: {exc}") from exc


def _undo_after(future: concurrent.futures.Future[_T], undo: Callable[[_T], None]) -> None:
    try:
        result = future.result()
    except BaseException:
        return  # the pin failed, and a failed pin has already undone itself
    try:
        undo(result)
    except Exception:
        log.exception("undoing a cancelled namespace pin failed")


def _validate_pod_id(pod_id: str) -> None:
    if not pod_id or "/" in pod_id or pod_id in (".", "..") or "\0" in pod_id:
        raise InvalidArgument(f"invalid pod id for a namespace pin: {pod_id!r}")


def _validate_hostname(hostname: str) -> None:
    encoded = hostname.encode()
    if not encoded or len(encoded) > _HOSTNAME_MAX or "\0" in hostname:
        raise InvalidArgument(
            f"hostname {hostname!r} must be 1 to {_HOSTNAME_MAX} bytes for the pod's UTS namespace"
        )
