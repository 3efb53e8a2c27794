"""Holders, revocation and leader election (SPEC §7, §8) on every backend of ours that
declares them (the others skip)."""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import pytest

import aiolock
from aiolock import Capability

from ..conftest import rows_fixture, url_fixture
from ..scenarios import params_of
from .conftest import ended

row = rows_fixture("row", params_of("memory", "redis", "zookeeper", "postgres"), "The backends under test.")
url = url_fixture("url", "row")


def _need(locks: aiolock.Locks, cap: Capability) -> None:
    if cap not in locks.capabilities:
        pytest.skip(f"{locks.url} does not declare {cap.value}")


async def test_holder_data_limits(pair: tuple[aiolock.Locks, aiolock.Locks]) -> None:
    a, b = pair
    _need(a, Capability.HOLDERS)
    name = f"h-{uuid.uuid4().hex}"
    with pytest.raises(ValueError):
        await a.lock(name, data="x" * 1025).acquire(timeout=0)
    with pytest.raises(ValueError):
        await a.lock(name, data="\ud800").acquire(timeout=0)
    data = "é🔒" * 300  # 600 characters, 2100 bytes
    lease = await a.lock(name, ttl=5, data=data).acquire()
    info = await b.status(name)
    assert len(info.held_by) == 1
    (holder,) = info.held_by
    assert holder.data == data and holder.pid == os.getpid()
    await lease.release()
    assert (await b.status(name)).held_by == ()


async def test_force_release_revokes(pair: tuple[aiolock.Locks, aiolock.Locks]) -> None:
    a, b = pair
    _need(a, Capability.REVOKE)
    name = f"f-{uuid.uuid4().hex}"
    assert await b.lock(name).force_release() is False
    cancelled_at = None

    async def holder() -> int:
        nonlocal cancelled_at
        async with a.lock(name, ttl=1.5) as lease:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                cancelled_at = time.monotonic()
                raise
        return lease.token

    task = asyncio.create_task(holder())
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    assert await b.lock(name).force_release() is True
    with pytest.raises(aiolock.LockLost):
        async with asyncio.timeout(5):
            await task
    assert cancelled_at is not None and cancelled_at - t0 < 0.5 + 0.3
    lease = await b.lock(name, ttl=5).acquire(timeout=1)
    info = await b.status(name)
    assert info.held and info.token == lease.token
    await lease.release()


async def test_election_handover_and_terms(pair: tuple[aiolock.Locks, aiolock.Locks]) -> None:
    a, b = pair
    _need(a, Capability.ELECTION)
    name = f"e-{uuid.uuid4().hex}"
    ea, eb = a.election(name, ttl=3), b.election(name, ttl=3)
    assert await ea.leader() is None
    first = await ea.campaign(data="A").acquire()
    second_task = asyncio.create_task(eb.campaign(data="B").acquire())
    await asyncio.sleep(0.2)
    assert not second_task.done()
    leader = await eb.leader()
    assert leader is not None and leader.data == "A" and leader.token == first.token
    await first.proclaim("A2")
    leader = await eb.leader()
    assert leader is not None and leader.data == "A2"
    t0 = time.monotonic()
    await first.release()
    async with asyncio.timeout(5):
        second = await second_task
    assert time.monotonic() - t0 < 1.0
    assert second.token > first.token
    leader = await ea.leader()
    assert leader is not None and leader.data == "B"
    await second.release()
    assert await ea.leader() is None


async def test_observe_ends_on_current_state(pair: tuple[aiolock.Locks, aiolock.Locks]) -> None:
    a, b = pair
    _need(a, Capability.ELECTION)
    name = f"o-{uuid.uuid4().hex}"
    seen: list[object] = []

    async def watch() -> None:
        async for leader in b.election(name, ttl=2).observe():
            seen.append(None if leader is None else leader.data)

    watcher = asyncio.create_task(watch())
    try:
        for i in range(5):  # churn
            term = await a.election(name, ttl=2).campaign(data=f"d{i}").acquire()
            await term.proclaim(f"d{i}x")
            await term.release()
        term = await a.election(name, ttl=2).campaign(data="final").acquire()
        await asyncio.sleep(1.0)
        assert seen and seen[-1] == "final", seen
        await term.release()
        await asyncio.sleep(1.0)
        assert seen[-1] is None, seen
    finally:
        watcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watcher


async def test_cancelled_campaigns_leave_no_leader(pair: tuple[aiolock.Locks, aiolock.Locks]) -> None:
    a, b = pair
    _need(a, Capability.ELECTION)
    name = f"c-{uuid.uuid4().hex}"
    holder = await a.election(name, ttl=3).campaign(data="a").acquire()
    for steps in range(0, 30, 3):
        task = asyncio.create_task(b.election(name, ttl=3).campaign(data="b").acquire())
        for _ in range(steps):
            await asyncio.sleep(0)
        if steps == 15:
            await holder.release()
        task.cancel()
        await ended(task)
        try:
            term = await task
        except asyncio.CancelledError:
            continue
        await term.release()
    async with asyncio.timeout(5):
        term = await a.election(name, ttl=3).campaign(data="z").acquire(timeout=1)
    leader = await b.election(name).leader()
    assert leader is not None and leader.data == "z"
    await term.release()
