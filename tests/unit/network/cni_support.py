"""What the CNI tests read of a runner: the network configuration list it uses."""

from __future__ import annotations

from cri_shim.network.cni import CniNetwork


def network_name(net: CniNetwork) -> str:
    """Name of the network configuration list in use, "" when there is none (the list is
    read again first when its files changed, as every call to the runner does)."""
    net._refresh()
    return net._conf.name if net._conf is not None else ""
