"""Adversarial: one Redis lock shared by the Lua path and the transaction path
(``?scripting=off`` or an ACL user without @scripting), per
docs/backends/redis-noscripting.md: exclusion, increasing tokens, killed waiters of
either path, prompt hand-over on release, revocation from either path, least privileges.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

import aiolock

from .adversarial.conftest import SECRET, acl_redis  # noqa: F401 -- a fixture
from .adversarial.servers import PasswordRedis

ROOT = Path(__file__).resolve().parents[1]

LEAST = ("~aiolock:* resetchannels &aiolock:* -@all +ping +watch +unwatch +multi "
         "+exec +get +set +mget +incr +del +hget +hmget +hset +pttl +pexpire +lrange +ltrim "
         "+llen +lpos +rpush +lrem +time +publish +subscribe +unsubscribe +pubsub|numsub "
         "+scan +zrange +hgetall")

WAITER = """
import asyncio, sys
import aiolock

async def main(url, name, ttl):
    async with aiolock.connect(url) as locks:
        task = asyncio.create_task(locks.lock(name, ttl=ttl).acquire(timeout=60))
        await asyncio.sleep(0.4)
        print("WAITING", flush=True)
        lease = await task
        print("GOT", lease.token, flush=True)
        await asyncio.sleep(60)

asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
"""


@pytest.fixture
async def admin(acl_redis: PasswordRedis) -> AsyncIterator[Any]:  # noqa: F811
    client = aioredis.Redis(port=acl_redis.port, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
def name() -> str:
    return f"adv2p-{uuid.uuid4().hex}"


def urls(server: PasswordRedis) -> dict[str, str]:
    port = server.port
    return {
        "lua": f"redis://127.0.0.1:{port}/0",
        "off": f"redis://127.0.0.1:{port}/0?scripting=off",
        "noscript": f"redis://noscript:{SECRET}@127.0.0.1:{port}/0",
    }


async def least_user(admin: Any, server: PasswordRedis, numsub: bool = True) -> str:
    user = f"tx-{uuid.uuid4().hex[:8]}"
    words = LEAST if numsub else LEAST.replace(" +pubsub|numsub", "")
    await admin.execute_command("ACL", "SETUSER", user, "reset", "on", f">{SECRET}",
                                *words.split())
    return f"redis://{user}:{SECRET}@127.0.0.1:{server.port}/0?scripting=off"


async def spawn_waiter(url: str, name: str, ttl: float = 8) -> asyncio.subprocess.Process:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", WAITER, url, name, str(ttl), env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 8)
    assert line.startswith(b"WAITING"), line
    return proc


def kill9(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        os.kill(proc.pid, signal.SIGKILL)


# -- exclusion and tokens across the paths -------------------------------------------


@pytest.mark.slow
async def test_mixed_paths_exclusion_and_tokens(acl_redis: PasswordRedis,  # noqa: F811
                                                admin: Any, name: str) -> None:
    u = urls(acl_redis)
    tx = await least_user(admin, acl_redis)
    inside = 0
    tokens: list[int] = []
    overlaps = 0

    async def worker(locks: aiolock.Locks, stop: float) -> None:
        nonlocal inside, overlaps
        while time.monotonic() < stop:
            try:
                lease = await locks.lock(name, ttl=2).acquire(timeout=2)
            except aiolock.LockTimeout:
                continue
            inside += 1
            if inside > 1:
                overlaps += 1
            tokens.append(lease.token)
            await asyncio.sleep(0.002)
            inside -= 1
            await lease.release()

    async with asyncio.timeout(9), aiolock.connect(u["lua"]) as a, \
            aiolock.connect(u["lua"]) as b, aiolock.connect(u["off"]) as c, \
            aiolock.connect(u["noscript"]) as d, aiolock.connect(tx) as e:
        stop = time.monotonic() + 3
        await asyncio.gather(*(worker(x, stop) for x in (a, b, c, d, e) for _ in range(4)))
    assert overlaps == 0
    assert len(tokens) >= 20
    assert all(y > x for x, y in pairwise(tokens)), "tokens not strictly increasing"


# -- prompt hand-over on release -------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("holder,waiter", [("lua", "off"), ("off", "lua"), ("off", "off"),
                                           ("lua", "noscript"), ("noscript", "lua")])
async def test_release_wakes_other_path_promptly(acl_redis: PasswordRedis,  # noqa: F811
                                                 name: str, holder: str, waiter: str) -> None:
    u = urls(acl_redis)
    async with asyncio.timeout(9), aiolock.connect(u[holder]) as h, \
            aiolock.connect(u[waiter]) as w:
        for _ in range(3):
            lease = await h.lock(name, ttl=9).acquire()
            task = asyncio.create_task(w.lock(name, ttl=9).acquire(timeout=8))
            await asyncio.sleep(0.3)
            released = time.monotonic()
            await lease.release()
            got = await task
            delay = time.monotonic() - released
            assert delay < 0.5, f"hand-over took {delay:.3f} s (ttl/3 = 3 s)"
            assert got.token > lease.token
            await got.release()


# -- killed waiters --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("holder,dead,live", [
    ("off", "lua", "lua"), ("off", "lua", "off"), ("lua", "lua", "off"),
    ("lua", "off", "lua"), ("off", "off", "off"), ("least", "lua", "lua"),
    ("least", "lua", "least"), ("lua", "least", "least")])
async def test_killed_waiter_does_not_hold_up_live(acl_redis: PasswordRedis,  # noqa: F811
                                                   admin: Any, name: str, holder: str,
                                                   dead: str, live: str) -> None:
    u = urls(acl_redis)
    u["least"] = await least_user(admin, acl_redis)
    async with asyncio.timeout(9.5), aiolock.connect(u[holder]) as h, \
            aiolock.connect(u[live]) as w:
        lease = await h.lock(name, ttl=8).acquire()
        proc = await spawn_waiter(u[dead], name)
        try:
            kill9(proc)
            await proc.wait()
            task = asyncio.create_task(w.lock(name, ttl=8).acquire(timeout=7))
            await asyncio.sleep(0.3)
            released = time.monotonic()
            await lease.release()
            got = await task
            delay = time.monotonic() - released
            assert delay < 1.0, f"live waiter got it after {delay:.3f} s"
            assert got.token > lease.token
            await got.release()
        finally:
            kill9(proc)


@pytest.mark.slow
async def test_without_numsub_still_works(acl_redis: PasswordRedis,  # noqa: F811
                                          admin: Any, name: str) -> None:
    """Docs: without ``+pubsub|numsub`` every registered waiter counts as live; a killed
    one holds the lock until its lease ttl lapses; live waiters still get it after."""
    u = urls(acl_redis)
    tx = await least_user(admin, acl_redis, numsub=False)
    async with asyncio.timeout(9.5), aiolock.connect(tx) as h, aiolock.connect(tx) as w, \
            aiolock.connect(u["lua"]) as lw:
        # plain hand-over between live waiters
        lease = await h.lock(name, ttl=3).acquire()
        task = asyncio.create_task(lw.lock(name, ttl=3).acquire(timeout=5))
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        await lease.release()
        got = await task
        assert time.monotonic() - t0 < 0.5
        await got.release()
        # a killed Lua waiter (ttl 3 s): the live one waits at most about that ttl
        lease = await h.lock(name, ttl=3).acquire()
        proc = await spawn_waiter(u["lua"], name, ttl=3)
        try:
            kill9(proc)
            await proc.wait()
            task = asyncio.create_task(w.lock(name, ttl=3).acquire(timeout=6))
            await asyncio.sleep(0.2)
            released = time.monotonic()
            await lease.release()
            got = await task
            assert time.monotonic() - released < 4.0
            assert got.token > lease.token
            await got.release()
        finally:
            kill9(proc)


# -- revocation from either path -------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("holder,revoker,waiter", [
    ("off", "lua", "lua"), ("lua", "off", "off"), ("lua", "off", "lua"),
    ("off", "lua", "off"), ("least", "lua", "least"), ("lua", "least", "lua")])
async def test_revocation_across_paths(acl_redis: PasswordRedis,  # noqa: F811
                                       admin: Any, name: str, holder: str, revoker: str,
                                       waiter: str) -> None:
    u = urls(acl_redis)
    u["least"] = await least_user(admin, acl_redis)
    ttl = 1.5
    async with asyncio.timeout(9), aiolock.connect(u[holder]) as h, \
            aiolock.connect(u[revoker]) as r, aiolock.connect(u[waiter]) as w:
        lease = await h.lock(name, ttl=ttl, on_lost="raise").acquire()
        task = asyncio.create_task(w.lock(name, ttl=5).acquire(timeout=6))
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        assert await r.lock(name).force_release() is True
        got = await task
        assert time.monotonic() - t0 < 0.6, "waiter not woken promptly by the revocation"
        assert got.token > lease.token
        await asyncio.wait_for(lease.wait_lost(), ttl / 3 + 1.0)
        assert lease.lost
        # the revoked holder's release must leave the new holder alone
        await lease.release()
        info = await r.status(name)
        assert info.held and info.token == got.token
        await got.release()
        later = await h.lock(name, ttl=2).acquire(timeout=2)
        assert later.token > got.token
        await later.release()


@pytest.mark.slow
@pytest.mark.parametrize("holder,live", [("lua", "off"), ("off", "lua"), ("least", "least"),
                                         ("lua", "lua")])
async def test_several_killed_lua_waiters_ahead(acl_redis: PasswordRedis,  # noqa: F811
                                                admin: Any, name: str, holder: str,
                                                live: str) -> None:
    """Three Lua-path waiters registered then killed with -9, ahead of a live waiter:
    the release goes past them at once."""
    u = urls(acl_redis)
    u["least"] = await least_user(admin, acl_redis)
    async with asyncio.timeout(9.5), aiolock.connect(u[holder]) as h, \
            aiolock.connect(u[live]) as w:
        lease = await h.lock(name, ttl=8).acquire()
        procs = list(await asyncio.gather(*(spawn_waiter(u["lua"], name) for _ in range(3))))
        try:
            for p in procs:
                kill9(p)
                await p.wait()
            task = asyncio.create_task(w.lock(name, ttl=8).acquire(timeout=7))
            await asyncio.sleep(0.3)
            released = time.monotonic()
            await lease.release()
            got = await task
            delay = time.monotonic() - released
            assert delay < 1.0, f"live waiter got it after {delay:.3f} s"
            assert got.token > lease.token
            await got.release()
        finally:
            for p in procs:
                kill9(p)


@pytest.mark.slow
@pytest.mark.parametrize("holder", ["off", "least", "lua"])
async def test_hand_over_to_live_lua_process(acl_redis: PasswordRedis,  # noqa: F811
                                             admin: Any, name: str, holder: str) -> None:
    """A live Lua-path waiter in another process behind a killed one gets it promptly
    when the holder (either path) releases."""
    u = urls(acl_redis)
    u["least"] = await least_user(admin, acl_redis)
    async with asyncio.timeout(9.5), aiolock.connect(u[holder]) as h:
        lease = await h.lock(name, ttl=8).acquire()
        dead = await spawn_waiter(u["lua"], name)
        kill9(dead)
        await dead.wait()
        live = await spawn_waiter(u["lua"], name)
        try:
            assert live.stdout is not None
            released = time.monotonic()
            await lease.release()
            line = await asyncio.wait_for(live.stdout.readline(), 7)
            delay = time.monotonic() - released
            assert line.startswith(b"GOT"), line
            assert int(line.split()[1]) > lease.token
            assert delay < 1.0, f"live Lua process got it after {delay:.3f} s"
            info = await h.status(name)
            assert info.held and info.token == int(line.split()[1])
        finally:
            kill9(live)
            await live.wait()
            kill9(dead)


# -- Sentinel --------------------------------------------------------------------------


@pytest.mark.slow
def test_sentinel_refuses_scripting_option() -> None:
    for value in ("off", "on", "auto"):
        with pytest.raises(ValueError):
            aiolock.connect(f"redis+sentinel://127.0.0.1:1/svc?scripting={value}")


@pytest.mark.slow
@pytest.mark.parametrize("via_sentinel", ["holder", "waiter"])
async def test_sentinel_lua_and_direct_transactions(redis_sentinel: Any,
                                                    name: str, via_sentinel: str) -> None:
    """A Sentinel client (Lua) and a ``?scripting=off`` client on the master share one
    lock: prompt hand-over both ways, increasing tokens, revocation across."""
    off = f"redis://127.0.0.1:{redis_sentinel.master.port}/0?scripting=off"
    async with asyncio.timeout(9.5), aiolock.connect(redis_sentinel.url) as s, \
            aiolock.connect(off) as t:
        h, w = (s, t) if via_sentinel == "holder" else (t, s)
        lease = await h.lock(name, ttl=6).acquire()
        task = asyncio.create_task(w.lock(name, ttl=6, on_lost="raise").acquire(timeout=5))
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        await lease.release()
        got = await task
        assert time.monotonic() - t0 < 0.5
        assert got.token > lease.token
        # revoke the waiter-now-holder from the other side; holder finds out within ttl/3
        task2 = asyncio.create_task(h.lock(name, ttl=6).acquire(timeout=5))
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        assert await h.lock(name).force_release() is True
        third = await task2
        assert time.monotonic() - t0 < 0.6
        assert third.token > got.token
        await asyncio.wait_for(got.wait_lost(), 2 + 1.0)
        await got.release()
        assert (await t.status(name)).token == third.token
        await third.release()


# -- cancelled waiters, revocations under contention -----------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("holder,cancelled,live", [
    ("off", "lua", "off"), ("least", "lua", "lua"), ("lua", "lua", "off"),
    ("lua", "off", "lua"), ("off", "off", "lua")])
async def test_cancelled_waiter_in_live_process(acl_redis: PasswordRedis,  # noqa: F811
                                                admin: Any, name: str, holder: str,
                                                cancelled: str, live: str) -> None:
    """A waiter cancelled while its process (and inbox) stays alive: a release by either
    path goes on to the live waiter promptly, and nothing is left held."""
    u = urls(acl_redis)
    u["least"] = await least_user(admin, acl_redis)
    async with asyncio.timeout(9.5), aiolock.connect(u[holder]) as h, \
            aiolock.connect(u[cancelled]) as c, aiolock.connect(u[live]) as w:
        for _ in range(3):
            lease = await h.lock(name, ttl=8).acquire()
            doomed = [asyncio.create_task(c.lock(name, ttl=8).acquire(timeout=7))
                      for _ in range(3)]
            await asyncio.sleep(0.2)
            task = asyncio.create_task(w.lock(name, ttl=8).acquire(timeout=7))
            await asyncio.sleep(0.2)
            for d in doomed:
                d.cancel()
            await asyncio.gather(*doomed, return_exceptions=True)
            released = time.monotonic()
            await lease.release()
            got = await task
            delay = time.monotonic() - released
            assert delay < 1.0, f"live waiter got it after {delay:.3f} s"
            assert got.token > lease.token
            await got.release()
            assert not (await h.status(name)).held


@pytest.mark.slow
@pytest.mark.parametrize("revoker", ["lua", "off", "least"])
async def test_revocation_skips_killed_lua_waiter(acl_redis: PasswordRedis,  # noqa: F811
                                                  admin: Any, name: str,
                                                  revoker: str) -> None:
    u = urls(acl_redis)
    u["least"] = await least_user(admin, acl_redis)
    async with asyncio.timeout(9.5), aiolock.connect(u["lua"]) as h, \
            aiolock.connect(u[revoker]) as r, aiolock.connect(u["off"]) as w:
        lease = await h.lock(name, ttl=3).acquire()
        proc = await spawn_waiter(u["lua"], name)
        try:
            kill9(proc)
            await proc.wait()
            task = asyncio.create_task(w.lock(name, ttl=8).acquire(timeout=7))
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            assert await r.lock(name).force_release() is True
            got = await task
            assert time.monotonic() - t0 < 1.0
            assert got.token > lease.token
            await asyncio.wait_for(lease.wait_lost(), 2.0)
            await got.release()
        finally:
            kill9(proc)


@pytest.mark.slow
async def test_revocation_storm_under_mixed_contention(acl_redis: PasswordRedis,  # noqa: F811
                                                       admin: Any, name: str) -> None:
    """Workers of both paths contend while revokers of both paths revoke: every token
    granted is unique, the server's token never goes back, and everything ends free."""
    u = urls(acl_redis)
    tx = await least_user(admin, acl_redis)
    tokens: list[int] = []
    seen: list[int] = []

    async def worker(locks: aiolock.Locks, stop: float) -> None:
        while time.monotonic() < stop:
            try:
                lease = await locks.lock(name, ttl=1.5).acquire(timeout=1)
            except aiolock.LockTimeout:
                continue
            tokens.append(lease.token)
            await asyncio.sleep(0.005)
            await lease.release()

    async def revoker(locks: aiolock.Locks, stop: float) -> None:
        while time.monotonic() < stop:
            await locks.lock(name).force_release()
            info = await locks.status(name)
            if info.token is not None:
                seen.append(info.token)
            await asyncio.sleep(0.01)

    async with asyncio.timeout(9), aiolock.connect(u["lua"]) as a, \
            aiolock.connect(u["off"]) as b, aiolock.connect(tx) as c:
        stop = time.monotonic() + 3
        await asyncio.gather(*(worker(x, stop) for x in (a, b, c) for _ in range(3)),
                             revoker(a, stop), revoker(c, stop))
        assert not (await a.status(name)).held
        final = await a.lock(name, ttl=2).acquire(timeout=2)
        await final.release()
    assert len(tokens) == len(set(tokens)), "a token was granted twice"
    assert len(tokens) >= 10
    assert final.token > max(tokens)


@pytest.mark.slow
@pytest.mark.parametrize("holder", ["lua", "off", "least", "noscript"])
async def test_release_past_only_killed_waiters_frees_the_lock(
    acl_redis: PasswordRedis, admin: Any, name: str, holder: str,  # noqa: F811
) -> None:
    """Only killed Lua-path waiters registered: the release leaves the lock free at once
    (not handed to a dead process), for a try-lock of either path."""
    u = urls(acl_redis)
    u["least"] = await least_user(admin, acl_redis)
    async with asyncio.timeout(9.5), aiolock.connect(u[holder]) as h, \
            aiolock.connect(u["lua"]) as lw, aiolock.connect(u["off"]) as tw:
        lease = await h.lock(name, ttl=8).acquire()
        procs = list(await asyncio.gather(*(spawn_waiter(u["lua"], name) for _ in range(2))))
        try:
            for p in procs:
                kill9(p)
                await p.wait()
            await lease.release()
            assert not (await h.status(name)).held, "handed to a killed waiter"
            for locks in (lw, tw):
                got = await locks.lock(name, ttl=2).acquire(timeout=0.3)
                assert got.token > lease.token
                await got.release()
        finally:
            for p in procs:
                kill9(p)


# -- election across the paths ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("leader_path,observer_path", [("off", "lua"), ("lua", "off"),
                                                       ("least", "lua"), ("lua", "least")])
async def test_election_observer_wakes_on_other_path(acl_redis: PasswordRedis,  # noqa: F811
                                                     admin: Any, name: str,
                                                     leader_path: str,
                                                     observer_path: str) -> None:
    """Grants, proclaims and releases on one path wake ``observe()`` on the other at once
    (well before its ttl/2 = 4.5 s timer)."""
    u = urls(acl_redis)
    u["least"] = await least_user(admin, acl_redis)
    seen: list[tuple[float, Any]] = []
    async with asyncio.timeout(9.5), aiolock.connect(u[leader_path]) as lp, \
            aiolock.connect(u[observer_path]) as op:

        async def watch() -> None:
            async for leader in op.election(name, ttl=9).observe():
                seen.append((time.monotonic(), None if leader is None else leader.data))

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0.3)

        async def changed(expect: Any) -> float:
            t0 = time.monotonic()
            while not (seen and seen[-1][1] == expect):
                assert time.monotonic() - t0 < 1.0, f"observer did not see {expect!r}: {seen}"
                await asyncio.sleep(0.01)
            return time.monotonic() - t0

        term = await lp.election(name, ttl=9).campaign(data="a").acquire()
        await changed("a")
        await term.proclaim("b")
        await changed("b")
        await term.release()
        await changed(None)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
