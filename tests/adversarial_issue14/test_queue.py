"""The queue under the etcd recipe: a waiter watching the key just before its own must
not take that key's deletion by a *cancelled* waiter (or a revocation) for a release;
a waiting writer blocks later readers; cancellation of rwlock / semaphore waiters leaves
no key; mutual exclusion on the 3-member cluster (slow)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

import aiolock

from .conftest import Target, claim_keys


async def _queued(etcd: Target, count: int) -> None:
    for _ in range(200):
        if len(claim_keys(etcd.server, etcd.prefix)) >= count:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{count} claims never queued")


@pytest.mark.parametrize("cancel", ["first-waiter", "middle-waiter"])
async def test_cancelled_predecessor_is_not_a_release(etcd: Target, cancel: str) -> None:
    """H holds; W1, W2, W3 queue (each on its own connection). Cancelling W1 (or W2) deletes
    the key its successor watches: the successor must look again, not take the lock while
    H (or the waiter ahead) still holds it."""
    conns = [aiolock.connect(etcd.url) for _ in range(4)]
    try:
        h = await conns[0].lock("q", ttl=10).acquire()
        ws = []
        for i in range(1, 4):
            ws.append(asyncio.create_task(conns[i].lock("q", ttl=10).acquire()))
            await _queued(etcd, i + 1)
        victim = 0 if cancel == "first-waiter" else 1
        ws[victim].cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ws[victim]
        await asyncio.sleep(0.5)
        assert not any(w.done() for w in ws if w is not ws[victim]), "a waiter took a held lock"
        await h.release()
        live = [w for w in ws if w is not ws[victim]]
        first = await asyncio.wait_for(live[0], 5)
        await asyncio.sleep(0.3)
        assert not live[1].done(), "two holders after one release"
        await first.release()
        second = await asyncio.wait_for(live[1], 5)
        assert second.token > first.token > h.token
        await second.release()
    finally:
        for c in conns:
            await c.aclose()
    assert claim_keys(etcd.server, etcd.prefix) == []


async def test_revoked_predecessor_hands_over_once(etcd: Target) -> None:
    """force_release of the holder: the first waiter gets it, the second keeps waiting."""
    conns = [aiolock.connect(etcd.url) for _ in range(3)]
    try:
        h = await conns[0].lock("rv", ttl=3).acquire()
        w1 = asyncio.create_task(conns[1].lock("rv", ttl=3).acquire())
        await _queued(etcd, 2)
        w2 = asyncio.create_task(conns[2].lock("rv", ttl=3).acquire())
        await _queued(etcd, 3)
        assert await conns[0].lock("rv").force_release()
        first = await asyncio.wait_for(w1, 5)
        await asyncio.sleep(0.4)
        assert not w2.done()
        await asyncio.wait_for(h.wait_lost(), 3)
        await first.release()
        second = await asyncio.wait_for(w2, 5)
        await second.release()
    finally:
        for c in conns:
            await c.aclose()


async def test_waiting_writer_blocks_later_readers(etcd: Target) -> None:
    """docs: a waiting writer blocks later readers; writers are not starved."""
    async with aiolock.connect(etcd.url) as a, aiolock.connect(etcd.url) as b, \
            aiolock.connect(etcd.url) as c:
        r1 = await a.rwlock("rw", ttl=5).read().acquire()
        w = asyncio.create_task(b.rwlock("rw", ttl=5).write().acquire())
        await _queued(etcd, 2)
        r2 = asyncio.create_task(c.rwlock("rw", ttl=5).read().acquire())
        await _queued(etcd, 3)
        await asyncio.sleep(0.4)
        assert not w.done() and not r2.done(), "a later reader passed the waiting writer"
        await r1.release()
        wl = await asyncio.wait_for(w, 5)
        await asyncio.sleep(0.3)
        assert not r2.done()
        await wl.release()
        rl = await asyncio.wait_for(r2, 5)
        assert rl.token > wl.token > r1.token
        await rl.release()


def _primitive(locks: aiolock.Locks, kind: str) -> Any:
    if kind == "read":
        return locks.rwlock("ck", ttl=10).read()
    if kind == "write":
        return locks.rwlock("ck", ttl=10).write()
    if kind == "permit":
        return locks.semaphore("ck", 1, ttl=10)
    return locks.election("ck", ttl=10).campaign(data="c")


@pytest.mark.parametrize("kind", ["read", "write", "permit", "leader"])
async def test_cancelled_waiters_of_every_kind_leave_no_key(etcd: Target, kind: str) -> None:
    async with aiolock.connect(etcd.url) as a, aiolock.connect(etcd.url) as b:
        holder_kind = "write" if kind == "read" else kind
        holder = await _primitive(a, holder_kind).acquire()
        for steps in range(0, 40, 2):
            task = asyncio.create_task(_primitive(b, kind).acquire())
            for _ in range(steps):
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                lease = await task
                await lease.release()
        await asyncio.sleep(0.3)
        left = claim_keys(etcd.server, etcd.prefix)
        assert [k.create_revision for k in left] == [holder.token], [k.key for k in left]
        await holder.release()
        lease = await _primitive(b, kind).acquire(timeout=2)
        await lease.release()


@pytest.mark.slow
async def test_mutual_exclusion_on_cluster_members(etcd_cluster: Any) -> None:
    """One connection per member of the 3-member cluster: never two holders, tokens rise."""
    prefix = f"adv14c-{id(etcd_cluster)}-{asyncio.get_running_loop().time():.0f}"
    conns = [aiolock.connect(f"etcd://{m.endpoint}?prefix={prefix}") for m in etcd_cluster.members]
    inside, tokens = 0, []

    async def worker(locks: aiolock.Locks) -> None:
        nonlocal inside
        for _ in range(10):
            async with locks.lock("cl", ttl=3) as lease:
                inside += 1
                assert inside == 1
                tokens.append(lease.token)
                await asyncio.sleep(0.002)
                inside -= 1

    try:
        await asyncio.wait_for(asyncio.gather(*(worker(c) for c in conns for _ in range(2))), 60)
    finally:
        for c in conns:
            await c.aclose()
    assert tokens == sorted(tokens) and len(set(tokens)) == 60
