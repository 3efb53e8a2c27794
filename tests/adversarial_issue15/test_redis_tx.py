"""Redis without scripting (issue 15), from README.md and docs/backends/redis-noscripting.md:
the transaction path chosen by ``?scripting=off`` or automatically for a user without
``@scripting``; its interplay with the Lua path on the same keys."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal
import time
import uuid
from typing import Any

import pytest

import aiolock
from aiolock import Capability

from .._children import exclusion_run, held_for
from ..conftest import acquire_cancelled_after
from .conftest import SECRET, Child, lock_key, user_url

pytestmark = pytest.mark.timeout(60)
C = Capability


@pytest.fixture
def name() -> str:
    return f"a15-{uuid.uuid4().hex[:12]}"


# -- choosing the path -----------------------------------------------------------------


async def test_auto_falls_back_on_noscript_user_and_says_so(auto_url: str, name: str,
                                                            caplog: Any) -> None:
    """auto on a user without @scripting: transactions, one INFO line, capabilities honest."""
    caplog.set_level(logging.DEBUG, logger="aiolock")
    async with aiolock.connect(auto_url) as locks:
        caps = locks.capabilities
        assert not caps & {C.FAIR, C.RWLOCK, C.SEMAPHORE}, caps
        async with locks.lock(name, ttl=2) as lease:
            assert isinstance(lease.token, int)
            assert await locks.lock(name).locked()
    infos = [r for r in caplog.records if r.levelno == logging.INFO and r.name == "aiolock"]
    assert infos, "no INFO line on the aiolock logger about the fallback"
    assert SECRET not in caplog.text


async def test_scripting_on_for_noscript_user_is_access_denied(tx_redis: Any, name: str) -> None:
    url = user_url(tx_redis, "noscript", "?scripting=on")
    with pytest.raises(aiolock.AccessDenied) as err:
        async with aiolock.connect(url) as locks:
            await locks.lock(name, ttl=1).acquire(timeout=1)
    assert SECRET not in str(err.value) and SECRET not in repr(err.value)


async def test_scripting_off_sends_no_script(off_url: str, raw_redis: Any, name: str) -> None:
    """`off`: the server never sees a script, not even SCRIPT LOAD."""

    async def script_calls() -> int:
        stats = await raw_redis.info("commandstats")
        return sum(int(v["calls"]) for k, v in stats.items()
                   if k.split("|")[0].removeprefix("cmdstat_") in {"eval", "evalsha", "script",
                                                                    "eval_ro", "evalsha_ro", "fcall"})

    before = await script_calls()
    async with aiolock.connect(off_url) as locks:
        lock = locks.lock(name, ttl=1)
        async with lock:
            pass
        lease = await lock.acquire(timeout=0)
        await lease.extend(2)
        await locks.status(name)
        await lease.release()
    assert await script_calls() == before


async def test_least_privilege_user_works_with_off_and_auto(tx_redis: Any, name: str) -> None:
    """The doc's exact ACL line runs lock() with off, and with auto (SCRIPT LOAD refused)."""
    for query in ("?scripting=off", ""):
        url = user_url(tx_redis, "minimal", query)
        async with aiolock.connect(url) as locks, aiolock.connect(url) as other, \
                locks.lock(name, ttl=1, data="d") as lease:
            info = await other.status(name)
            assert info.held and info.token == lease.token
            assert [h.data for h in info.held_by] == ["d"]
            with pytest.raises(aiolock.LockTimeout):
                await other.lock(name, ttl=1).acquire(timeout=0)


async def test_user_without_transactions_either(tx_redis: Any, name: str) -> None:
    """Neither scripts nor MULTI: auto gives the scripts' refusal, off an AccessDenied."""
    for query in ("", "?scripting=off"):
        with pytest.raises(aiolock.AccessDenied) as err:
            async with aiolock.connect(user_url(tx_redis, "notx", query)) as locks:
                await locks.lock(name, ttl=1).acquire(timeout=1)
        assert SECRET not in str(err.value)


async def test_script_load_allowed_evalsha_refused(tx_redis: Any, name: str) -> None:
    """SCRIPT LOAD allowed, EVALSHA refused: auto falls back or refuses clearly, at once."""
    url = user_url(tx_redis, "noevalsha")
    async with asyncio.timeout(10):
        try:
            async with aiolock.connect(url) as locks, aiolock.connect(url) as other:
                async with locks.lock(name, ttl=1) as lease:
                    with pytest.raises(aiolock.LockTimeout):
                        await other.lock(name, ttl=1).acquire(timeout=0)
                assert not await other.lock(name).locked()
                assert isinstance(lease.token, int)
        except aiolock.AccessDenied as exc:
            assert SECRET not in str(exc)


async def test_renamed_script_commands_fall_back(renamed_redis: Any, name: str) -> None:
    """EVAL/EVALSHA/SCRIPT renamed away ("unknown command"): auto uses transactions."""
    async with aiolock.connect(f"redis://127.0.0.1:{renamed_redis.port}/0") as locks:
        assert C.FAIR not in locks.capabilities
        async with locks.lock(name, ttl=1) as lease:
            first = lease.token
        async with locks.lock(name, ttl=1) as lease:
            assert lease.token > first
    with pytest.raises(aiolock.LockError):
        async with aiolock.connect(f"redis://127.0.0.1:{renamed_redis.port}/0?scripting=on") as locks:
            await locks.lock(name, ttl=1).acquire(timeout=1)


# -- options ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["maybe", "true", "0", "offf", "Off "])
async def test_bad_scripting_value_refused(lua_url: str, value: str) -> None:
    for kwargs, url in (({}, f"{lua_url}?scripting={value}"), ({"scripting": value}, lua_url)):
        with pytest.raises(ValueError, match="auto") as err:
            async with aiolock.connect(url, **kwargs):
                pass
        message = str(err.value)
        assert "off" in message and "on" in message


async def test_bad_scripting_value_message_hides_password(tx_redis: Any) -> None:
    url = user_url(tx_redis, "noscript", "?scripting=nope")
    with pytest.raises(ValueError) as err:
        async with aiolock.connect(url):
            pass
    assert SECRET not in str(err.value)


@pytest.mark.parametrize("query", ["?scriptin=off", "?scripting=off&bogus=1", "?Scripting=off"])
async def test_unknown_option_refused(lua_url: str, query: str) -> None:
    with pytest.raises(ValueError):
        async with aiolock.connect(lua_url + query):
            pass


@pytest.mark.parametrize("url", [
    "redis+cluster://127.0.0.1:1,127.0.0.1:2?scripting=off",
    "redis+sentinel://127.0.0.1:1/mymaster?scripting=off",
    "redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3?scripting=off",
])
async def test_scripting_refused_by_topologies(url: str) -> None:
    with pytest.raises(ValueError, match="scripting"):
        async with aiolock.connect(url, connect_timeout=0.5):
            pass


async def test_wrong_password_access_denied_no_secret(tx_redis: Any, caplog: Any) -> None:
    caplog.set_level(logging.DEBUG)
    url = f"redis://noscript:{SECRET}x@127.0.0.1:{tx_redis.port}/0?scripting=off"
    with pytest.raises(aiolock.AccessDenied) as err:
        async with aiolock.connect(url) as locks:
            await locks.lock("x", ttl=1).acquire(timeout=0)
    assert SECRET not in str(err.value) and SECRET not in caplog.text


# -- what the path offers --------------------------------------------------------------


async def test_capabilities_declared_honestly(tx_url: str, name: str) -> None:
    """What the docs say is unsupported is refused with ValueError; what is declared works."""
    async with aiolock.connect(tx_url) as locks:
        caps = locks.capabilities
        assert {C.DISTRIBUTED, C.EVENTS, C.EXPIRY, C.HOLDERS} <= caps, caps
        with pytest.raises(ValueError):
            locks.lock(name, fair=True)
        with pytest.raises(ValueError):
            locks.rwlock(name)
        with pytest.raises(ValueError):
            locks.semaphore(name, limit=2)
        if C.ELECTION not in caps:
            with pytest.raises(ValueError):
                locks.election(name)
        lease = await locks.lock(name, ttl=2, data="x").acquire()  # no block: a revocation
        if C.SCAN in caps:                                         # would make it raise
            assert name in [i.name async for i in locks.scan(prefix=name)]
        else:
            with pytest.raises(ValueError):
                async for _ in locks.scan(prefix=name):
                    pass
        if C.REVOKE in caps:
            await locks.lock(name).force_release()
            await asyncio.sleep(1.2)
            assert lease.lost
        else:
            with pytest.raises(ValueError):
                await locks.lock(name).force_release()
            assert not lease.lost
        await lease.release()


async def test_reentrant_and_holder_record(tx_url: str, name: str) -> None:
    async with aiolock.connect(tx_url) as locks:
        lock = locks.lock(name, ttl=2, reentrant=True, data="job 7")
        async with lock as outer, lock as inner:
            assert inner.token == outer.token
            info = await locks.status(name)
            assert info.held and info.token == outer.token
            assert [h.data for h in info.held_by] == ["job 7"]
        assert not await lock.locked()
        with pytest.raises(aiolock.LockError):
            async with locks.lock(name, ttl=2) as _, locks.lock(name, ttl=2):
                pass


# -- safety ----------------------------------------------------------------------------


async def test_mutual_exclusion_and_tokens_many_tasks_both_paths(lua_url: str, auto_url: str,
                                                                 off_url: str, name: str) -> None:
    """Tasks on a Lua client, an auto (noscript) client and an off client, one name:
    never two inside, tokens strictly increasing in grant order."""
    async with aiolock.connect(lua_url) as a, aiolock.connect(auto_url) as b, \
            aiolock.connect(off_url) as c, aiolock.connect(auto_url) as d:
        overlaps, order = await exclusion_run([a, b, c, d], name, tasks=16, ttl=3, pause=0.002)
    assert overlaps == 0
    assert len(order) > 20
    assert all(x < y for x, y in itertools.pairwise(order)), order


@pytest.mark.slow
async def test_mutual_exclusion_across_processes(tx_redis: Any, children: list[Child],
                                                 name: str) -> None:
    await _processes(tx_redis, children, name, 8.0)


async def test_mutual_exclusion_across_processes_short(tx_redis: Any, children: list[Child],
                                                       name: str) -> None:
    await _processes(tx_redis, children, name, 1.5)


async def _processes(tx_redis: Any, children: list[Child], name: str, seconds: float) -> None:
    counter = user_url(tx_redis, "default")
    urls = [user_url(tx_redis, "noscript"), user_url(tx_redis, "default", "?scripting=off"),
            user_url(tx_redis, "default"), user_url(tx_redis, "noscript")]
    for url in urls:
        children.append(await Child.start("worker", "churn", url, name, str(seconds), "4", counter))
    tokens: list[int] = []
    for child in children:
        out, err = await child.finish(seconds + 40)
        lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
        assert "OVERLAPS" in lines, err[-2000:]
        assert lines["OVERLAPS"] == "0"
        mine = [int(t) for t in lines["TOKENS"].split(",") if t]
        assert mine, "a process never got the lock"
        assert all(x < y for x, y in itertools.pairwise(mine))
        tokens += mine
    assert len(set(tokens)) == len(tokens), "a token was given twice"


async def test_tokens_increase_alternating_paths(lua_url: str, auto_url: str, off_url: str,
                                                 name: str) -> None:
    async with aiolock.connect(lua_url) as lua, aiolock.connect(auto_url) as auto, \
            aiolock.connect(off_url) as off:
        last = 0
        for locks in (lua, auto, off, lua, off, auto, lua):
            lease = await locks.lock(name, ttl=2).acquire(timeout=2)
            assert lease.token > last
            last = lease.token
            for other in (lua, auto, off):  # held for both paths
                if other is not locks:
                    with pytest.raises(aiolock.LockTimeout):
                        await other.lock(name, ttl=2).acquire(timeout=0)
                    info = await other.status(name)
                    assert info.held and info.token == last
            await lease.release()


async def test_try_lock_never_waits(tx_url: str, lua_url: str, name: str) -> None:
    async with aiolock.connect(lua_url) as holder, aiolock.connect(tx_url) as other:
        lease = await holder.lock(name, ttl=10).acquire()
        for _ in range(5):
            start = time.monotonic()
            with pytest.raises(aiolock.LockTimeout):
                await other.lock(name, ttl=1).acquire(timeout=0)
            with pytest.raises(aiolock.LockTimeout):
                async with other.lock(name, ttl=1, timeout=0):
                    pass
            assert time.monotonic() - start < 0.5
        await lease.release()
        got = await other.lock(name, ttl=1).acquire(timeout=0)
        assert got.token > lease.token
        await got.release()


@pytest.mark.parametrize("holder_path", ["lua", "tx"])
async def test_waiter_woken_by_release_not_ttl(holder_path: str, lua_url: str, tx_url: str,
                                               name: str) -> None:
    """A transaction-path waiter (another connection) gets the lock right after a release
    through either path, long before the holder's 20 s ttl; and a Lua waiter after a
    transaction-path release."""
    async with aiolock.connect(lua_url if holder_path == "lua" else tx_url) as holder, \
            aiolock.connect(tx_url) as waiter_tx, aiolock.connect(lua_url) as waiter_lua:
        for waiter in (waiter_tx, waiter_lua):
            lease = await holder.lock(name, ttl=20).acquire()
            task = asyncio.create_task(waiter.lock(name, ttl=5).acquire(timeout=8))
            await asyncio.sleep(0.5)
            assert not task.done()
            released = time.monotonic()
            await lease.release()
            got = await task
            assert time.monotonic() - released < 0.5
            assert got.token > lease.token
            await got.release()


async def test_watchdog_keeps_lease_several_ttls(tx_url: str, lua_url: str, name: str) -> None:
    async with aiolock.connect(tx_url) as locks, aiolock.connect(lua_url) as other:
        await held_for(locks, other, name, ttl=0.6, seconds=1.6, step=0.1)


async def test_killed_holder_freed_within_ttl(tx_url: str, children: list[Child],
                                              name: str) -> None:
    ttl = 1.0
    child = await Child.start("worker", "hold", tx_url, name, str(ttl))
    children.append(child)
    token = int((await child.expect("GOT")).split()[1])
    await child.expect("WRITE")
    async with aiolock.connect(tx_url) as locks:
        waiter = asyncio.create_task(locks.lock(name, ttl=1).acquire(timeout=5))
        await asyncio.sleep(0.8)  # a renewal or two went through; the waiter waits
        assert not waiter.done()
        child.signal(signal.SIGKILL)
        killed = time.monotonic()
        lease = await waiter
        took = time.monotonic() - killed
        assert lease.token > token
        await lease.release()
    assert took < ttl + 0.3, f"taken over {took:.2f}s after kill -9 (ttl {ttl})"


@pytest.mark.parametrize("tamper", ["delete", "overwrite-owner", "wrong-type", "persist-then-delete"])
async def test_loss_detected_when_key_tampered(tamper: str, tx_url: str, raw_redis: Any,
                                               name: str) -> None:
    """The lock hash deleted / its owner replaced / replaced by a string behind the holder:
    the lease is lost within ttl/3 (+ slack), the body cancelled, LockLost raised."""
    ttl = 1.2
    async with aiolock.connect(tx_url) as locks:
        body_cancelled = False
        t0 = 0.0
        with pytest.raises(aiolock.LockLost):
            async with locks.lock(name, ttl=ttl) as lease:
                key = lock_key(name)
                assert await raw_redis.exists(key)
                if tamper == "delete":
                    await raw_redis.delete(key)
                elif tamper == "overwrite-owner":
                    await raw_redis.hset(key, "owner", "someone-else")
                elif tamper == "wrong-type":
                    await raw_redis.delete(key)
                    await raw_redis.set(key, "x", px=60_000)
                else:
                    await raw_redis.persist(key)
                    await raw_redis.delete(key)
                t0 = time.monotonic()
                try:
                    await asyncio.sleep(ttl * 3)
                except asyncio.CancelledError:
                    body_cancelled = True
                    raise
        assert body_cancelled
        # a WRONGTYPE reply is not "gone": then lost by its last confirmed expiry
        bound = ttl + 0.5 if tamper == "wrong-type" else ttl / 3 + 0.5
        assert time.monotonic() - t0 < bound
        assert lease.lost
        await lease.release()  # releasing a lost lease: no error, no damage
        if tamper == "wrong-type":
            assert await raw_redis.get(key) == b"x"
            await raw_redis.delete(key)


async def test_release_of_lost_lease_spares_new_holder(tx_url: str, lua_url: str,
                                                       raw_redis: Any, name: str) -> None:
    async with aiolock.connect(tx_url) as a, aiolock.connect(tx_url) as b, \
            aiolock.connect(lua_url) as c:
        for newcomer in (b, c):
            old = await a.lock(name, ttl=5, watchdog=False).acquire()
            await raw_redis.delete(lock_key(name))
            new = await newcomer.lock(name, ttl=5).acquire(timeout=1)
            assert new.token > old.token
            with pytest.raises(aiolock.LockError):
                await old.extend(5)
            with contextlib.suppress(aiolock.LockLost):
                await old.release()
            info = await a.status(name)
            assert info.held and info.token == new.token
            assert not new.lost
            await asyncio.sleep(0.1)
            with pytest.raises(aiolock.LockTimeout):
                await a.lock(name, ttl=1).acquire(timeout=0)
            await new.release()


async def test_cancellation_at_random_points_never_leaks(tx_url: str, lua_url: str,
                                                         name: str) -> None:
    """Acquires cancelled after 0..60 loop steps, free and contended: afterwards the lock
    is free at once (nothing left held by nobody)."""
    async with aiolock.connect(tx_url) as locks, aiolock.connect(lua_url) as other:
        lock = locks.lock(name, ttl=30)
        for steps in range(0, 60, 3):
            await acquire_cancelled_after(lock, steps)
            assert not await other.lock(name).locked(), f"held by nobody after {steps} steps"
        for steps in range(0, 60, 5):  # contended: the cancelled one is waiting
            held = await other.lock(name, ttl=30).acquire()
            await acquire_cancelled_after(lock, steps)
            await held.release()
            await asyncio.sleep(0.05)
            lease = await other.lock(name, ttl=30).acquire(timeout=0)
            await lease.release()


async def test_cancel_release_at_random_points(tx_url: str, lua_url: str, name: str) -> None:
    async with aiolock.connect(tx_url) as locks, aiolock.connect(lua_url) as other:
        for steps in range(0, 30, 2):
            lease = await locks.lock(name, ttl=30).acquire()
            task = asyncio.create_task(lease.release())
            for _ in range(steps):
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await lease.release()  # again: safe
            got = await other.lock(name, ttl=30).acquire(timeout=2)
            assert got.token > lease.token
            await got.release()


async def test_watchdog_false_expires_and_extend(tx_url: str, lua_url: str, name: str) -> None:
    async with aiolock.connect(tx_url) as locks, aiolock.connect(lua_url) as other:
        lease = await locks.lock(name, ttl=0.5, watchdog=False).acquire()
        await asyncio.sleep(0.3)
        await lease.extend(1.0)
        await asyncio.sleep(0.4)
        assert not lease.lost
        with pytest.raises(aiolock.LockTimeout):
            await other.lock(name, ttl=1).acquire(timeout=0)
        await asyncio.sleep(0.8)
        assert lease.lost
        got = await other.lock(name, ttl=1).acquire(timeout=0.5)
        assert got.token > lease.token
        await got.release()


# -- more: options in the URL, batches, the two paths together -------------------------


@pytest.mark.parametrize("query", ["?scripting=", "?bogus=", "?connect_timeout="])
async def test_empty_query_value_not_silently_dropped(lua_url: str, query: str) -> None:
    """An empty value is not one of the three, and an unknown option is refused even blank."""
    with pytest.raises(ValueError):
        async with aiolock.connect(lua_url + query):
            pass


@pytest.mark.parametrize("query", ["?scripting=off&scripting=on", "?scripting=on&scripting=off"])
async def test_conflicting_repeated_option_refused(lua_url: str, query: str) -> None:
    """Two different values for one option: one of them would be silently dropped."""
    with pytest.raises(ValueError):
        async with aiolock.connect(lua_url + query):
            pass


@pytest.mark.parametrize("lock_name", ["a{b}c", "50%{x}", "}{", "%7B", "\u540d\U0001f512"])
async def test_escaped_names_same_lock_on_both_paths(lua_url: str, tx_url: str,
                                                     lock_name: str) -> None:
    lock_name = f"{uuid.uuid4().hex[:6]}{lock_name}"
    async with aiolock.connect(lua_url) as lua, aiolock.connect(tx_url) as tx:
        for holder, other in ((tx, lua), (lua, tx)):
            async with holder.lock(lock_name, ttl=2, data="h") as lease:
                with pytest.raises(aiolock.LockTimeout):
                    await other.lock(lock_name, ttl=2).acquire(timeout=0)
                info = await other.status(lock_name)
                assert info.held and info.token == lease.token
                assert [h.data for h in info.held_by] == ["h"]
            assert not await other.lock(lock_name).locked()


async def test_lua_revocation_of_tx_holder_detected(lua_url: str, tx_url: str, name: str) -> None:
    ttl = 1.5
    async with aiolock.connect(lua_url) as lua, aiolock.connect(tx_url) as tx:
        assert C.REVOKE in lua.capabilities
        lease = await tx.lock(name, ttl=ttl).acquire()
        assert name in [i.name async for i in lua.scan(prefix=name)]
        await lua.lock(name).force_release()
        start = time.monotonic()
        await asyncio.wait_for(lease.wait_lost(), ttl + 1)
        assert lease.lost
        assert time.monotonic() - start < ttl / 3 + 0.5
        got = await lua.lock(name, ttl=ttl).acquire(timeout=0)
        assert got.token > lease.token
        await lease.release()
        assert (await tx.status(name)).held
        await got.release()


@pytest.mark.parametrize("tamper", ["delete", "wrong-type"])
@pytest.mark.parametrize("path", ["lua", "tx"])
async def test_tampered_lease_spares_rest_of_renewal_batch(path: str, tamper: str, lua_url: str,
                                                           auto_url: str, raw_redis: Any,
                                                           name: str) -> None:
    """One lease of a watchdog batch deleted or replaced by a string: the others stay held."""
    ttl = 0.6
    async with aiolock.connect(lua_url if path == "lua" else auto_url) as locks:
        leases = [await locks.lock(f"{name}-{i}", ttl=ttl).acquire() for i in range(12)]
        victim = lock_key(f"{name}-5")
        await raw_redis.delete(victim)
        if tamper == "wrong-type":
            await raw_redis.set(victim, "x", px=30_000)
        await asyncio.sleep(ttl * 2.5)
        lost = [i for i, lease in enumerate(leases) if lease.lost]
        for lease in leases:
            await lease.release()
        await raw_redis.delete(victim)
    assert lost == [5]


@pytest.fixture
def private_redis() -> Any:
    """A redis-server of the test alone (restarted by it), with the ACL users."""
    from ..adversarial.servers import PasswordRedis
    from .conftest import ACL_USERS

    server = PasswordRedis(users=ACL_USERS).start()
    yield server
    server.close()


async def test_server_restart_loses_lease_then_works(private_redis: Any, name: str) -> None:
    url = user_url(private_redis, "noscript")
    ttl = 1.5
    async with aiolock.connect(url) as locks:
        assert C.FAIR not in locks.capabilities
        lease = await locks.lock(name, ttl=ttl).acquire()
        private_redis.restart()
        restarted = time.monotonic()
        await asyncio.wait_for(lease.wait_lost(), ttl + 2)
        assert time.monotonic() - restarted < ttl / 3 + 1.0
        async with locks.lock(name, ttl=ttl, timeout=5) as again:
            assert isinstance(again.token, int)
            info = await locks.status(name)
            assert info.held and info.token == again.token


async def test_waiter_survives_pubsub_kill(auto_url: str, raw_redis: Any, name: str) -> None:
    """The pub/sub connections killed while a transaction-path waiter waits: the release
    still reaches it quickly (a reconnect retries at once), well before the 20 s ttl."""
    async with aiolock.connect(auto_url) as holder, aiolock.connect(auto_url) as waiter:
        lease = await holder.lock(name, ttl=20).acquire()
        task = asyncio.create_task(waiter.lock(name, ttl=5).acquire(timeout=10))
        await asyncio.sleep(0.3)
        await raw_redis.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
        await asyncio.sleep(0.5)
        released = time.monotonic()
        await lease.release()
        got = await task
        assert time.monotonic() - released < 1.5
        await got.release()
