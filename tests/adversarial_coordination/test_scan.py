"""locks.scan(prefix) (SPEC §7): every held name of every kind, nothing free or expired,
awkward prefixes, long and many names, changes during iteration, ValueError without SCAN."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import pytest

import aiolock
from aiolock import Capability

from ..conftest import need
from ..mc_server import MemcachedServer
from ..servers import RedisServer
from .helpers import scan_names


async def test_scan_lists_every_kind_and_nothing_free(coord: aiolock.Locks) -> None:
    need(coord, Capability.SCAN)
    p = f"k{uuid.uuid4().hex[:6]}:"
    caps = coord.capabilities
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(coord.lock(p + "lock", ttl=5))
        expected = {p + "lock"}
        if Capability.RWLOCK in caps:
            await stack.enter_async_context(coord.rwlock(p + "rd", ttl=5).read())
            await stack.enter_async_context(coord.rwlock(p + "wr", ttl=5).write())
            expected |= {p + "rd", p + "wr"}
        if Capability.SEMAPHORE in caps:
            await stack.enter_async_context(coord.semaphore(p + "sem", 3, ttl=5))
            expected.add(p + "sem")
        if Capability.ELECTION in caps:
            await stack.enter_async_context(coord.election(p + "el", ttl=5).campaign(data="d"))
            expected.add(p + "el")
        # released and expired ones must not show
        async with coord.lock(p + "released", ttl=5):
            pass
        gone = await coord.lock(p + "expired", ttl=0.3, watchdog=False).acquire()
        await asyncio.sleep(0.7)
        names = await scan_names(coord, p)
        assert sorted(names) == sorted(expected)
        infos = [i async for i in coord.scan(p)]
        for info in infos:
            assert info.held and info.held_by, info
        await gone.release()
    assert await scan_names(coord, p) == []


SPECIALS = ["%", "_", "\\", "\\%", "%_", "*", "?", "[a]", "'", '"', "\u00e9\U0001f512", "\x7f"]


async def test_scan_prefix_is_literal(coord: aiolock.Locks) -> None:
    need(coord, Capability.SCAN)
    for special in SPECIALS:
        base = f"s{uuid.uuid4().hex[:6]}"
        literal = base + special + "tail"
        # names a LIKE/glob pattern would wrongly match
        decoys = [base + "X" * len(special) + "tail", base + "tail", base + "Ztail",
                  base + "\\\\tail"]
        decoys = [d for d in decoys if not d.startswith(base + special)]
        async with contextlib.AsyncExitStack() as stack:
            for n in [literal, *decoys]:
                await stack.enter_async_context(coord.lock(n, ttl=5))
            got = await scan_names(coord, base + special)
            assert got == [literal], (special, got)
            assert sorted(await scan_names(coord, base)) == sorted([literal, *decoys])


async def test_scan_512_char_names(coord: aiolock.Locks) -> None:
    need(coord, Capability.SCAN)
    base = f"L{uuid.uuid4().hex[:6]}"
    n1 = (base + "a" * 600)[:512]
    n2 = (base + "\U0001f512" * 600)[:512]
    async with coord.lock(n1, ttl=5), coord.lock(n2, ttl=5):
        got = sorted(await scan_names(coord, base))
        assert got == sorted([n1, n2])
        assert await scan_names(coord, n1) == [n1]
        # a prefix longer than any name can be: nothing, or ValueError (names are <= 512)
        with contextlib.suppress(ValueError):
            assert await scan_names(coord, n1 + "z") == []


async def test_scan_thousands_of_names(coord: aiolock.Locks, coord_url: str) -> None:
    """Thousands on memory://; on PostgreSQL each held lease keeps a connection (a
    documented limit), so as many as the pool allows (45 of the default 50)."""
    need(coord, Capability.SCAN)
    base = f"T{uuid.uuid4().hex[:6]}:"
    count = 2000 if coord_url.startswith("memory") else 45
    leases = await asyncio.gather(*(coord.lock(f"{base}{i}", ttl=10).acquire(timeout=30)
                                    for i in range(count)))
    try:
        async with asyncio.timeout(30):
            got = await scan_names(coord, base)
        assert len(got) == count
        assert set(got) == {f"{base}{i}" for i in range(count)}
    finally:
        await asyncio.gather(*(lease.release() for lease in leases))
    assert await scan_names(coord, base) == []


async def test_scan_during_concurrent_changes(coord: aiolock.Locks) -> None:
    """Names held throughout the iteration appear exactly once; churning names may or
    may not; nothing else appears; the iteration ends."""
    need(coord, Capability.SCAN)
    base = f"C{uuid.uuid4().hex[:6]}:"
    stable = [f"{base}stable{i}" for i in range(30)]
    leases = [await coord.lock(n, ttl=10).acquire() for n in stable]
    stop = asyncio.Event()

    async def churn(i: int) -> None:
        while not stop.is_set():
            async with coord.lock(f"{base}churn{i}", ttl=5):
                await asyncio.sleep(0)

    churners = [asyncio.create_task(churn(i)) for i in range(5)]
    try:
        for _ in range(3):
            seen: list[str] = []
            async with asyncio.timeout(20):
                async for info in coord.scan(base):
                    seen.append(info.name)
                    await asyncio.sleep(0)
            assert len(seen) == len(set(seen)), "a name listed twice"
            assert set(stable) <= set(seen)
            assert set(seen) - set(stable) <= {f"{base}churn{i}" for i in range(5)}
    finally:
        stop.set()
        await asyncio.gather(*churners)
        for lease in leases:
            await lease.release()


async def test_scan_breaking_out_early_is_harmless(coord: aiolock.Locks) -> None:
    need(coord, Capability.SCAN)
    base = f"B{uuid.uuid4().hex[:6]}:"
    leases = [await coord.lock(f"{base}{i}", ttl=10).acquire() for i in range(20)]
    try:
        for _ in range(5):
            gen = coord.scan(base)
            async for _info in gen:
                break
            await gen.aclose()  # type: ignore[attr-defined]
        assert len(await scan_names(coord, base)) == 20
    finally:
        for lease in leases:
            await lease.release()


@pytest.mark.parametrize("prefix", [5, None, b"x"])
async def test_scan_bad_prefix_is_value_error(coord: aiolock.Locks, prefix: object) -> None:
    need(coord, Capability.SCAN)
    with pytest.raises(ValueError):
        async for _ in coord.scan(prefix):  # type: ignore[arg-type]
            pass


SURROGATE = ("scan() does not validate a lone-surrogate prefix: memory:// and MySQL list "
             "nothing, PostgreSQL raises LockError wrapping asyncpg's DataError (names get "
             "ValueError; etcd does it right)")


async def test_scan_surrogate_prefix_is_value_error(coord: aiolock.Locks, coord_url: str,
                                                    request: pytest.FixtureRequest) -> None:
    need(coord, Capability.SCAN)
    with pytest.raises(ValueError):
        async for _ in coord.scan("\ud800"):
            pass


async def _refuses_scan(locks: aiolock.Locks) -> None:
    assert Capability.SCAN not in locks.capabilities
    with pytest.raises(ValueError):
        async for _ in locks.scan(""):
            pass


async def test_scan_refused_on_memcached(memcached_server: MemcachedServer) -> None:
    async with aiolock.connect(memcached_server.url) as locks:
        await _refuses_scan(locks)


async def test_scan_refused_or_works_on_redis(redis_server: RedisServer) -> None:
    async with aiolock.connect(redis_server.url) as locks:
        if Capability.SCAN not in locks.capabilities:
            await _refuses_scan(locks)
        else:
            async with locks.lock("adv-scan-redis", ttl=5):
                assert "adv-scan-redis" in await scan_names(locks, "adv-scan")

