"""Kata Containers: a VM per pod, which its containers join.

The pod gets a sandbox container (it starts the pod's VM); the VM's kernel runs the pod,
so the host's namespaces are not the pod's. Everything else is the OCI command line.
"""

from __future__ import annotations

from cri_shim.runtime.features import HandlerFeatures
from cri_shim.runtime.kinds.base import HandlerKind

KATA = HandlerFeatures(host_namespaces=False, engine="Kata VM")


class KataKind(HandlerKind):
    engine = KATA.engine
    pod_sandbox = True

    def features(self) -> HandlerFeatures:
        return KATA
