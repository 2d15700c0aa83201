"""ExecSync in a container: `<runtime> exec` directly, as the container's process.

conmon's exec mode would add a process and a protocol for nothing that ExecSync needs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from cri_shim import tracing
from cri_shim.runtime.handler_runtime import HandlerRuntime
from cri_shim.runtime.oci import ExecResult


async def exec_sync(
    runtime: HandlerRuntime,
    container_id: str,
    cmd: Sequence[str],
    timeout: float | None,
    env: Mapping[str, str] | None = None,
) -> ExecResult:
    with tracing.span("exec", **{"cri.container_id": container_id}) as span:
        result = await runtime.oci.exec_sync(
            container_id,
            cmd,
            timeout,
            env,
            options=exec_options(runtime, container_id),
            inside=runtime.kind.inside,
        )
        span.set_attribute("process.exit.code", result.exit_code)
        return result


def exec_options(runtime: HandlerRuntime, container_id: str) -> list[str]:
    """Options of `<runtime> exec` that make the process the container's (runsc's
    exec needs the user spelled out)."""
    meta = runtime.files.read_meta(container_id)
    return runtime.kind.exec_options(Path(meta.bundle)) if meta is not None else []
