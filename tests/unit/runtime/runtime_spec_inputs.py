"""Inputs shared by the runtime unit tests: an image's passwd/group, request builders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cri_shim.api.v1 import api_pb2

STUB_DIR = Path(__file__).resolve().parents[3] / "conmon-stub"

PASSWD = """root:x:0:0:root:/root:/bin/sh
daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin
app:x:1000:1001:App:/home/app:/bin/sh
broken:line
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
"""
GROUP = """root:x:0:
daemon:x:1:
appgroup:x:1001:
audio:x:29:app,daemon
video:x:44:app
staff:x:50:
"""


def container_config(**fields: Any) -> api_pb2.ContainerConfig:
    """A ContainerConfig with a name and a command unless the test says otherwise."""
    cfg = api_pb2.ContainerConfig()
    cfg.metadata.name = "app"
    if "command" not in fields and "args" not in fields:
        fields["command"] = ["/bin/app"]
    for key, value in fields.items():
        if isinstance(value, list):
            getattr(cfg, key).extend(value)
        else:
            setattr(cfg, key, value)
    return cfg
