"""Port-forward into pods whose handler's kind serves the pod where a dial from the node's
side of its network namespace does not arrive (gVisor's own network stack): the relay
command the kind gives, or its refusal naming the handler. Other pods are dialled directly."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cri_shim.config.model import RuntimeConfig
from cri_shim.state.records import SandboxRecord


class SandboxForwarding:
    def __init__(self, backends: Mapping[str, Any], runtime: RuntimeConfig) -> None:
        self._backends = backends  # RuntimeBackend by handler name
        self._runtime = runtime

    def _handler_of(self, sandbox: SandboxRecord) -> tuple[str, Any, list[str]] | None:
        name = sandbox.runtime_handler or self._runtime.default_handler
        backend, handler = self._backends.get(name), self._runtime.handlers.get(name)
        if backend is None or handler is None:
            return None
        return name, backend, handler.runtime_args

    def check(self, sandbox: SandboxRecord) -> None:
        found = self._handler_of(sandbox)
        if found is not None:
            name, backend, runtime_args = found
            backend.kind.check_port_forward(name, runtime_args)

    def relay(self, sandbox: SandboxRecord, port: int) -> list[str] | None:
        found = self._handler_of(sandbox)
        if found is None:
            return None
        _, backend, runtime_args = found
        relay: list[str] | None = backend.kind.relay_argv(
            backend.oci.root, runtime_args, sandbox.id, port
        )
        return relay
