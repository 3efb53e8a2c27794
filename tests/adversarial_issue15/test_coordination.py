"""Holders, listing, revocation and leader elections on Redis without scripting (issue 15),
written from README.md, SPEC.md §7-8 and docs/backends/redis-noscripting.md alone.

The transaction path (``?scripting=off``, or the automatic fallback for an ACL user
without ``@scripting``) next to the Lua path on the same keys: revocations seen at the next
renewal, tokens that keep increasing, waiters served after a revocation, elections whose
candidates and observers sit on both paths, ``scan()`` with awkward prefixes, the
documented least-privilege ACL (and one command less), and cancellation at random points
of ``force_release()``, ``proclaim()`` and ``campaign()``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

import aiolock
from aiolock import Capability, Kind

from .._children import Child
from ..adversarial.servers import PasswordRedis
from ..conftest import session_server
from .conftest import SECRET

pytestmark = pytest.mark.timeout(90)

#: the least-privilege line of docs/backends/redis-noscripting.md, word for word (its
#: commands; the keys ``~aiolock:*`` and channels ``&aiolock:*`` are added below)
DOC_LINE = (
    "+ping +watch +unwatch +multi +exec +get +set +mget +incr +del +hget +hmget +hset +pttl"
    " +pexpire +lrange +ltrim +llen +time +publish +subscribe +unsubscribe +pubsub|numsub +scan +zrange"
    " +hgetall")
DOC_COMMANDS = DOC_LINE.split()


def _acl(user: str, commands: list[str], keys: str = "~aiolock:*",
         channels: str = "&aiolock:*") -> str:
    return f"{user} on >{SECRET} {keys} resetchannels {channels} -@all {' '.join(commands)}"


def _users() -> list[str]:
    users = [
        "default on nopass ~* &* +@all",
        f"noscript on >{SECRET} ~* &* +@all -@scripting",
        _acl("aiolock-tx", DOC_COMMANDS),
    ]
    for cmd in DOC_COMMANDS:  # one command of the documented line less
        users.append(_acl(f"no-{cmd[1:]}", [c for c in DOC_COMMANDS if c != cmd]))
    users.append(_acl("no-channels", DOC_COMMANDS, channels=""))
    users.append(_acl("no-keys", DOC_COMMANDS, keys="~other:*"))
    return users


coord_redis = session_server("coord_redis", lambda: PasswordRedis(users=_users()),
                             "redis-server with the documented no-scripting ACL user.")


def url_of(server: PasswordRedis, user: str, query: str = "") -> str:
    cred = "" if user == "default" else f"{user}:{SECRET}@"
    return f"redis://{cred}127.0.0.1:{server.port}/0{query}"


@pytest.fixture
def name() -> str:
    return f"c15-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def urls(coord_redis: PasswordRedis) -> dict[str, str]:
    """lua: scripts; tx: scripting=off; auto: the fallback of the documented ACL user."""
    return {"lua": url_of(coord_redis, "default"),
            "tx": url_of(coord_redis, "default", "?scripting=off"),
            "auto": url_of(coord_redis, "aiolock-tx")}


@pytest.fixture
async def conns(urls: dict[str, str]) -> AsyncIterator[dict[str, aiolock.Locks]]:
    """Two connections per path: ``lua``, ``lua2``, ``tx``, ``tx2`` (``tx2``: the
    documented ACL user, automatic fallback)."""
    opened = {"lua": aiolock.connect(urls["lua"]), "lua2": aiolock.connect(urls["lua"]),
              "tx": aiolock.connect(urls["tx"]), "tx2": aiolock.connect(urls["auto"])}
    for locks in opened.values():
        await locks.__aenter__()
    yield opened
    for locks in opened.values():
        await locks.aclose()


@pytest.fixture
async def raw(coord_redis: PasswordRedis) -> AsyncIterator[Any]:
    import redis.asyncio as aioredis

    client = aioredis.Redis(host="127.0.0.1", port=coord_redis.port)
    yield client
    await client.aclose()


def other(path: str) -> str:
    return {"lua": "lua2", "tx": "tx2"}[path]


# a child process: ``wait URL NAME TTL KIND`` registers as a waiter (a candidate) and
# blocks, printing ``WAITING`` first; ``lead URL NAME TTL`` campaigns and, when it leads,
# prints ``LEAD <token>`` and stays; ``churn URL NAME TTL SECONDS REDIS_PORT`` campaigns
# in a loop and checks, while it leads, that it is alone (a Redis counter) and that its
# term is above every earlier one, then prints ``DONE <terms> <overlaps> <regressions>``.
CHILD = r"""
import asyncio, os, random, sys, time
import aiolock

async def main():
    mode, url, name, ttl, *rest = sys.argv[1:]
    ttl = float(ttl)
    async with aiolock.connect(url) as locks:
        if mode == "wait":
            what = (locks.lock(name, ttl=ttl) if rest[0] == "lock"
                    else locks.election(name, ttl=ttl).campaign(data="dead-" + str(os.getpid())))
            task = asyncio.create_task(what.acquire())
            await asyncio.sleep(0.3)
            print("WAITING", flush=True)
            await task
            print("GOT", flush=True)
            await asyncio.sleep(3600)
        elif mode == "lead":
            async with locks.election(name, ttl=ttl).campaign(data=str(os.getpid())) as term:
                print("LEAD", term.token, flush=True)
                await asyncio.sleep(3600)
        elif mode == "churn":
            import redis.asyncio as aioredis
            seconds, port = float(rest[0]), int(rest[1])
            r = aioredis.Redis(host="127.0.0.1", port=port)
            inside, last = "c15:inside:" + name, "c15:last:" + name
            terms = overlaps = regressions = 0
            end = time.monotonic() + seconds
            election = locks.election(name, ttl=ttl)
            while time.monotonic() < end:
                async with election.campaign(data=str(os.getpid())) as term:
                    terms += 1
                    if await r.incr(inside) != 1:
                        overlaps += 1
                    before = int(await r.get(last) or 0)
                    if term.token <= before:
                        regressions += 1
                    await r.set(last, term.token)
                    if random.random() < 0.3:
                        await term.proclaim("p" + str(term.token))
                    await asyncio.sleep(random.random() * 0.01)
                    await r.decr(inside)
                await asyncio.sleep(random.random() * 0.005)
            await r.aclose()
            print("DONE", terms, overlaps, regressions, flush=True)

asyncio.run(main())
"""


async def start_child(children: list[Child], *args: str) -> Child:
    child = await Child.run("-c", CHILD, *args)
    children.append(child)
    return child


async def no_holder_leaks(locks: aiolock.Locks, name: str, kind: Kind = Kind.LOCK) -> None:
    """``name`` is free now (nothing listed, status free)."""
    info = await locks.status(name, kind)
    assert not info.held, info
    assert [i async for i in locks.scan(name) if i.name == name] == []


# -- the documented least privileges ---------------------------------------------------


async def test_documented_acl_runs_every_coordination_feature(urls: dict[str, str], name: str,
                                                              caplog: Any) -> None:
    """The documented ACL line (automatic fallback): locks, holders, status, scan, revocation
    (either way between the paths), elections with proclaim and observe -- and the Lua
    path's read-write locks and semaphores listed by this user."""
    caplog.set_level(logging.INFO, logger="aiolock")
    async with aiolock.connect(urls["auto"]) as tx, aiolock.connect(urls["lua"]) as lua:
        caps = tx.capabilities
        assert {Capability.HOLDERS, Capability.SCAN, Capability.REVOKE,
                Capability.ELECTION} <= caps
        assert not caps & {Capability.FAIR, Capability.RWLOCK, Capability.SEMAPHORE}
        lease = await tx.lock(name, ttl=1.5, data="mine").acquire()
        assert lease.holder.data == "mine"
        info = await lua.status(name)
        assert info.held and info.token == lease.token and info.held_by[0].data == "mine"
        rw = await lua.rwlock(name + "-rw").read().acquire()
        sem = await lua.semaphore(name + "-sem", limit=2).acquire()
        listed = {i.name: i.family async for i in tx.scan(name)}
        assert listed == {name: "lock", name + "-rw": "rw", name + "-sem": "sem"}, listed
        assert await lua.lock(name).force_release()
        await asyncio.wait_for(lease.wait_lost(), 1.2)  # within ttl/3, plus a little
        taken = await lua.lock(name, ttl=1.5).acquire(timeout=1)
        assert taken.token > lease.token
        assert await tx.lock(name).force_release()
        await asyncio.wait_for(taken.wait_lost(), 1.2)
        await rw.release()
        await sem.release()

        election = tx.election(name, ttl=1.5)
        seen: list[str | None] = []

        async def watch() -> None:
            async for leader in lua.election(name, ttl=1.5).observe():
                seen.append(None if leader is None else leader.data)

        watcher = asyncio.create_task(watch())
        async with election.campaign(data="a") as term:
            await term.proclaim("b")
            leader = await lua.election(name).leader()
            assert leader is not None and leader.data == "b" and leader.token == term.token
            await asyncio.sleep(0.6)
        await asyncio.sleep(0.3)
        watcher.cancel()
        assert "b" in seen and seen[-1] is None, seen
    assert SECRET not in caplog.text


#: commands whose absence the sweep's workload never needs (it just works): slow tier
_UNNEEDED = {"ltrim", "unsubscribe", "zrange", "hgetall"}


@pytest.mark.parametrize("missing", [
    pytest.param(c[1:], marks=[pytest.mark.slow] if c[1:] in _UNNEEDED else [])
    for c in DOC_COMMANDS if c not in ("+mget", "+unwatch")] + ["channels", "keys"])
async def test_one_permission_less_is_a_clear_error(coord_redis: PasswordRedis, urls: dict[str, str],
                                                     missing: str) -> None:
    """One command (or the key / channel pattern) less than the documented line: every
    step either works or raises AccessDenied (never a hang, never a wrong answer)."""
    url = url_of(coord_redis, f"no-{missing}", "?scripting=off")
    name = f"c15p-{uuid.uuid4().hex[:8]}"

    async def workload() -> None:
        async with aiolock.connect(url, request_timeout=3) as tx, \
                aiolock.connect(urls["lua"]) as lua:
            async with tx.lock(name, ttl=5) as lease:
                info = await tx.status(name)
                assert info.held and info.token == lease.token
                assert [i.name async for i in tx.scan(name)] == [name]
            held = await lua.lock(name, ttl=5).acquire()
            waiter = asyncio.create_task(tx.lock(name, ttl=5).acquire(timeout=3))
            await asyncio.sleep(0.2)
            await held.release()
            got = await waiter
            assert await tx.lock(name).force_release()
            assert not await tx.lock(name).force_release()
            await asyncio.wait_for(got.wait_lost(), 3)
            async with tx.election(name, ttl=5).campaign(data="a") as term:
                await term.proclaim("b")
                leader = await tx.election(name).leader()
                assert leader is not None and leader.data == "b"
                gen = tx.election(name).observe()
                first = await asyncio.wait_for(gen.__anext__(), 3)
                assert first is not None and first.data == "b"
                await gen.aclose()  # type: ignore[attr-defined]

    try:
        await asyncio.wait_for(workload(), 20)
    except aiolock.AccessDenied as err:
        assert SECRET not in str(err)
        assert "NOPERM" in str(err) or "permission" in str(err).lower(), err


@pytest.mark.parametrize("missing", ["mget", pytest.param("unwatch", marks=pytest.mark.slow)])
async def test_missing_renewal_command_is_not_silent(coord_redis: PasswordRedis,
                                                     urls: dict[str, str], name: str,
                                                     missing: str, caplog: Any) -> None:
    """DEFECT: without ``+mget`` (or ``+unwatch``) of the documented line, locks are granted
    and renewed as if all were well; the first renewal batch that finds a lease gone (a
    revocation) fails with NOPERM, logged at INFO only, and retried until expiry. So no
    AccessDenied ever reaches the application, the revoked holder is told "its last
    confirmed expiry passed without a renewal" a full ttl later (not "revoked" within
    ttl/3: it believes it holds a lock another process holds), and every other lease of
    the batch, never revoked, lapses with it."""
    caplog.set_level(logging.INFO, logger="aiolock")
    url = url_of(coord_redis, f"no-{missing}", "?scripting=off")
    try:
        async with aiolock.connect(url) as tx, aiolock.connect(urls["lua"]) as lua:
            revoked = await tx.lock(name + "-a", ttl=1.5).acquire()
            kept = await tx.lock(name + "-b", ttl=1.5).acquire()
            await asyncio.sleep(0.1)
            assert await lua.lock(name + "-a").force_release()
            start = time.monotonic()
            await asyncio.wait_for(revoked.wait_lost(), 2.5)
            lost_after = time.monotonic() - start
            await asyncio.sleep(2.0 - lost_after)
            problems = []
            if lost_after > 0.5 + 0.3:
                problems.append(f"revoked lease believed held {lost_after:.2f} s (ttl/3 = 0.5 s)")
            if kept.lost:
                problems.append("a lease nobody revoked lapsed with it")
            assert not problems, problems
    except aiolock.AccessDenied as err:  # a clear error up front is as good
        assert missing in str(err)


# -- revocation ---------------------------------------------------------------------------

PAIRS = [("tx", "tx"), ("tx", "lua"), ("lua", "tx")]


def _primitive(locks: aiolock.Locks, kind: str, name: str, ttl: float) -> Any:
    return locks.lock(name, ttl=ttl) if kind == "lock" else locks.election(name, ttl=ttl).campaign()


@pytest.mark.parametrize("kind", ["lock", "election"])
@pytest.mark.parametrize(("holder", "revoker"), PAIRS)
async def test_revoked_holder_learns_it_and_waiters_get_it(conns: dict[str, aiolock.Locks],
                                                           name: str, kind: str, holder: str,
                                                           revoker: str) -> None:
    """A revocation through either path: True once, then False; the holder's body is
    cancelled with LockLost within ttl/3; a waiter on each path gets it at once (not at
    the ttl), with a greater token; nothing is left listed afterwards."""
    ttl = 1.5
    body_cancelled = False
    tokens: list[int] = []

    async def hold() -> None:
        nonlocal body_cancelled
        async with _primitive(conns[holder], kind, name, ttl) as lease:
            tokens.append(lease.token)
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                body_cancelled = True
                raise

    holding = asyncio.create_task(hold())
    while not tokens:
        await asyncio.sleep(0.01)
    lua_waiter = asyncio.create_task(_primitive(conns["lua2"], kind, name, 30).acquire(timeout=10))
    tx_waiter = asyncio.create_task(_primitive(conns["tx2"], kind, name, 30).acquire(timeout=10))
    await asyncio.sleep(0.3)  # both waiters are waiting
    revoked_at = time.monotonic()
    assert await _primitive(conns[revoker], kind, name, ttl).force_release() is True
    with pytest.raises(aiolock.LockLost, match="revoked"):
        await asyncio.wait_for(holding, ttl)
    assert body_cancelled
    assert time.monotonic() - revoked_at < ttl / 3 + 0.35
    done, _ = await asyncio.wait([lua_waiter, tx_waiter], timeout=2,
                                 return_when=asyncio.FIRST_COMPLETED)
    assert done, "no waiter got it within 2 s of the revocation (ttl 30)"
    winner = done.pop()
    first = winner.result()
    assert first.token > tokens[0]
    kind_ = Kind.LOCK if kind == "lock" else Kind.LEADER
    await asyncio.sleep(0.1)  # the revoked holder's exit (its release) spares the new holder
    assert not first.lost and (await conns["lua"].status(name, kind_)).token == first.token
    rest = tx_waiter if winner is lua_waiter else lua_waiter
    await first.release()
    second = await asyncio.wait_for(rest, 3)
    assert second.token > first.token
    await second.release()
    assert await _primitive(conns[revoker], kind, name, ttl).force_release() is False
    await no_holder_leaks(conns["lua"], name, Kind.LOCK if kind == "lock" else Kind.LEADER)
    await no_holder_leaks(conns["tx"], name, Kind.LOCK if kind == "lock" else Kind.LEADER)


async def test_force_release_of_free_and_other_kind_is_false(conns: dict[str, aiolock.Locks],
                                                             name: str) -> None:
    """Free names answer False on both paths; a held lock and a held election of the same
    name are two things: revoking one leaves the other."""
    for path in ("tx", "lua"):
        assert await conns[path].lock(name).force_release() is False
        assert await conns[path].election(name).campaign().force_release() is False
    lock = await conns["tx"].lock(name, ttl=1.2).acquire()
    term = await conns["tx"].election(name, ttl=1.2).campaign(data="x").acquire()
    assert await conns["lua"].election(name).campaign().force_release() is True
    await asyncio.wait_for(term.wait_lost(), 3)
    assert not lock.lost and (await conns["tx"].status(name)).held
    assert await conns["tx"].lock(name).force_release() is True
    await asyncio.wait_for(lock.wait_lost(), 3)


async def test_concurrent_revocations_report_one_holder(conns: dict[str, aiolock.Locks],
                                                        name: str) -> None:
    """Six revokers on both paths at once, against one holder: exactly one says True."""
    for round_ in range(4):
        lease = await conns["tx" if round_ % 2 else "lua"].lock(name, ttl=0.6).acquire()
        results = await asyncio.gather(*(conns[p].lock(name).force_release()
                                         for p in ("tx", "tx2", "lua", "lua2", "tx", "lua")))
        assert results.count(True) == 1, results
        await asyncio.wait_for(lease.wait_lost(), 3)


@pytest.mark.parametrize("holder", ["tx", pytest.param("lua", marks=pytest.mark.slow)])
async def test_revocation_in_a_batch_spares_the_others(conns: dict[str, aiolock.Locks],
                                                       name: str, holder: str) -> None:
    """20 leases renewed together; revoking 5 (from the other path) loses those 5 only."""
    leases = [await conns[holder].lock(f"{name}-{i}", ttl=1.2).acquire() for i in range(20)]
    revoker = conns["lua" if holder == "tx" else "tx"]
    for lease in leases[::4]:
        assert await revoker.lock(lease.name).force_release()
    await asyncio.sleep(2.5)  # two ttls: the others must have been renewed
    assert [lease.lost for lease in leases] == [i % 4 == 0 for i in range(20)]
    for lease in leases:
        await lease.release()


async def test_revoked_lease_without_watchdog_extend_fails(conns: dict[str, aiolock.Locks],
                                                           name: str) -> None:
    """watchdog=False: a revoked lease cannot be extended back to life."""
    lease = await conns["tx"].lock(name, ttl=5, watchdog=False).acquire()
    assert await conns["lua"].lock(name).force_release()
    with pytest.raises(aiolock.LockLost):
        await lease.extend(5)
    assert lease.lost
    assert not (await conns["lua"].status(name)).held


# -- a Lua-path waiter whose process was killed ---------------------------------------


_KILLED_WAITER_DEFAULT = {("tx-release", "lock"), ("lua-release", "lock"),
                          ("tx-revoke", "election"), ("lua-revoke", "lock")}


@pytest.mark.parametrize(("how", "kind"), [
    pytest.param(how, kind, marks=[] if (how, kind) in _KILLED_WAITER_DEFAULT else [pytest.mark.slow])
    for how in ("tx-release", "lua-release", "tx-revoke", "lua-revoke")
    for kind in ("lock", "election")])
async def test_killed_lua_waiter_is_not_handed_the_lock(children: list[Child],
                                                        conns: dict[str, aiolock.Locks],
                                                        urls: dict[str, str], name: str,
                                                        kind: str, how: str) -> None:
    """DEFECT (tx-release, tx-revoke, lua-revoke): a Lua-path waiter (candidate) in a
    process killed with -9 stays in the Lua path's queue. A release through the Lua path
    skips it: a live waiter gets the lock at once. A release through the transaction path
    ("hand it to the first live waiter registered by the Lua path, as its script would")
    and a force_release through either path hand it to the dead process instead: the lock
    (leadership) is then held by nobody for the dead waiter's whole ttl (10 s here), the
    live waiter waits that long, and status()/leader() name the dead pid as the holder."""
    holder_path = "tx" if how.startswith("tx") else "lua"
    holder = await _primitive(conns[holder_path], kind, name, 30).acquire()
    child = await start_child(children, "wait", urls["lua"], name, "10", kind)
    await child.expect("WAITING")
    await child.kill()
    waiter = asyncio.create_task(_primitive(conns["tx2"], kind, name, 5).acquire(timeout=2))
    await asyncio.sleep(0.3)
    if how.endswith("release"):
        await holder.release()
    else:
        assert await _primitive(conns[holder_path], kind, name, 5).force_release()
    info = await conns["lua"].status(name, Kind.LOCK if kind == "lock" else Kind.LEADER)
    try:
        got = await waiter
    except aiolock.LockTimeout:
        pids = [h.pid for h in info.held_by]
        raise AssertionError(f"the live waiter did not get it in 2 s; held by pids {pids} "
                             f"(killed waiter: {child.proc.pid}), ttl left {info.ttl_left}") from None
    assert got.token > holder.token
    await got.release()
    await holder.release()


# -- elections across processes and paths ----------------------------------------------


async def _observe_into(locks: aiolock.Locks, name: str, ttl: float,
                        seen: list[tuple[float, aiolock.Leader | None]]) -> None:
    async for leader in locks.election(name, ttl=ttl).observe():
        seen.append((time.monotonic(), leader))


def _current(seen: list[tuple[float, aiolock.Leader | None]]) -> tuple[str, int] | None:
    leader = seen[-1][1] if seen else None
    return None if leader is None else (leader.data, leader.token)


async def test_one_leader_across_processes_and_paths(children: list[Child], urls: dict[str, str],
                                                     coord_redis: PasswordRedis, name: str) -> None:
    """Four processes (two per path, one of them the automatic fallback) campaign in a loop
    for 3 s, proclaiming now and then: never two leaders, terms strictly increasing."""
    procs = [await start_child(children, "churn", url, name, "2", "3", str(coord_redis.port))
             for url in (urls["lua"], urls["tx"], urls["auto"], urls["lua"])]
    results = [(await child.expect("DONE", within=40)).split() for child in procs]
    terms = [int(r[1]) for r in results]
    assert [r[2:] for r in results] == [["0", "0"]] * 4, results  # overlaps, regressions
    assert sum(terms) >= 20, terms
    assert min(terms[1:3]) > 0, f"a transaction-path candidate never led: {terms}"


async def test_killed_leader_replaced_within_ttl(children: list[Child], urls: dict[str, str],
                                                 conns: dict[str, aiolock.Locks], name: str) -> None:
    """Candidates on both paths; the leader is killed with -9 three times: a new one leads
    within the ttl (1 s), one at a time, and observers on both paths end on the last one."""
    ttl = 1.0
    procs = {}
    for url in (urls["lua"], urls["tx"], urls["auto"], urls["tx"]):
        child = await start_child(children, "lead", url, name, str(ttl))
        procs[child.proc.pid] = child
    seen: dict[str, list[tuple[float, aiolock.Leader | None]]] = {"lua": [], "tx": []}
    watchers = [asyncio.create_task(_observe_into(conns[p], name, ttl, seen[p])) for p in seen]
    reads = {pid: asyncio.create_task(c.expect("LEAD", within=60)) for pid, c in procs.items()}
    killed_at = None
    tokens = []
    for _ in range(3):
        done, _pending = await asyncio.wait(reads.values(), timeout=ttl * 3 + 2,
                                            return_when=asyncio.FIRST_COMPLETED)
        assert done, "nobody leads"
        leaders = [pid for pid, task in reads.items() if task.done()]
        assert len(leaders) == 1, f"two leaders at once: {leaders}"
        pid = leaders[0]
        tokens.append(int(reads.pop(pid).result().split()[1]))
        if killed_at is not None:
            assert time.monotonic() - killed_at < ttl + 0.5, time.monotonic() - killed_at
        leader = await conns["tx"].election(name).leader()
        assert leader is not None and leader.data == str(pid) and leader.token == tokens[-1]
        await asyncio.sleep(0.3)
        for path in seen:
            assert _current(seen[path]) == (str(pid), tokens[-1]), (path, seen[path][-3:])
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        await procs[pid].proc.wait()
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), tokens
    done, _pending = await asyncio.wait(reads.values(), timeout=ttl + 2)
    assert len(done) == 1
    await asyncio.sleep(0.3)
    final = await conns["lua"].election(name).leader()
    assert final is not None
    for path in seen:
        assert _current(seen[path]) == (final.data, final.token), (path, seen[path][-3:])
    for task in [*watchers, *reads.values()]:
        task.cancel()


@pytest.mark.parametrize(("leader_path", "observer_path"), [
    ("tx", "lua"), pytest.param("lua", "tx", marks=pytest.mark.slow),
    pytest.param("tx", "tx", marks=pytest.mark.slow)])
async def test_observe_follows_the_other_path_and_ends_current(
        conns: dict[str, aiolock.Locks], name: str, leader_path: str, observer_path: str) -> None:
    """Grants, proclaims, resignations and a revocation through one path are seen by an
    observer on the other at once (well before its ttl/2 look), and under churn its last
    value is the current leader (or None)."""
    ttl = 6.0  # a look every 3 s: faster than that is the publish
    seen: list[tuple[float, aiolock.Leader | None]] = []
    watcher = asyncio.create_task(_observe_into(conns[observer_path], name, ttl, seen))
    await asyncio.sleep(0.2)
    election = conns[leader_path].election(name, ttl=ttl)

    async def settled(expect: tuple[str, int] | None) -> None:
        deadline = time.monotonic() + 1.0
        while _current(seen) != expect:
            assert time.monotonic() < deadline, (expect, [(_current([s])) for s in seen[-4:]])
            await asyncio.sleep(0.01)

    async with election.campaign(data="a") as term:
        await settled(("a", term.token))
        for i in range(5):
            await term.proclaim(f"d{i}")
            await settled((f"d{i}", term.token))
    await settled(None)
    term = await election.campaign(data="r").acquire()
    await settled(("r", term.token))
    assert await conns[other(observer_path)].election(name).campaign().force_release()
    await settled(None)
    await asyncio.wait_for(term.wait_lost(), ttl / 3 + 1)
    await term.release()
    # churn from both paths, then stop: the last value is the current one
    rng = random.Random(15)
    for _ in range(20):
        locks = conns[rng.choice(["tx", "tx2", "lua", "lua2"])]
        async with locks.election(name, ttl=ttl).campaign(data=str(rng.random())) as t:
            if rng.random() < 0.5:
                await t.proclaim("x" + str(rng.random()))
    last = await conns["tx"].election(name, ttl=ttl).campaign(data="last").acquire()
    await settled(("last", last.token))
    await last.release()
    await settled(None)
    watcher.cancel()


# -- cancellation ----------------------------------------------------------------------


async def _cancel_after(coro: Any, k: int) -> Any:
    """Run ``coro`` and cancel it at point ``k``: after ``k`` loop steps for k < 20, else
    after (k - 19) * 2.5 ms (the round trips themselves); its result, or CancelledError."""
    task = asyncio.ensure_future(coro)
    if k < 20:
        for _ in range(k):
            await asyncio.sleep(0)
    else:
        await asyncio.sleep((k - 19) * 0.0025)
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return asyncio.CancelledError


@pytest.mark.parametrize("holder", ["tx2", pytest.param("lua", marks=pytest.mark.slow)])
async def test_cancelled_force_release_leaves_holder_or_frees(conns: dict[str, aiolock.Locks],
                                                             name: str, holder: str) -> None:
    """force_release() (transaction path) cancelled at 40 points (loop steps, then up to
    50 ms), on 40 names at once: each holder either still holds (and keeps holding past
    ttl/3) or learns the revocation and the name is free; never held by nobody."""
    ttl = 0.9
    names = [f"{name}-{k}" for k in range(40)]
    leases = [await conns[holder].lock(n, ttl=ttl).acquire() for n in names]
    outcomes = await asyncio.gather(*(_cancel_after(conns["tx"].lock(n).force_release(), k)
                                      for k, n in enumerate(names)))
    await asyncio.sleep(ttl / 3 + 0.4)  # a revocation is known by now
    kinds = set()
    for lease, outcome in zip(leases, outcomes, strict=True):
        info = await conns["lua"].status(lease.name)
        if lease.lost:
            kinds.add("revoked")
            assert not info.held, (lease.name, outcome, info)
        else:
            kinds.add("kept")
            assert outcome is not True, (lease.name, outcome)
            assert info.held and info.token == lease.token, (lease.name, outcome, info)
        await lease.release()
        got = await conns["lua2"].lock(lease.name, ttl=2).acquire(timeout=1)
        await got.release()
    assert kinds == {"revoked", "kept"}, kinds  # the cancellations landed on both sides


@pytest.mark.parametrize("path", ["tx", pytest.param("tx2", marks=pytest.mark.slow)])
async def test_cancelled_proclaim_keeps_leadership_consistent(conns: dict[str, aiolock.Locks],
                                                              name: str, path: str) -> None:
    """proclaim() cancelled at 40 points (loop steps, then up to 50 ms), on 40 elections
    at once: every term stays (not lost past ttl/3), each leader's data is the old or the
    new one on both paths, and resigning frees the election."""
    ttl = 0.9
    names = [f"{name}-{k}" for k in range(40)]
    terms = [await conns[path].election(n, ttl=ttl).campaign(data="old").acquire()
             for n in names]
    await asyncio.gather(*(_cancel_after(t.proclaim(f"new{k}"), k) for k, t in enumerate(terms)))
    await asyncio.sleep(ttl / 3 + 0.4)
    datas = set()
    for k, term in enumerate(terms):
        assert not term.lost, term.name
        for p in ("lua", "tx2"):
            leader = await conns[p].election(term.name).leader()
            assert leader is not None and leader.token == term.token, (term.name, leader)
            assert leader.data in ("old", f"new{k}"), (term.name, leader)
            datas.add(leader.data == "old")
        await term.proclaim("after")
        leader = await conns["lua"].election(term.name).leader()
        assert leader is not None and leader.data == "after"
        await term.release()
        assert await conns["lua"].election(term.name).leader() is None
    assert datas == {True, False}, datas


@pytest.mark.parametrize("contended", [False, True])
async def test_cancelled_campaign_leaves_no_leader(conns: dict[str, aiolock.Locks], name: str,
                                                   contended: bool) -> None:
    """campaign().acquire() (transaction path) cancelled at step 0..29, alone or while a
    Lua-path leader resigns at the same moment: afterwards the election is free or led by
    a live term, and another candidate leads at once."""
    rng = random.Random(contended)
    for steps in range(30):
        rival = None
        if contended:
            rival = await conns["lua"].election(name, ttl=5).campaign(data="rival").acquire()
        campaign = conns["tx"].election(name, ttl=5).campaign(data="me")
        task = asyncio.ensure_future(campaign.acquire())
        if rival is not None:
            await asyncio.sleep(0.02)
            release: asyncio.Future[Any] = asyncio.ensure_future(rival.release())
        for _ in range(steps if not contended else rng.randrange(8)):
            await asyncio.sleep(0)
        task.cancel()
        try:
            term = await task
        except asyncio.CancelledError:
            term = None
        if rival is not None:
            await release
        leader = await conns["lua"].election(name).leader()
        if term is not None:
            assert leader is not None and leader.token == term.token, (steps, leader)
            await term.release()
        else:
            assert leader is None, (steps, leader)
        got = await conns["lua2"].election(name, ttl=5).campaign().acquire(timeout=1)
        await got.release()


# -- scan ------------------------------------------------------------------------------


def _awkward(base: str) -> list[str]:
    names = [base + s for s in (
        "*", "?x", "[ab]", "[", "]", "^", "-", "\\", "\\*", "\\[", "{br}", "}", "{", "%s%d", "%",
        " sp", "ü日本", ":lock:{x}", ":q", ":seq", "}:x:ab", "a", "b", "\n", "\x00")]
    names.append(base + "z" * (512 - len(base)))
    names.append(base + "é" * (512 - len(base)))
    return names


async def test_scan_awkward_prefixes_both_paths(conns: dict[str, aiolock.Locks]) -> None:
    """Names with glob characters, braces, %, unicode, 512 characters, held as locks and
    elections on both paths (and freed neighbours): every prefix of every name lists
    exactly the held names that start with it, on both paths, each as status() says."""
    base = f"g{uuid.uuid4().hex[:6]}"
    names = _awkward(base)
    leases: list[aiolock.Lease] = []
    for i, n in enumerate(names):
        locks = conns["tx" if i % 2 else "lua"]
        if i % 3 == 0:
            leases.append(await locks.election(n, ttl=20).campaign(data=n[:40]).acquire())
        else:
            leases.append(await locks.lock(n, ttl=20, data=n[:40]).acquire())
    for n in (base + "free*", base + "free", base + "["):  # held then released
        term = await conns["tx"].election(n + "e").campaign().acquire()
        await term.release()
        lease = await conns["tx"].lock(n + "l", ttl=5).acquire()
        await lease.release()
    prefixes = {base} | {n[:k] for n in names for k in (len(base) + 1, len(base) + 2, len(n))}
    kinds = {"lock": Kind.LOCK, "elect": Kind.LEADER}
    for path in ("tx", "lua"):
        for prefix in sorted(prefixes):
            got = [i async for i in conns[path].scan(prefix)]
            listed = sorted(i.name for i in got)
            assert listed == sorted(n for n in names if n.startswith(prefix)), (path, prefix)
        for info in [i async for i in conns[path].scan(base)]:
            status = await conns["lua" if path == "tx" else "tx"].status(info.name,
                                                                        kinds[info.family])
            assert (info.held, info.token, info.holders) == (True, status.token, 1)
            assert status.held and [h.data for h in status.held_by] == [info.name[:40]]
            assert [h.data for h in info.held_by] == [info.name[:40]]
    for lease in leases:
        await lease.release()
    for path in ("tx", "lua"):
        assert [i async for i in conns[path].scan(base)] == []


async def test_scan_under_churn_lists_only_held_never_twice(conns: dict[str, aiolock.Locks],
                                                             raw: Any) -> None:
    """300 names held throughout while 8 tasks churn 400 others and the keyspace grows
    (rehashing under SCAN): each scan lists every held name once, and nothing free."""
    base = f"S{uuid.uuid4().hex[:6]}"
    stable = [f"{base}:s{i}" for i in range(300)]
    leases = [await conns["tx" if i % 2 else "lua"].lock(n, ttl=30).acquire()
              for i, n in enumerate(stable)]
    stop = asyncio.Event()

    async def churn(k: int) -> None:
        i = 0
        while not stop.is_set():
            locks = conns["tx2" if k % 2 else "lua2"]
            lease = await locks.lock(f"{base}:c{k}-{i % 50}", ttl=5).acquire()
            i += 1
            await asyncio.sleep(random.random() * 0.002)
            await lease.release()

    async def grow() -> None:
        i = 0
        while not stop.is_set():
            await raw.set(f"aiolock:lock:{{{base}:junk{i}}}:seq", 1)
            i += 1
            if i % 50 == 0:
                await asyncio.sleep(0)

    tasks = [asyncio.create_task(churn(k)) for k in range(8)] + [asyncio.create_task(grow())]
    try:
        for _ in range(2):
            for path in ("tx", "lua"):
                listed = []
                async for info in conns[path].scan(base):
                    assert info.held and info.token is not None and info.held_by, info
                    listed.append(info.name)
                    await asyncio.sleep(0)
                assert len(listed) == len(set(listed)), "a name listed twice"
                assert set(stable) <= set(listed), len(set(stable) - set(listed))
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        for lease in leases:
            await lease.release()
        keys = [k async for k in raw.scan_iter(f"aiolock:lock:{{{base}:junk*")]
        if keys:
            await raw.delete(*keys)


# -- what the path does not offer ------------------------------------------------------


@pytest.mark.parametrize("path", ["tx", "tx2"])
async def test_unsupported_kinds_refused_clearly(conns: dict[str, aiolock.Locks], name: str,
                                                 path: str) -> None:
    """rwlock(), semaphore() and fair=True: ValueError naming them, before any request;
    a Lua-path read-write lock of the same name is left alone."""
    locks = conns[path]
    held = await conns["lua"].rwlock(name).write().acquire()
    make: list[tuple[str, Callable[[], Any]]] = [
        ("rwlock", lambda: locks.rwlock(name)),
        ("semaphore", lambda: locks.semaphore(name, limit=2)),
        ("fair", lambda: locks.lock(name, fair=True))]
    for word, build in make:
        with pytest.raises(ValueError, match=word):
            await asyncio.wait_for(build().acquire(timeout=0), 2)
    assert not held.lost and (await locks.status(name, Kind.WRITE)).held
    await held.release()
