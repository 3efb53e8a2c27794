"""Release signals for the Redis backend: ONE pub/sub connection carries every channel.

A plain lock's ``RELEASE`` hands the lock to the next waiter on the server and publishes
``<lock key>|<new owner>|<token>`` on that waiter's *inbox*: one channel per process
(per :class:`Signals`), through which all its plain-lock waiters listen (``listen(...,
via=inbox)``), so only the process concerned hears it. :class:`Signals` wakes only that
owner's waiter (the claims this process registers as waiters are :attr:`Signals.claims`)
and leaves the grant in its ``claim.state`` for the backend. Read-write locks and
semaphores publish ``<releaser>|<first queued owner or ''>`` on the lock's own channel and
wake every waiter of it; a release made by this process already woke its local waiter
directly (see ``aiolock._locks``), so its echo is dropped unless it names one.
:class:`Signals` subscribes to a channel when the first waiter of this backend listens
to it, and keeps the subscription for :data:`IDLE_UNSUBSCRIBE` seconds after the last
waiter left (an inbox stays), so a lock handed from task to task does not resubscribe
each time.

A waiter only starts waiting once its subscription is confirmed, so a release after that
is never missed while the connection is up; a subscription that cannot be made fails its
waiters (``BackendUnavailable``, ``AccessDenied``...). When the connection drops, every waiter is
woken (to retry at once), the connection is re-established with backoff, and every
waiter is woken again once its channel is confirmed anew; in between, waiters still
retry at least once per holder's remaining lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from ..abc import Claim, Waiter
from ..errors import AccessDenied
from ._redis_errors import redis_error

__all__ = ["IDLE_UNSUBSCRIBE", "Signals"]

log = logging.getLogger("aiolock.backends.redis")

#: Seconds a channel stays subscribed after its last waiter left.
IDLE_UNSUBSCRIBE = 10.0
#: Claims kept whose abandon failed (see :meth:`Signals.orphan`), the latest ones.
MAX_ORPHANS = 1000


class Signals:
    """Routes pub/sub release messages to waiting claims."""

    def __init__(self, client: Any, request_timeout: float) -> None:
        self._client = client
        self._timeout = request_timeout
        self._pubsub: Any = None
        self._task: asyncio.Task[None] | None = None
        self._waiters: dict[str, set[Waiter]] = {}
        self._confirmed: dict[str, asyncio.Future[None]] = {}
        self._idle_since: dict[str, float] = {}
        self._swept = time.monotonic()  # last look for idle channels
        self._rewake: set[str] = set()
        self._local_releases: set[str] = set()  # owner ids released by this process
        #: owner id -> a claim of this process registered as a waiter on the server
        #: (plain locks), so that a grant naming it finds it (see the module doc)
        self.claims: dict[str, Claim] = {}
        self._inboxes: set[str] = set()  # channels that carry hand-offs of many locks
        self._hear_again = 0.0  # see hear()
        #: owner id -> (claim, retry) for claims whose abandon failed: a release may still
        #: hand them the lock (their queue entry stayed), and then ``retry(claim)`` runs
        self._orphans: dict[str, tuple[Claim, Callable[[Claim], Awaitable[None]]]] = {}
        self._background: set[asyncio.Future[None]] = set()
        self._subscribing = asyncio.Lock()
        self._closed = False

    async def listen(self, channel: str, waiter: Waiter, via: str | None = None) -> None:
        """Deliver ``channel``'s signals to ``waiter`` once its subscription (to ``via``,
        an inbox, if given) is confirmed, or the request timeout passed."""
        waiters = self._waiters.get(channel)
        if waiters is None:
            waiters = self._waiters[channel] = set()
        waiters.add(waiter)
        if via is None:
            self._idle_since.pop(channel, None)
        else:
            self._inboxes.add(via)
            channel = via
        if self._closed:  # aclose() ran: nothing would confirm it (the caller's next
            return        # request fails at once: the connection is closed)
        confirmed = self._confirmed.get(channel)
        if confirmed is None:
            confirmed = self._confirmed[channel] = asyncio.get_running_loop().create_future()
            # In the background: a waiter cancelled meanwhile must not stop the subscription.
            self._spawn(self._subscribe(channel))
        if not confirmed.done():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._timeout):
                    await asyncio.shield(confirmed)

    def hear(self, inbox: str) -> None:
        """Subscribe to ``inbox`` now, in the background, unless it is already (called
        before a claim that may wait first asks: a release skips a registered waiter whose
        inbox nobody hears, as if its process had died, so a process whose first busy
        attempt came before its subscription lost that place and waited unregistered,
        behind a busy process's unbounded local hand-offs). An inbox stays subscribed."""
        if inbox in self._confirmed or self._closed:
            return
        now = time.monotonic()
        if now < self._hear_again:  # it failed just now: not a try per acquire
            return
        self._hear_again = now + 1.0
        self._inboxes.add(inbox)
        self._confirmed[inbox] = asyncio.get_running_loop().create_future()
        self._spawn(self._subscribe(inbox))

    async def _subscribe(self, channel: str) -> None:
        try:
            # one at a time: redis-py's PubSub opens a connection per concurrent first
            # SUBSCRIBE and reads only the last one, so the others' messages are lost
            async with self._subscribing:
                if self._pubsub is None:
                    self._pubsub = self._new_pubsub()
                await self._pubsub.subscribe(channel)
        except Exception as exc:  # the waiters fail with it (the next listen tries again)
            fut = self._confirmed.pop(channel, None)
            if fut is not None and not fut.done():
                fut.set_exception(redis_error(exc, "(pub/sub)", f"SUBSCRIBE {channel}"))
                fut.add_done_callback(_retrieved)  # if every waiter already left
            return
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def warm(self) -> None:
        """Open the pub/sub connection now (its handshake then does not delay the first
        waiter); a failure is only logged: listening retries later."""
        try:
            async with self._subscribing:
                if self._pubsub is None:
                    self._pubsub = self._new_pubsub()
                await self._pubsub.connect()
        except Exception as exc:
            log.debug("could not open the pub/sub connection yet: %s", exc)

    def _new_pubsub(self) -> Any:
        """Hook: a new ``redis.asyncio`` PubSub object (not yet subscribed to anything)."""
        return self._client.pubsub()

    async def _reconnect(self) -> None:
        """Hook, called after the pub/sub connection failed (and a backoff pause).

        Here nothing: redis-py reconnects the same PubSub on its next read and
        resubscribes its channels. A subclass may move to another server instead.
        """

    def _connection_lost(self) -> None:
        """The connection dropped: waiters retry at once, and again once their channel
        is confirmed anew (messages sent in between were missed)."""
        loop = asyncio.get_running_loop()
        for channel, old in list(self._confirmed.items()):
            # redis-py resubscribes on reconnect; that confirmation wakes them again
            if not old.done():
                old.set_result(None)  # its listeners go on, relying on timers
            self._confirmed[channel] = loop.create_future()
            self._rewake.add(channel)
        self._wake_all()

    def _refused(self, error: AccessDenied) -> None:
        """The server refused a SUBSCRIBE (redis-py reads the reply in get_message): the
        waiters of every channel not yet confirmed fail with it."""
        for channel, fut in list(self._confirmed.items()):
            if not fut.done():
                del self._confirmed[channel]
                fut.set_exception(error)
                fut.add_done_callback(_retrieved)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def note_local_release(self, channel: str, owner: str) -> bool:
        """A release by this process is about to be sent: drop its echo when it comes."""
        if channel not in self._confirmed:
            return False  # not subscribed: no echo will come
        if len(self._local_releases) > 10_000:  # echoes lost in a reconnect: forget them
            self._local_releases.clear()
        self._local_releases.add(owner)
        return True

    def mark(self, channel: str) -> object | None:
        """A token for "subscribed and confirmed now", or None; see :meth:`unbroken`."""
        confirmed = self._confirmed.get(channel)
        return confirmed if confirmed is not None and confirmed.done() else None

    def unbroken(self, channel: str, mark: object | None) -> bool:
        """True if ``channel`` stayed subscribed, with no message possibly lost, since
        :meth:`mark` gave ``mark`` (every break replaces the channel's future)."""
        return mark is not None and self._confirmed.get(channel) is mark

    def listening(self, channel: str) -> bool:
        """Whether any waiter of this process listens on ``channel`` now."""
        return channel in self._waiters  # (an entry goes with its last waiter)

    def waiting(self, channel: str) -> list[Waiter]:
        """The waiters of this process listening on ``channel`` now."""
        return list(self._waiters.get(channel, ()))

    def granted(self, channel: str, owner: str, token: int, claim: Claim | None = None) -> None:
        """A release handed the lock to ``owner`` with ``token``: if that claim waits in
        this process (or is ``claim``), leave the grant for the backend and wake its
        waiter."""
        claim = self.claims.pop(owner, None) or claim
        if claim is None:
            orphan = self._orphans.pop(owner, None)
            if orphan is not None and not self._closed:
                self._spawn(_quietly(orphan[1](orphan[0])))
            return  # a claim no longer waiting
        claim.state["grant"] = token
        for waiter in self._waiters.get(channel, ()):
            if waiter.claim is claim:
                waiter.wake(owner)

    def orphan(self, claim: Claim, retry: Callable[[Claim], Awaitable[None]]) -> None:
        """``claim``'s abandon failed, so the server may still queue it: if a release
        hands it the lock, run ``retry(claim)`` (abandon it again, handing the lock on)
        rather than leave the lock to nobody until its lease ends."""
        if len(self._orphans) >= MAX_ORPHANS:
            del self._orphans[next(iter(self._orphans))]
        self._orphans[claim.owner] = (claim, retry)

    def forget_local_release(self, owner: str) -> None:
        self._local_releases.discard(owner)

    def unlisten(self, channel: str, waiter: Waiter) -> None:
        waiters = self._waiters.get(channel)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del self._waiters[channel]
                if channel in self._confirmed:  # not for a lock that listens via an inbox
                    self._idle_since[channel] = time.monotonic()

    def _wake_all(self) -> None:
        for waiters in list(self._waiters.values()):
            for waiter in list(waiters):
                waiter.wake()

    async def _run(self) -> None:
        backoff = 0.05
        while not self._closed and self._pubsub is not None:
            try:
                message = await self._pubsub.get_message(timeout=1.0)
                backoff = 0.05
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                refused = redis_error(exc, "(pub/sub)", "SUBSCRIBE")
                if isinstance(refused, AccessDenied):  # NOPERM: a refusal, not a loss
                    self._refused(refused)
                    await asyncio.sleep(backoff)  # no busy loop if it keeps refusing
                    backoff = min(backoff * 2, 1.0)
                    continue
                log.warning("pub/sub connection lost (%s); reconnecting", exc)
                self._connection_lost()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                await self._reconnect()
                continue
            if message is None or time.monotonic() - self._swept > 1.0:
                self._unsubscribe_idle()  # also under steady traffic, so idle ones go
            if message is None:
                continue
            kind = message["type"]
            channel = _text(message["channel"])
            if kind == "message":
                releaser, _, hint = _text(message["data"]).partition("|")
                if channel in self._inboxes:  # a plain lock handed to one of our claims
                    lock, owner, token = _text(message["data"]).rsplit("|", 2)
                    self.granted(lock, owner, int(token))
                    continue
                if releaser in self._local_releases:
                    self._local_releases.discard(releaser)
                    if not hint:
                        continue  # the releasing task already woke the next local waiter
                for waiter in list(self._waiters.get(channel, ())):
                    waiter.wake(hint or None)
            elif kind == "subscribe":
                fut = self._confirmed.get(channel)
                if fut is not None and not fut.done():
                    fut.set_result(None)
                elif fut is not None:  # confirmed again: redis-py resubscribed after a
                    self._rewake.add(channel)  # silent reconnect, messages may be lost
                    again = self._confirmed[channel] = asyncio.get_running_loop().create_future()
                    again.set_result(None)  # a new mark: see unbroken()
                if channel in self._rewake:  # catch releases made while we were cut off
                    self._rewake.discard(channel)
                    if channel in self._inboxes:
                        self._wake_all()
                    for waiter in list(self._waiters.get(channel, ())):
                        waiter.wake()

    def _unsubscribe_idle(self) -> None:
        now = self._swept = time.monotonic()
        idle = [c for c, since in self._idle_since.items() if now - since > IDLE_UNSUBSCRIBE]
        for channel in idle:
            del self._idle_since[channel]
            self._confirmed.pop(channel, None)
        if idle and self._pubsub is not None:
            self._spawn(self._safe_unsubscribe(idle))

    async def _safe_unsubscribe(self, channels: list[str]) -> None:
        try:
            await self._pubsub.unsubscribe(*channels)
        except Exception as exc:
            log.debug("unsubscribe failed: %s", exc)

    async def aclose(self) -> None:
        self._closed = True
        for pending in list(self._background):
            pending.cancel()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        # nothing confirms a subscription any more: its listeners go on at once (to a
        # request that fails, the connection being closed), not after request_timeout
        for fut in self._confirmed.values():
            if not fut.done():
                fut.set_result(None)
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(Exception):
                await pubsub.aclose()
        self._wake_all()


async def _quietly(step: Awaitable[None]) -> None:
    try:
        await step
    except Exception as exc:
        log.debug("could not abandon a claim handed the lock: %s", exc)


def _retrieved(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

