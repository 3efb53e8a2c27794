"""The watchdog: one loop per connection renews every held lease, in batches.

Each hold is renewed ``ttl/3`` after its last renewal was *sent*; holds that fall due
within ``ttl/12`` of the first one go out in the same request (up to :data:`MAX_BATCH`
claims per request). A reply moves a hold's expiry to ``sent + granted``; a reply that
says "gone" marks it lost; a failed request is retried soon, and if no renewal is
confirmed before the last confirmed expiry, the hold is lost at that instant -- except a
request the server refused (``AccessDenied``: a permission it lacks), which no retry can
mend: its holds are lost at once, with the server's refusal as the reason. Holds
acquired with ``watchdog=False`` are not renewed but still expire here.

The loop keeps holds, never leases (see :mod:`aiolock._lease`), in a heap by next event;
it sleeps until the next renewal or expiry is due and runs only while something is held.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any

from . import _telemetry
from ._lease import _Hold
from .abc import REVOKED, Backend
from .errors import AccessDenied

__all__ = ["MAX_BATCH", "Watchdog"]

log = logging.getLogger("aiolock.watchdog")

#: At most this many claims in one renewal request.
MAX_BATCH = 1000
#: Stale heap entries tolerated beyond the live ones before they are swept.
_COMPACT_SLACK = 64


class Watchdog:
    """Renews and expires the holds of one connection.

    Holds wait in a heap ordered by their next event (renewal due, or expiry); an entry
    is stale once its hold was rescheduled or untracked, and is skipped when popped.

    Invariants: only tracked holds (``_holds``) are scheduled; after each pass of the
    loop every tracked hold has exactly one live heap entry, the one whose time equals
    ``hold.sched`` (``nan`` while a pass handles it); the heap holds at most about twice
    as many entries as there are tracked holds (:meth:`untrack` sweeps stale ones,
    a stale entry keeping a dead hold alive); a hold whose renewal is in flight
    (``renewing``) is scheduled for its expiry only, so it is never renewed twice at once;
    the loop task runs while anything is tracked.
    """

    def __init__(
        self, backend: Backend,
        spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]],
    ) -> None:
        self._backend = backend
        self._spawn = spawn
        self._holds: set[_Hold] = set()
        self._heap: list[tuple[float, int, _Hold]] = []
        self._seq = itertools.count()
        self._task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Future[None] | None = None
        self._next = math.inf

    def __len__(self) -> int:
        return len(self._holds)

    def track(self, hold: _Hold) -> None:
        self._holds.add(hold)
        self._schedule(hold)
        if self._task is None or self._task.done():
            self._task = self._spawn(self._run())

    def untrack(self, hold: _Hold) -> None:
        self._holds.discard(hold)
        # Its heap entry stays until popped, and the loop may sleep for ttl/3: under a
        # steady stream of short holds, stale entries (each keeping a dead hold alive)
        # would pile up by the thousand. Drop them once they outnumber the live ones.
        heap = self._heap
        if len(heap) > 2 * len(self._holds) + _COMPACT_SLACK:
            heap[:] = [e for e in heap if e[2].sched == e[0] and e[2] in self._holds]
            heapq.heapify(heap)  # in place: the loop holds a reference to this list

    def drop_all(self) -> None:
        """Stop renewing every hold, releasing none (a simulated crash)."""
        self._holds.clear()

    def _schedule(self, hold: _Hold) -> None:
        """(Re)queue ``hold`` for its next event; wake the loop if that comes first."""
        assert hold in self._holds, "only tracked holds are scheduled"
        when = hold.expires_at
        if hold.watchdog and not hold.renewing:
            when = min(when, hold.renew_at)
        hold.sched = when
        heapq.heappush(self._heap, (when, next(self._seq), hold))
        if when < self._next:
            self._poke()

    def _poke(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def renew_now(self, hold: _Hold) -> None:
        """Renew one hold at once (``Lease.extend``); raises if the server is unreachable."""
        await self._renew([hold], raise_errors=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        heap = self._heap
        while self._holds:
            now = time.monotonic()
            due: list[_Hold] = []
            later: list[_Hold] = []
            while heap:
                when, _, hold = heap[0]
                if hold.sched != when or hold not in self._holds:
                    heapq.heappop(heap)  # stale entry
                    continue
                renewal = hold.watchdog and not hold.renewing and when == hold.renew_at
                # renewals due within ttl/12 share a batch; expiries wait for their time
                if when - (hold.ttl / 12 if renewal else 0.0) > now:
                    break
                heapq.heappop(heap)
                hold.sched = math.nan
                if hold.expires_at <= now:
                    hold.mark_lost("its last confirmed expiry passed without a renewal")
                elif renewal:
                    hold.renewing = True
                    due.append(hold)
                later.append(hold)
            groups: dict[object, list[_Hold]] = {}
            for hold in due:
                groups.setdefault(self._backend.renewal_group(hold.claim), []).append(hold)
            for batch in groups.values():
                for i in range(0, len(batch), MAX_BATCH):
                    self._spawn(self._renew(batch[i : i + MAX_BATCH]))
            for hold in later:  # after the pass: a re-pushed entry is never popped twice
                if hold in self._holds:
                    self._schedule(hold)
            if not self._holds:
                break
            self._next = heap[0][0] if heap else math.inf
            self._wakeup = loop.create_future()
            delay = self._next - time.monotonic() if heap else 3600.0
            timer = loop.call_later(max(0.0, delay), _resolve, self._wakeup)
            try:
                await self._wakeup
            finally:
                timer.cancel()
                self._wakeup = None
                self._next = math.inf
        self._heap.clear()
        self._task = None

    async def _renew(self, holds: list[_Hold], raise_errors: bool = False) -> None:
        for hold in holds:
            hold.renewing = True
        sent = time.monotonic()
        try:
            granted = await self._backend.renew([hold.claim for hold in holds])
        except Exception as exc:
            now = time.monotonic()
            for hold in holds:
                hold.renewing = False
                # try again soon, well before the last confirmed expiry
                hold.renew_at = now + min(hold.ttl / 6, 1.0)
                if hold in self._holds:
                    self._schedule(hold)
            _telemetry.renewal_failed(self._backend, holds, sent, exc)
            if isinstance(exc, AccessDenied) and not raise_errors:  # (extend() raises it)
                # no retry can succeed: say so now
                for hold in holds:
                    if not hold.done:
                        hold.mark_lost(f"the server refused its renewal ({exc}); it expires unrenewed")
            if raise_errors:
                raise
            return
        except BaseException:
            for hold in holds:
                hold.renewing = False
            raise
        _telemetry.renewed(self._backend, len(holds), sent)
        for hold, ms in zip(holds, granted, strict=True):
            hold.renewing = False
            if hold.done:
                continue
            if hold.ending and (ms is None or ms == REVOKED):
                continue  # our own release got there first: its answer decides (see _Hold)
            if ms == REVOKED:
                hold.mark_lost("revoked by an operator (force_release)")
                continue
            if ms is None:
                hold.mark_lost("the server no longer has it (expired or taken over)")
                continue
            if sent >= hold.expires_at:
                hold.mark_lost("its last confirmed expiry passed before the renewal was sent")
                continue
            hold.expires_at = max(hold.expires_at, sent + ms / 1000)  # never moves back
            hold.renew_at = sent + min(hold.ttl, ms / 1000) / 3
            self._schedule(hold)

    async def aclose(self) -> None:
        task, self._task = self._task, None
        self._holds.clear()
        self._heap.clear()
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
