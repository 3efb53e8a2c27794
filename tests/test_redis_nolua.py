"""Redis without scripting (SPEC §6, issue 15): ``lock()`` and ``election()`` as WATCH/MULTI/EXEC
transactions, with holders, ``scan`` and ``force_release`` (SPEC §7, §8).

One redis-server of our own, with an ACL user that may run everything but scripts
(``-@scripting``): its URL falls back by itself (``scripting=auto``, the default); the
default user with ``?scripting=off`` runs the same transactions by request, and without
it the Lua scripts, on the same keys -- so the two paths are tested against each other.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

import aiolock
from aiolock.abc import REVOKED, Busy, Capability, Claim, Granted, Kind
from aiolock.backends import _redis_lend
from aiolock.backends._redis_txn import MAX_CONFLICTS, AutoRedisBackend, RedisTxnBackend
from aiolock.backends.redis import RedisBackend

from .adversarial.conftest import SECRET, acl_redis  # noqa: F401 -- a fixture
from .adversarial.servers import PasswordRedis
from .conftest import acquire_cancelled_after
from .servers import RedisServer
from .test_faults_redis import Procs, own_server  # noqa: F401 -- a fixture


# (fixtures named apart from their functions: tests/test_redis_nolua_coordination.py
# imports the functions)
@pytest.fixture(scope="module", name="server")
def acl_server(acl_redis: PasswordRedis) -> PasswordRedis:  # noqa: F811
    """Users: default (everything), noscript (all but @scripting), nothing (no command)."""
    return acl_redis


@pytest.fixture(name="nolua")
def nolua_url(server: PasswordRedis) -> str:
    """The ACL user without @scripting: falls back on its own."""
    return f"redis://noscript:{SECRET}@127.0.0.1:{server.port}/0"


@pytest.fixture(params=["lean", "redis-py"])
def off(server: PasswordRedis, request: pytest.FixtureRequest) -> str:
    """scripting=off on aiolock's own connections, or through redis.asyncio's pool (an
    option only redis-py honours)."""
    query = "&health_check_interval=30" if request.param == "redis-py" else ""
    return f"redis://127.0.0.1:{server.port}/0?scripting=off{query}"


@pytest.fixture(name="lua")
def lua_url(server: PasswordRedis) -> str:
    """The default user, on the Lua scripts."""
    return f"redis://127.0.0.1:{server.port}/0"


@pytest.fixture
async def admin(server: PasswordRedis) -> AsyncIterator[Any]:
    client = aioredis.Redis(port=server.port, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
def name() -> str:
    return f"n-{uuid.uuid4().hex}"


def _claim(name: str, ttl_ms: int = 5000) -> Claim:
    return Claim(name=name, kind=Kind.LOCK, owner=uuid.uuid4().hex, ttl_ms=ttl_ms)


# -- choosing the path -------------------------------------------------------------------


@pytest.mark.parametrize("query", ["", "?health_check_interval=30"], ids=["lean", "redis-py"])
async def test_refused_scripts_fall_back_to_transactions(
    nolua: str, name: str, query: str,
) -> None:
    """On aiolock's own connection, or through redis.asyncio (an option only it honours)."""
    async with asyncio.timeout(10), aiolock.connect(nolua + query) as locks:
        assert type(locks.backend) is RedisTxnBackend
        assert locks.capabilities == {Capability.EVENTS, Capability.EXPIRY,
                                      Capability.DISTRIBUTED, Capability.HOLDERS,
                                      Capability.SCAN, Capability.REVOKE, Capability.ELECTION}
        for unsupported in (lambda: locks.rwlock(name), lambda: locks.semaphore(name, 2),
                            lambda: locks.lock(name, fair=True)):
            with pytest.raises(ValueError, match="not supported"):
                unsupported()
        async with locks.lock(name, ttl=5) as lease:
            assert lease.token >= 1
            info = await locks.status(name)
            assert info.held and info.token == lease.token and info.ttl_left is not None
        assert not (await locks.status(name)).held


async def test_fallback_without_async_with(nolua: str, name: str) -> None:
    """Used without ``async with`` (no connect()), the first request decides."""
    locks = aiolock.connect(nolua)
    try:
        assert type(locks.backend) is AutoRedisBackend
        async with asyncio.timeout(10):
            first, second = await asyncio.gather(
                locks.lock(name).acquire(timeout=5), locks.lock(name + "b").acquire(timeout=5))
            assert type(locks.backend) is RedisTxnBackend
            await first.release()
            await second.release()
    finally:
        await locks.aclose()


async def test_a_client_you_pass_falls_back_too(server: PasswordRedis, name: str) -> None:
    """``connect(client)`` with a redis.asyncio client of the ACL user without
    @scripting: the same automatic fallback as its URL; ``scripting=`` chooses, and a
    misspelled option or a bad value is a ValueError naming what is accepted."""
    client = aioredis.Redis(port=server.port, username="noscript", password=SECRET)
    try:
        async with asyncio.timeout(10), aiolock.connect(client) as locks:
            assert type(locks.backend) is RedisTxnBackend
            async with locks.lock(name, ttl=5) as lease:
                assert (await locks.status(name)).token == lease.token
        for given in ({"scripting": "maybe"}, {"scriptin": "off"}, {"request_timeout": -1}):
            with pytest.raises(ValueError, match=r"scripting|accepted|request_timeout"):
                aiolock.connect(client, **given)
        locks = aiolock.connect(client, scripting="on")
        assert type(locks.backend) is RedisBackend
        with pytest.raises(aiolock.LockError):
            await locks.lock(name).acquire(timeout=1)
        await locks.aclose()
    finally:
        await client.aclose()


async def test_revocation_decides_without_async_with(nolua: str, name: str) -> None:
    """force_release() (an operator's first request, no connect()) decides the path
    rather than running the refused script."""
    locks = aiolock.connect(nolua)
    try:
        async with asyncio.timeout(10):
            assert await locks.lock(name).force_release() is False
            assert type(locks.backend) is RedisTxnBackend
    finally:
        await locks.aclose()


async def test_scripts_allowed_stay_lua(lua: str) -> None:
    async with asyncio.timeout(10), aiolock.connect(lua) as locks:
        assert type(locks.backend) is RedisBackend
        assert Capability.RWLOCK in locks.capabilities


async def test_scripting_on_never_falls_back(nolua: str, name: str) -> None:
    with pytest.raises(aiolock.AccessDenied) as info:
        async with asyncio.timeout(10), aiolock.connect(nolua + "?scripting=on"):
            pass
    assert SECRET not in str(info.value)


@pytest.mark.parametrize("value", ["yes", "OFF", "1", "false"])
def test_scripting_value_refused_saying_what_is_accepted(nolua: str, value: str) -> None:
    with pytest.raises(ValueError, match="on, off, auto") as info:
        aiolock.connect(f"{nolua}?scripting={value}")
    assert SECRET not in str(info.value)
    with pytest.raises(ValueError, match="on, off, auto"):
        aiolock.connect(nolua, scripting=True)


@pytest.mark.parametrize("url", ["redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3",
                                 "redis+cluster://127.0.0.1:1", "redis+sentinel://127.0.0.1:1/m"])
def test_scripting_refused_where_scripts_are_needed(url: str) -> None:
    for query, keywords in (("?scripting=off", {}), ("", {"scripting": "off"})):
        with pytest.raises(ValueError, match="scripting"):
            aiolock.connect(url + query, **keywords)


def test_scripting_keyword_and_query(off: str, lua: str) -> None:
    assert type(aiolock.connect(lua, scripting="off").backend) is RedisTxnBackend
    assert type(aiolock.connect(off).backend) is RedisTxnBackend
    assert type(aiolock.connect(off, scripting="on").backend) is RedisBackend  # keyword wins


async def test_user_without_transactions_gets_the_script_refusal(server: PasswordRedis) -> None:
    url = f"redis://nothing:{SECRET}@127.0.0.1:{server.port}/0"
    with pytest.raises(aiolock.AccessDenied) as info:
        async with asyncio.timeout(10), aiolock.connect(url):
            pass
    assert "script" in str(info.value).lower()
    assert SECRET not in str(info.value) and SECRET not in repr(info.value.__cause__)


async def test_user_without_multi_is_refused_before_any_write(
    server: PasswordRedis, admin: Any, name: str,
) -> None:
    """A refused MULTI would let the commands queued after it run unguarded: such a user
    gets AccessDenied at connect (or at the first acquire, without ``async with``),
    before any lock is written."""
    user = f"nomulti-{uuid.uuid4().hex[:8]}"
    await admin.execute_command("ACL", "SETUSER", user, "on", f">{SECRET}", "~*", "&*",
                                "+@all", "-multi")
    url = f"redis://{user}:{SECRET}@127.0.0.1:{server.port}/0?scripting=off"
    with pytest.raises(aiolock.AccessDenied, match=r"(?i)multi"):
        async with asyncio.timeout(10), aiolock.connect(url):
            pass
    locks = aiolock.connect(url)
    try:
        with pytest.raises(aiolock.AccessDenied):
            await locks.lock(name).acquire(timeout=1)
    finally:
        await locks.aclose()
    assert not await admin.exists(f"aiolock:lock:{{{name}}}", f"aiolock:lock:{{{name}}}:seq")


async def test_unreachable_is_bounded_without_password() -> None:
    from .servers import free_port

    url = f"redis://nolua:{SECRET}@127.0.0.1:{free_port()}/0?scripting=off"
    started = time.monotonic()
    with pytest.raises(aiolock.BackendUnavailable) as info:
        async with aiolock.connect(url, connect_timeout=1):
            pass
    assert time.monotonic() - started < 5
    assert SECRET not in str(info.value)


# -- the lock ------------------------------------------------------------------------------


async def test_mutual_exclusion_many_tasks(
    nolua: str, lua: str, name: str,
) -> None:
    """Four connections (three without scripts: two on aiolock's connections, one on
    redis.asyncio's; one Lua) x 8 tasks on one name: never two inside at once, tokens
    strictly increasing in hold order."""
    inside, records = 0, []

    async def worker(locks: aiolock.Locks, stop: float) -> None:
        nonlocal inside
        lock = locks.lock(name, ttl=5)
        while time.monotonic() < stop:
            async with lock as lease:
                inside += 1
                assert inside == 1, "two holders at once"
                records.append(lease.token)
                await asyncio.sleep(0.001 if len(records) % 2 else 0)
                inside -= 1

    async with asyncio.timeout(30), aiolock.connect(nolua) as a, aiolock.connect(nolua) as b, \
            aiolock.connect(lua + "?scripting=off&health_check_interval=30") as c, \
            aiolock.connect(lua) as d:
        stop = time.monotonic() + 1.5
        await asyncio.gather(*(worker(x, stop) for x in (a, b, c, d) for _ in range(8)))
        conflicts = sum(x.backend.conflicts for x in (a, b, c))  # type: ignore[attr-defined]
    assert len(records) >= 20, len(records)  # (not a speed claim: a shared, loaded machine)
    assert all(y > x for x, y in pairwise(records)), "tokens not strictly increasing"
    print(f"{len(records)} holds, {conflicts} EXEC conflicts")


async def test_mutual_exclusion_three_processes(
    nolua: str, name: str, tmp_path: Path,
) -> None:
    procs = Procs(tmp_path)
    files = [tmp_path / f"w{i}.jsonl" for i in range(3)]
    try:
        workers = [await procs.spawn("worker.py", nolua, name, "4", str(f), stdin=True)
                   for f in files]
        for w in workers:
            await w.expect("READY", 20)
        stop = time.monotonic() + 2.0
        for w in workers:
            assert w.proc.stdin is not None
            w.proc.stdin.write(f"GO {stop}\n".encode())
            await w.proc.stdin.drain()
        for w in workers:
            assert await w.finish(20) == 0, w.output()
    finally:
        await procs.cleanup()
    records = sorted((tuple(json.loads(line)) for f in files for line in
                      f.read_text().splitlines()), key=lambda r: r[1])
    per_proc = {r[3] for r in records}
    overlaps = [(a, b) for a, b in pairwise(records) if b[1] < a[2]]
    assert not overlaps, f"{len(overlaps)} overlapping critical sections: {overlaps[:3]}"
    assert all(b[0] > a[0] for a, b in pairwise(records)), "tokens not increasing"
    assert len(records) >= 10 and len(per_proc) >= 2, (len(records), per_proc)


async def test_renewed_while_held_then_lost_when_taken(off: str, name: str, admin: Any) -> None:
    async with asyncio.timeout(10), aiolock.connect(off) as locks:
        lease = await locks.lock(name, ttl=0.6, on_lost="raise").acquire()
        await asyncio.sleep(1.0)  # past the ttl: the watchdog renewed it
        assert not lease.lost
        assert 0 < await admin.pttl(f"aiolock:lock:{{{name}}}") <= 600
        await admin.hset(f"aiolock:lock:{{{name}}}", "owner", "someone-else")
        await asyncio.wait_for(lease.wait_lost(), 2.0)  # within ttl/3 (+ slack)
        assert await admin.hget(f"aiolock:lock:{{{name}}}", "owner") == "someone-else"
        await lease.release()  # not ours any more: leaves it alone
        assert await admin.hget(f"aiolock:lock:{{{name}}}", "owner") == "someone-else"


async def test_expires_without_watchdog(off: str, name: str) -> None:
    async with asyncio.timeout(10), aiolock.connect(off) as locks:
        lease = await locks.lock(name, ttl=0.3, watchdog=False).acquire()
        started = time.monotonic()
        other = await asyncio.create_task(locks.lock(name, ttl=5).acquire(timeout=3))
        assert time.monotonic() - started < 1.5 and lease.lost
        assert other.token > lease.token
        await other.release()


async def test_release_only_by_the_owner(off: str, name: str) -> None:
    async with asyncio.timeout(10), aiolock.connect(off) as locks:
        backend = locks.backend
        mine = _claim(name)
        # one try that does not wait: a waiting claim would take a place in the queue,
        # and its process hears its inbox, so the release below would hand it the lock
        theirs = dataclasses.replace(_claim(name), waits=False)
        granted = await backend.try_acquire(mine)
        assert isinstance(granted, Granted)
        assert isinstance(await backend.try_acquire(theirs), Busy)
        assert await backend.release(theirs) is False
        again = await backend.try_acquire(mine)  # repeating a granted claim re-grants it
        assert isinstance(again, Granted) and again.token == granted.token
        assert await backend.renew([theirs, mine]) == [None, mine.ttl_ms]
        assert await backend.release(mine) is True
        assert await backend.release(mine) is False
        assert not (await backend.inspect(name)).held


async def test_revoked_by_an_operator_is_told(off: str, name: str, admin: Any) -> None:
    """The Lua path's revocation (the lock deleted, the holder's waiter key marked 'v'):
    the renewal says REVOKED, not merely gone."""
    async with asyncio.timeout(10), aiolock.connect(off) as locks:
        backend = locks.backend
        revoked, gone, kept = _claim(name), _claim(name + "g"), _claim(name + "k")
        for claim in (revoked, gone, kept):
            assert isinstance(await backend.try_acquire(claim), Granted)
        base = f"aiolock:lock:{{{name}}}"
        await admin.delete(base, f"aiolock:lock:{{{name}g}}")
        await admin.set(f"{base}:x:{revoked.owner}", "v", px=60_000)
        assert await backend.renew([revoked, gone, kept]) == [REVOKED, None, kept.ttl_ms]
        assert await backend.renew([revoked]) == [REVOKED]
        await backend.release(kept)


async def test_abandoned_claim_cannot_be_granted(off: str, name: str) -> None:
    async with asyncio.timeout(10), aiolock.connect(off) as locks:
        backend = locks.backend
        claim = _claim(name)
        assert isinstance(await backend.try_acquire(claim), Granted)
        await backend.abandon(claim)
        assert not (await backend.inspect(name)).held
        with pytest.raises(aiolock.LockError, match="abandoned"):
            await backend.try_acquire(claim)  # a late repeat of its request
        assert not (await backend.inspect(name)).held


async def test_cancellation_never_leaves_it_held(nolua: str, name: str) -> None:
    async with asyncio.timeout(30), aiolock.connect(nolua) as locks:
        lock = locks.lock(name, ttl=10)
        for steps in range(12):
            await acquire_cancelled_after(lock, steps)
            assert not (await locks.status(name)).held, f"held after a cancel at step {steps}"
        holder = await lock.acquire()
        for steps in range(12):  # cancelled while waiting
            task = asyncio.create_task(locks.lock(name).acquire())
            for _ in range(steps):
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await holder.release()
        lease = await lock.acquire(timeout=0)
        await lease.release()


async def test_conflicts_are_retried_then_busy(
    off: str, name: str, admin: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another client writes between every WATCH and EXEC: MAX_CONFLICTS aborted EXEC,
    then Busy (the core waits and retries); once the writes stop, it is granted."""
    run = _redis_lend.Lent.run
    writes = 0

    async def meddling(self: Any, *commands: tuple[Any, ...]) -> list[Any]:
        nonlocal writes
        replies = await run(self, *commands)
        if commands[0][0] == "WATCH" and commands[1][0] == "HMGET" and writes < 2 * MAX_CONFLICTS:
            writes += 1
            await admin.incr(f"aiolock:lock:{{{name}}}:seq")  # a watched key changes
        return replies

    monkeypatch.setattr(_redis_lend.Lent, "run", meddling)
    async with asyncio.timeout(10), aiolock.connect(off) as locks:
        backend = locks.backend
        assert isinstance(backend, RedisTxnBackend)
        busy = await backend.try_acquire(_claim(name))
        assert isinstance(busy, Busy) and busy.retry_after <= 0.01
        assert backend.conflicts == MAX_CONFLICTS
        lease = await locks.lock(name).acquire(timeout=5)  # the core retried
        assert backend.conflicts == 2 * MAX_CONFLICTS
        assert lease.token == int(await admin.get(f"aiolock:lock:{{{name}}}:seq"))
        await lease.release()


# -- faults --------------------------------------------------------------------------------


async def test_paused_server_lease_lost_and_acquire_bounded(
    own_server: RedisServer, name: str,  # noqa: F811
) -> None:
    """A silent server: the held lease is lost within its ttl (its renewals time out),
    an acquire gives up within its timeout; once resumed, the lock works again."""
    async with aiolock.connect(own_server.url + "?scripting=off", request_timeout=0.5,
                               connect_timeout=0.5) as locks:
        lease = await locks.lock(name, ttl=1.0, on_lost="raise").acquire()
        own_server.pause()
        paused = time.monotonic()
        try:
            await asyncio.wait_for(lease.wait_lost(), 2.0)
            assert time.monotonic() - paused <= 1.3, "believed past its ttl (+ loop lag)"
            started = time.monotonic()
            with pytest.raises((aiolock.LockTimeout, aiolock.BackendUnavailable)):
                await locks.lock(name + "x").acquire(timeout=0.5)
            assert time.monotonic() - started < 1.5
        finally:
            own_server.resume()
        # once resumed it works again (its first answers may still come late on a busy
        # machine: a request past the 0.5 s request timeout is BackendUnavailable)
        deadline = time.monotonic() + 5
        while True:
            try:
                again = await locks.lock(name, ttl=5).acquire(timeout=3)  # the old lease expired
                break
            except aiolock.BackendUnavailable:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        assert again.token > lease.token
        await again.release()


@pytest.mark.parametrize("query", ["", "&health_check_interval=30"], ids=["lean", "redis-py"])
async def test_killed_connections_and_restart(
    own_server: RedisServer, name: str, query: str,  # noqa: F811
) -> None:
    """Every client connection killed under a held lease: the next renewal reconnects
    (the lease stays); a restart without persistence loses it at the next renewal."""
    admin = aioredis.Redis(port=own_server.port)
    url = own_server.url + "?scripting=off" + query
    try:
        async with asyncio.timeout(20), aiolock.connect(url) as locks:
            lease = await locks.lock(name, ttl=0.9, on_lost="raise").acquire()
            await admin.client_kill_filter(_type="normal", skipme=True)
            await asyncio.sleep(0.9)  # renewals after the kill
            assert not lease.lost
            await lease.release()
            assert not (await locks.status(name)).held
            lease = await locks.lock(name, ttl=0.9, on_lost="raise").acquire()
            own_server.restart()
            await asyncio.wait_for(lease.wait_lost(), 3.0)
            again = await locks.lock(name).acquire(timeout=3)
            await again.release()
    finally:
        await admin.aclose()


async def test_renewal_batch_survives_one_changing_key(
    off: str, name: str, admin: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A key of the batch changes between WATCH and EXEC (as a lease expiring does): the
    batch is renewed in halves, and only that lease is reported gone."""
    run = _redis_lend.Lent.run
    victim = f"aiolock:lock:{{{name}1}}"

    async def meddling(self: Any, *commands: tuple[Any, ...]) -> list[Any]:
        replies = await run(self, *commands)
        if commands[0][0] == "WATCH" and victim in commands[0]:
            await admin.hset(victim, "owner", "someone-else")
        return replies

    async with asyncio.timeout(10), aiolock.connect(off) as locks:
        backend = locks.backend
        assert isinstance(backend, RedisTxnBackend)
        claims = [_claim(f"{name}{i}") for i in range(4)]
        for claim in claims:
            assert isinstance(await backend.try_acquire(claim), Granted)
        monkeypatch.setattr(_redis_lend.Lent, "run", meddling)
        assert await backend.renew(claims) == [5000, None, 5000, 5000]
        assert backend.conflicts >= 1
        monkeypatch.undo()
        for claim in claims:
            await backend.release(claim)


# -- the two paths on the same keys ------------------------------------------------------


async def test_each_path_sees_the_other(off: str, lua: str, name: str) -> None:
    async with asyncio.timeout(15), aiolock.connect(off) as tx, aiolock.connect(lua) as ls:
        tokens = []
        records = Capability.HOLDERS in ls.capabilities  # the Lua path keeps them (issue 12)
        for holder, other in ((tx, ls), (ls, tx), (tx, ls)):
            label = type(holder.backend).__name__
            lease = await holder.lock(name, data=label).acquire()
            tokens.append(lease.token)
            with pytest.raises(aiolock.LockTimeout):
                await asyncio.create_task(other.lock(name).acquire(timeout=0))
            info = await other.status(name)
            assert info.held and info.token == lease.token
            if records:
                assert [h.data for h in info.held_by] == [label]
                assert info.held_by[0].since is not None and info.held_by[0].since < 5
            await lease.release()
        assert tokens == sorted(set(tokens))


async def test_release_wakes_a_waiter_of_the_other_path(off: str, lua: str, name: str) -> None:
    """ttl 30 s: without a signal a waiter would wait up to 10 s. A transaction release
    hands the lock (or the leadership) to the Lua path's registered waiter; a Lua release
    (nobody registered) signals the lock's channel, where the transaction path listens."""
    async with asyncio.timeout(20), aiolock.connect(off) as tx, aiolock.connect(lua) as ls:
        for (holder, waiter), make in itertools.product(
                ((tx, ls), (ls, tx)),
                (lambda c: c.lock(name, ttl=30),
                 lambda c: c.election(name, ttl=30).campaign(data="next"))):
            lease = await make(holder).acquire()
            waiting = asyncio.create_task(make(waiter).acquire(timeout=5))
            await asyncio.sleep(0.3)  # registered / subscribed
            await lease.release()
            started = time.monotonic()
            second = await waiting
            assert time.monotonic() - started < 1.0
            assert second.token > lease.token
            await second.release()


@pytest.mark.parametrize("fmt", ["v2", "v1"])
async def test_release_hands_over_to_a_registered_waiter(
    off: str, name: str, admin: Any, fmt: str,
) -> None:
    """The Lua path's queue as its scripts leave it, both registration formats (with and
    without a holder record): a dead entry is skipped, the live one gets the lock, its
    record and ttl, and one message on its inbox."""
    base, inbox, record = f"aiolock:lock:{{{name}}}", f"inbox-{name}", '{"d":"w"}'
    value = f"7000|{len(inbox)}|{inbox}{record}" if fmt == "v2" else f"7000|{inbox}"
    await admin.rpush(base + ":q", "dead", "live", "after")
    await admin.set(base + ":x:live", value, px=5000)
    await admin.set(base + ":x:after", value, px=5000)
    pubsub = admin.pubsub()
    await pubsub.subscribe(inbox)
    try:
        async with asyncio.timeout(10), aiolock.connect(off) as locks:
            lease = await locks.lock(name).acquire()
            await lease.release()
            owner, token, info = await admin.hmget(base, "owner", "token", "info")
            assert (owner, int(token)) == ("live", lease.token + 1)
            assert info == (record if fmt == "v2" else "")
            assert 6000 < await admin.pttl(base) <= 7000
            assert await admin.lrange(base + ":q", 0, -1) == ["after"]
            message = None
            while message is None or message["type"] != "message":
                message = await pubsub.get_message(timeout=2)
            assert message["data"] == f"{base}|live|{token}"
    finally:
        await pubsub.aclose()


async def test_a_hand_over_nobody_hears_is_never_taken_back(off: str, name: str,
                                                             admin: Any) -> None:
    """A Lua-path waiter registered before its process subscribed its inbox (a fast
    path's first ACQUIRE does so), then asking again at once (as it does once
    subscribed): a release on this path must not hand it the lock and then, finding the
    hand-over unheard, take it back -- by then the waiter's ACQUIRE may have found itself
    the owner, and a third claim would get the lock too. (This happened: CI, 4 processes
    on both paths, one overlap.) Skipped before the transaction, the waiter takes the
    freed lock or waits; never both it and another claim."""
    from aiolock.backends._redis_scripts import ACQUIRE

    base = f"aiolock:lock:{{{name}}}"
    async with asyncio.timeout(60), aiolock.connect(off) as locks, \
            aiolock.connect(off) as other:
        for _ in range(6):
            lease = await locks.lock(name, ttl=5).acquire(timeout=5)
            me = uuid.uuid4().hex
            keys = [base, base + ":seq", base + ":q", base + ":qt", base + ":x:" + me]
            args = [me, 5000, "0", 5000, f"aiolock:inbox:{me}", "", "0"]  # nobody subscribed
            assert (await admin.eval(ACQUIRE.source, 5, *keys, *args))[0] == 0  # registered
            ends, ask = time.monotonic() + 0.25, [*args[:3], 0, *args[4:]]  # (no new place)

            asks = asyncio.create_task(_asks_until(admin, ends, keys, ask))
            await asyncio.sleep(0)
            await lease.release()
            try:
                third = await other.lock(name, ttl=5).acquire(timeout=0.25)
            except aiolock.LockTimeout:
                third = None
            got = await asks
            assert got is None or third is None, "the lock went to two claims at once"
            if third is not None:
                await third.release()
            await admin.delete(base, base + ":q", keys[4])


async def test_without_numsub_every_registered_waiter_counts_as_live(
    server: PasswordRedis, admin: Any, name: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A user the ACL denies ``PUBSUB NUMSUB`` (the least-privilege line before it named
    it): releases still work and hand the lock to a registered Lua-path waiter, whether
    its process hears it or not (a killed one then holds it for its ttl); one INFO line
    says what to grant, without the password."""
    user = f"tx-{uuid.uuid4().hex[:8]}"
    await admin.execute_command("ACL", "SETUSER", user, "reset", "on", f">{SECRET}",
                                *LEAST.replace(" +pubsub|numsub", "").split())
    url = f"redis://{user}:{SECRET}@127.0.0.1:{server.port}/0?scripting=off"
    base = f"aiolock:lock:{{{name}}}"
    caplog.set_level("INFO", logger="aiolock")
    async with asyncio.timeout(15), aiolock.connect(url) as locks:
        for waiter in ("w1", "w2"):
            inbox = f"aiolock:inbox:{waiter}"  # nobody subscribed
            await admin.rpush(base + ":q", waiter)
            await admin.set(f"{base}:x:{waiter}", f"3000|{len(inbox)}|{inbox}", px=3000)
            lease = await locks.lock(name, ttl=5).acquire(timeout=5)
            await lease.release()
            assert await admin.hget(base, "owner") == waiter
            await admin.delete(base)
    told = [r.getMessage() for r in caplog.records if "NUMSUB" in r.getMessage()]
    assert len(told) == 1 and "+pubsub|numsub" in told[0], told
    assert SECRET not in caplog.text


async def _asks_until(admin: Any, ends: float, keys: list[str], args: list[Any]) -> float | None:
    """A Lua-path waiter asking (ACQUIRE, without registering again) until ``ends``:
    when it found itself the owner, or None."""
    from aiolock.backends._redis_scripts import ACQUIRE

    while time.monotonic() < ends:
        if (await admin.eval(ACQUIRE.source, 5, *keys, *args))[0] == 1:
            return time.monotonic()
    return None


#: The least-privilege ACL of the transaction path, as docs/backends/redis-noscripting.md
#: gives it (the words after ``user NAME on >PASSWORD``).
LEAST = ("~aiolock:* resetchannels &aiolock:* -@all +ping +watch +unwatch +multi "
         "+exec +get +set +mget +incr +del +hget +hmget +hset +pttl +pexpire +lrange +ltrim "
         "+llen +lpos +rpush +lrem +time +publish +subscribe +unsubscribe +pubsub|numsub "
         "+scan +zrange +hgetall")


def test_least_privileges_are_documented() -> None:
    doc = Path(__file__).resolve().parents[1] / "docs" / "backends" / "redis-noscripting.md"
    assert f"user aiolock-tx on >PASSWORD {LEAST}" in doc.read_text()


async def test_least_privileges(server: PasswordRedis, admin: Any, name: str) -> None:
    user = f"tx-{uuid.uuid4().hex[:8]}"
    await admin.execute_command("ACL", "SETUSER", user, "reset", "on", f">{SECRET}",
                                *LEAST.split())
    url = f"redis://{user}:{SECRET}@127.0.0.1:{server.port}/0?scripting=off"
    async with asyncio.timeout(15), aiolock.connect(url) as locks, \
            aiolock.connect(url) as other:
        async with locks.lock(name, ttl=0.6) as lease:
            waiting = asyncio.create_task(other.lock(name).acquire(timeout=5))
            await asyncio.sleep(0.5)  # a renewal; the waiter subscribed
            assert (await locks.status(name)).held_by[0].pid == os.getpid()
        second = await waiting
        assert second.token > lease.token
        await second.release()
        assert not (await locks.status(name, Kind.READ)).held  # (a Lua rwlock's keys)
        term = await locks.election(name, ttl=5).campaign(data="a").acquire()
        await term.proclaim("b")
        assert [i.name async for i in other.scan(name)] == [name]
        assert await other.election(name).campaign().force_release() is True
        await term.release()


async def test_no_script_ever_runs_with_scripting_off(server: PasswordRedis, name: str) -> None:
    admin = aioredis.Redis(port=server.port, decode_responses=True)
    try:
        await admin.config_resetstat()
        async with asyncio.timeout(10), \
                aiolock.connect(f"redis://127.0.0.1:{server.port}/0?scripting=off") as locks:
            async with locks.lock(name, ttl=1):
                await asyncio.sleep(0.5)  # a renewal
            await locks.status(name)
            term = await locks.election(name).campaign().acquire()
            await term.proclaim("x")
            assert [i.family async for i in locks.scan(name)] == ["elect"]
            assert await locks.election(name).campaign().force_release()
            await term.release()  # (revoked: a no-op)
        stats = await admin.info("commandstats")
    finally:
        await admin.aclose()
    assert not [k for k in stats if "eval" in k or "script" in k], stats
    assert "cmdstat_exec" in stats
