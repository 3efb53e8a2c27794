"""The etcd recipe's promises (SPEC §2, §3, §6; docs/backends/etcd.md): mutual exclusion,
tokens = the holder key's create_revision, strictly increasing across kinds, one waiter
woken per release, FIFO, cancellation never leaving a key, loss noticed when the key or
its lease is removed behind the holder's back."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random

import pytest

import aiolock

from ..conftest import acquire_cancelled_after, release_cancelled_after
from .conftest import Target, claim_keys, delta, grpc_counts


async def test_mutual_exclusion_and_tokens_across_connections(etcd: Target) -> None:
    """Four connections (as four processes), three tasks each: never two holders, every
    token strictly above the one before."""
    conns = [aiolock.connect(etcd.url) for _ in range(4)]
    inside = 0
    tokens: list[int] = []

    async def worker(locks: aiolock.Locks) -> None:
        nonlocal inside
        for _ in range(4):
            async with locks.lock("mx", ttl=5) as lease:
                inside += 1
                assert inside == 1, "two holders at once"
                tokens.append(lease.token)
                await asyncio.sleep(0.003)
                inside -= 1

    try:
        await asyncio.wait_for(asyncio.gather(*(worker(c) for c in conns for _ in range(3))), 30)
    finally:
        for c in conns:
            await c.aclose()
    assert len(tokens) == 48
    assert all(b > a for a, b in itertools.pairwise(tokens)), tokens
    assert claim_keys(etcd.server, etcd.prefix) == []


async def test_token_is_the_holder_keys_create_revision(etcd: Target) -> None:
    """docs: the fencing token is the holder key's create_revision, for every kind."""
    async with aiolock.connect(etcd.url) as locks:
        for ctx in (locks.lock("tok", ttl=5), locks.semaphore("tok-s", 2, ttl=5),
                    locks.rwlock("tok-rw", ttl=5).read(), locks.rwlock("tok-rw2", ttl=5).write(),
                    locks.election("tok-e", ttl=5).campaign(data="x")):
            async with ctx as lease:
                held = claim_keys(etcd.server, etcd.prefix)
                assert len(held) == 1, held
                assert lease.token == held[0].create_revision, (lease.token, held)


async def test_tokens_increase_across_waiters_kinds_and_revocation(etcd: Target) -> None:
    """Tokens of one rwlock (readers, writers), one semaphore and one election keep rising
    across hand-offs to waiters and across force_release."""
    async with aiolock.connect(etcd.url) as a, aiolock.connect(etcd.url) as b:
        seen: list[int] = []
        rw_a, rw_b = a.rwlock("k-rw", ttl=5), b.rwlock("k-rw", ttl=5)
        async with rw_a.write() as w:
            seen.append(w.token)
            waiter = asyncio.create_task(rw_b.read().acquire())
            await asyncio.sleep(0.2)
            assert not waiter.done()
        r = await asyncio.wait_for(waiter, 5)
        seen.append(r.token)
        await r.release()
        sem_a = a.semaphore("k-s", 1, ttl=5)
        s1 = await sem_a.acquire()
        assert await b.semaphore("k-s", 1, ttl=5).force_release()
        s2 = await b.semaphore("k-s", 1, ttl=5).acquire(timeout=5)
        seen += [s1.token, s2.token]
        await s2.release()
        with contextlib.suppress(aiolock.LockError):
            await s1.release()
        el = a.election("k-e", ttl=5)
        async with el.campaign(data="one") as t1:
            seen.append(t1.token)
        async with b.election("k-e", ttl=5).campaign(data="two") as t2:
            seen.append(t2.token)
    # per name: strictly increasing; across names on one etcd: revisions only grow
    assert seen == sorted(seen) and len(set(seen)) == len(seen), seen


async def test_release_wakes_one_waiter_not_a_herd(etcd: Target) -> None:
    """Eight waiters on eight connections: one release costs the server a handful of
    requests, not one per waiter (etcd's /metrics, Txn + Range + Put + DeleteRange)."""
    n = 8
    conns = [aiolock.connect(etcd.url) for _ in range(n + 1)]
    try:
        holder = await conns[0].lock("herd", ttl=30).acquire()
        waiters = [asyncio.create_task(c.lock("herd", ttl=30).acquire()) for c in conns[1:]]
        for _ in range(100):
            if len(claim_keys(etcd.server, etcd.prefix)) == n + 1:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        kv_methods = ("Txn", "Range", "Put", "DeleteRange")
        before = grpc_counts(etcd.server)
        await holder.release()
        done, _ = await asyncio.wait(waiters, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1
        await asyncio.sleep(0.5)  # a herd would show up now
        d = delta(before, grpc_counts(etcd.server))
        kv = sum(d.get(m, 0) for m in kv_methods)
        assert sum(w.done() for w in waiters) == 1
        assert kv <= 4, f"one release cost {d} on the server"
        for w in waiters:
            w.cancel()
        for w in waiters:
            with contextlib.suppress(asyncio.CancelledError):
                lease = await w
                await lease.release()
    finally:
        for c in conns:
            await c.aclose()
    assert claim_keys(etcd.server, etcd.prefix) == []


async def test_fifo_across_connections(etcd: Target) -> None:
    """Always fair: waiters that queued one after another (on different connections)
    get the lock in that order."""
    n = 6
    conns = [aiolock.connect(etcd.url) for _ in range(n + 1)]
    order: list[int] = []
    try:
        holder = await conns[0].lock("fifo", ttl=10).acquire()

        async def wait(i: int) -> None:
            async with conns[i + 1].lock("fifo", ttl=10):
                order.append(i)
                await asyncio.sleep(0.01)

        tasks = []
        for i in range(n):
            tasks.append(asyncio.create_task(wait(i)))
            for _ in range(100):  # until its key is on the server
                if len(claim_keys(etcd.server, etcd.prefix)) == i + 2:
                    break
                await asyncio.sleep(0.02)
        await holder.release()
        await asyncio.wait_for(asyncio.gather(*tasks), 15)
    finally:
        for c in conns:
            await c.aclose()
    assert order == list(range(n))


@pytest.mark.parametrize("held", [False, True], ids=["free", "held"])
async def test_cancellation_at_random_points_leaves_no_key(etcd: Target, held: bool) -> None:
    """Cancel acquire() after 0..k loop steps (and release() too): no claim key is left
    under the prefix, and the lock is free (or held only by the holder)."""
    rng = random.Random(14)
    async with aiolock.connect(etcd.url) as a, aiolock.connect(etcd.url) as b:
        holder = await a.lock("cx", ttl=10).acquire() if held else None
        lock = b.lock("cx", ttl=10)
        for steps in [*range(0, 25), *(rng.randrange(25, 200) for _ in range(10))]:
            lease = await acquire_cancelled_after(lock, steps, timeout=None if held else 5,
                                                  release=False)
            if lease is not None:
                await release_cancelled_after(lease, rng.randrange(0, 8))
        await asyncio.sleep(0.3)
        left = claim_keys(etcd.server, etcd.prefix)
        expect = 1 if held else 0
        assert len(left) == expect, [k.key for k in left]
        if holder is not None:
            assert left[0].create_revision == holder.token
            await holder.release()
        # and the lock is usable at once
        lease = await b.lock("cx", ttl=10).acquire(timeout=2)
        await lease.release()
    assert claim_keys(etcd.server, etcd.prefix) == []


async def _wait_lost(lease: aiolock.Lease, within: float) -> float:
    t0 = asyncio.get_running_loop().time()
    await asyncio.wait_for(lease.wait_lost(), within)
    return asyncio.get_running_loop().time() - t0


@pytest.mark.parametrize("how", ["del-key", "revoke-lease"])
async def test_lease_knows_it_is_lost_when_removed_behind_it(etcd: Target, how: str) -> None:
    """`etcdctl del` of the holder key, or `etcdctl lease revoke` of its etcd lease: the
    lease is lost within ttl/3 (+ slack), the body of `async with` is cancelled, the block
    raises LockLost, and the next holder gets a higher token."""
    ttl = 3.0
    async with aiolock.connect(etcd.url) as locks:
        body_cancelled = False
        with pytest.raises(aiolock.LockLost):
            async with locks.lock("gone", ttl=ttl) as lease:
                (kv,) = claim_keys(etcd.server, etcd.prefix)
                if how == "del-key":
                    etcd.server.etcdctl("del", kv.key)
                else:
                    etcd.server.etcdctl("lease", "revoke", format(kv.lease, "x"))
                start = asyncio.get_running_loop().time()
                try:
                    await asyncio.sleep(ttl * 3)
                except asyncio.CancelledError:
                    body_cancelled = True
                    took = asyncio.get_running_loop().time() - start
                    raise
        assert body_cancelled
        assert took <= ttl / 3 + 1.0, took
        assert lease.lost
        nxt = await locks.lock("gone", ttl=ttl).acquire(timeout=2)
        assert nxt.token > lease.token
        await nxt.release()


async def test_holders_scan_force_release_on_etcd(etcd: Target) -> None:
    """SPEC §7 on etcd: held_by lists every reader / permit; scan finds every kind;
    force_release revokes, the victim learns it within ttl/3, and tokens keep rising."""
    async with aiolock.connect(etcd.url) as a, aiolock.connect(etcd.url) as ops:
        sem = a.semaphore("h-sem", 3, ttl=3, data="permit")
        permits = [await sem.acquire() for _ in range(3)]
        rd = await a.rwlock("h-rw", ttl=3, data="reader").read().acquire()
        lk = await a.lock("h-lock", ttl=3, data="d" * 1024).acquire()
        info = await ops.status("h-sem", aiolock.Kind.PERMIT)
        assert info.held and len(info.held_by) == 3
        assert {h.data for h in info.held_by} == {"permit"}
        info = await ops.status("h-lock")
        assert info.held_by[0].data == "d" * 1024 and info.token == lk.token
        assert lk.holder is not None and info.held_by[0].pid == lk.holder.pid
        names = {i.name async for i in ops.scan(prefix="h-")}
        assert names == {"h-sem", "h-rw", "h-lock"}, names
        assert {i.name async for i in ops.scan(prefix="h-l")} == {"h-lock"}
        t0 = asyncio.get_running_loop().time()
        assert await ops.lock("h-lock").force_release()
        assert not await ops.lock("h-lock").force_release()
        await _wait_lost(lk, 3 / 3 + 1.0)
        assert asyncio.get_running_loop().time() - t0 <= 3 / 3 + 1.0
        nxt = await ops.lock("h-lock", ttl=3).acquire(timeout=2)
        assert nxt.token > lk.token
        assert (await ops.status("h-lock")).held_by[0].pid == nxt.holder.pid  # type: ignore[union-attr]
        await nxt.release()
        assert await ops.semaphore("h-sem", 3).force_release()
        for p in permits:
            await _wait_lost(p, 2.0)
        await rd.release()
        assert [i.name async for i in ops.scan(prefix="h-")] == []
        info = await ops.status("h-lock")
        assert not info.held and info.last_token == nxt.token


async def test_election_on_etcd(etcd: Target) -> None:
    """SPEC §8: one leader, FIFO candidates, proclaim, observe ends on the current state,
    leader() None when vacant."""
    async with aiolock.connect(etcd.url) as a, aiolock.connect(etcd.url) as b:
        ea, eb = a.election("el", ttl=3), b.election("el", ttl=3)
        assert await ea.leader() is None
        seen: list[object] = []

        async def watch() -> None:
            async for leader in eb.observe():
                seen.append(None if leader is None else leader.data)

        obs = asyncio.create_task(watch())
        term = await ea.campaign(data="a1").acquire()
        second = asyncio.create_task(eb.campaign(data="b1").acquire())
        await asyncio.sleep(0.3)
        assert not second.done()
        await term.proclaim("a2")  # type: ignore[attr-defined]
        await asyncio.sleep(0.3)
        lead = await eb.leader()
        assert lead is not None and lead.data == "a2" and lead.token == term.token
        await term.release()
        t2 = await asyncio.wait_for(second, 5)
        assert t2.token > term.token
        await asyncio.sleep(0.3)
        assert seen and seen[-1] == "b1", seen
        assert "a2" in seen
        await t2.release()
        await asyncio.sleep(1.5)
        obs.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await obs
        assert seen[-1] is None, seen
