"""Single-use tokens for the URLs that Exec, Attach and PortForward hand out.

A URL grants a shell in a container to whoever holds it, so it carries an unguessable
token that works once and expires a minute after it was issued if unused (as kubelet's
streaming package does). The requests are kept in memory only: a restarted daemon has a
new port anyway, so old URLs could not work.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from cri_shim.errors import ResourceExhausted

DEFAULT_TOKEN_TTL = 60.0
# Bounds memory if a client requests URLs in a loop without ever using them.
MAX_PENDING_TOKENS = 1000


@dataclass(frozen=True)
class ExecTarget:
    container_id: str
    cmd: tuple[str, ...]
    tty: bool
    stdin: bool
    stdout: bool
    stderr: bool


@dataclass(frozen=True)
class AttachTarget:
    container_id: str
    tty: bool
    stdin: bool
    stdout: bool
    stderr: bool


@dataclass(frozen=True)
class PortForwardTarget:
    sandbox_id: str
    ports: tuple[int, ...]


StreamTarget = ExecTarget | AttachTarget | PortForwardTarget


@dataclass
class _Entry:
    target: StreamTarget
    expires_at: float


class TokenCache:
    """Tokens to targets. Safe to call from any thread (gRPC handlers may run in threads)."""

    def __init__(
        self,
        ttl: float = DEFAULT_TOKEN_TTL,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_pending: int = MAX_PENDING_TOKENS,
    ) -> None:
        self._ttl = ttl
        self._clock = clock
        self._max_pending = max_pending
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def insert(self, target: StreamTarget) -> str:
        with self._lock:
            self._expire()
            if len(self._entries) >= self._max_pending:
                raise ResourceExhausted(
                    f"{len(self._entries)} streaming URLs are pending; "
                    "use or let some expire before asking for more"
                )
            token = secrets.token_urlsafe(16)
            self._entries[token] = _Entry(target, self._clock() + self._ttl)
            return token

    def consume(self, token: str) -> StreamTarget | None:
        """The target, once: later calls, and calls after expiry, return None."""
        with self._lock:
            self._expire()
            entry = self._entries.pop(token, None)
            return entry.target if entry is not None else None

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._entries)

    def _expire(self) -> None:
        now = self._clock()
        # Entries are in insertion order and share one TTL, so expired ones are at the front.
        while self._entries:
            token, entry = next(iter(self._entries.items()))
            if entry.expires_at > now:
                break
            del self._entries[token]
