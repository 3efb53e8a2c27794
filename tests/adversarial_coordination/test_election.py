"""Elections (SPEC §8), in one process over several connections: at most one leader,
terms increase, proclaim, leader(), observe() settling, cancellation, try-once, FIFO
hand-over, decorators."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

import aiolock
from aiolock import Capability, Kind

from ..conftest import acquire_cancelled_after, need
from ..mc_server import MemcachedServer
from .helpers import eventually


@pytest.mark.slow
async def test_at_most_one_leader_many_candidates(elocks: aiolock.Locks, elect_url: str,
                                                  name: str) -> None:
    need(elocks, Capability.ELECTION)
    conns = [elocks] + [await aiolock.connect(elect_url).__aenter__() for _ in range(2)]
    leading: list[int] = []
    overlaps: list[tuple[int, ...]] = []
    terms: list[int] = []
    rounds = 0
    deadline = time.monotonic() + 2.5

    async def candidate(i: int, locks: aiolock.Locks) -> None:
        nonlocal rounds
        el = locks.election(name, ttl=2)
        rng = random.Random(i)
        while time.monotonic() < deadline:
            try:
                async with el.campaign(data=f"c{i}", timeout=2) as term:
                    leading.append(i)
                    if len(leading) > 1:
                        overlaps.append(tuple(leading))
                    terms.append(term.token)
                    rounds += 1
                    await asyncio.sleep(rng.random() * 0.01)
                    leading.remove(i)
            except aiolock.LockTimeout:
                pass

    try:
        async with asyncio.timeout(30):
            await asyncio.gather(*(candidate(i, conns[i % 3]) for i in range(9)))
    finally:
        for c in conns[1:]:
            await c.aclose()
    assert overlaps == []
    assert rounds >= 9
    assert terms == sorted(terms) and len(set(terms)) == len(terms), "terms not strictly increasing"


async def test_leader_and_proclaim_visible(elocks: aiolock.Locks, name: str) -> None:
    need(elocks, Capability.ELECTION)
    el = elocks.election(name, ttl=3)
    assert await el.leader() is None
    async with el.campaign(data="host-a:8080") as term:
        ldr = await el.leader()
        assert ldr is not None and (ldr.data, ldr.token) == ("host-a:8080", term.token)
        await term.proclaim("host-a:9090")
        ldr = await el.leader()
        assert ldr is not None and (ldr.data, ldr.token) == ("host-a:9090", term.token)
        assert term.holder.data in ("host-a:9090", "host-a:8080")
        for bad in ["x" * 1025, "\udc00", 5]:
            with pytest.raises(ValueError):
                await term.proclaim(bad)  # type: ignore[arg-type]
        ldr = await el.leader()
        assert ldr is not None and ldr.data == "host-a:9090"
        assert not term.lost
    assert await el.leader() is None


async def test_proclaim_after_resign_is_lock_error(elocks: aiolock.Locks, name: str) -> None:
    need(elocks, Capability.ELECTION)
    el = elocks.election(name, ttl=3)
    term = await el.campaign(data="a").acquire(timeout=5)
    await term.release()
    with pytest.raises(aiolock.LockError):
        await term.proclaim("b")
    assert await el.leader() is None


@pytest.mark.slow
async def test_proclaim_after_expiry_raises_lock_lost(elocks: aiolock.Locks, name: str) -> None:
    need(elocks, Capability.ELECTION)
    el = elocks.election(name, ttl=0.5, watchdog=False)
    term = await el.campaign(data="a").acquire(timeout=5)
    await asyncio.sleep(0.8)
    assert term.lost
    with pytest.raises(aiolock.LockLost):
        await term.proclaim("b")
    await term.release()


async def test_terms_strictly_increase(elocks: aiolock.Locks, name: str) -> None:
    need(elocks, Capability.ELECTION)
    el = elocks.election(name, ttl=3)
    terms = []
    for i in range(5):
        async with el.campaign(data=str(i)) as term:
            terms.append(term.token)
    assert terms == sorted(set(terms))
    # a lock of the same name shares no state with the election, but tokens must still not
    # let a lock-holder's token be confused with a term: at least the election's own increase
    async with el.campaign() as term:
        assert term.token > terms[-1]


async def test_campaign_timeout_zero_is_try_once(elocks: aiolock.Locks, elect_url: str,
                                                 name: str) -> None:
    need(elocks, Capability.ELECTION)
    el = elocks.election(name, ttl=3)
    t0 = time.monotonic()
    term = await el.campaign(data="first", timeout=0).acquire()
    assert time.monotonic() - t0 < 2
    try:
        async with aiolock.connect(elect_url) as other:
            el2 = other.election(name, ttl=3)
            t0 = time.monotonic()
            with pytest.raises(aiolock.LockTimeout):
                await el2.campaign(data="second", timeout=0).acquire()
            assert time.monotonic() - t0 < 2
            with pytest.raises(aiolock.LockTimeout):
                async with el2.campaign(data="third", timeout=0):
                    pytest.fail("must not lead")
            # the failed try left no candidate or phantom behind
            ldr = await el.leader()
            assert ldr is not None and ldr.data == "first"
    finally:
        await term.release()
    assert await el.leader() is None
    async with el.campaign(timeout=0) as t2:
        assert t2.token > term.token


async def test_resign_hands_over_fifo(elocks: aiolock.Locks, elect_url: str, name: str) -> None:
    need(elocks, Capability.ELECTION)
    # README: memory:// and PostgreSQL (advisory) serve candidates FIFO; its row mode and
    # MySQL do not promise it
    fair = elect_url.startswith(("memory", "postgres")) and "mode=row" not in elect_url
    el = elocks.election(name, ttl=3)
    first = await el.campaign(data="0").acquire(timeout=5)
    order: list[str] = []
    async with aiolock.connect(elect_url) as other:
        conns = [elocks, other]

        async def cand(i: int) -> None:
            async with conns[i % 2].election(name, ttl=3).campaign(data=str(i), timeout=20) as t:
                order.append(t.holder.data)
                ldr = await el.leader()
                assert ldr is not None and ldr.data == str(i) and ldr.token == t.token
                await asyncio.sleep(0.05)

        tasks = []
        for i in range(1, 5):
            tasks.append(asyncio.create_task(cand(i)))
            await asyncio.sleep(0.15)  # a clear arrival order
        t0 = time.monotonic()
        await first.release()
        async with asyncio.timeout(20):
            await asyncio.gather(*tasks)
        assert time.monotonic() - t0 < 5
    assert sorted(order) == ["1", "2", "3", "4"]
    if fair:
        assert order == ["1", "2", "3", "4"]


async def test_cancelled_campaigns_leave_no_phantom(
        elocks: aiolock.Locks, elect_url: str, name: str, request: pytest.FixtureRequest) -> None:
    need(elocks, Capability.ELECTION)
    for seed in range(3):
        el = elocks.election(f"{name}-{seed}", ttl=2)
        rng = random.Random(seed)

        async def cancel_after(steps: int, el: aiolock.Election = el) -> None:
            await acquire_cancelled_after(el.campaign(data=f"ghost{steps}"), steps)

        # cancelled while someone leads (they queue), then while vacant (they may win)
        holder = await el.campaign(data="holder").acquire(timeout=5)
        for _ in range(15):
            await cancel_after(rng.randrange(0, 40))
        await holder.release()
        for _ in range(30):
            await cancel_after(rng.randrange(0, 40))
        await asyncio.sleep(0.1)
        assert await el.leader() is None
        async with el.campaign(data="real", timeout=0) as term:
            ldr = await el.leader()
            held = [h.data for h in (await elocks.status(f"{name}-{seed}", Kind.LEADER)).held_by]
            assert held == ["real"], held
            assert ldr is not None and (ldr.data, ldr.token) == ("real", term.token), ldr


@pytest.mark.slow
async def test_cancelled_lock_acquires_leave_no_holder_record(coord: aiolock.Locks, name: str) -> None:
    need(coord, Capability.HOLDERS)
    rng = random.Random(1)
    for _ in range(40):
        await acquire_cancelled_after(coord.lock(name, ttl=2, data="ghost"), rng.randrange(0, 40))
    async with coord.lock(name, ttl=2, data="real", timeout=5):
        assert [h.data for h in (await coord.status(name)).held_by] == ["real"]


async def test_observe_current_state_first_and_settles(elocks: aiolock.Locks, elect_url: str,
                                                       name: str) -> None:
    need(elocks, Capability.ELECTION)
    ttl = 1.0
    el = elocks.election(name, ttl=ttl)
    seen: list[aiolock.Leader | None] = []
    first_seen = asyncio.Event()

    async def watch() -> None:
        async for ldr in el.observe():
            seen.append(ldr)
            first_seen.set()

    w = asyncio.create_task(watch())
    try:
        await asyncio.wait_for(first_seen.wait(), 5)
        assert seen == [None]
        async with aiolock.connect(elect_url) as other:
            el2 = other.election(name, ttl=ttl)
            # churn: many quick campaigns from two connections
            async def churn(e: aiolock.Election, tag: str) -> None:
                for i in range(15):
                    async with e.campaign(data=f"{tag}{i}", timeout=5) as term:
                        if i % 3 == 0:
                            await term.proclaim(f"{tag}{i}!")
            await asyncio.gather(churn(el, "a"), churn(el2, "b"))
            final = await el2.campaign(data="final").acquire(timeout=5)
            await term_settles(el, seen, ttl, lambda v: v is not None and v.data == "final"
                               and v.token == final.token)
            await final.proclaim("final2")
            await term_settles(el, seen, ttl, lambda v: v is not None and v.data == "final2")
            await final.release()
            await term_settles(el, seen, ttl, lambda v: v is None)
        # the last state, nothing after it
        n = len(seen)
        await asyncio.sleep(ttl)
        assert len(seen) == n and seen[-1] is None
    finally:
        w.cancel()
        await asyncio.gather(w, return_exceptions=True)


async def term_settles(el: aiolock.Election, seen: list[aiolock.Leader | None], ttl: float,
                       ok: object) -> None:
    assert callable(ok)

    async def pred() -> bool:
        return bool(seen) and bool(ok(seen[-1]))

    took = await eventually(pred, ttl + 1.0)
    assert took <= ttl + 1.0


async def test_observe_sees_vacancy_when_leader_connection_closes(
        elocks: aiolock.Locks, elect_url: str, name: str) -> None:
    need(elocks, Capability.ELECTION)
    el = elocks.election(name, ttl=1.0)
    seen: list[aiolock.Leader | None] = []

    async def watch() -> None:
        async for ldr in el.observe():
            seen.append(ldr)

    other = aiolock.connect(elect_url)
    await other.__aenter__()
    term = await other.election(name, ttl=1.0).campaign(data="x").acquire(timeout=5)
    w = asyncio.create_task(watch())
    try:
        await eventually(lambda: _last_is(seen, "x"), 3)
        await other.aclose()
        await eventually(lambda: _last_is(seen, None), 2.5)
        assert term.released or term.lost
    finally:
        w.cancel()
        await asyncio.gather(w, return_exceptions=True)


async def _last_is(seen: list[aiolock.Leader | None], data: str | None) -> bool:
    if not seen:
        return False
    last = seen[-1]
    return last is None if data is None else (last is not None and last.data == data)


@pytest.mark.slow
async def test_many_observers_all_settle(elocks: aiolock.Locks, name: str) -> None:
    need(elocks, Capability.ELECTION)
    el = elocks.election(name, ttl=1.0)
    seens: list[list[aiolock.Leader | None]] = [[] for _ in range(20)]

    async def watch(s: list[aiolock.Leader | None]) -> None:
        async for ldr in el.observe():
            s.append(ldr)

    ws = [asyncio.create_task(watch(s)) for s in seens]
    try:
        async with el.campaign(data="L"):
            for s in seens:
                await eventually(lambda s=s: _last_is(s, "L"), 3)  # type: ignore[misc]
        for s in seens:
            await eventually(lambda s=s: _last_is(s, None), 3)  # type: ignore[misc]
    finally:
        for w in ws:
            w.cancel()
        await asyncio.gather(*ws, return_exceptions=True)


async def test_decorators(elocks: aiolock.Locks, name: str) -> None:
    need(elocks, Capability.ELECTION)
    el = elocks.election(name, ttl=3)
    inside = 0
    peak = 0

    @el.campaign(data="deco")
    async def lead(x: int) -> int:
        nonlocal inside, peak
        inside += 1
        peak = max(peak, inside)
        ldr = await el.leader()
        assert ldr is not None and ldr.data == "deco"
        await asyncio.sleep(0.02)
        inside -= 1
        return x * 2

    assert lead.__name__ == "lead"
    results = await asyncio.wait_for(asyncio.gather(*(lead(i) for i in range(5))), 20)
    assert results == [0, 2, 4, 6, 8]
    assert peak == 1
    assert await el.leader() is None

    @elocks.lock(name + ":l", ttl=3)
    async def locked() -> str:
        assert await elocks.lock(name + ":l").locked()
        return "ok"

    assert await locked() == "ok"
    assert not await elocks.lock(name + ":l").locked()

    @elocks.lock(name + ":e", ttl=3)
    async def boom() -> None:
        raise KeyError("user error passes through")

    with pytest.raises(KeyError):
        await boom()
    assert not await elocks.lock(name + ":e").locked()


@pytest.mark.parametrize("which", ["lock", "campaign", "semaphore"])
async def test_decorating_a_sync_function_is_refused(elocks: aiolock.Locks, name: str,
                                                     which: str) -> None:
    need(elocks, Capability.ELECTION)
    if which == "semaphore":
        need(elocks, Capability.SEMAPHORE)
    deco = {"lock": lambda: elocks.lock(name),
            "campaign": lambda: elocks.election(name).campaign(),
            "semaphore": lambda: elocks.semaphore(name, 2)}[which]()

    def sync() -> None:
        pass

    with pytest.raises((ValueError, TypeError)):
        deco(sync)  # type: ignore[arg-type]

    async def agen():  # type: ignore[no-untyped-def]
        yield 1

    with pytest.raises((ValueError, TypeError)):
        deco(agen)


@pytest.mark.parametrize("bad", [{"ttl": 0}, {"ttl": -1}, {"ttl": float("nan")},
                                 {"on_lost": "ignore"}])
async def test_election_bad_options(elocks: aiolock.Locks, name: str, bad: dict[str, object]) -> None:
    need(elocks, Capability.ELECTION)
    with pytest.raises(ValueError):
        elocks.election(name, **bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["", "x" * 513, "\ud800", 5, None])
async def test_election_bad_names(elocks: aiolock.Locks, bad: object) -> None:
    need(elocks, Capability.ELECTION)
    with pytest.raises(ValueError):
        elocks.election(bad)  # type: ignore[arg-type]


async def test_election_refused_without_capability(pg_url: str,
                                                   memcached_server: MemcachedServer) -> None:
    for url in (pg_url + "?mode=row", memcached_server.url):
        async with aiolock.connect(url) as locks:
            if Capability.ELECTION in locks.capabilities:
                continue
            with pytest.raises(ValueError):
                el = locks.election("adv-el")
                await el.leader()
            with pytest.raises(ValueError):
                el = locks.election("adv-el")
                async for _ in el.observe():
                    break
            with pytest.raises(ValueError):
                el = locks.election("adv-el")
                await el.campaign().acquire(timeout=0)


async def test_abandoned_observers_leak_nothing(elocks: aiolock.Locks, name: str) -> None:
    """Breaking out of observe() many times must not pin connections (PostgreSQL: a pool
    of 50) or tasks: afterwards 40 leases can still be taken."""
    need(elocks, Capability.ELECTION)
    el = elocks.election(name, ttl=2)
    for _ in range(60):
        gen = el.observe()
        async with asyncio.timeout(5):
            async for _ldr in gen:
                break
        await gen.aclose()  # type: ignore[attr-defined]
    async with asyncio.timeout(20):
        leases = [await elocks.lock(f"{name}-{i}", ttl=5).acquire(timeout=10) for i in range(40)]
    for lease in leases:
        await lease.release()


async def test_observe_ends_or_raises_when_connection_closes(elect_url: str, name: str) -> None:
    locks = aiolock.connect(elect_url)
    await locks.__aenter__()
    need(locks, Capability.ELECTION)
    el = locks.election(name, ttl=1)
    got: list[object] = []

    async def watch() -> None:
        async for ldr in el.observe():
            got.append(ldr)

    w = asyncio.create_task(watch())
    await asyncio.sleep(0.3)
    await asyncio.wait_for(locks.aclose(), 10)
    try:
        await asyncio.wait_for(w, 3)
    except aiolock.LockError:
        pass
    except TimeoutError:
        pytest.fail("observe() kept iterating after its connection was closed")
    assert got == [None]
