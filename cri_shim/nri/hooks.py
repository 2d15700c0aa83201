"""What the pod and container lifecycles tell NRI plugins, and when.

Each event a plugin sees about an object is tied to the object's undo journal: before a
plugin first hears of a pod (RunPodSandbox) or a container (CreateContainer), the events
that end its life for the plugin (StopPodSandbox, RemovePodSandbox, RemoveContainer) are
recorded as undo steps. A creation that fails, a cached object that expires unclaimed, a
removal and a restart that rolls back an interrupted creation all run the journal, so a
plugin hears of the end exactly once, whichever way the object goes. A kubelet retry
answered from the creation cache creates nothing, so the plugin hears nothing new.
A RemoveContainer drops its step where it picks its plugins, and a removed container is
hidden before: a plugin that connects during a removal is synchronized with the container
only if it will hear of its removal. A RemovePodSandbox drops its step there too, and the
pod, which stays listed until its teardown ends, is left out of a connecting plugin's
Synchronize from that moment (`removing_pod`).

Events that can refuse (RunPodSandbox, CreateContainer, StartContainer, UpdateContainer)
fail the call
with the plugin's message; the others only inform, and a plugin's error is logged.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from google.protobuf.message import Message as ProtoMessage

from cri_shim.errors import FailedPrecondition
from cri_shim.nri.actions import CONTAINER_REMOVED, CONTAINER_STOPPED, POD_REMOVED, POD_STOPPED
from cri_shim.nri.adaptation import Adaptation
from cri_shim.nri.api import api_pb2
from cri_shim.nri.ttrpc import CallError
from cri_shim.state.journal import Journal

log = logging.getLogger("cri_shim.nri")


Reply = TypeVar("Reply", bound=ProtoMessage)
Adjustments = list[tuple[str, api_pb2.ContainerAdjustment]]


class PluginRefused(FailedPrecondition):
    """An NRI plugin failed the pod's or container's creation or start."""


def _encoded(message: ProtoMessage) -> str:
    return base64.b64encode(message.SerializeToString()).decode()


def _decoded(text: str, message: Reply) -> Reply:
    message.ParseFromString(base64.b64decode(text))
    return message


class NriHooks:
    def __init__(self, journal: Journal, adaptation: Adaptation | None = None) -> None:
        self.adaptation = adaptation
        self._journal = journal
        # Registered whether NRI is on or not: a journal written while it was on is
        # replayed after a restart with it off (then the steps inform nobody).
        journal.register(POD_STOPPED, self._undo_pod_stopped)
        journal.register(POD_REMOVED, self._undo_pod_removed)
        journal.register(CONTAINER_REMOVED, self._undo_container_removed)
        journal.register(CONTAINER_STOPPED, self._undo_container_stopped)
        # StopContainer for containers whose exit was noticed, one task per container.
        self._stopping: dict[str, asyncio.Task[None]] = {}
        # The pods RemovePodSandbox is removing, and whether their RemovePodSandbox has
        # picked its plugins (a plugin enrolled after that would never hear of it).
        self._removing: dict[str, bool] = {}

    @property
    def enabled(self) -> bool:
        return self.adaptation is not None

    async def _call(
        self,
        event: int,
        method: str,
        request: ProtoMessage,
        reply: type[Reply],
        refusable: bool,
        journal: Callable[[], None] = lambda: None,
    ) -> list[tuple[str, Reply]]:
        if self.adaptation is None:
            return []
        try:
            # Journaled where the event picks its plugins: a plugin connecting now finds
            # the object either in its snapshot or in this event, not both.
            answers = await self.adaptation.call_plugins(event, method, request, reply, journal)
        except CallError as e:
            if refusable:
                raise PluginRefused(f"{method}: {e.message}") from e
            log.warning("NRI %s: %s", method, e.message)
            return []
        return [(plugin.id, answer) for plugin, answer in answers]

    # ---- pods ------------------------------------------------------------------------

    async def run_pod(self, pod: api_pb2.PodSandbox) -> None:
        if self.adaptation is None:
            return

        def journal() -> None:
            self._journal.record(pod.id, POD_REMOVED, pod=_encoded(pod))
            self._journal.record(pod.id, POD_STOPPED, pod=_encoded(pod))

        request = api_pb2.RunPodSandboxRequest(pod=pod)
        await self._call(
            api_pb2.RUN_POD_SANDBOX,
            "RunPodSandbox",
            request,
            api_pb2.RunPodSandboxResponse,
            True,
            journal,
        )

    async def _undo_pod_stopped(self, args: dict[str, Any]) -> None:
        await self._tell(api_pb2.STOP_POD_SANDBOX, pod=_decoded(args["pod"], api_pb2.PodSandbox()))

    async def _undo_pod_removed(self, args: dict[str, Any]) -> None:
        pod = _decoded(args["pod"], api_pb2.PodSandbox())

        def journal() -> None:
            # Where the event picks its plugins: a plugin enrolled from here on is not
            # synchronized with the pod, listed or not, since it will not hear of its end.
            self._journal.discharge(pod.id, POD_REMOVED)
            if pod.id in self._removing:
                self._removing[pod.id] = True

        await self._call(
            api_pb2.REMOVE_POD_SANDBOX,
            "RemovePodSandbox",
            api_pb2.RemovePodSandboxRequest(pod=pod),
            api_pb2.RemovePodSandboxResponse,
            False,
            journal,
        )

    @contextlib.contextmanager
    def removing_pod(self, pod_id: str) -> Iterator[None]:
        """RemovePodSandbox's teardown of a listed pod: from the moment its
        RemovePodSandbox picks its plugins until the block ends (when the pod is no longer
        listed), `removal_told` says so and the pod is left out of Synchronize."""
        self._removing[pod_id] = False
        try:
            yield
        finally:
            self._removing.pop(pod_id, None)

    def removal_told(self, pod_id: str) -> bool:
        return self._removing.get(pod_id, False)

    # ---- containers ------------------------------------------------------------------

    async def create_container(
        self, pod: api_pb2.PodSandbox, container: api_pb2.Container
    ) -> Adjustments:
        """The plugins' adjustments to the container, in plugin order."""
        if self.adaptation is None:
            return []

        def journal() -> None:
            self._journal.record(
                container.id, CONTAINER_REMOVED, pod=_encoded(pod), container=_encoded(container)
            )

        request = api_pb2.CreateContainerRequest(pod=pod, container=container)
        answers = await self._call(
            api_pb2.CREATE_CONTAINER,
            "CreateContainer",
            request,
            api_pb2.CreateContainerResponse,
            True,
            journal,
        )
        for plugin, answer in answers:
            if answer.update or answer.evict:
                log.warning(
                    "NRI plugin %s: updates and evictions of other containers during a "
                    "creation are not applied",
                    plugin,
                )
        return [(plugin, answer.adjust) for plugin, answer in answers if answer.HasField("adjust")]

    async def update_pod(
        self,
        pod: api_pb2.PodSandbox,
        overhead: api_pb2.LinuxResources | None,
        resources: api_pb2.LinuxResources | None,
    ) -> None:
        """UpdatePodSandbox (an in-place pod resize), which plugins may refuse."""
        request = api_pb2.UpdatePodSandboxRequest(pod=pod)
        if overhead is not None:
            request.overhead_linux_resources.CopyFrom(overhead)
        if resources is not None:
            request.linux_resources.CopyFrom(resources)
        await self._call(
            api_pb2.UPDATE_POD_SANDBOX,
            "UpdatePodSandbox",
            request,
            api_pb2.UpdatePodSandboxResponse,
            True,
        )

    async def pod_updated(self, pod: api_pb2.PodSandbox) -> None:
        """PostUpdatePodSandbox: the resize was applied."""
        await self._tell(api_pb2.POST_UPDATE_POD_SANDBOX, pod=pod)

    async def update_container(
        self,
        pod: api_pb2.PodSandbox,
        container: api_pb2.Container,
        resources: api_pb2.LinuxResources,
    ) -> list[tuple[str, api_pb2.LinuxResources]]:
        """UpdateContainer, which may refuse: the plugins' changes to this container's
        update, in plugin order."""
        request = api_pb2.UpdateContainerRequest(
            pod=pod, container=container, linux_resources=resources
        )
        answers = await self._call(
            api_pb2.UPDATE_CONTAINER,
            "UpdateContainer",
            request,
            api_pb2.UpdateContainerResponse,
            True,
        )
        changes: list[tuple[str, api_pb2.LinuxResources]] = []
        for plugin, answer in answers:
            for update in answer.update:
                if update.container_id == container.id:
                    changes.append((plugin, update.linux.resources))
                else:
                    log.warning(
                        "NRI plugin %s: updates of other containers during an update are "
                        "not applied",
                        plugin,
                    )
            if answer.evict:
                log.warning("NRI plugin %s: evictions are not applied", plugin)
        return changes

    def announced(self) -> tuple[dict[str, api_pb2.PodSandbox], dict[str, api_pb2.Container]]:
        """The pods and containers plugins were told of and not yet told the end of, as
        they were told; visible or not (in flight, or in the creation cache)."""
        pods = {
            step.object_id: _decoded(step.args["pod"], api_pb2.PodSandbox())
            for step in self._journal.steps_named(POD_REMOVED)
        }
        containers = {
            step.object_id: _decoded(step.args["container"], api_pb2.Container())
            for step in self._journal.steps_named(CONTAINER_REMOVED)
        }
        return pods, containers

    async def _undo_container_removed(self, args: dict[str, Any]) -> None:
        request = api_pb2.RemoveContainerRequest(
            pod=_decoded(args["pod"], api_pb2.PodSandbox()),
            container=_decoded(args["container"], api_pb2.Container()),
        )

        def journal() -> None:
            # Where the event picks its plugins: a plugin enrolled from here on is not
            # synchronized with a container whose removal it would not hear of.
            self._journal.discharge(request.container.id, CONTAINER_REMOVED)

        await self._call(
            api_pb2.REMOVE_CONTAINER,
            "RemoveContainer",
            request,
            api_pb2.RemoveContainerResponse,
            False,
            journal,
        )

    async def _undo_container_stopped(self, args: dict[str, Any]) -> None:
        await self._tell(api_pb2.STOP_CONTAINER, **_pod_and_container(args))

    async def start_container(self, pod: api_pb2.PodSandbox, container: api_pb2.Container) -> None:
        """StartContainer, which may refuse; from here on the container's end includes a
        StopContainer, sent once when it stops or exits."""
        if self.adaptation is None:
            return
        self._journal.record(
            container.id, CONTAINER_STOPPED, pod=_encoded(pod), container=_encoded(container)
        )
        await self.container_event(api_pb2.START_CONTAINER, pod, container)

    def container_exited(self, container_id: str) -> None:
        """The container's process is gone: tell plugins (StopContainer) without holding
        up whoever noticed (the exit watcher, a status call)."""
        if self.adaptation is None or container_id in self._stopping:
            return
        task = asyncio.get_running_loop().create_task(
            self._journal.undo(container_id, only=(CONTAINER_STOPPED,))
        )
        self._stopping[container_id] = task
        task.add_done_callback(lambda _: self._stopping.pop(container_id, None))

    async def settle(self, container_id: str) -> None:
        """Wait until plugins have heard of the container's exit, if they are hearing."""
        task = self._stopping.get(container_id)
        if task is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(task)

    async def removed(self, container_id: str) -> None:
        """The container is being removed: StopContainer (if its exit is still being
        told) then RemoveContainer, once each, from its journal."""
        await self.settle(container_id)
        await self._journal.undo(container_id, only=(CONTAINER_STOPPED, CONTAINER_REMOVED))

    async def close(self) -> None:
        for task in list(self._stopping.values()):
            task.cancel()
        await asyncio.gather(*self._stopping.values(), return_exceptions=True)

    async def container_event(
        self, event: int, pod: api_pb2.PodSandbox, container: api_pb2.Container
    ) -> None:
        """PostCreate, Start (which may refuse), PostStart and PostUpdate."""
        await self._tell(event, pod=pod, container=container)

    async def _tell(self, event: int, **fields: ProtoMessage) -> None:
        method, request_type, reply_type = _EVENTS[event]
        request = request_type(**fields)
        await self._call(event, method, request, reply_type, event == api_pb2.START_CONTAINER)


def _pod_and_container(args: dict[str, Any]) -> dict[str, ProtoMessage]:
    return {
        "pod": _decoded(args["pod"], api_pb2.PodSandbox()),
        "container": _decoded(args["container"], api_pb2.Container()),
    }


# The events that only inform (and StartContainer): method, request and reply types.
_EVENTS: dict[int, tuple[str, Any, type[ProtoMessage]]] = {
    api_pb2.STOP_POD_SANDBOX: (
        "StopPodSandbox",
        api_pb2.StopPodSandboxRequest,
        api_pb2.StopPodSandboxResponse,
    ),
    api_pb2.REMOVE_POD_SANDBOX: (
        "RemovePodSandbox",
        api_pb2.RemovePodSandboxRequest,
        api_pb2.RemovePodSandboxResponse,
    ),
    api_pb2.STOP_CONTAINER: (
        "StopContainer",
        api_pb2.StopContainerRequest,
        api_pb2.StopContainerResponse,
    ),
    api_pb2.REMOVE_CONTAINER: (
        "RemoveContainer",
        api_pb2.RemoveContainerRequest,
        api_pb2.RemoveContainerResponse,
    ),
    api_pb2.POST_CREATE_CONTAINER: (
        "PostCreateContainer",
        api_pb2.PostCreateContainerRequest,
        api_pb2.PostCreateContainerResponse,
    ),
    api_pb2.START_CONTAINER: (
        "StartContainer",
        api_pb2.StartContainerRequest,
        api_pb2.StartContainerResponse,
    ),
    api_pb2.POST_UPDATE_CONTAINER: (
        "PostUpdateContainer",
        api_pb2.PostUpdateContainerRequest,
        api_pb2.PostUpdateContainerResponse,
    ),
    api_pb2.POST_UPDATE_POD_SANDBOX: (
        "PostUpdatePodSandbox",
        api_pb2.PostUpdatePodSandboxRequest,
        api_pb2.PostUpdatePodSandboxResponse,
    ),
    api_pb2.POST_START_CONTAINER: (
        "PostStartContainer",
        api_pb2.PostStartContainerRequest,
        api_pb2.PostStartContainerResponse,
    ),
}
