"""``aclose()`` called from inside an ``async with`` block holding a lease (lock, read,
write, permit, leadership), from the block's own task or another: the lease is released
on the server at once and ends ``released``, not ``lost`` (so the body is not cancelled
as for a lost lease and the block raises no ``LockLost``; at most a ``LockError``), the
block's exit is quick, no cancellation is left pending on the task. Written from
README.md, SPEC.md and docs/ only."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiolock
from aiolock import Capability

from .conftest import (
    CLOSE,
    LONG,
    has,
    take_leadership,
    take_lock,
    take_permits,
    take_write,
)


def _kinds(conn: aiolock.Locks, name: str) -> list[tuple[str, Callable[[aiolock.Locks], Any], Any]]:
    """(label, make the primitive on a connection, check it free on the judge)."""
    kinds: list[tuple[str, Callable[[aiolock.Locks], Any], Any]] = [
        ("lock", lambda c: c.lock(f"{name}-l", ttl=LONG), lambda j: take_lock(j, f"{name}-l"))
    ]
    if has(conn, Capability.RWLOCK):
        kinds.append(
            ("read", lambda c: c.rwlock(f"{name}-r", ttl=LONG).read(), lambda j: take_write(j, f"{name}-r"))
        )
        kinds.append(
            ("write", lambda c: c.rwlock(f"{name}-w", ttl=LONG).write(), lambda j: take_write(j, f"{name}-w"))
        )
    if has(conn, Capability.SEMAPHORE):
        kinds.append(
            (
                "permit",
                lambda c: c.semaphore(f"{name}-s", limit=1, ttl=LONG),
                lambda j: take_permits(j, f"{name}-s", 1),
            )
        )
    if has(conn, Capability.ELECTION):
        kinds.append(
            (
                "leader",
                lambda c: c.election(f"{name}-e", ttl=LONG).campaign(data="doomed"),
                lambda j: take_leadership(j, f"{name}-e"),
            )
        )
    return kinds


async def test_aclose_from_inside_the_block_of_its_own_task(
    backend_url: str, judge: aiolock.Locks, name: str
) -> None:
    """``async with prim as lease: await locks.aclose(); ...`` -- the body runs on to its
    end, the lease is free on the server while the body still runs, the block exits
    with no exception but (at most) a ``LockError`` and no ``CancelledError``, the task
    has no cancellation pending, the lease ends released and not lost."""
    probe = aiolock.connect(backend_url)
    kinds = _kinds(probe, name)
    await probe.aclose()
    failures = []
    for label, make, free in kinds:
        doomed = aiolock.connect(backend_url)
        reached: list[str] = []
        got: Any = None
        error: BaseException | None = None
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(20):
                async with make(doomed) as lease:
                    got = lease
                    await doomed.aclose()
                    reached.append("closed")
                    await free(judge)  # free on the server while the body still runs
                    reached.append("free")
                    await asyncio.sleep(0.05)
                    reached.append("end")
        except BaseException as e:  # judged below
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            error = e
        took = time.monotonic() - t0
        task = asyncio.current_task()
        assert task is not None
        pending = task.uncancel() if task.cancelling() else 0
        if pending:
            failures.append(f"{label}: a cancellation was left pending on the task ({pending})")
        if error is not None and not isinstance(error, aiolock.LockError):
            failures.append(f"{label}: the block raised {error!r} after {reached}")
        if reached != ["closed", "free", "end"]:
            failures.append(f"{label}: the body stopped after {reached} ({error!r})")
        if got is not None and not (got.released and not got.lost):
            failures.append(
                f"{label}: lease released={got.released} lost={got.lost} (expected released, not lost)"
            )
        if isinstance(error, aiolock.LockLost):
            failures.append(f"{label}: the block raised LockLost for a lease released by the close")
        if took > CLOSE + 2:
            failures.append(f"{label}: the block took {took:.2f} s")
    assert not failures, "\n".join(failures)


async def test_aclose_from_another_task_while_blocks_hold(
    backend_url: str, judge: aiolock.Locks, name: str
) -> None:
    """One task per kind sits in an ``async with`` body (0.8 s) when another task closes
    the connection: every name is free on the server at once; each body is not
    cancelled (its lease is released, not lost) and its block then exits within a
    second with no exception but (at most) a ``LockError``."""
    doomed = aiolock.connect(backend_url)
    kinds = _kinds(doomed, name)
    entered = {label: asyncio.Event() for label, _, _ in kinds}
    result: dict[str, Any] = {}

    async def sit(label: str, prim: Any) -> None:
        try:
            async with prim as lease:
                result[f"{label}-lease"] = lease
                entered[label].set()
                await asyncio.sleep(0.8)
                result[f"{label}-body"] = "ended"
        except BaseException as e:
            result[f"{label}-error"] = e
            raise

    tasks = {label: asyncio.create_task(sit(label, make(doomed))) for label, make, _ in kinds}
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in entered.values())), 10)
    await doomed.aclose()
    for _label, _make, free in kinds:
        await free(judge)
    done, pending = await asyncio.wait(tasks.values(), timeout=3)
    failures = []
    for label, task in tasks.items():
        if task not in done:
            failures.append(f"{label}: the block still running 3 s after the close")
            task.cancel()
            continue
        if task.cancelled():
            failures.append(f"{label}: the holding task was cancelled ({result})")
            continue
        error = task.exception()
        if error is not None and not isinstance(error, aiolock.LockError):
            failures.append(f"{label}: the block raised {error!r}")
        if isinstance(error, aiolock.LockLost) or f"{label}-body" not in result:
            failures.append(f"{label}: the body was cut short ({error!r}) for a lease released by the close")
        lease = result.get(f"{label}-lease")
        if lease is not None and not (lease.released and not lease.lost):
            failures.append(f"{label}: lease released={lease.released} lost={lease.lost}")
    await asyncio.gather(*pending, return_exceptions=True)
    assert not failures, "\n".join(failures)
