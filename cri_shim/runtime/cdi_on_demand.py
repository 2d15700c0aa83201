"""CDI loaded on first use: the registry of spec files (runtime/cdi.py) imported and built
only when a container first names a device."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cri_shim.api.v1 import api_pb2
from cri_shim.runtime.cdi_request import requested_devices

if TYPE_CHECKING:
    from cri_shim.runtime.cdi import CdiRegistry


class CdiOnDemand:
    """The CDI registry of `spec_dirs`, made when a container first names a device."""

    def __init__(self, spec_dirs: Sequence[Path]) -> None:
        self.spec_dirs = tuple(spec_dirs)
        self._registry: CdiRegistry | None = None

    def inject(self, spec: dict[str, Any], cfg: api_pb2.ContainerConfig) -> None:
        """Apply the edits of the devices `cfg` asks for to `spec`, in place."""
        if not requested_devices(cfg):
            return
        if self._registry is None:
            from cri_shim.runtime.cdi import CdiRegistry

            self._registry = CdiRegistry(self.spec_dirs)
        self._registry.inject(spec, cfg)
