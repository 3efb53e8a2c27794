"""``locks.scan(prefix)`` (SPEC §7): "every name starting with ``prefix`` that is held now"
(docstring), for every kind. A prefix is a plain string: glob characters of Redis ``SCAN
MATCH`` (``* ? [ ] \\``), SQL ``LIKE`` wildcards (``% _ \\``) and ``/`` (a ZooKeeper path
separator) match only themselves."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import pytest

import aiolock

ODD = ["*", "?", "[ab]", "[", "]", "\\", "%", "_", "/", "{", "}", ":", "\\*", "^", "a.*"]


async def _names(locks: aiolock.Locks, prefix: str) -> list[str]:
    return [info.name async for info in locks.scan(prefix=prefix)]


async def test_odd_prefixes_match_literally(slocks: aiolock.Locks) -> None:
    """For each odd character c, hold ``base+c+"x"`` and a decoy that a glob/LIKE/path
    reading of ``base+c`` would match (``base+"Zx"``, ``base+"ax"``, ``base+"bx"``);
    ``scan(base+c)`` must list exactly the first."""
    base = f"s{uuid.uuid4().hex[:8]}-"
    decoys = [base + d for d in ("Zx", "ax", "bx", "x", "Z/x", "Z\\x")]
    held = {c: base + c + "x" for c in ODD}
    async with contextlib.AsyncExitStack() as stack:
        for n in [*held.values(), *decoys]:
            await stack.enter_async_context(slocks.lock(n, ttl=10))
        wrong = {}
        for c in held:
            got = await _names(slocks, base + c)
            expect = sorted(m for m in [*held.values(), *decoys] if m.startswith(base + c))
            if sorted(got) != expect:
                wrong[c] = (got, expect)
        assert not wrong, wrong
        got = sorted(await _names(slocks, base))
        assert got == sorted([*held.values(), *decoys])


async def test_scan_lists_every_kind_once(slocks: aiolock.Locks) -> None:
    """SPEC §7: "every name now held, any kind", each as ``status`` reports it."""
    base = f"k{uuid.uuid4().hex[:8]}:"
    from aiolock import Capability
    async with contextlib.AsyncExitStack() as stack:
        expect: list[tuple[str, str]] = []
        await stack.enter_async_context(slocks.lock(base + "l", ttl=10))
        expect.append((base + "l", "lock"))
        if Capability.RWLOCK in slocks.capabilities:
            await stack.enter_async_context(slocks.rwlock(base + "r", ttl=10).read())
            expect.append((base + "r", "rwlock"))
        if Capability.SEMAPHORE in slocks.capabilities:
            await stack.enter_async_context(slocks.semaphore(base + "s", limit=3, ttl=10))
            expect.append((base + "s", "semaphore"))
        await stack.enter_async_context(slocks.election(base + "e", ttl=10).campaign("d"))
        expect.append((base + "e", "election"))
        infos = [i async for i in slocks.scan(prefix=base)]
        names = [i.name for i in infos]
        assert sorted(names) == sorted(n for n, _ in expect), infos
        assert all(i.held and i.held_by for i in infos), infos


async def test_scan_while_names_churn(slocks: aiolock.Locks) -> None:
    """Names held for the whole scan are listed (once each) while other names of the same
    prefix are acquired and released all along; a name listed was held (never free)."""
    base = f"c{uuid.uuid4().hex[:8]}:"
    stable = [f"{base}s{i:03d}" for i in range(40)]
    stop = asyncio.Event()

    async def churn(i: int) -> None:
        while not stop.is_set():
            async with slocks.lock(f"{base}c{i:03d}-{uuid.uuid4().hex[:4]}", ttl=10):
                await asyncio.sleep(0)

    async with contextlib.AsyncExitStack() as stack:
        for n in stable:
            await stack.enter_async_context(slocks.lock(n, ttl=10))
        tasks = [asyncio.create_task(churn(i)) for i in range(8)]
        try:
            for _ in range(3):
                infos = [i async for i in slocks.scan(prefix=base)]
                names = [i.name for i in infos]
                assert len(names) == len(set(names)), "a name listed twice"
                missing = set(stable) - set(names)
                assert not missing, f"{len(missing)} held names not listed"
                assert all(i.held for i in infos)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_scan_prefix_surrogate_and_types(slocks: aiolock.Locks) -> None:
    """Bad input -> ValueError (common rules): a non-UTF-8 prefix (lone surrogate)."""
    with pytest.raises(ValueError):
        [i async for i in slocks.scan(prefix="\udc80")]
