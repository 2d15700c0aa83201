"""Clients that call the runtime without a pause and count the status codes they get
back: what kubelet's sync loops look like to the runtime across its restarts. Shared by
the socket-activation tests (tests/integration, tests/guest).

Calls are not retried: a restart the client notices shows as a code other than OK.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import grpc

from cri_shim.api.v1 import api_pb2, api_pb2_grpc
from tests.harness import pod_config
from tests.waiting import wait_until

# Long enough for a restart: a call made while no daemon serves waits for the next one.
CALL_TIMEOUT = 300


class LoopingClient:
    """`readers` threads calling Version and ListPodSandbox; with `pods`, one more that
    runs, stops and removes host-network pods, one after the other (kubelet's churn)."""

    def __init__(self, target: Path, readers: int = 4, pods: bool = False) -> None:
        self.codes: Counter[str] = Counter()
        self._target = f"unix://{target}"
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._read) for _ in range(readers)]
        if pods:
            self._threads.append(threading.Thread(target=self._churn_pods))

    def __enter__(self) -> LoopingClient:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def wait_for_calls(self, more_than: int) -> None:
        wait_until(lambda: self.codes["OK"] > more_than, timeout=120)

    def _call(self, call: Callable[..., object], request: object) -> object | None:
        try:
            reply = call(request, timeout=CALL_TIMEOUT)
            code = "OK"
        except grpc.RpcError as exc:
            reply, code = None, exc.code().name
        with self._lock:
            self.codes[code] += 1
        return reply

    def _read(self) -> None:
        with grpc.insecure_channel(self._target) as channel:
            runtime = api_pb2_grpc.RuntimeServiceStub(channel)
            while not self._stop.is_set():
                self._call(runtime.Version, api_pb2.VersionRequest())
                self._call(runtime.ListPodSandbox, api_pb2.ListPodSandboxRequest())

    def _churn_pods(self) -> None:
        node = api_pb2.NamespaceOption(network=api_pb2.NODE)
        linux = api_pb2.LinuxPodSandboxConfig(
            security_context=api_pb2.LinuxSandboxSecurityContext(namespace_options=node)
        )
        with grpc.insecure_channel(self._target) as channel:
            runtime = api_pb2_grpc.RuntimeServiceStub(channel)
            for index in itertools.count():
                if self._stop.is_set():
                    return
                config = pod_config(name=f"churn-{index}", uid=f"churn-{index}", linux=linux)
                reply = self._call(
                    runtime.RunPodSandbox, api_pb2.RunPodSandboxRequest(config=config)
                )
                if isinstance(reply, api_pb2.RunPodSandboxResponse):
                    pod = reply.pod_sandbox_id
                    self._call(
                        runtime.StopPodSandbox, api_pb2.StopPodSandboxRequest(pod_sandbox_id=pod)
                    )
                    self._call(
                        runtime.RemovePodSandbox,
                        api_pb2.RemovePodSandboxRequest(pod_sandbox_id=pod),
                    )
