"""Fixtures of the anyio adversarial tests, written from README.md, /work/shared/SPEC.md
and docs/ only -- never from the implementation (nor from the other test files).

The promise under attack: aiolock works inside anyio-based apps (FastAPI, Starlette) on
the asyncio backend -- anyio's cancel scopes (``move_on_after``, ``fail_after``,
``CancelScope``, shielded or not) and task groups behave with leases:

- a lost lease (revoked with ``force_release()`` from another connection, or expired
  with ``watchdog=False``) cancels the ``async with`` body and the block raises
  ``aiolock.LockLost`` (README "The watchdog and lease loss", SPEC 2), which a
  surrounding scope must not swallow as its own cancel; a scope's own cancel is never
  turned into ``LockLost``;
- cancellation safety (README "Cancellation safety"): a cancelled ``acquire()`` never
  leaves the lock held or a place queued, a cancelled ``release()`` finishes in the
  background -- also under anyio's *level* cancellation, which cancels the task again at
  every await until it leaves the cancelled scope;
- after every scenario: nothing held, no waiter place left (another connection takes the
  lock at once), no "Task exception was never retrieved" / "Task was destroyed but it is
  pending" reports, ``lease.lost`` / ``lease.released`` as documented.

Backends are the rows of ``tests/scenarios.py`` (one topology each), on the servers the
session fixtures of ``tests/conftest.py`` start.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import aiolock

from ..scenarios import SCENARIOS, rows  # noqa: F401 -- rows: for the tests

#: lease length of the leases whose loss a test provokes (the revoked holder learns it at
#: its next renewal, within ttl/3)
TTL = 1.5
#: how long another connection may wait for a lock that must be free: well under every
#: ttl used here, so a leaked claim or waiter place (which lapses only within its ttl, or
#: never if something renews it) cannot pass for a free lock
TAKE = 0.6
#: the ttl of leases and waiters whose leak a test looks for (lapses far beyond TAKE)
LEAK_TTL = 5.0




@pytest.fixture
async def other(backend_url: str) -> AsyncIterator[aiolock.Locks]:
    """A second, independent connection to the row's server (same data): the operator
    who revokes, and the judge who checks that a lock is free."""
    async with aiolock.connect(backend_url) as conn:
        yield conn


@pytest.fixture(autouse=True)
async def loop_reports() -> AsyncIterator[list[dict[str, Any]]]:
    """Every report the event loop's exception handler gets during the test ("Task
    exception was never retrieved", "Task was destroyed but it is pending!", an
    exception in a callback): none may appear. Checked after the connections closed
    (autouse fixtures are torn down last), after a garbage collection."""
    loop = asyncio.get_running_loop()
    reports: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()

    def record(_loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        reports.append(context)

    loop.set_exception_handler(record)
    try:
        yield reports
        for _ in range(3):
            gc.collect()
            await asyncio.sleep(0.01)
    finally:
        loop.set_exception_handler(previous)
    assert not reports, "event loop reports: " + "; ".join(
        f"{r.get('message')!r} {r.get('exception')!r} {r.get('task') or r.get('future')!r}"
        for r in reports)


async def assert_free(conn: aiolock.Locks, *names: str, within: float = TAKE) -> None:
    """Each of ``names`` is free: ``conn`` (another connection) takes it within
    ``within`` seconds (a leaked hold or a waiter place the release would be handed to
    would keep it longer), and gives it back."""
    for name in names:
        t0 = time.monotonic()
        try:
            lease = await conn.lock(name, ttl=LEAK_TTL).acquire(timeout=within)
        except aiolock.LockTimeout:
            info = await conn.status(name)
            raise AssertionError(
                f"{name!r} not free: another connection could not take it within {within}s "
                f"(status: {info})") from None
        await lease.release()
        assert time.monotonic() - t0 < within + 0.5


async def eventually(what: str, check: Callable[[], bool], within: float = 3.0) -> None:
    """Poll ``check()`` (a bool) until true, for at most ``within`` seconds."""
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: still false after {within}s")
        await asyncio.sleep(0.01)


def cancelling() -> int:
    """Cancellation requests pending on the current task: after a block that ended
    (LockLost caught, or a scope that caught its own cancel), 0 -- as after
    ``asyncio.timeout`` -- or the next ``asyncio.timeout`` / anyio scope misbehaves."""
    task = asyncio.current_task()
    assert task is not None
    return task.cancelling()


@contextlib.contextmanager
def escaped(where: str) -> Iterator[None]:
    """Around an anyio cancel scope whose cancel is the scope's own: a ``CancelledError``
    that gets out of it is one the scope could not recognise as its own (anyio swallows
    only a ``CancelledError`` carrying its scope's message), which would cancel the
    caller's whole task -- turned into an ``AssertionError`` saying where and which."""
    try:
        yield
    except asyncio.CancelledError as e:
        raise AssertionError(f"{where}: a CancelledError got out of the cancelled anyio scope "
                             f"(args {e.args!r}; context {e.__context__!r})") from e


@contextlib.asynccontextmanager
async def revoked_after(conn: aiolock.Locks, name: str, delay: float) -> AsyncIterator[None]:
    """Revoke ``name`` from ``conn`` ``delay`` seconds after entering, in a task of its own
    (awaited on exit)."""

    async def revoke() -> None:
        await asyncio.sleep(delay)
        await conn.lock(name).force_release()

    task = asyncio.create_task(revoke())
    try:
        yield
    finally:
        await task


async def checkpoints(steps: int) -> None:
    """Let the loop run ``steps`` steps (anyio checkpoints)."""
    for _ in range(steps):
        await anyio.lowlevel.checkpoint()


async def cancel_after(scope: anyio.CancelScope, steps: int) -> None:
    """Cancel ``scope`` after ``steps`` steps of the loop."""
    await checkpoints(steps)
    scope.cancel()
