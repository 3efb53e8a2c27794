"""The queue recipe shared by the backends that keep one ordered entry per claim
(ZooKeeper's sequential znodes, etcd's keys by create revision): pure, no I/O.

Given one family's entries of a name, oldest first, it decides who holds and, for an
entry that does not, which earlier entries it waits for -- Curator's
``StandardLockInternalsDriver.getsTheLock`` returning ``PredicateResults``. Mutex, leader,
writer, reader and semaphore differ only in data:

* lock, leader, writer: the first entry holds; a waiter watches the entry just before it;
* reader: every entry before the first writer holds (a waiting writer blocks later
  readers, so writers are not starved); a waiter watches the last writer before it;
* semaphore permit: the first ``limit`` entries hold (Curator's
  ``InterProcessSemaphoreV2``); a waiter watches the ``limit`` entries before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from ..abc import Kind

__all__ = ["Entry", "Verdict", "holders", "verdict", "watch_targets"]


class Entry(Protocol):
    """One claim in the queue: only its kind matters here."""

    @property
    def kind(self) -> Kind: ...


E = TypeVar("E", bound=Entry)


@dataclass(slots=True, frozen=True)
class Verdict(Generic[E]):
    """Whether the entry holds, and if not, the entries whose deletion may grant it."""

    holds: bool
    watch: list[E]


def holders(entries: Sequence[E], limit: int) -> list[E]:
    """The entries in a granted position (the holders, or the ones about to notice)."""
    if not entries:
        return []
    first = entries[0].kind
    if first is Kind.PERMIT:
        return list(entries[:limit])
    if first is not Kind.READ:  # lock, leader, writer: exclusive
        return [entries[0]]
    out = []
    for entry in entries:
        if entry.kind is Kind.WRITE:
            break
        out.append(entry)
    return out


def watch_targets(entries: Sequence[E], index: int, kind: Kind, limit: int) -> list[E]:
    """The entries whose deletion may grant the one at ``index`` (which does not hold)."""
    if kind is Kind.READ:
        for i in range(index - 1, -1, -1):
            if entries[i].kind is Kind.WRITE:
                return [entries[i]]
        return []
    if kind is Kind.PERMIT:
        return list(entries[max(0, index - limit) : index])
    return list(entries[index - 1 : index])


def verdict(entries: Sequence[E], index: int, limit: int) -> Verdict[E]:
    """Does the entry at ``index`` hold, and what does it watch if not."""
    me = entries[index]
    if me.kind is Kind.PERMIT:
        holds = index < limit
    elif me.kind is Kind.READ:
        holds = all(e.kind is not Kind.WRITE for e in entries[:index])
    else:
        holds = index == 0
    if holds:
        return Verdict(True, [])
    return Verdict(False, watch_targets(entries, index, me.kind, limit))
