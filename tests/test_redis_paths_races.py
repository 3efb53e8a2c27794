"""Races between the two Redis code paths on the same keys: the Lua scripts and the
``WATCH``/``MULTI``/``EXEC`` transactions (``?scripting=off``, or a user without
``@scripting``).

Each test forces one interleaving: a transaction is paused between two of its round trips
(its reads under ``WATCH``, the ``PUBSUB NUMSUB`` before ``MULTI``, its ``EXEC``) by a
wrapper around :meth:`aiolock.backends._redis_lend.Lent.run`, and a Lua script (run by
hand with the ``admin`` client, as another process of the Lua path would) or a raw command
lands in between. Then the promises are checked: never two holders, tokens strictly
increasing, a lease lost is reported lost (a revoked one as revoked), nothing held by
nobody past what the documentation says.

Tests that expose a defect still open are marked ``xfail(strict=True)`` with the symptom;
the others guard an interleaving verified to be handled (an aborted ``EXEC`` retried).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

import aiolock
from aiolock.abc import REVOKED, Busy, Claim, Granted, Kind
from aiolock.backends import _redis_lend
from aiolock.backends._redis_admin import REVOKE
from aiolock.backends._redis_scripts import ACQUIRE, RELEASE, RENEW
from aiolock.backends._redis_txn import RedisTxnBackend

from .adversarial.conftest import acl_redis  # noqa: F401 -- a fixture
from .adversarial.servers import PasswordRedis
from .test_redis_nolua import acl_server, lua_url  # noqa: F401 -- fixtures

Step = Callable[[], Awaitable[Any]]
Batch = tuple[tuple[Any, ...], ...]


@pytest.fixture
def txn(server: PasswordRedis) -> str:
    """The default user with scripting=off, on aiolock's own connections."""
    return f"redis://127.0.0.1:{server.port}/0?scripting=off"


@pytest.fixture
async def admin(server: PasswordRedis) -> AsyncIterator[Any]:
    client = aioredis.Redis(port=server.port, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
def name() -> str:
    return f"race-{uuid.uuid4().hex}"


def _base(name: str) -> str:
    return f"aiolock:lock:{{{name}}}"


def _claim(name: str, ttl_ms: int = 5000) -> Claim:
    return Claim(name=name, kind=Kind.LOCK, owner=uuid.uuid4().hex, ttl_ms=ttl_ms)


def _keys(name: str, owner: str) -> list[str]:
    base = _base(name)
    return [base, base + ":seq", base + ":q", base + ":qt", base + ":x:" + owner]


def _registration(inbox: str, ttl_ms: int = 5000) -> str:
    return f"{ttl_ms}|{len(inbox)}|{inbox}"


class Lua:
    """The Lua path's scripts, run by hand as another process would (``admin``)."""

    def __init__(self, admin: Any, name: str) -> None:
        self.admin, self.name = admin, name

    async def acquire(self, owner: str, inbox: str = "", wttl: int = 0,
                      ttl: int = 5000) -> Any:
        """ACQUIRE (wttl > 0: register as a waiter on ``inbox`` when busy)."""
        return await self.admin.eval(ACQUIRE.source, 5, *_keys(self.name, owner), owner, ttl,
                                     "0", wttl, inbox or f"aiolock:inbox:{owner}", "", "0")

    async def release(self, owner: str, *, abandon: bool = False) -> Any:
        """RELEASE (or an abandon), trusting PUBLISH counts as plain Redis does."""
        return await self.admin.eval(RELEASE.source, 5, *_keys(self.name, owner), owner,
                                     _base(self.name), "1" if abandon else "0",
                                     60000 if abandon else 0, "", 0, "", "0", "1")

    async def revoke(self) -> int:
        keys = [*_keys(self.name, "-"), _base(self.name) + ":h", _base(self.name) + ":ht"]
        return int(await self.admin.eval(REVOKE.source, 7, *keys, "x", "0", 60000, "1"))

    async def renew(self, owner: str, ttl: int = 5000) -> int:
        base = _base(self.name)
        [out] = await self.admin.eval(RENEW.source, 2, base, base, "h", owner, ttl)
        return int(out)


def interpose(monkeypatch: pytest.MonkeyPatch, when: Callable[[Batch], bool],
              step: Step) -> list[Batch]:
    """Run ``step`` once, right after the first batch of a transaction for which
    ``when(commands)`` is true got its replies (before the transaction's next round
    trip); the batches it fired after (one at most)."""
    run = _redis_lend.Lent.run
    fired: list[Batch] = []

    async def paused(self: Any, *commands: tuple[Any, ...]) -> list[Any]:
        replies = await run(self, *commands)
        if not fired and when(commands):
            fired.append(commands)
            await step()
        return replies

    monkeypatch.setattr(_redis_lend.Lent, "run", paused)
    return fired


def reads(first: str, then: str) -> Callable[[Batch], bool]:
    """A transaction's first round trip: ``WATCH`` then ``then`` (HMGET: an acquire,
    HGET: a renewal, release, revocation or proclaim), on the lock named ``first``."""
    return lambda c: c[0][0] == "WATCH" and len(c) > 1 and tuple(c[1][:2]) == (then, first)


def numsub(commands: Batch) -> bool:
    """A release's (or revocation's) last look before its MULTI: who hears the inboxes."""
    return commands[0][:2] == ("PUBSUB", "NUMSUB")


def expect(ok: bool, symptom: str) -> None:
    """Fail with ``symptom`` alone (no traceback to render: the defects' xfail tests)."""
    if not ok:
        pytest.fail(symptom, pytrace=False)


async def _subscribed(admin: Any, *inboxes: str) -> Any:
    pubsub = admin.pubsub()
    await pubsub.subscribe(*inboxes)
    return pubsub


async def _owner(admin: Any, name: str) -> str | None:
    owner = await admin.hget(_base(name), "owner")
    return None if owner is None else str(owner)


# -- acquire: its read under WATCH, then EXEC ----------------------------------------------


async def test_acquire_yields_to_a_lua_grant_between_its_read_and_exec(
    txn: str, name: str, admin: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lock is free at the transaction's read; a Lua ACQUIRE takes it before the
    EXEC: the EXEC aborts, the retry finds it held (Busy), and the Lua holder keeps it
    with the only token given."""
    lua = Lua(admin, name)
    other = uuid.uuid4().hex
    granted: list[Any] = []

    async def lua_takes_it() -> None:
        granted.append(await lua.acquire(other))

    interpose(monkeypatch, reads(_base(name), "HMGET"), lua_takes_it)
    async with asyncio.timeout(10), aiolock.connect(txn) as locks:
        backend = locks.backend
        assert isinstance(backend, RedisTxnBackend)
        result = await backend.try_acquire(_claim(name))
        assert isinstance(result, Busy)
        assert granted[0][0] == 1 and backend.conflicts >= 1
        assert await _owner(admin, name) == other
        assert int(await admin.get(_base(name) + ":seq")) == int(granted[0][1])


async def test_acquire_yields_to_a_lua_abandon_handing_the_free_lock_over(
    txn: str, name: str, admin: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A free lock with two registered Lua waiters (their holder's lease lapsed): the
    first waiter abandons between the transaction's read and its EXEC, and its RELEASE
    hands the free lock to the second (a Lua abandon does that: it may have been the one
    expected to take it). The transaction must not grant it too."""
    lua, base = Lua(admin, name), _base(name)
    first, second = uuid.uuid4().hex, uuid.uuid4().hex
    inbox = f"aiolock:inbox:{second}"
    pubsub = await _subscribed(admin, inbox)
    try:
        assert (await lua.acquire("gone"))[0] == 1
        for waiter in (first, second):
            assert (await lua.acquire(waiter, wttl=5000))[0] == 0  # registered
        await admin.delete(base)  # the holder's lease lapsed

        async def first_abandons() -> None:
            assert (await lua.release(first, abandon=True))[0] == 0

        interpose(monkeypatch, reads(base, "HMGET"), first_abandons)
        async with asyncio.timeout(10), aiolock.connect(txn) as locks:
            result = await locks.backend.try_acquire(_claim(name))
        assert isinstance(result, Busy)
        assert await _owner(admin, name) == second
    finally:
        await pubsub.aclose()


async def test_acquire_abandoned_between_its_read_and_exec_is_never_granted(
    txn: str, name: str, admin: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The claim's abandon (its tombstone, from another task) lands between the
    acquire's read (free) and its EXEC: the EXEC aborts (the claim's waiter key is
    watched) and the retry says abandoned; the lock is left free."""
    claim = _claim(name)
    async with asyncio.timeout(10), aiolock.connect(txn) as locks:
        backend = locks.backend
        assert isinstance(backend, RedisTxnBackend)

        async def abandoned() -> None:
            await backend.abandon(claim)

        interpose(monkeypatch, reads(_base(name), "HMGET"), abandoned)
        with pytest.raises(aiolock.LockError, match="abandoned"):
            await backend.try_acquire(claim)
        assert await _owner(admin, name) is None
        assert await admin.get(_base(name) + ":seq") is None  # no token was given


# -- renew: its read under WATCH, then EXEC --------------------------------------------------


async def test_renewal_after_a_lua_revocation_lands_is_told_revoked(
    txn: str, name: str, admin: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Lua REVOKE between the renewal's read (still held) and its EXEC: the PEXPIRE
    must not run on whatever the key became, and the holder is told REVOKED."""
    claim = _claim(name)
    async with asyncio.timeout(10), aiolock.connect(txn) as locks:
        backend = locks.backend
        assert isinstance(backend, RedisTxnBackend)
        assert isinstance(await backend.try_acquire(claim), Granted)
        lua = Lua(admin, name)

        async def revoked() -> None:
            assert await lua.revoke() == 1

        interpose(monkeypatch, reads(_base(name), "HGET"), revoked)
        assert await backend.renew([claim]) == [REVOKED]
        assert await _owner(admin, name) is None


async def test_renewal_never_extends_the_next_holders_lease(
    txn: str, name: str, admin: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lease lapses between the renewal's read (still held) and its EXEC, and a Lua
    claim takes the lock: the renewal must say lost (not renewed: two holders), and the
    new holder's lease is left as its grant made it."""
    claim = _claim(name, ttl_ms=60000)
    other = uuid.uuid4().hex
    async with asyncio.timeout(10), aiolock.connect(txn) as locks:
        backend = locks.backend
        assert isinstance(backend, RedisTxnBackend)
        assert isinstance(await backend.try_acquire(claim), Granted)
        lua = Lua(admin, name)

        async def lapsed_and_taken() -> None:
            await admin.pexpire(_base(name), 1)
            await asyncio.sleep(0.01)
            assert (await lua.acquire(other, ttl=2000))[0] == 1

        interpose(monkeypatch, reads(_base(name), "HGET"), lapsed_and_taken)
        assert await backend.renew([claim]) == [None]
        assert await _owner(admin, name) == other
        assert 0 < await admin.pttl(_base(name)) <= 2000


async def test_proclaim_after_the_lease_lapsed_leaves_no_key_behind(
    txn: str, name: str, admin: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A leader's record change (set_info) whose lease lapses between its read and its
    EXEC: False, and no election hash without an owner or an expiry is left (an HSET on
    the lapsed key would make one that never expires)."""
    claim = Claim(name=name, kind=Kind.LEADER, owner=uuid.uuid4().hex, ttl_ms=5000,
                  info="new")
    key = f"aiolock:elect:{{{name}}}"
    async with asyncio.timeout(10), aiolock.connect(txn) as locks:
        backend = locks.backend
        assert isinstance(backend, RedisTxnBackend)
        assert isinstance(await backend.try_acquire(claim), Granted)

        async def lapsed() -> None:
            await admin.pexpire(key, 1)
            await asyncio.sleep(0.01)

        interpose(monkeypatch, reads(key, "HGET"), lapsed)
        assert await backend.set_info(claim) is False
        assert not await admin.exists(key)


@contextlib.asynccontextmanager
async def _holder_and_lua_waiters(
    txn: str, admin: Any, name: str, *waiters: str,
) -> AsyncIterator[tuple[RedisTxnBackend, Claim, Granted, Any]]:
    """A transaction-path claim holding ``name``, and Lua-path ``waiters`` registered
    behind it, their inboxes heard (subscribed by ``admin``): the backend, the claim, its
    grant and the subscription (read the hand-over messages there)."""
    lua = Lua(admin, name)
    inboxes = [f"aiolock:inbox:{w}" for w in waiters]
    pubsub = await _subscribed(admin, *inboxes)
    claim = _claim(name)
    try:
        async with asyncio.timeout(10), aiolock.connect(txn) as locks:
            backend = locks.backend
            assert isinstance(backend, RedisTxnBackend)
            held = await backend.try_acquire(claim)
            assert isinstance(held, Granted)
            for waiter, inbox in zip(waiters, inboxes, strict=True):
                assert (await lua.acquire(waiter, inbox, wttl=5000))[0] == 0
            yield backend, claim, held, pubsub
    finally:
        await pubsub.aclose()


# -- release: reads under WATCH, the waiters' keys, NUMSUB, then MULTI/EXEC --------------


async def test_release_never_hands_over_to_a_waiter_that_abandoned_before_exec(
    txn: str, name: str, admin: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The release chose a heard Lua waiter (its NUMSUB is in); the waiter abandons before
    the EXEC (its RELEASE sets its tombstone and leaves the queue): the EXEC aborts and
    the retry hands the lock to the next live waiter, never to the abandoned one."""
    lua, base = Lua(admin, name), _base(name)
    gone, next_ = uuid.uuid4().hex, uuid.uuid4().hex
    async with _holder_and_lua_waiters(txn, admin, name, gone, next_) as (backend, claim, held, _):

        async def abandons() -> None:
            await lua.release(gone, abandon=True)

        fired = interpose(monkeypatch, numsub, abandons)
        assert await backend.release(claim) is True
        assert fired and backend.conflicts >= 1
        assert await _owner(admin, name) == next_
        assert int(await admin.hget(base, "token")) == held.token + 1
        assert await admin.get(f"{base}:x:{gone}") == "a"


async def test_release_retried_after_the_waiter_refreshed_its_place(
    txn: str, name: str, admin: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The chosen waiter asks again (a busy ACQUIRE refreshes its waiter key and the
    queue's expiry) between the release's look and its EXEC: aborted, retried, handed
    over once, with the next token, and its ACQUIRE then finds itself the owner."""
    lua, base = Lua(admin, name), _base(name)
    waiter = uuid.uuid4().hex
    inbox = f"aiolock:inbox:{waiter}"
    async with _holder_and_lua_waiters(txn, admin, name, waiter) as (backend, claim, held, pubsub):
        asked: list[Any] = []

        async def asks_again() -> None:
            asked.append(await lua.acquire(waiter, inbox, wttl=5000))

        interpose(monkeypatch, numsub, asks_again)
        assert await backend.release(claim) is True
        assert asked[0][0] == 0 and backend.conflicts >= 1
        assert await _owner(admin, name) == waiter
        assert int(await admin.get(base + ":seq")) == held.token + 1
        again = await lua.acquire(waiter, inbox, wttl=5000)
        assert (again[0], int(again[1])) == (1, held.token + 1)
        messages = []
        while (m := await pubsub.get_message(timeout=0.5)) is not None:
            if m["type"] == "message":
                messages.append(m["data"])
        assert messages == [f"{base}|{waiter}|{held.token + 1}"]  # one hand-over, heard


async def test_release_after_a_lua_revocation_landed_hands_nothing_over_again(
    txn: str, name: str, admin: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Lua REVOKE between the release's look (it still held; a heard waiter chosen) and
    its EXEC hands the lock to that waiter itself: the EXEC aborts and the retry finds
    the lock no longer this claim's -- False (a lease lost), nothing handed over twice,
    one token given."""
    lua, base = Lua(admin, name), _base(name)
    waiter, later = uuid.uuid4().hex, uuid.uuid4().hex
    async with _holder_and_lua_waiters(txn, admin, name, waiter, later) as (backend, claim, held, _):

        async def revoked() -> None:
            assert await lua.revoke() == 1

        interpose(monkeypatch, numsub, revoked)
        assert await backend.release(claim) is False
        assert await _owner(admin, name) == waiter
        assert int(await admin.hget(base, "token")) == held.token + 1
        assert int(await admin.get(base + ":seq")) == held.token + 1
        assert await admin.lrange(base + ":q", 0, -1) == [
            f"{later}|{_registration(f'aiolock:inbox:{later}')}"]


# -- force_release ------------------------------------------------------------------------


async def test_revocation_retried_marks_the_holder_at_exec_not_the_one_it_read(
    txn: str, name: str, admin: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A revocation (transactions) reads holder A; A's lease lapses and a Lua claim B
    takes the lock before the EXEC. The EXEC aborts; the retry revokes B, whose renewal
    then says revoked (-1) -- it must not silently lose the lock (0) to a DEL meant for A,
    and A's waiter key carries no mark."""
    lua, base = Lua(admin, name), _base(name)
    first, second = uuid.uuid4().hex, uuid.uuid4().hex
    assert (await lua.acquire(first))[0] == 1

    async def lapsed_and_taken() -> None:
        await admin.delete(base)
        assert (await lua.acquire(second))[0] == 1

    fired = interpose(monkeypatch, reads(base, "HGET"), lapsed_and_taken)
    async with asyncio.timeout(10), aiolock.connect(txn) as locks:
        assert await locks.lock(name).force_release() is True
    assert fired
    assert await lua.renew(second) == -1
    assert await admin.get(f"{base}:x:{first}") is None
    assert await _owner(admin, name) is None


async def test_revocation_never_hands_over_to_an_unheard_waiter_and_takes_it_back(
    txn: str, name: str, admin: Any,
) -> None:
    """The race of commit 24eb96b, through force_release: a Lua waiter registered before
    its process subscribed, asking again at once; a revocation on this path must not
    leave the lock to both that waiter and a third claim."""
    base = _base(name)
    async with asyncio.timeout(30), aiolock.connect(txn) as locks, \
            aiolock.connect(txn) as other:
        for _ in range(4):
            holder = await locks.lock(name, ttl=5).acquire(timeout=5)
            me = uuid.uuid4().hex
            lua = Lua(admin, name)
            assert (await lua.acquire(me, wttl=5000))[0] == 0  # registered, nobody hears
            asking = asyncio.create_task(_asks_until(lua, me, time.monotonic() + 0.25))
            await asyncio.sleep(0)
            assert await locks.lock(name).force_release() is True
            try:
                third = await other.lock(name, ttl=5).acquire(timeout=0.25)
            except aiolock.LockTimeout:
                third = None
            got = await asking
            assert got is None or third is None, "the lock went to two claims at once"
            if third is not None:
                await third.release()
            await holder.release()  # revoked: a no-op
            await admin.delete(base, base + ":q", f"{base}:x:{me}")


async def _asks_until(lua: Lua, owner: str, ends: float) -> float | None:
    """A Lua-path waiter asking (ACQUIRE, no new place) until ``ends``: when it found
    itself the owner, or None."""
    while time.monotonic() < ends:
        if (await lua.acquire(owner))[0] == 1:
            return time.monotonic()
    return None


async def _holder_also_queued(admin: Any, name: str, inbox: str) -> tuple[str, Any]:
    """A Lua holder that also keeps a live place in the queue: a waiter whose waiter key
    lapsed (its process stalled past its ttl) while its entry stayed, asks again (a
    second entry), and is then handed the lock from the first. Its waiter id, and the
    subscription that keeps its inbox heard."""
    lua, base = Lua(admin, name), _base(name)
    assert (await lua.acquire("holder"))[0] == 1
    waiter = uuid.uuid4().hex
    pubsub = await _subscribed(admin, inbox)
    assert (await lua.acquire(waiter, inbox, wttl=5000))[0] == 0
    await admin.delete(f"{base}:x:{waiter}")  # lapsed
    assert (await lua.acquire(waiter, inbox, wttl=5000))[0] == 0  # registered again
    assert await admin.llen(base + ":q") == 2
    handed = await lua.release("holder")
    assert (handed[1], await admin.llen(base + ":q")) == (waiter, 1)
    return waiter, pubsub


@pytest.mark.parametrize("path", [
    "lua",
    "txn",
])
async def test_revocation_never_hands_the_lock_back_to_the_revoked_holder(
    txn: str, name: str, admin: Any, path: str,
) -> None:
    """Lua's REVOKE writes the mark first, then hands over: the revoked holder's own
    entry is skipped (its waiter key now says 'v'). The transaction must do the same."""
    inbox = f"aiolock:inbox:{uuid.uuid4().hex}"
    waiter, pubsub = await _holder_also_queued(admin, name, inbox)
    lua = Lua(admin, name)
    try:
        if path == "lua":
            assert await lua.revoke() == 1
        else:
            async with asyncio.timeout(10), aiolock.connect(txn) as locks:
                assert await locks.lock(name).force_release() is True
        expect(await _owner(admin, name) != waiter, "revoked, then handed it back")
        expect(await lua.renew(waiter) == -1, "the revoked holder renews its lease")
    finally:
        await pubsub.aclose()


@pytest.mark.parametrize("path", ["lua", "txn"])
async def test_a_release_never_hands_the_lock_back_to_its_releaser(
    txn: str, name: str, admin: Any, path: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    inbox = f"aiolock:inbox:{uuid.uuid4().hex}"
    waiter, pubsub = await _holder_also_queued(admin, name, inbox)
    try:
        if path == "lua":
            assert (await Lua(admin, name).release(waiter))[0] == 1
        else:
            async with asyncio.timeout(10), aiolock.connect(txn) as locks:
                claim = Claim(name=name, kind=Kind.LOCK, owner=waiter, ttl_ms=5000)
                assert await locks.backend.release(claim) is True
        expect(await _owner(admin, name) is None, "released, and handed back to itself")
    finally:
        await pubsub.aclose()


# -- hand-over messages --------------------------------------------------------------------


async def _lua_waiter(
    ls: aiolock.Locks, admin: Any, name: str,
) -> tuple[asyncio.Task[aiolock.Lease], str]:
    """A Lua-path waiter on ``name`` (ttl 30), registered and subscribed: its task and
    its owner id (read from the queue)."""
    base = _base(name)
    waiting = asyncio.create_task(ls.lock(name, ttl=30).acquire(timeout=8))
    deadline = time.monotonic() + 3
    while not await admin.llen(base + ":q"):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # subscribed, asked again
    [entry] = await admin.lrange(base + ":q", 0, -1)
    return waiting, entry.partition("|")[0]


async def _within(task: asyncio.Task[aiolock.Lease], seconds: float) -> aiolock.Lease | None:
    """``task``'s lease if it is granted within ``seconds``, else None (still waiting)."""
    await asyncio.wait({task}, timeout=seconds)
    return task.result() if task.done() else None


async def _stop(task: asyncio.Task[Any]) -> None:
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_stale_grant_message_is_not_believed(
    txn: str, lua: str, name: str, admin: Any,
) -> None:
    """A Lua-path waiter (trust_handoffs: a grant message is taken without asking) whose
    inbox carries hand-over messages with tokens not above the holder's it saw (old
    messages: a hand-over made before its last busy ACQUIRE, and since ended) must not
    take them as a grant while a transaction client holds the lock."""
    base = _base(name)
    async with asyncio.timeout(10), aiolock.connect(txn) as tx, aiolock.connect(lua) as ls:
        holder = await tx.lock(name, ttl=30).acquire()
        waiting, waiter = await _lua_waiter(ls, admin, name)
        try:
            inbox = ls.backend.inbox  # type: ignore[attr-defined]
            for token in (holder.token - 1, holder.token):
                assert await admin.publish(inbox, f"{base}|{waiter}|{token}") == 1
                await asyncio.sleep(0.2)
            assert not waiting.done(), "took a stale hand-over message as its grant"
            assert await _owner(admin, name) != waiter
        finally:
            await _stop(waiting)
            await holder.release()


async def test_after_a_stale_grant_message_the_real_hand_over_is_heard(
    txn: str, lua: str, name: str, admin: Any,
) -> None:
    base = _base(name)
    async with asyncio.timeout(10), aiolock.connect(txn) as tx, aiolock.connect(lua) as ls:
        holder = await tx.lock(name, ttl=30).acquire()
        waiting, waiter = await _lua_waiter(ls, admin, name)
        try:
            inbox = ls.backend.inbox  # type: ignore[attr-defined]
            assert await admin.publish(inbox, f"{base}|{waiter}|{holder.token}") == 1
            await asyncio.sleep(0.2)
            await holder.release()  # hands it over to the waiter, with the next token
            assert await _owner(admin, name) == waiter
            lease = await _within(waiting, 1.5)
            expect(lease is not None, "handed the lock, and still waiting for it")
            assert lease is not None
            assert lease.token == holder.token + 1
            await lease.release()
        finally:
            await _stop(waiting)


# -- liveness of a hand-over --------------------------------------------------------------


@pytest.mark.parametrize("path", [
    "lua",
    "txn",
])
async def test_a_live_lua_waiter_behind_many_dead_ones_is_handed_the_lock(
    txn: str, lua: str, name: str, admin: Any, path: str,
) -> None:
    """Eight registered waiters whose processes are gone (nobody hears their inboxes),
    then a live Lua-path waiter: a release hands the lock to the live one, as Lua's
    RELEASE does (it looks at the whole queue), rather than free it unheard."""
    base = _base(name)
    async with asyncio.timeout(15), aiolock.connect(txn if path == "txn" else lua) as hs, \
            aiolock.connect(lua) as ls:
        holder = await hs.lock(name, ttl=30).acquire()
        for i in range(8):  # waiters whose processes are gone (nobody hears their inbox)
            dead = f"dead{i}-{uuid.uuid4().hex}"
            value = _registration(f"aiolock:inbox:{dead}", 30000)
            await admin.set(f"{base}:x:{dead}", value, px=30000)
            await admin.rpush(base + ":q", f"{dead}|{value}")
        waiting = asyncio.create_task(ls.lock(name, ttl=30).acquire(timeout=8))
        await asyncio.sleep(0.3)  # registered behind them, subscribed
        assert await admin.llen(base + ":q") == 9
        await holder.release()
        try:
            expect(await _owner(admin, name) is not None, "freed, with a live waiter queued")
            lease = await _within(waiting, 2)
            expect(lease is not None, "the lock is free, and the live waiter still waits")
            assert lease is not None
            await lease.release()
        finally:
            await _stop(waiting)


@pytest.mark.parametrize("path", [
    "lua",
    "txn",
])
async def test_a_waiter_of_either_path_is_not_starved_by_lua_local_hand_offs(
    txn: str, lua: str, name: str, path: str,
) -> None:
    """Three tasks of one Lua process take turns (each holds 5 ms and comes back at
    once): a waiter in another process gets the lock within a few hand-offs."""
    async with asyncio.timeout(15), aiolock.connect(lua) as ls, \
            aiolock.connect(txn if path == "txn" else lua) as other:
        stop = asyncio.Event()
        turns = 0

        async def takes_turns() -> None:
            nonlocal turns
            while not stop.is_set():
                async with ls.lock(name, ttl=1):
                    turns += 1
                    await asyncio.sleep(0.005)

        tasks = [asyncio.create_task(takes_turns()) for _ in range(3)]
        try:
            await asyncio.sleep(0.2)
            assert turns > 5
            try:
                lease = await other.lock(name, ttl=1).acquire(timeout=2.5)
            except aiolock.LockTimeout:
                lease = None
            expect(lease is not None, f"starved for 2.5 s ({turns} local turns)")
            assert lease is not None
            await lease.release()
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_waiter_that_does_not_trust_hand_overs_asks_at_once(
    txn: str, lua: str, name: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """(Sentinel's setting, on plain Redis: its backend's waiting is the same code.) A
    transaction release hands the lock to the waiting Lua-path claim; told by its inbox,
    the claim asks (its ACQUIRE finds it the owner) at once, not at its timer."""
    async with asyncio.timeout(15), aiolock.connect(txn) as tx, aiolock.connect(lua) as ls:
        monkeypatch.setattr(ls.backend, "trust_handoffs", False)
        holder = await tx.lock(name, ttl=30).acquire()
        waiting = asyncio.create_task(ls.lock(name, ttl=30).acquire(timeout=8))
        await asyncio.sleep(0.5)  # registered, subscribed, asked again
        try:
            await holder.release()
            lease = await _within(waiting, 1.5)
            expect(lease is not None, "handed the lock, and waiting for its timer")
            assert lease is not None
            assert lease.token == holder.token + 1
            await lease.release()
        finally:
            await _stop(waiting)
