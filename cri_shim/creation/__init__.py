"""The idempotency core (DESIGN §2): CRI names, their registrar, and the coordinator that
reserves a name, runs its creation detached from the request, caches what a timed-out
request leaves behind and expires what nobody claims. Pure asyncio, no I/O of its own."""

from cri_shim.creation.coordinator import (
    CreationCoordinator,
    CreationHooks,
    Creator,
    NameInfo,
    Phase,
    Stage,
)
from cri_shim.creation.names import container_name, sandbox_name
from cri_shim.creation.registrar import NameRegistrar, NameTaken
from cri_shim.creation.statistics import (
    CreationObserver,
    CreationStatistics,
    CreationStats,
    InFlightInfo,
)

__all__ = [
    "CreationCoordinator",
    "CreationHooks",
    "CreationObserver",
    "CreationStatistics",
    "CreationStats",
    "Creator",
    "InFlightInfo",
    "NameInfo",
    "NameRegistrar",
    "NameTaken",
    "Phase",
    "Stage",
    "container_name",
    "sandbox_name",
]
