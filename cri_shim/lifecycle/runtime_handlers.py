"""The runtime handlers containers run under: a handler's backend, and what it supports."""

from __future__ import annotations

from cri_shim.errors import FailedPrecondition
from cri_shim.runtime.conmon import RuntimeBackend
from cri_shim.runtime.features import HandlerFeatures
from cri_shim.state.records import ContainerRecord
from cri_shim.state.sandboxes import SandboxRepository


class RuntimeHandlers:
    """The configured handlers by name; "" is the default handler."""

    def __init__(
        self,
        backends: dict[str, RuntimeBackend],
        default_handler: str,
        pod_rows: SandboxRepository,
    ) -> None:
        self.backends = backends
        self._default = default_handler
        # A container runs under its pod's handler, which only the pod's row records.
        self._pod_rows = pod_rows

    def backend(self, handler: str) -> RuntimeBackend:
        try:
            return self.backends[handler or self._default]
        except KeyError:
            raise FailedPrecondition(f"runtime handler {handler!r} is not configured") from None

    def backend_of(self, container: ContainerRecord) -> RuntimeBackend:
        return self.backend(self._pod_rows.runtime_handler(container.sandbox_id) or self._default)

    def features_of(self, handler: str) -> HandlerFeatures:
        """What a runtime handler supports (probed once, then remembered)."""
        return self.backend(handler).kind.features()
