"""CRI object names: the keys that make creation idempotent (DESIGN §2).

kubelet never sends these names. It sends metadata and expects the runtime to build the
same name from it every time, so that the retry of a timed-out RunPodSandbox or
CreateContainer lands on the same reservation instead of starting a second creation. The
format is the one kubelet's tooling, CRI-O and containerd all print, so that operators can
read a name in `crictl` and in logs alike.
"""

from __future__ import annotations

from cri_shim.errors import InvalidArgument

_PREFIX = "k8s"
# Sandboxes take the container slot of the name; "POD" is what every runtime puts there.
_SANDBOX_MARKER = "POD"


def sandbox_name(name: str, namespace: str, uid: str, attempt: int) -> str:
    """`k8s_POD_<name>_<namespace>_<uid>_<attempt>`: the key of a pod sandbox."""
    _check(name, "pod name", attempt)
    return _join(_SANDBOX_MARKER, name, namespace, uid, attempt)


def container_name(container: str, pod: str, namespace: str, uid: str, attempt: int) -> str:
    """`k8s_<container>_<pod>_<namespace>_<uid>_<attempt>`: the key of a container."""
    _check(container, "container name", attempt)
    return _join(container, pod, namespace, uid, attempt)


def _check(own_name: str, what: str, attempt: int) -> None:
    # An empty name or a negative attempt would still give a string, but one that another
    # object's metadata could produce too; refuse rather than risk two objects on one key.
    if not own_name:
        raise InvalidArgument(f"{what} must not be empty")
    if attempt < 0:
        raise InvalidArgument(f"attempt must not be negative (got {attempt})")


def _join(first: str, pod: str, namespace: str, uid: str, attempt: int) -> str:
    return "_".join((_PREFIX, first, pod, namespace, uid, str(attempt)))
