"""Holder records (SPEC §7): ``data`` is "an optional user string, <= 1024 chars", kept on
the server next to the claim and shown by ``status().held_by`` and ``lease.holder``."""

from __future__ import annotations

import asyncio

import pytest

import aiolock

# 1024 characters each, every one a string a user may pass
DATA = {
    "ascii": "d" * 1024,
    "bmp": "é中" * 512,                       # 2- and 3-byte UTF-8
    "astral": "\U0001F512" * 1024,           # 4-byte UTF-8 (utf8mb3 columns refuse it)
    "control": ("a\nb\tc\rd\x1b[31m\x7f" * 100)[:1024],
    "quotes": ("'\";--\\%_*?[]{}/" * 100)[:1024],
}


@pytest.mark.parametrize("kind", list(DATA))
async def test_any_1024_char_data_round_trips(hlocks: aiolock.Locks, name: str, kind: str) -> None:
    """SPEC §7: ``data="..."  # optional user string, <= 1024 chars``; ``Holder.data`` is
    "the user string": whatever string of at most 1024 characters is given comes back."""
    data = DATA[kind]
    assert len(data) == 1024
    async with hlocks.lock(name, ttl=5, data=data) as lease:
        assert lease.holder is not None and lease.holder.data == data
        info = await hlocks.status(name)
        assert [h.data for h in info.held_by] == [data]


async def test_data_over_1024_refused_with_valueerror(hlocks: aiolock.Locks, name: str) -> None:
    """SPEC §7 "<= 1024 chars"; §4/guide: bad input -> ValueError saying what is accepted."""
    with pytest.raises(ValueError, match="1024"):
        hlocks.lock(name, data="x" * 1025)
    with pytest.raises(ValueError, match="1024"):
        hlocks.election(name).campaign(data="x" * 1025)


async def test_nul_in_data(hlocks: aiolock.Locks, name: str) -> None:
    """A NUL is a character of a Python string: either it round-trips, or it is refused
    up front with ValueError (never a server error, never a lock left behind)."""
    data = "a\x00b"
    try:
        lock = hlocks.lock(name, ttl=5, data=data)
    except ValueError:
        return
    async with lock as lease:
        assert lease.holder is not None and lease.holder.data == data
        info = await hlocks.status(name)
        assert [h.data for h in info.held_by] == [data]


async def test_holder_record_fields(hlocks: aiolock.Locks, name: str) -> None:
    """SPEC §7: Holder(host = socket.gethostname(), pid, task = the acquiring task's name,
    data, since = seconds it has been held)."""
    import os
    import socket

    async def take() -> aiolock.Lease:
        return await hlocks.lock(name, ttl=5, data="rec").acquire()

    lease = await asyncio.create_task(take(), name="the-acquirer")
    try:
        await asyncio.sleep(0.3)
        info = await hlocks.status(name)
        (h,) = info.held_by
        assert (h.host, h.pid, h.task, h.data) == (socket.gethostname(), os.getpid(),
                                                   "the-acquirer", "rec")
        assert h.since is not None and 0.0 <= h.since < 5.0, h.since
    finally:
        await lease.release()
    assert (await hlocks.status(name)).held_by == ()


@pytest.mark.parametrize("how", ["release", "revoke"])
async def test_handed_over_lock_shows_the_new_holder(hlocks: aiolock.Locks, name: str,
                                                     how: str) -> None:
    """SPEC §7 ``info.held_by``: "every current holder"; ``Leader(data, ...)``: the
    leader's data. After a release or a revocation hands the lock (the leadership) to a
    waiter, the record shown is the waiter's, never the previous holder's."""
    from aiolock import Capability
    if how == "revoke" and Capability.REVOKE not in hlocks.capabilities:
        pytest.skip("no REVOKE")
    first = await hlocks.lock(name, ttl=3, data="A").acquire()
    waiter = asyncio.create_task(hlocks.lock(name, ttl=3, data="B").acquire(timeout=10))
    election = hlocks.election(name + "e", ttl=3)
    term = await election.campaign(data="LA").acquire()
    candidate = asyncio.create_task(election.campaign(data="LB").acquire(timeout=10))
    await asyncio.sleep(0.3)
    if how == "release":
        await first.release()
        await term.release()
    else:
        assert await hlocks.lock(name).force_release()
        assert await election.campaign().force_release()
    second, next_term = await waiter, await candidate
    try:
        info = await hlocks.status(name)
        assert [h.data for h in info.held_by] == ["B"], info
        assert second.holder is not None and second.holder.data == "B"
        leader = await election.leader()
        assert leader is not None and (leader.data, leader.token) == ("LB", next_term.token)
        assert leader.holder.data == "LB"
    finally:
        for lease in (second, next_term, first, term):
            await lease.release()
