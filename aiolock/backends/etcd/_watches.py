"""Waiting: the one watch stream per connection, the waiters it wakes, and the watches
on the keys just before each waiting claim (or on an election's whole family)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from typing import Any

from ...abc import Claim, Waiter
from ._claim import ClaimState, state
from ._connection import Connection
from ._recipe import range_end
from ._wire import NOPUT, Stream, brief, pb

__all__ = ["Watches"]

log = logging.getLogger("aiolock.backends.etcd")


class Watches:
    """The watch stream of one connection and who each watch wakes.

    A watch id is in ``_owner`` (a claim's key watch, cancelled once it fires) or in
    ``_families`` (an election listener's, kept while it listens), never both.
    """

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.stream: Stream | None = None
        self._ids = itertools.count(1)
        self._owner: dict[int, str] = {}  # watch id -> owner of the claim it wakes
        #: a claim's key watch not yet confirmed -> its key. A watch starts at the
        #: server's revision as the server takes the request; etcd (3.4, 3.5) reads that
        #: revision before it registers the watch, so a write in between leaves the watch
        #: "unsynced", and etcd catches those up only every 100 ms: a release in that
        #: window would reach its waiter up to 100 ms late. So once the server confirms
        #: the watch, the key is read once more: gone, the watch fires at once. (It also
        #: covers a deletion between the claim's listing and the watch.)
        #: Invariant: keys of ``_unconfirmed`` are keys of ``_owner``.
        self._unconfirmed: dict[int, bytes] = {}
        #: watch id -> (listener, family prefix): an election's listeners watch every change
        #: of the family (a new leader, a proclaim, a release), for as long as they listen
        self._families: dict[int, tuple[Waiter, bytes]] = {}
        self._created: dict[int, asyncio.Future[None]] = {}
        self.waiters: dict[str, Waiter] = {}
        #: bumped whenever the watch stream ends: a Busy answer from before is stale
        self.epoch = 0

    def _open(self) -> Stream:
        stream = self.stream
        if stream is None or not stream.alive:
            stub = self._conn.stubs["Watch"]
            stream = self.stream = Stream(
                lambda it: stub.Watch(it, metadata=self._conn.metadata), self._on_watch, self._ended)
            for watch_id, (_, prefix) in self._families.items():
                stream.send(_family_request(watch_id, prefix))
        return stream

    def _send(self, request: Any) -> None:
        stream = self.stream
        if stream is not None and stream.alive:
            stream.send(request)

    def _on_watch(self, response: Any) -> None:
        watch_id = int(response.watch_id)
        if response.created:
            created = self._created.pop(watch_id, None)
            if created is not None and not created.done():
                created.set_result(None)
            key = self._unconfirmed.pop(watch_id, None)
            if key is not None:
                self._conn.spawn(self._recheck(watch_id, key))
        changed = bool(response.events or response.canceled or response.compact_revision)
        family = self._families.get(watch_id)
        if family is not None:
            if response.canceled:
                del self._families[watch_id]
            if changed:
                family[0].wake()
        elif changed:  # (only deletions are sent: NOPUT) the key went, or the watch cannot serve
            self._fire(watch_id)

    def _fire(self, watch_id: int) -> None:
        owner = self._owner.pop(watch_id, None)
        self._unconfirmed.pop(watch_id, None)
        if owner is None:
            return
        self._send(pb.WatchRequest(cancel_request=pb.WatchCancelRequest(watch_id=watch_id)))
        waiter = self.waiters.get(owner)
        if waiter is not None:
            waiter.wake()

    async def _recheck(self, watch_id: int, key: bytes) -> None:
        """Fire the watch ``watch_id`` if ``key`` is gone now (or cannot be read)."""
        try:
            reply = await self._conn.unary("KV", "Range", pb.RangeRequest(key=key, count_only=True),
                                           "a watch")
        except Exception:  # (the claim looks again, and meets the error)
            self._fire(watch_id)
            return
        if not reply.count:
            self._fire(watch_id)

    def _ended(self, stream: Stream, error: BaseException | None) -> None:
        self._conn.note_stream_end(error)
        if self.stream is stream:
            self.stream = None
        self.epoch += 1
        self._owner.clear()
        self._unconfirmed.clear()
        for created in self._created.values():
            if not created.done():
                created.set_result(None)
        self._created.clear()
        if self._conn.closed:
            return
        if error is not None:
            log.debug("etcd watch stream ended: %s", brief(error))
        for waiter in list(self.waiters.values()):  # never trust a watch across this
            waiter.wake()
        if self._families:
            self._conn.spawn(self._rewatch_families())

    async def _rewatch_families(self) -> None:
        """The family watches again, on a new stream (their listeners were woken)."""
        await asyncio.sleep(0.2)
        if self._conn.closed or (self.stream is not None and self.stream.alive):
            return  # (a new stream is open already: _open re-sent them)
        self._open()

    # -- a waiting claim's key watches ----------------------------------------------------

    def watch(self, claim: Claim, keys: set[bytes]) -> None:
        """Make ``keys`` (which the claim's listing saw) the set whose deletion wakes
        ``claim``."""
        current = state(claim).watch
        for key, watch_id in list(current.items()):
            if key not in keys or watch_id not in self._owner:
                self._cancel(watch_id)
                del current[key]
        new = keys - current.keys()
        if not new:
            return
        stream = self._open()
        for key in new:
            watch_id = next(self._ids)
            self._owner[watch_id] = claim.owner
            current[key] = watch_id
            self._unconfirmed[watch_id] = key
            stream.send(pb.WatchRequest(create_request=pb.WatchCreateRequest(
                key=key, filters=[NOPUT], watch_id=watch_id)))

    def watching(self, st: ClaimState) -> bool:
        """Every watch of this claim is still registered (none fired, no stream restart)."""
        return bool(st.watch) and all(w in self._owner for w in st.watch.values())

    def _cancel(self, watch_id: int) -> None:
        self._unconfirmed.pop(watch_id, None)
        if self._owner.pop(watch_id, None) is not None:
            self._send(pb.WatchRequest(cancel_request=pb.WatchCancelRequest(watch_id=watch_id)))

    def unwatch(self, st: ClaimState) -> None:
        current, st.watch = st.watch, {}
        for watch_id in current.values():
            self._cancel(watch_id)

    # -- listeners --------------------------------------------------------------------------

    async def listen_family(self, waiter: Waiter, prefix: bytes) -> None:
        """Wake ``waiter`` on every change under ``prefix`` (an election's listeners);
        returns once the server confirmed the watch (or after the request timeout)."""
        watch_id = next(self._ids)
        created: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._created[watch_id] = created
        stream = self._open()
        self._families[watch_id] = (waiter, prefix)
        stream.send(_family_request(watch_id, prefix))
        state(waiter.claim).family_watch = watch_id
        with contextlib.suppress(TimeoutError):  # (the caller re-reads on a timer anyway)
            async with asyncio.timeout(self._conn.request_timeout):
                await created

    def unlisten(self, waiter: Waiter) -> None:
        st = state(waiter.claim)
        if self.waiters.get(waiter.claim.owner) is waiter:
            del self.waiters[waiter.claim.owner]
        watch_id, st.family_watch = st.family_watch, None
        if watch_id is not None and self._families.pop(watch_id, None) is not None:
            self._created.pop(watch_id, None)
            self._send(pb.WatchRequest(cancel_request=pb.WatchCancelRequest(watch_id=watch_id)))
        self.unwatch(st)

    async def aclose(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()
        self.waiters.clear()
        self._owner.clear()
        self._unconfirmed.clear()
        self._families.clear()
        self._created.clear()


def _family_request(watch_id: int, prefix: bytes) -> Any:
    return pb.WatchRequest(create_request=pb.WatchCreateRequest(
        key=prefix, range_end=range_end(prefix), watch_id=watch_id))
