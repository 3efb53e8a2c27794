"""A SQL backend's per-claim state, and the server lock names of a claim."""

from __future__ import annotations

import asyncio
import enum
import hashlib
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..abc import Waiter

__all__ = ["QUEUED_RECHECK", "ClaimState", "Renewal", "digest", "forget_listener", "result"]

T = TypeVar("T")
K = TypeVar("K")

#: A ``Busy.retry_after`` while a blocking wait is queued on the server: the wait itself
#: wakes the waiter; this only bounds an in-memory re-check.
QUEUED_RECHECK = 5.0


class Renewal(enum.IntEnum):
    """What a renewal statement found on the claim's own session."""

    GONE = 0  #: the lock is no longer held by this session
    HELD = 1  #: held, expiry restarted
    REVOKED = 2  #: held, but an operator deleted its holder row (``force_release``)


@dataclass(slots=True, eq=False)
class ClaimState:
    """What a SQL backend keeps on a :class:`Claim` (in ``claim.state["sql"]``).

    Invariants (asserted where they matter):

    * ``conn`` is not None only while this claim owns that connection: it is out of the
      pool, and its session holds ``keys[slot]`` (or held it until the server ended it);
      no other claim and no pooled request uses it.
    * ``op`` (a non-blocking attempt) and ``wait`` (a queued blocking wait) never run at
      once, and neither starts while ``conn`` is set.
    * ``abandoned`` is final: once set, no attempt or wait starts, and after
      :meth:`SQLBackend.abandon` returns ``conn`` is None for good.
    """

    keys: list[Any]  #: the server lock names: one, or one per semaphore slot
    conn: Any = None  #: the connection holding the lock once granted
    slot: int = 0  #: the index in ``keys`` of the one held (a semaphore's slot), else 0
    token: int = 0
    mutex: asyncio.Lock = field(default_factory=asyncio.Lock)  #: one statement at a time on conn
    op: asyncio.Task[Any] | None = None  #: an attempt in flight (shielded from cancellation)
    wait: asyncio.Task[Any] | None = None  #: a blocking wait queued on the server
    wait_ending: bool = False  #: that wait failed or was cancelled: it is cleaning up
    waiter: Waiter | None = None
    cleanup: asyncio.Task[None] | None = None
    release: asyncio.Task[bool] | None = None
    abandoned: bool = False

    @property
    def key(self) -> Any:
        """The server lock name held (or tried, for a single key)."""
        return self.keys[self.slot]


def digest(family: str, name: str, slot: int | None, size: int) -> bytes:
    """``blake2b(family NUL name [NUL slot])`` of ``size`` bytes: a server lock name that
    keeps the families (and a semaphore's slots) of one name apart."""
    text = f"{family}\0{name}" if slot is None else f"{family}\0{name}\0{slot}"
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=size).digest()


def result(task: asyncio.Task[T]) -> T | None:
    """A finished task's result; None if it was cancelled or failed (it logged why)."""
    if task.cancelled() or task.exception() is not None:
        return None
    return task.result()


def forget_listener(listeners: dict[K, set[Waiter]], key: K, waiter: Waiter) -> None:
    """Remove ``waiter`` from ``listeners[key]``, and the key once nobody listens."""
    waiters = listeners.get(key)
    if waiters is not None:
        waiters.discard(waiter)
        if not waiters:
            del listeners[key]
