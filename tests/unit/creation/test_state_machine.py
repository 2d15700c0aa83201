"""The creation contract as a state machine, explored by hypothesis in virtual time.

The machine (contract_machine.py) drives the coordinator; after every step the invariants
of DESIGN §2 are checked, each beside the part of the coordinator it holds for:

- contract_reservation.py: at most one creation per name at a time, the database agrees
  with memory, and every object nobody claimed is cleaned up exactly once, its name
  released after;
- contract_waiters.py: every request returns by its own deadline, at the moment the
  contract says, with an answer the contract allows; the hand-off and its recovery;
- contract_cache.py: an object handed to a client is never cleaned up, and an unclaimed
  one expires grace after the last deadline;
- contract_restore.py: restarts, and the fresh expiry of what they restore into the cache.
"""

from __future__ import annotations

from contract_cache import CacheContract
from contract_reservation import ReservationContract
from contract_restore import RestoreContract
from contract_waiters import WaiterContract
from hypothesis import HealthCheck, settings


class CreationContract(ReservationContract, WaiterContract, RestoreContract, CacheContract):
    """Every part's invariants, checked after every step of one machine."""


CreationContract.TestCase.settings = settings(
    max_examples=500,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCreationContract = CreationContract.TestCase
