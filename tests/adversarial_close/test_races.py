"""``aclose()`` at seeded random moments while acquires, releases, ``extend()``s, watchdog
renewals, ``status()`` / ``locked()`` / ``scan()`` reads and election calls are in flight
(the cancellation-like races of a close): every call ends (returns, or raises a
``LockError``) promptly, never a bare ``CancelledError`` or another exception; nothing
stays held on the server (a judge connection takes every name at once, with leases of
ttl 30 s: a leak would keep them); no event-loop report. Written from README.md, SPEC.md
and docs/ only."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
from collections.abc import Awaitable, Callable
from typing import Any

import aiolock
from aiolock import Capability

from ..scenarios import Scenario
from .conftest import CLOSE, LONG, Outcome, has, take_leadership, take_lock, take_permits, take_write, timed

ROUNDS = 6


async def _cycle(conn: aiolock.Locks, name: str) -> int:
    """Acquire and release ``name`` over and over until the connection fails."""
    n = 0
    while True:
        lease = await conn.lock(name, ttl=LONG).acquire(timeout=5)
        await lease.release()
        n += 1
        await asyncio.sleep(0)  # memory:// answers without yielding: let the close run


async def _reads(conn: aiolock.Locks, name: str, scan: bool) -> None:
    while True:
        await conn.status(name)
        await conn.lock(name).locked()
        if scan:
            async for _ in conn.scan(prefix=name):
                pass
        await asyncio.sleep(0)  # memory:// answers without yielding: let the close run


async def _in_body(conn: aiolock.Locks, name: str) -> None:
    async with conn.lock(name, ttl=LONG):
        await asyncio.sleep(0.005)


def _calls(
    doomed: aiolock.Locks, n: str, pre: dict[str, aiolock.Lease]
) -> dict[str, Callable[[], Awaitable[Any]]]:
    """The calls in flight at the close, by label."""

    async def acquire_release() -> None:
        lease = await doomed.lock(f"{n}-ar", ttl=LONG).acquire(timeout=5)
        await lease.release()

    calls: dict[str, Callable[[], Awaitable[Any]]] = {
        "acquire free": lambda: doomed.lock(f"{n}-free", ttl=LONG).acquire(timeout=5),
        "acquire free (0)": lambda: doomed.lock(f"{n}-free0", ttl=LONG).acquire(timeout=0),
        "acquire busy": lambda: doomed.lock(f"{n}-busy", ttl=LONG).acquire(timeout=10),
        "acquire+release": acquire_release,
        "async with body": lambda: _in_body(doomed, f"{n}-body"),
        "cycle": lambda: _cycle(doomed, f"{n}-cyc"),
        "reads": lambda: _reads(doomed, f"{n}-busy", has(doomed, Capability.SCAN)),
    }
    if "to-release" in pre:
        calls["release"] = pre["to-release"].release
        calls["extend"] = lambda: pre["to-extend"].extend(LONG)
    if has(doomed, Capability.FAIR):
        calls["fair"] = lambda: doomed.lock(f"{n}-fair", ttl=LONG, fair=True).acquire(timeout=5)
    if has(doomed, Capability.RWLOCK):
        calls["read"] = lambda: doomed.rwlock(f"{n}-rw", ttl=LONG).read().acquire(timeout=5)
    if has(doomed, Capability.SEMAPHORE):
        calls["permit"] = lambda: doomed.semaphore(f"{n}-sem", limit=1, ttl=LONG).acquire(timeout=5)
    if has(doomed, Capability.ELECTION):
        calls["campaign"] = lambda: doomed.election(f"{n}-el", ttl=LONG).campaign().acquire(timeout=5)
        calls["leader"] = lambda: doomed.election(f"{n}-el").leader()
    return calls


async def _round(
    rnd: random.Random, rnd_round: int, n: str, backend_url: str, judge: aiolock.Locks
) -> list[str]:
    """One close at a random moment; the failures it shows."""
    failures: list[str] = []
    busy = await judge.lock(f"{n}-busy", ttl=LONG).acquire(timeout=5)
    doomed = aiolock.connect(backend_url)
    pre: dict[str, aiolock.Lease] = {}
    if rnd_round % 2:  # connected before; even rounds close while connecting
        await doomed.status(n)
        pre["to-release"] = await doomed.lock(f"{n}-rel", ttl=LONG).acquire(timeout=5)
        pre["to-extend"] = await doomed.lock(f"{n}-ext", ttl=LONG).acquire(timeout=5)
        pre["renewing"] = await doomed.lock(f"{n}-ren", ttl=0.6).acquire(timeout=5)
    tasks = {
        what: asyncio.create_task(timed(what, call, cap=20)) for what, call in _calls(doomed, n, pre).items()
    }
    if rnd.random() < 0.5:
        steps = rnd.randrange(0, 40)
        for _ in range(steps):
            await asyncio.sleep(0)
        when = f"{steps} loop steps"
    else:
        delay = rnd.uniform(0, 0.05 if rnd_round % 2 == 0 else 0.7)  # odd: past a renewal
        await asyncio.sleep(delay)
        when = f"{delay * 1000:.0f} ms"
    closed = await timed("aclose()", doomed.aclose)
    where = f"round {rnd_round} (closed after {when})"
    if closed.error is not None or closed.elapsed >= CLOSE:
        failures.append(f"{where}: " + closed.describe())
    done, pending = await asyncio.wait(tasks.values(), timeout=5)
    for what, task in tasks.items():
        if task not in done:
            failures.append(f"{where}: {what} still running 5 s after the close")
            continue
        outcome: Outcome = task.result()
        if outcome.error is not None and not isinstance(outcome.error, aiolock.LockError):
            failures.append(f"{where}: " + outcome.describe())
        if isinstance(outcome.result, aiolock.Lease) and not outcome.result.released:
            failures.append(f"{where}: {what} returned a lease not released by the close: {outcome.result!r}")
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    await busy.release()
    # nothing held, no waiter place kept: a judge takes every name at once
    try:
        for suffix in ("free", "free0", "busy", "ar", "body", "cyc", "rel", "ext"):
            await take_lock(judge, f"{n}-{suffix}")
        if has(judge, Capability.FAIR):
            await take_lock(judge, f"{n}-fair", fair=True)
        if has(judge, Capability.RWLOCK):
            await take_write(judge, f"{n}-rw")
        if has(judge, Capability.SEMAPHORE):
            await take_permits(judge, f"{n}-sem", 1)
        if has(judge, Capability.ELECTION):
            await take_leadership(judge, f"{n}-el")
    except AssertionError as e:
        failures.append(f"{where}: {e}")
    for what, lease in pre.items():
        if what != "renewing" and not lease.released:
            failures.append(f"{where}: the lease {what} held at the close: {lease!r}")
    with contextlib.suppress(Exception):
        await doomed.aclose()
    gc.collect()
    return failures


async def test_aclose_at_random_points_of_calls_in_flight(
    scenario: Scenario, backend_url: str, judge: aiolock.Locks, name: str
) -> None:
    """Six rounds (seeded by the row): a fresh connection (odd rounds: connected, holding
    leases to release, to extend and one of ttl 0.6 s being renewed) starts every kind
    of call it offers -- acquires of free and busy names, an acquire-release, an
    ``async with`` body, an acquire/release cycle, status/locked/scan reads, fair, read,
    permit, campaign, leader -- and is closed after a random number of loop steps or
    milliseconds."""
    rnd = random.Random(f"races-{scenario.id}")
    failures: list[str] = []
    for rnd_round in range(ROUNDS):
        failures += await _round(rnd, rnd_round, f"{name}-{rnd_round}", backend_url, judge)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures)
