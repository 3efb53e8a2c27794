"""Reading a grant that is still being made: what ``status()``, ``scan()`` and
``leader()`` wait for before they report it.

A backend's grant can become visible in steps: the SQL backends and Memcached take the
lock first and write its token and holder record in the same request's next statement
(or the next request, for a queued waiter); Redlock's nodes each count their own token
until the acquirer has raised them to one. A read that lands between the steps sees a
lock held with no token, no holder record, or tokens the nodes do not agree on yet. Such
a read is made again after a moment, for :data:`SETTLE` seconds at most; after that it is
reported as it was seen (a lock taken outside aiolock never shows a record).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from .abc import Kind, LockInfo

__all__ = ["SETTLE", "in_progress", "settled"]

T = TypeVar("T")

#: How long a read waits for a grant in progress to show whole (seconds).
SETTLE = 0.25
#: The pause between two reads of a grant in progress (seconds).
STEP = 0.005

#: Families whose holder has a token of its own (one holder at a time).
_EXCLUSIVE = frozenset({Kind.LOCK.family, Kind.LEADER.family})


def in_progress(info: LockInfo, holders: bool) -> bool:
    """``info`` shows an exclusive lock held with no token yet, or, on a backend that
    keeps holder records (``holders``), with none yet."""
    if not info.held or info.family not in _EXCLUSIVE:
        return False
    return info.token is None or (holders and not info.held_by)


async def settled(read: Callable[[], Awaitable[T]], unsettled: Callable[[T], bool]) -> T:
    """``read()`` again while ``unsettled`` says its answer shows a grant in progress, for
    :data:`SETTLE` seconds at most; the last answer."""
    answer = await read()
    deadline = time.monotonic() + SETTLE
    while unsettled(answer) and time.monotonic() < deadline:
        await asyncio.sleep(STEP)
        answer = await read()
    return answer
