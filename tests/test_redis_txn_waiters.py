"""Waiters of the transaction path (``?scripting=off``) registered on the server, as the
Lua path's are: a queue entry ``<owner>|<registration>`` and a waiter key, kept while it
waits, removed when it stops; a release through either path hands the lock to the first
live registered waiter, whichever its path (docs/backends/redis-noscripting.md).
"""

# ruff: noqa: F811  -- the imported fixtures are test parameters
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest

import aiolock
from aiolock.backends._redis_txn import RedisTxnBackend

from .adversarial.conftest import SECRET, acl_redis  # noqa: F401 -- a fixture
from .adversarial.servers import PasswordRedis
from .test_adversarial_two_paths import kill9, spawn_waiter
from .test_redis_nolua import LEAST, acl_server, lua_url  # noqa: F401 -- fixtures
from .test_redis_paths_races import _base, admin, txn  # noqa: F401 -- fixtures


@pytest.fixture
def name() -> str:
    return f"txnw-{uuid.uuid4().hex}"


async def _queued(admin: Any, name: str) -> list[str]:
    """The owners in the lock's queue, in order."""
    return [e.partition("|")[0] for e in await admin.lrange(_base(name) + ":q", 0, -1)]


async def _waiting(locks: aiolock.Locks, admin: Any, name: str, ttl: float = 30,
                   timeout: float = 8) -> tuple[asyncio.Task[aiolock.Lease], str]:
    """A task of ``locks`` waiting for ``name``, registered: (its task, its owner id)."""
    before = set(await _queued(admin, name))
    task = asyncio.create_task(locks.lock(name, ttl=ttl).acquire(timeout=timeout))
    for _ in range(100):
        await asyncio.sleep(0.02)
        new = [o for o in await _queued(admin, name) if o not in before]
        if new:
            await asyncio.sleep(0.05)  # (subscribed: it registered after listening)
            return task, new[0]
    task.cancel()
    pytest.fail("the waiter never registered on the server", pytrace=False)


async def _within(task: asyncio.Task[aiolock.Lease], seconds: float) -> aiolock.Lease | None:
    done, _ = await asyncio.wait({task}, timeout=seconds)
    return task.result() if done else None


async def _stop(task: asyncio.Task[Any]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    if not task.cancelled() and task.exception() is None:
        await task.result().release()


async def test_a_txn_waiter_registers_as_a_lua_waiter_does(
    txn: str, lua: str, name: str, admin: Any,
) -> None:
    base = _base(name)
    async with asyncio.timeout(10), aiolock.connect(lua) as ls, aiolock.connect(txn) as tx:
        holder = await ls.lock(name, ttl=30).acquire()
        waiting, owner = await _waiting(tx, admin, name, ttl=6)
        try:
            inbox = tx.backend.inbox  # type: ignore[attr-defined]
            value = f"6000|{len(inbox)}|{inbox}"
            [entry] = await admin.lrange(base + ":q", 0, -1)
            assert entry.startswith(f"{owner}|{value}")
            x = await admin.get(f"{base}:x:{owner}")
            assert x is not None and x.startswith(value)
            assert 0 < await admin.pttl(f"{base}:x:{owner}") <= 6000
            assert (await ls.status(name)).waiters == 1
            assert (await tx.status(name)).waiters == 1
            await holder.release()  # the Lua RELEASE hands it over, on the inbox
            assert await admin.hget(base, "owner") == owner
            lease = await _within(waiting, 1)
            assert lease is not None, "handed the lock, and still waiting"
            assert lease.token == holder.token + 1
            assert await admin.llen(base + ":q") == 0
            assert not await admin.exists(f"{base}:x:{owner}")
            await lease.release()
        finally:
            await _stop(waiting)


async def test_a_txn_waiter_refreshes_its_registration(
    txn: str, lua: str, name: str, admin: Any,
) -> None:
    """Its waiter key lives one lease ttl; it comes back within a third of that."""
    base = _base(name)
    async with asyncio.timeout(10), aiolock.connect(lua) as ls, aiolock.connect(txn) as tx:
        holder = await ls.lock(name, ttl=30).acquire()
        waiting, owner = await _waiting(tx, admin, name, ttl=0.6)
        try:
            await asyncio.sleep(1.5)  # 2.5 waiter ttls
            assert await admin.exists(f"{base}:x:{owner}")
            assert await _queued(admin, name) == [owner]  # once, in its place
            await holder.release()
            lease = await _within(waiting, 1)
            assert lease is not None
            await lease.release()
        finally:
            await _stop(waiting)


@pytest.mark.parametrize("holder_path", ["lua", "txn"])
@pytest.mark.parametrize("first", ["txn", "lua"])
async def test_first_come_first_served_across_the_paths(
    txn: str, lua: str, name: str, admin: Any, holder_path: str, first: str,
) -> None:
    """A waiter registered first is handed the lock first, whichever path each is on and
    whichever path releases."""
    async with asyncio.timeout(15), aiolock.connect(lua) as ls, aiolock.connect(txn) as tx, \
            aiolock.connect(lua if holder_path == "lua" else txn) as hs:
        paths = {"lua": ls, "txn": tx}
        second = "lua" if first == "txn" else "txn"
        holder = await hs.lock(name, ttl=30).acquire()
        one, owner1 = await _waiting(paths[first], admin, name)
        two, owner2 = await _waiting(paths[second], admin, name)
        try:
            assert await _queued(admin, name) == [owner1, owner2]
            await holder.release()
            lease = await _within(one, 1)
            assert lease is not None, f"the {first} waiter, registered first, still waits"
            assert not two.done(), "the second waiter got it too"
            await asyncio.sleep(0.1)
            await lease.release()
            lease2 = await _within(two, 1)
            assert lease2 is not None
            assert lease2.token > lease.token > holder.token
            await lease2.release()
        finally:
            await _stop(one)
            await _stop(two)


async def test_a_cancelled_txn_waiter_leaves_no_registration(
    txn: str, lua: str, name: str, admin: Any,
) -> None:
    """Cancelled while registered: its entry is removed and its waiter key holds the
    tombstone; the next waiter (of the Lua path) is handed the lock at the release."""
    base = _base(name)
    async with asyncio.timeout(10), aiolock.connect(lua) as ls, aiolock.connect(txn) as tx, \
            aiolock.connect(lua) as other:
        holder = await ls.lock(name, ttl=30).acquire()
        gone, owner = await _waiting(tx, admin, name)
        nxt, owner2 = await _waiting(other, admin, name)
        try:
            gone.cancel()
            await asyncio.gather(gone, return_exceptions=True)
            assert await _queued(admin, name) == [owner2]
            assert await admin.get(f"{base}:x:{owner}") == "a"
            released = time.monotonic()
            await holder.release()
            lease = await _within(nxt, 1)
            assert lease is not None, "the lock went to the cancelled waiter"
            assert time.monotonic() - released < 0.5
            await lease.release()
        finally:
            await _stop(gone)
            await _stop(nxt)


async def test_a_txn_waiter_cancelled_at_any_point_strands_nothing(
    txn: str, lua: str, name: str, admin: Any,
) -> None:
    """Cancelled after 0 to 12 ms (before, during or after its transactions): nothing of
    it stays in the queue, and the lock goes on to a live waiter at once."""
    async with asyncio.timeout(30), aiolock.connect(lua) as ls, aiolock.connect(txn) as tx, \
            aiolock.connect(lua) as other:
        for i in range(13):
            holder = await ls.lock(name, ttl=30).acquire()
            gone = asyncio.create_task(tx.lock(name, ttl=30).acquire(timeout=8))
            await asyncio.sleep(i / 1000)
            gone.cancel()
            await asyncio.gather(gone, return_exceptions=True)
            assert await _queued(admin, name) == []
            nxt, _ = await _waiting(other, admin, name)
            await holder.release()
            lease = await _within(nxt, 1)
            assert lease is not None, f"cancelled after {i} ms: the lock went to nobody"
            await lease.release()


async def test_granted_while_giving_up_is_passed_on(
    txn: str, lua: str, name: str, admin: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A txn waiter whose abandon fails (its registration stays) and that is then handed
    the lock passes it on at once (abandons again), not after its lease ttl."""
    async with asyncio.timeout(10), aiolock.connect(lua) as ls, aiolock.connect(txn) as tx, \
            aiolock.connect(lua) as other:
        backend = tx.backend
        assert isinstance(backend, RedisTxnBackend)
        holder = await ls.lock(name, ttl=30).acquire()
        gone, owner = await _waiting(tx, admin, name)
        nxt, _ = await _waiting(other, admin, name)
        real = RedisTxnBackend._tx_release
        failed: list[bool] = []

        async def fails_twice(self: Any, *args: Any, **kwargs: Any) -> Any:
            if len(failed) < 2:  # (an abandon that fails at once is tried once more)
                failed.append(True)
                raise aiolock.BackendUnavailable("connection lost (test)")
            return await real(self, *args, **kwargs)

        monkeypatch.setattr(RedisTxnBackend, "_tx_release", fails_twice)
        try:
            gone.cancel()
            await asyncio.gather(gone, return_exceptions=True)
            assert failed
            assert (await _queued(admin, name))[0] == owner  # its registration stayed
            released = time.monotonic()
            await holder.release()  # handed to it: its process hears it, and passes it on
            lease = await _within(nxt, 2)
            assert lease is not None, "the lock stays with a waiter that gave up"
            assert time.monotonic() - released < 1
            await lease.release()
        finally:
            await _stop(gone)
            await _stop(nxt)


@pytest.mark.parametrize("releaser", ["lua", "txn"])
async def test_a_killed_txn_waiter_does_not_strand_the_lock(
    txn: str, lua: str, name: str, admin: Any, releaser: str,
) -> None:
    """A registered txn waiter killed with -9 (its waiter key still alive): a release by
    either path skips it (nobody hears its inbox) and hands the lock to the live one."""
    async with asyncio.timeout(20), aiolock.connect(lua if releaser == "lua" else txn) as hs, \
            aiolock.connect(lua) as ls:
        holder = await hs.lock(name, ttl=30).acquire()
        proc = await spawn_waiter(txn, name, ttl=20)
        try:
            [dead] = await _queued(admin, name)  # registered (ttl 20 s)
            kill9(proc)
            await proc.wait()
            live, _ = await _waiting(ls, admin, name)
            assert (await _queued(admin, name))[0] == dead
            released = time.monotonic()
            await holder.release()
            lease = await _within(live, 2)
            assert lease is not None, "the lock went to the killed waiter"
            assert time.monotonic() - released < 1
            await lease.release()
        finally:
            kill9(proc)


async def test_a_lua_process_hands_off_locally_only_a_few_times_before_a_txn_waiter(
    txn: str, lua: str, name: str, admin: Any,
) -> None:
    """Issue 10's bound, now that the txn waiter shows in the server's queue: three Lua
    tasks taking turns let a txn waiter in within a few of their turns, again and again."""
    async with asyncio.timeout(20), aiolock.connect(lua) as ls, aiolock.connect(txn) as tx:
        stop = asyncio.Event()
        turns = 0

        async def takes_turns() -> None:
            nonlocal turns
            while not stop.is_set():
                async with ls.lock(name, ttl=5):
                    turns += 1
                    await asyncio.sleep(0.002)

        tasks = [asyncio.create_task(takes_turns()) for _ in range(3)]
        try:
            await asyncio.sleep(0.1)
            for _ in range(5):
                before = turns
                lease = await tx.lock(name, ttl=5).acquire(timeout=3)
                assert turns - before < 60, f"{turns - before} local turns before the txn waiter"
                await lease.release()
                await asyncio.sleep(0.02)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_txn_candidate_is_handed_the_leadership(
    txn: str, lua: str, name: str, admin: Any,
) -> None:
    async with asyncio.timeout(10), aiolock.connect(lua) as ls, aiolock.connect(txn) as tx:
        term = await ls.election(name, ttl=30).campaign(data="lua").acquire()
        waiting = asyncio.create_task(tx.election(name, ttl=30).campaign(data="txn").acquire())
        await asyncio.sleep(0.3)
        assert await admin.llen(f"aiolock:elect:{{{name}}}:q") == 1
        await term.release()
        lead = await _within(waiting, 1)
        assert lead is not None, "the txn candidate was not handed the leadership"
        assert lead.token > term.token
        await lead.release()


@pytest.mark.parametrize("conn", ["lean", "redis-py"])
@pytest.mark.parametrize("denied", [" +lpos +rpush +lrem", " +rpush +lrem"])
async def test_a_user_without_the_registration_commands_waits_unregistered(
    server: PasswordRedis, lua: str, name: str, admin: Any, caplog: pytest.LogCaptureFixture,
    denied: str, conn: str,
) -> None:
    """The least-privilege line from before waiters of this path registered (no
    ``LPOS``, ``RPUSH``, ``LREM``; or ``LPOS`` alone, found refused inside the first
    registration's ``MULTI``): locks still work, waiters are not registered (woken by a
    release's message on the lock's channel), and one INFO line says what to grant."""
    user = f"tx-{uuid.uuid4().hex[:8]}"
    words = LEAST.replace(denied, " +lpos" if denied == " +rpush +lrem" else "")
    assert words != LEAST
    await admin.execute_command("ACL", "SETUSER", user, "reset", "on", f">{SECRET}",
                                *words.split())
    query = "&health_check_interval=30" if conn == "redis-py" else ""
    url = f"redis://{user}:{SECRET}@127.0.0.1:{server.port}/0?scripting=off{query}"
    caplog.set_level("INFO", logger="aiolock")
    async with asyncio.timeout(10), aiolock.connect(lua) as ls, aiolock.connect(url) as tx:
        holder = await ls.lock(name, ttl=30).acquire()
        waiting = asyncio.create_task(tx.lock(name, ttl=30).acquire(timeout=8))
        await asyncio.sleep(0.3)
        try:
            assert await admin.llen(_base(name) + ":q") == 0
            await holder.release()
            lease = await _within(waiting, 1)
            assert lease is not None
            await lease.release()
        finally:
            await _stop(waiting)
    told = [r.getMessage() for r in caplog.records if "+lpos +rpush +lrem" in r.getMessage()]
    assert len(told) == 1, told
    assert SECRET not in caplog.text
