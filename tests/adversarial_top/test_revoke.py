"""``aiolock revoke NAME`` against every row that declares ``Capability.REVOKE``
(docs/operations.md, "aiolock revoke: force-release a name"): exit 0 if something was
held, 1 if nothing was; every holder of NAME, in every kind, finds its lease lost at its
next renewal (within ttl/3), its ``async with`` body cancelled with ``LockLost``; tokens
keep increasing; exactly NAME is revoked (not names it is a prefix of)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest

import aiolock

from ..scenarios import Scenario
from ..servers import RedisServer
from .conftest import C, cli, no_traceback, on_rows, prefix

TTL = 2.0
#: a renewal comes within ttl/3; then a little for the request itself and the cancel
LOST_WITHIN = TTL / 3 + 1.5


async def lost_within(lease: aiolock.Lease, seconds: float) -> float:
    t0 = time.monotonic()
    deadline = t0 + seconds
    while not lease.lost:
        if time.monotonic() > deadline:
            raise AssertionError(f"{lease.name!r} not lost {seconds}s after the revocation")
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


@pytest.mark.slow  # (about 25 s of the suite; ./test.sh -m slow)
@on_rows(C.REVOKE)
async def test_revoke_exit_codes_every_kind_and_only_that_name(scenario: Scenario, backend_url: str) -> None:
    p = prefix()
    target = p + "x"
    caps = scenario.capabilities
    async with aiolock.connect(backend_url) as locks, aiolock.connect(backend_url) as other:
        # a holder in an `async with` whose body must be cancelled and raise LockLost
        entered = asyncio.Event()
        cancelled = asyncio.Event()
        token: list[int] = []

        async def body() -> None:
            async with locks.lock(target, ttl=TTL, data="victim") as lease:
                token.append(lease.token)
                entered.set()
                try:
                    await asyncio.sleep(60)
                except asyncio.CancelledError:
                    cancelled.set()
                    raise

        holder = asyncio.create_task(body())
        await asyncio.wait_for(entered.wait(), 15)
        victims: list[aiolock.Lease] = []
        if C.ELECTION in caps:
            victims.append(await other.election(target, ttl=TTL).campaign(data="leader").acquire(timeout=10))
        if C.SEMAPHORE in caps:
            sem = other.semaphore(target, 3, ttl=TTL)
            victims += [await asyncio.create_task(sem.acquire(timeout=10)) for _ in range(2)]
        # names the target is a prefix of, or that contain it: untouched
        bystanders = [
            await other.lock(n, ttl=TTL).acquire(timeout=10)
            for n in (target + ":1", target + "y", target + "*", "z" + target)
        ]
        before = {b.name: (await locks.status(b.name)).token for b in bystanders}

        ran = await cli("revoke", "--url", backend_url, target, timeout=40)
        assert ran.code == 0, ran
        no_traceback(ran.err + ran.out)
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(holder), LOST_WITHIN)
        except aiolock.LockLost:
            pass
        except TimeoutError:
            raise AssertionError(f"the holder's body was not cancelled within {LOST_WITHIN}s") from None
        else:
            raise AssertionError("the revoked holder's block did not raise LockLost")
        assert cancelled.is_set(), "the body was not cancelled"
        for v in victims:
            await lost_within(v, max(0.0, LOST_WITHIN - (time.monotonic() - t0)) + 0.5)
        # the bystanders live on, unrevoked, across several renewals
        await asyncio.sleep(TTL / 3 + 0.3)  # past their next renewal
        for b in bystanders:
            assert not b.lost, f"revoking {target!r} revoked {b.name!r} too"
            assert (await locks.status(b.name)).token == before[b.name], b.name
        listed = await cli("ls", "--json", "--url", backend_url, p, timeout=40) if C.SCAN in caps else None

        again = await cli("revoke", "--url", backend_url, target, timeout=40)
        assert again.code == 1, again
        never = await cli("revoke", "--url", backend_url, p + "never-held", timeout=40)
        assert never.code == 1, never
        no_traceback(again.err + again.out + never.err + never.out)

        async with locks.lock(target, ttl=TTL) as fresh:
            assert fresh.token > token[0], (fresh.token, token)
        for lease in [*victims, *bystanders]:
            with contextlib.suppress(aiolock.LockError):
                await lease.release()
    if listed is not None:
        assert listed.code == 0, listed
        names = {json.loads(line)["name"] for line in listed.out.splitlines() if line.strip()}
        assert target not in names, listed.out
        assert {target + ":1", target + "y", target + "*"} <= names, listed.out


@on_rows(C.REVOKE)
async def test_revoke_odd_names(scenario: Scenario, backend_url: str) -> None:
    """Names with non-ASCII, glob, LIKE and markup characters are revoked exactly."""
    p = prefix()
    odd = [p + "ключ 🔒 名前", p + "a_%*?[x]{y}\\!/b", p + "[bold]z[/]"]
    async with aiolock.connect(backend_url) as locks:
        leases = [await locks.lock(n, ttl=TTL).acquire(timeout=10) for n in odd]
        near = await locks.lock(p + "aX%*?[x]{y}\\!/b", ttl=TTL).acquire(timeout=10)  # `_` as a wildcard
        runs = await asyncio.gather(*(cli("revoke", "--url", backend_url, n, timeout=40) for n in odd))
        for n, ran in zip(odd, runs, strict=True):
            assert ran.code == 0, (n, ran)
            no_traceback(ran.err + ran.out)
        for lease in leases:
            await lost_within(lease, LOST_WITHIN)
        assert not near.lost and (await locks.status(near.name)).held
        await near.release()


@on_rows(C.REVOKE)
async def test_revoke_exit_0_for_a_name_held_in_one_kind_only(scenario: Scenario, backend_url: str) -> None:
    """'Revokes every holder of NAME, in every kind': a name held only as an election, only
    as semaphore permits or only as read locks is something held (exit 0), its holders
    lose their leases; a lock of another name is untouched."""
    p = prefix()
    caps = scenario.capabilities
    async with aiolock.connect(backend_url) as locks:
        held: dict[str, list[aiolock.Lease]] = {}
        if C.ELECTION in caps:
            held[p + "elect"] = [
                await locks.election(p + "elect", ttl=TTL).campaign(data="l").acquire(timeout=10)
            ]
        if C.SEMAPHORE in caps:
            sem = locks.semaphore(p + "sem", 2, ttl=TTL)
            held[p + "sem"] = [await asyncio.create_task(sem.acquire(timeout=10)) for _ in range(2)]
        if C.RWLOCK in caps:
            rw = locks.rwlock(p + "rw", ttl=TTL)
            held[p + "rw"] = [await asyncio.create_task(rw.read().acquire(timeout=10)) for _ in range(2)]
        if not held:
            pytest.skip("only plain locks here")
        runs = await asyncio.gather(*(cli("revoke", "--url", backend_url, n, timeout=40) for n in held))
        for n, ran in zip(held, runs, strict=True):
            assert ran.code == 0, (n, ran)
        for leases in held.values():
            for lease in leases:
                await lost_within(lease, LOST_WITHIN)
        runs = await asyncio.gather(*(cli("revoke", "--url", backend_url, n, timeout=40) for n in held))
        for n, ran in zip(held, runs, strict=True):
            assert ran.code == 1, (n, ran)


@pytest.mark.parametrize("bad", ["", "x" * 513])
async def test_revoke_bad_name_is_a_usage_error(bad: str, redis_server: RedisServer) -> None:
    """An empty or over-long (> 512 characters) name is a bad argument: exit 2, one line,
    no traceback."""
    ran = await cli("revoke", "--url", redis_server.url, bad, timeout=30)
    assert ran.code == 2, ran
    no_traceback(ran.err + ran.out)
    assert len([line for line in ran.err.splitlines() if line.strip()]) == 1, ran.err
