"""Holder records (SPEC §7): exact, per reader and permit, validated data, sensible since."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

import aiolock
from aiolock import Capability, Kind

from ..conftest import need


async def test_holder_fields_are_exact(coord: aiolock.Locks, name: str) -> None:
    need(coord, Capability.HOLDERS)
    data = "ünï\u00e9 \U0001f512 " + "x" * 1000
    data = data[:1024]
    lock = coord.lock(name, ttl=5, data=data)
    seen: list[aiolock.Holder] = []

    async def body() -> aiolock.Holder:
        async with lock as lease:
            seen.extend((await coord.status(name)).held_by)
            return lease.holder

    mine = await asyncio.create_task(body(), name="worker-\u00e9-7")
    me = (socket.gethostname(), os.getpid(), "worker-\u00e9-7", data)
    assert (mine.host, mine.pid, mine.task, mine.data) == me
    assert len(seen) == 1
    assert (seen[0].host, seen[0].pid, seen[0].task, seen[0].data) == me
    assert (await coord.status(name)).held_by == ()


async def test_default_data_is_empty_string(coord: aiolock.Locks, name: str) -> None:
    need(coord, Capability.HOLDERS)
    async with coord.lock(name, ttl=5) as lease:
        assert lease.holder.data == ""
        (h,) = (await coord.status(name)).held_by
        assert h.data == ""


AWKWARD = ["a\x00b", "\x00", "tab\tnew\nline\r", "'; DROP TABLE x; --", "\\x00%_"]
BAD = ["x" * 1025, "\ud800", "ok\udfffok", 7, b"bytes", None, ["l"]]


async def test_awkward_data_roundtrips_or_is_refused(coord: aiolock.Locks, name: str) -> None:
    """Any str <= 1024 chars is data: it comes back exactly, or (NUL) is refused with
    ValueError up front -- never a driver error."""
    need(coord, Capability.HOLDERS)
    for data in AWKWARD:
        try:
            lock = coord.lock(name, ttl=5, data=data)
            lease = await lock.acquire(timeout=5)
        except ValueError:
            assert "\x00" in data, "only NUL may be refused"
            continue
        try:
            assert lease.holder.data == data
            (h,) = (await coord.status(name)).held_by
            assert h.data == data, (h.data, data)
        finally:
            await lease.release()


async def test_bad_data_is_value_error_everywhere(coord: aiolock.Locks, name: str) -> None:
    need(coord, Capability.HOLDERS)
    for data in BAD:
        with pytest.raises(ValueError):
            coord.lock(name, data=data)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            coord.rwlock(name, data=data)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            coord.semaphore(name, 2, data=data)  # type: ignore[arg-type]
        if Capability.ELECTION in coord.capabilities:
            with pytest.raises(ValueError):
                coord.election(name).campaign(data=data)  # type: ignore[arg-type]


async def test_data_of_exactly_1024_chars_is_accepted(coord: aiolock.Locks, name: str) -> None:
    need(coord, Capability.HOLDERS)
    data = "\U0001f600" * 1024  # 1024 chars, 4096 UTF-8 bytes
    async with coord.lock(name, ttl=5, data=data):
        (h,) = (await coord.status(name)).held_by
        assert h.data == data


async def test_each_reader_and_permit_has_its_own_record(coord: aiolock.Locks, name: str) -> None:
    need(coord, Capability.HOLDERS)
    caps = coord.capabilities
    release = asyncio.Event()
    ready: list[int] = []

    async def hold(lock: aiolock.Lock) -> None:
        async with lock:
            ready.append(1)
            await release.wait()

    if Capability.RWLOCK in caps:
        rws = [coord.rwlock(name, ttl=5, data=f"reader-{i}") for i in range(3)]
        tasks = [asyncio.create_task(hold(rw.read()), name=f"rt-{i}") for i, rw in enumerate(rws)]
        async with asyncio.timeout(10):
            while len(ready) < 3:
                await asyncio.sleep(0.01)
        info = await coord.status(name, Kind.READ)
        assert info.held and info.holders == 3
        got = sorted((h.task, h.data, h.pid) for h in info.held_by)
        assert got == [(f"rt-{i}", f"reader-{i}", os.getpid()) for i in range(3)]
        release.set()
        await asyncio.gather(*tasks)
        assert (await coord.status(name, Kind.READ)).held_by == ()
    if Capability.SEMAPHORE in caps:
        release.clear()
        ready.clear()
        sname = name + ":sem"
        sems = [coord.semaphore(sname, 4, ttl=5, data=f"permit-{i}") for i in range(3)]
        tasks = [asyncio.create_task(hold(s), name=f"pt-{i}") for i, s in enumerate(sems)]
        async with asyncio.timeout(10):
            while len(ready) < 3:
                await asyncio.sleep(0.01)
        info = await coord.status(sname, Kind.PERMIT)
        got = sorted((h.task, h.data) for h in info.held_by)
        assert got == [(f"pt-{i}", f"permit-{i}") for i in range(3)]
        release.set()
        await asyncio.gather(*tasks)
        assert (await coord.status(sname, Kind.PERMIT)).held_by == ()


async def test_since_is_monotone_and_sensible(coord: aiolock.Locks, name: str) -> None:
    need(coord, Capability.HOLDERS)
    async with coord.lock(name, ttl=5):
        (a,) = (await coord.status(name)).held_by
        await asyncio.sleep(0.4)
        (b,) = (await coord.status(name)).held_by
    assert a.since is not None and b.since is not None
    assert 0 <= a.since < 1.0
    assert b.since >= a.since + 0.3, (a.since, b.since)
    assert b.since < a.since + 2.0
    # the next holder's since starts again
    async with coord.lock(name, ttl=5):
        (c,) = (await coord.status(name)).held_by
        assert c.since is not None and c.since < 0.3, c


async def test_expired_holder_is_not_listed(coord: aiolock.Locks, name: str) -> None:
    need(coord, Capability.HOLDERS)
    lease = await coord.lock(name, ttl=0.3, watchdog=False).acquire()
    await asyncio.sleep(0.6)
    assert lease.lost
    info = await coord.status(name)
    assert info.held_by == () or not info.held, info
    await lease.release()


async def test_holder_of_a_leader(coord: aiolock.Locks, name: str) -> None:
    need(coord, Capability.ELECTION)
    el = coord.election(name, ttl=5)

    async def lead() -> None:
        async with el.campaign(data="host-a:8080") as term:
            ldr = await el.leader()
            assert ldr is not None
            assert ldr.token == term.token and ldr.data == "host-a:8080"
            assert ldr.holder.pid == os.getpid() and ldr.holder.task == "lead-task"
            info = await coord.status(name, Kind.LEADER)
            assert [h.data for h in info.held_by] == ["host-a:8080"]

    await asyncio.create_task(lead(), name="lead-task")
