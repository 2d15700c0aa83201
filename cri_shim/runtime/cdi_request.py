"""The CDI devices a container's request names, read without loading CDI itself."""

from __future__ import annotations

from cri_shim.api.v1 import api_pb2

ANNOTATION_PREFIX = "cdi.k8s.io/"


def requested_devices(cfg: api_pb2.ContainerConfig) -> list[str]:
    """The devices a request asks for: CDI_devices first, then the annotations (sorted by
    key, for a stable order), each name once."""
    names = [device.name for device in cfg.CDI_devices]
    for key in sorted(cfg.annotations):
        if key.startswith(ANNOTATION_PREFIX):
            names.extend(n.strip() for n in cfg.annotations[key].split(",") if n.strip())
    return list(dict.fromkeys(names))
