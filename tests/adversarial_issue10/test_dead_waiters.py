"""Waiters that die, freeze or give up while in line (README "Waiting"): "On plain Redis
a waiting process that dies is skipped at once"; on Cluster and Sentinel "a dead waiter
may still be handed the lock once before its place lapses (within one ttl), and that
lease then expires within its ttl"; a waiter that timed out is abandoned ("removed from
the queue, barred"); a frozen waiter handed the lock is a holder that stops renewing,
freed within the dead-holder bound -- and must never believe in that lease once it runs
again while someone else holds the lock ("never believe in a lease longer than the
server granted it")."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

import pytest

import aiolock

from .conftest import Agents, Backend, backend, go_in_order

pytestmark = pytest.mark.timeout(120)

#: backends where a dead waiting process is skipped at once: plain Redis (the PUBLISH
#: count), and the SQL servers' own lock queues (a dead session leaves the queue)
AT_ONCE = {"redis", "postgres", "mysql"}
AT_ONCE_BOUND = 1.5  # s: "at once", on a loaded 2-core box
SLACK = 1.5  # s added to every documented bound


def fresh(what: str) -> str:
    return f"a10-{what}-{uuid.uuid4().hex[:10]}"


def options(b: Backend) -> dict[str, object]:
    # ZooKeeper: a short session, so that a killed process's nodes go within the test
    return {"session_timeout": 4} if b.id == "zookeeper" else {}


SETTLE = 0.4  # s between two waiters' arrivals: an order the server sees


@pytest.mark.parametrize(("key", "fair"), [
    pytest.param("redis", False, id="redis"),
    pytest.param("redis", True, id="redis-fair"),
    pytest.param("postgres", False, id="postgres"),
    pytest.param("mysql", False, id="mysql"),
    pytest.param("redis-cluster", False, id="redis-cluster"),
    pytest.param("redis-sentinel", False, id="redis-sentinel"),
    pytest.param("zookeeper", False, id="zookeeper"),
    pytest.param("etcd", False, id="etcd"),
])
async def test_killed_waiters_are_skipped(request: pytest.FixtureRequest, agents: Agents,
                                          key: str, fair: bool) -> None:
    """Attacks "a dead waiting process is skipped (plain Redis: at once; Cluster,
    Sentinel: within its ttl)": the first waiters in line are ``kill -9``ed, then the
    holder releases; the live waiter behind them must get the lock within the bound,
    and the lock must be with it (not with a dead process). ``fair=True`` on Redis: "a
    dead waiter's place lapses within one ttl"."""
    b = backend(request, key)
    name = fresh("killed")
    at_once = key in AT_ONCE and not fair
    # at once: ttl 30 everywhere, so that a dead waiter handed the lock shows (30 s);
    # else one dead waiter ahead, ttl 2: handed the lock once, its lease ends within ttl
    ttl = 30.0 if at_once else 2.0
    dead = 2 if at_once else 1
    bound = AT_ONCE_BOUND if at_once else b.row.kill_bound(ttl) + ttl / 3 + SLACK
    opts = options(b)
    async with aiolock.connect(b.url, **opts) as locks:
        held = await locks.lock(name, ttl=ttl, fair=fair).acquire()
        line = await agents.start("once", b.url, name, dead + 1, ttl=ttl, fair=fair, hold=1.0,
                                  connect=opts)
        await go_in_order(line, SETTLE)
        for victim in line[:dead]:
            await victim.kill9()
        await asyncio.sleep(0.3)  # the server sees the sockets close
        released = time.monotonic()
        await held.release()
        got = await line[-1].got(bound + 30)
        info = await locks.status(name)
    waited = got.at - released
    assert waited <= bound, (
        f"the live waiter behind {dead} killed one(s) got the lock after {waited:.2f}s "
        f"(bound {bound:.2f}s)")
    assert got.token > held.token
    assert not got.lost
    assert info.held and [h.pid for h in info.held_by] == [line[-1].pid], info


@pytest.mark.slow
async def test_waiter_killed_as_the_holder_releases(request: pytest.FixtureRequest,
                                                    agents: Agents) -> None:
    """Attacks the plain-Redis skip when the kill and the release race: the first waiter
    may be handed the lock just before it dies (then it is a dead holder, freed within
    its ttl, and the next waiter's wait is bounded by that holder's ttl) or be skipped;
    either way the second waiter gets the lock within ttl + ttl/3 (+ slack)."""
    b = backend(request, "redis")
    name = fresh("race")
    ttl = 2.0
    async with aiolock.connect(b.url) as locks:
        held = await locks.lock(name, ttl=ttl).acquire()
        line = await agents.start("once", b.url, name, 2, ttl=ttl, hold=0.3)
        await go_in_order(line, SETTLE)
        released = time.monotonic()
        await asyncio.gather(held.release(), line[0].kill9())
        got = await line[1].got(30)
    bound = ttl + ttl / 3 + SLACK
    assert got.at - released <= bound, f"{got.at - released:.2f}s, bound {bound:.2f}s"


STOPPED = [
    pytest.param("redis", id="redis"),
    pytest.param("postgres", id="postgres"),
    pytest.param("zookeeper", id="zookeeper"),
    pytest.param("mysql", id="mysql"),
    pytest.param("redis-cluster", id="redis-cluster"),
    pytest.param("redis-sentinel", id="redis-sentinel"),
    pytest.param("etcd", id="etcd"),
]


@pytest.mark.parametrize("key", STOPPED)
async def test_frozen_waiter_handed_the_lock(request: pytest.FixtureRequest, agents: Agents,
                                             key: str) -> None:
    """Attacks the dead-holder bound and "never believe in a lease longer than the server
    granted it" across a hand-off: the first waiter is frozen (SIGSTOP) just before the
    holder releases, so the lock is handed to a process that cannot renew it. The second
    waiter must get the lock within the frozen one's dead-holder bound (+ a recheck,
    ttl/3); once thawed, the frozen one must never act as a holder (``lease.lost`` false)
    while the second holds the lock."""
    b = backend(request, key)
    name = fresh("frozen")
    ttl = 2.0  # everyone's: the next waiter's wait is bounded by a holder's ttl
    opts = options(b)
    async with aiolock.connect(b.url, **opts) as locks:
        held = await locks.lock(name, ttl=ttl).acquire()
        frozen, alive = await agents.start("once", b.url, name, 2, ttl=ttl, hold=1.6, connect=opts)
        await go_in_order([frozen, alive], SETTLE)
        frozen.signal(signal.SIGSTOP)
        await asyncio.sleep(0.05)
        released = time.monotonic()
        await held.release()
        bound = b.row.dead_holder(ttl) + ttl / 3 + SLACK
        got = await alive.got(bound + 15)
        await asyncio.sleep(0.1)
        frozen.signal(signal.SIGCONT)
        await asyncio.gather(frozen.drain(1.2), alive.expect("RELEASING", 20))
    waited = got.at - released
    assert waited <= bound, (
        f"the live waiter got the lock {waited:.2f}s after the release, behind a frozen "
        f"waiter (bound {bound:.2f}s)")
    assert not got.lost
    alive_end = float(alive.lines[-1].split()[1])
    alive_hb = [ln.split() for ln in alive.lines if ln.startswith("HB ")]
    assert all(h[2] == "0" for h in alive_hb), "the live waiter lost its lease"
    # the frozen waiter, thawed: never a holder that believes it while the other holds
    believed = []
    for ln in frozen.lines:
        parts = ln.split()
        if parts[0] == "GOT" and parts[3] == "0":
            believed.append((float(parts[2]), f"GOT token {parts[1]}"))
        elif parts[0] == "HB" and parts[2] == "0":
            believed.append((float(parts[1]), "HB"))
    overlap = [(round(t - got.at, 3), what) for t, what in believed if got.at <= t <= alive_end]
    assert not overlap, (
        f"the thawed waiter acted on a lease it believed (lost=False) while the other "
        f"process held the lock (token {got.token}): {overlap[:5]}; its lines {frozen.lines[:6]}")


@pytest.mark.parametrize("key", [
    pytest.param("redis", id="redis"),
    pytest.param("zookeeper", id="zookeeper"),
    pytest.param("postgres", id="postgres"),
    pytest.param("mysql", id="mysql"),
    pytest.param("redis-cluster", id="redis-cluster"),
    pytest.param("redis-sentinel", id="redis-sentinel"),
    pytest.param("etcd", id="etcd"),
])
async def test_timed_out_waiter_is_not_handed_the_lock(request: pytest.FixtureRequest,
                                                       agents: Agents, key: str) -> None:
    """Attacks "a release hands the lock to the first live waiter" for a waiter that gave
    up (``LockTimeout``) in a process that still runs and listens (it waits on another
    lock): its place must be gone, so the next release goes to the live waiter behind it
    at once, not to the abandoned claim (whose ttl, 30 s, would show)."""
    b = backend(request, key)
    name, other = fresh("gaveup"), fresh("other")
    opts = options(b)
    async with aiolock.connect(b.url, **opts) as locks:
        held = await locks.lock(name, ttl=30).acquire()
        kept = await locks.lock(other, ttl=30).acquire()
        quitter = (await agents.start("timeout", b.url, name, 1, ttl=30, wait=0.6, other=other,
                                      connect=opts))[0]
        waiter = (await agents.start("once", b.url, name, 1, ttl=30, hold=1.0, connect=opts))[0]
        await go_in_order([quitter, waiter], SETTLE)
        await quitter.expect("TIMEOUT", 10)
        await asyncio.sleep(0.3)
        released = time.monotonic()
        await held.release()
        got = await waiter.got(40)
        info = await locks.status(name)
        await kept.release()
    assert got.at - released <= AT_ONCE_BOUND, (
        f"the live waiter got the lock {got.at - released:.2f}s after the release, behind a "
        f"waiter that had timed out")
    assert info.held and [h.pid for h in info.held_by] == [waiter.pid], info


@pytest.mark.parametrize("key", [
    pytest.param("redis", id="redis"),
    pytest.param("zookeeper", id="zookeeper"),
    pytest.param("etcd", id="etcd"),
    pytest.param("redis-cluster", id="redis-cluster"),
])
async def test_line_moves_on_after_a_killed_holder(request: pytest.FixtureRequest,
                                                   agents: Agents, key: str) -> None:
    """Attacks the timer path of waiting ("each wait is still bounded by the holder's
    remaining TTL") and what it leaves behind: the holder (another process) is ``kill
    -9``ed, so no release wakes anyone; the first waiter must get the lock within the
    holder's kill bound (+ a recheck), and its release must then hand the lock to the
    second at once -- no stale queue place of the first may be handed the lock again."""
    b = backend(request, key)
    name = fresh("holderkilled")
    ttl = 2.0
    opts = options(b)
    holder, first, second = await agents.start_each("once", b.url, name, [
        {"ttl": ttl, "hold": 600, "connect": opts}, *[{"ttl": ttl, "hold": 0.5, "connect": opts}] * 2])
    await holder.say("GO")
    h = await holder.got(20)
    await go_in_order([first, second], SETTLE)
    killed = time.monotonic()
    await holder.kill9()
    g1 = await first.got(b.row.kill_bound(ttl) + 30)
    released = float((await first.expect("RELEASING", 20)).split()[1])
    g2 = await second.got(30)
    bound = b.row.kill_bound(ttl) + ttl / 3 + SLACK
    assert g1.at - killed <= bound, (
        f"the first waiter got the lock {g1.at - killed:.2f}s after the holder was killed "
        f"(bound {bound:.2f}s)")
    assert g2.at - released <= AT_ONCE_BOUND, (
        f"the second waiter got the lock {g2.at - released:.2f}s after the first released it")
    assert h.token < g1.token < g2.token


@pytest.mark.parametrize(("key", "fair"), [
    pytest.param("redis", False, id="redis"),
    pytest.param("redis", True, id="redis-fair"),
    pytest.param("redis-cluster", False, id="redis-cluster"),
    pytest.param("redis-sentinel", False, id="redis-sentinel"),
])
async def test_holder_and_first_waiter_killed_together(request: pytest.FixtureRequest,
                                                       agents: Agents, key: str,
                                                       fair: bool) -> None:
    """Attacks "if the holder and the first waiter die together, the lock is free up to a
    third of the waiter's ttl after the holder's lease ends": both are ``kill -9``ed at
    once; the second waiter must hold the lock within the holder's kill bound + a third of
    the waiter's ttl (+ slack)."""
    b = backend(request, key)
    name = fresh("bothkilled")
    ttl = 2.0  # everyone's
    holder, first, second = await agents.start_each("once", b.url, name, [
        {"ttl": ttl, "hold": 600, "fair": fair}, *[{"ttl": ttl, "hold": 0.5, "fair": fair}] * 2])
    await holder.say("GO")
    h = await holder.got(20)
    await go_in_order([first, second], SETTLE)
    killed = time.monotonic()
    await asyncio.gather(holder.kill9(), first.kill9())
    g2 = await second.got(30)
    bound = b.row.kill_bound(ttl) + ttl / 3 + SLACK
    assert g2.at - killed <= bound, (
        f"the second waiter got the lock {g2.at - killed:.2f}s after the holder and the first "
        f"waiter were killed (bound {bound:.2f}s)")
    assert g2.token > h.token


@pytest.mark.parametrize(("key", "fair"), [
    pytest.param("redis", False, id="plain"),
    pytest.param("redis", True, id="fair"),
    pytest.param("redis-cluster", False, id="redis-cluster-plain"),
    pytest.param("redis-sentinel", True, id="redis-sentinel-fair"),
])
async def test_waiter_frozen_past_its_ttl_is_skipped_then_served(
        request: pytest.FixtureRequest, agents: Agents, key: str, fair: bool) -> None:
    """Attacks "a place in the lock's queue that lapses unless the waiter renews it every
    third of its ttl" (Redis, both modes): a waiter frozen past its ttl has lost its
    place, so the release goes at once to the live waiter behind it; once thawed, the
    frozen one must find its way back and get the lock after that one (not be left
    waiting for a wake-up that no longer concerns it)."""
    b = backend(request, key)
    name = fresh("lapsed")
    ttl = 2.0  # everyone's (a wait is bounded by the holder's remaining ttl); > AT_ONCE_BOUND
    async with aiolock.connect(b.url) as locks:
        held = await locks.lock(name, ttl=ttl, fair=fair).acquire()
        frozen, alive = await agents.start("once", b.url, name, 2, ttl=ttl, fair=fair, hold=0.5)
        await go_in_order([frozen, alive], SETTLE)
        frozen.signal(signal.SIGSTOP)
        await asyncio.sleep(ttl + 0.8)  # its place lapses; the live one keeps its own
        released = time.monotonic()
        await held.release()
        got = await alive.got(30)
        frozen.signal(signal.SIGCONT)
        done = float((await alive.expect("RELEASING", 20)).split()[1])
        late = await frozen.got(30)
    assert got.at - released <= AT_ONCE_BOUND, (
        f"the live waiter got the lock {got.at - released:.2f}s after the release, behind a "
        f"waiter frozen past its ttl")
    assert late.at >= done and late.token > got.token
    assert late.at - done <= ttl + SLACK, (
        f"the thawed waiter got the lock {late.at - done:.2f}s after it was free")


@pytest.mark.slow
@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
async def test_a_long_wait_keeps_its_place(request: pytest.FixtureRequest, agents: Agents,
                                           fair: bool) -> None:
    """Attacks "a place in the lock's queue that lapses unless the waiter renews it every
    third of its ttl" from the other side: a live waiter with a short ttl (0.6 s) waits
    through a hold of 6 of its ttls; its renewals must keep its place, so the release
    hands it the lock at once (the holder's ttl, 30 s, would show a lost place)."""
    b = backend(request, "redis")
    name = fresh("longwait")
    async with aiolock.connect(b.url) as locks:
        held = await locks.lock(name, ttl=30, fair=fair).acquire()
        (waiter,) = await agents.start("once", b.url, name, 1, ttl=0.6, fair=fair, hold=1.0)
        await go_in_order([waiter], 3.6)
        released = time.monotonic()
        await held.release()
        got = await waiter.got(40)
        await waiter.expect("RELEASING", 10)
    assert got.at - released <= AT_ONCE_BOUND, (
        f"the waiter got the lock {got.at - released:.2f}s after the release")
    lost = [ln for ln in waiter.lines if ln.startswith("HB ") and ln.split()[2] == "1"]
    assert not lost, f"its lease (ttl 0.6 s) was lost while held: {lost[:3]}"
