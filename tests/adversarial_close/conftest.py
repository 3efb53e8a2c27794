"""Fixtures of the close adversarial tests, written from README.md, /work/shared/SPEC.md
and docs/ only -- never from the implementation.

The promise under attack: closing a connection (``await locks.aclose()``, or leaving
``async with aiolock.connect(...)``) releases every lease it still holds (SPEC 2: "when
the backend is closed (it releases what it holds)"; README "Connecting": "Closing a
connection releases every lease it still holds and gives up every place its waiters keep
in a server queue"), stops the watchdog, and ends the connection's waiters at once with
a ``LockError`` (README Status); a lease held at the close ends ``released``, not
``lost`` (the contract suite's reading); a ``release()`` after the close is a no-op; any
other use of the closed connection raises a ``LockError`` (``match="closed"`` in the
contract suite), never hangs, never lets a bare ``CancelledError`` out; ``aiolock.
leases.lost`` counts a lease held at the close with the outcome ``closed``
(docs/operations.md).

Backends: every row of ``tests/scenarios.py`` (the ``scenario`` / ``backend_url`` /
``name`` fixtures of ``tests/conftest.py``, as the contract suite), on the session
servers it starts. Every test is also checked for event-loop reports ("Task exception
was never retrieved", "Task was destroyed but it is pending!").
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

import aiolock
from aiolock import Capability

T = TypeVar("T")

#: ttl of the leases whose leak a test looks for: never lapses within a test
LONG = 30.0
#: another connection must take a name the closed connection held within this (a leaked
#: claim or waiter place would keep it for LONG)
TAKE = 1.0
#: a waiter of the closed connection, or a call on it, ends within this (README: "at once")
PROMPT = 1.0
#: a close against live servers ends within this
CLOSE = 5.0
#: past this an operation "hung"
HANG = 15.0


def has(locks: aiolock.Locks, capability: Capability) -> bool:
    return capability in locks.capabilities


@dataclass
class Outcome:
    """How an operation ended: its duration, and its exception or result."""

    what: str
    elapsed: float
    error: BaseException | None
    result: Any = None

    def describe(self) -> str:
        if self.error is None:
            return f"{self.what}: returned {self.result!r} after {self.elapsed:.2f} s"
        return (
            f"{self.what}: {type(self.error).__name__}({self.error}) after {self.elapsed:.2f} s\n"
            + "".join(traceback.format_exception(self.error))
        )

    @property
    def hung(self) -> bool:
        return isinstance(self.error, _Hung)


class _Hung(Exception):
    pass


async def timed(what: str, op: Callable[[], Awaitable[T]], cap: float = HANG) -> Outcome:
    """Run ``op()`` in a task of its own (its cancellation is not ours), timing it; never
    longer than ``cap`` (then the error is ``_Hung``)."""
    start = time.monotonic()
    task = asyncio.ensure_future(op())
    done, _ = await asyncio.wait([task], timeout=cap)
    elapsed = time.monotonic() - start
    if not done:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        return Outcome(what, elapsed, _Hung(f"still running after {cap} s"))
    if task.cancelled():
        return Outcome(what, elapsed, asyncio.CancelledError("the task was cancelled"))
    error = task.exception()
    if error is not None:
        return Outcome(what, elapsed, error)
    return Outcome(what, elapsed, None, task.result())


def assert_lock_error(outcome: Outcome, within: float = PROMPT) -> None:
    """``outcome`` raised a ``LockError`` (not a bare ``CancelledError``, not anything
    else) within ``within`` seconds."""
    assert isinstance(outcome.error, aiolock.LockError), "not a LockError: " + outcome.describe()
    assert outcome.elapsed < within, f"slower than {within} s: " + outcome.describe()


def assert_at_most_lock_error(outcome: Outcome, within: float = PROMPT) -> None:
    """``outcome`` returned or raised a ``LockError``, within ``within`` seconds."""
    assert outcome.error is None or isinstance(outcome.error, aiolock.LockError), (
        "raised something else than a LockError: " + outcome.describe()
    )
    assert outcome.elapsed < within, f"slower than {within} s: " + outcome.describe()


@pytest.fixture
async def judge(backend_url: str) -> AsyncIterator[aiolock.Locks]:
    """A second, independent connection to the row's server: the one that checks what the
    closed connection left behind."""
    async with aiolock.connect(backend_url) as conn:
        yield conn


async def take_lock(judge: aiolock.Locks, name: str, within: float = TAKE, **options: Any) -> None:
    """``judge`` takes the plain lock ``name`` within ``within`` s and gives it back."""
    t0 = time.monotonic()
    try:
        lease = await judge.lock(name, ttl=LONG, **options).acquire(timeout=within)
    except aiolock.LockTimeout:
        info = await judge.status(name)
        raise AssertionError(
            f"lock {name!r} not free: another connection could not take it "
            f"within {within} s after the close (status: {info})"
        ) from None
    await lease.release()
    assert time.monotonic() - t0 < within + 1.0


async def take_write(judge: aiolock.Locks, name: str, within: float = TAKE) -> None:
    """``judge`` takes the write side of the rwlock ``name`` (free of every reader and
    writer) within ``within`` s."""
    try:
        lease = await judge.rwlock(name, ttl=LONG).write().acquire(timeout=within)
    except aiolock.LockTimeout:
        info = await judge.status(name)
        raise AssertionError(
            f"rwlock {name!r} not free for a writer within {within} s after the close (status: {info})"
        ) from None
    await lease.release()


async def take_permits(judge: aiolock.Locks, name: str, limit: int, within: float = TAKE) -> None:
    """``judge`` takes all ``limit`` permits of the semaphore ``name`` (each in a task of
    its own) within ``within`` s."""
    sem = judge.semaphore(name, limit=limit, ttl=LONG)
    tasks = [asyncio.create_task(sem.acquire(timeout=within)) for _ in range(limit)]
    got = await asyncio.gather(*tasks, return_exceptions=True)
    for lease in got:
        if isinstance(lease, aiolock.Lease):
            await lease.release()
    failed = [g for g in got if not isinstance(g, aiolock.Lease)]
    if failed:
        info = await judge.status(name)
        raise AssertionError(
            f"semaphore {name!r}: {len(failed)} of {limit} permits not free within "
            f"{within} s after the close ({failed!r}; status: {info})"
        )


async def take_leadership(judge: aiolock.Locks, name: str, within: float = TAKE) -> None:
    """Nobody leads the election ``name`` and ``judge`` wins it within ``within`` s."""
    election = judge.election(name, ttl=LONG)
    leader = await election.leader()
    assert leader is None, f"election {name!r} still led after the close: {leader!r}"
    try:
        term = await election.campaign(data="judge").acquire(timeout=within)
    except aiolock.LockTimeout:
        raise AssertionError(
            f"election {name!r}: another connection could not win it within {within} s after the close"
        ) from None
    await term.release()


class _AsyncioLog(logging.Handler):
    """Records of the ``asyncio`` logger (where the default exception handler writes)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


_WATCHED = (
    "never retrieved",
    "destroyed but it is pending",
    "exception in callback",
    "Unhandled error",
    "exception was never",
)


@pytest.fixture(autouse=True)
async def loop_reports() -> AsyncIterator[list[dict[str, Any]]]:
    """Every report the event loop's exception handler gets during the test, and every
    ``asyncio`` log record of those kinds: none may appear. Checked after the connections
    closed (autouse fixtures are torn down last), after a garbage collection."""
    loop = asyncio.get_running_loop()
    reports: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    log = _AsyncioLog()
    logging.getLogger("asyncio").addHandler(log)

    def record(_loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        reports.append(context)

    loop.set_exception_handler(record)
    try:
        yield reports
        for _ in range(3):
            gc.collect()
            await asyncio.sleep(0.02)
    finally:
        loop.set_exception_handler(previous)
        logging.getLogger("asyncio").removeHandler(log)
    logged = [
        r.getMessage() for r in log.records if any(w.lower() in r.getMessage().lower() for w in _WATCHED)
    ]
    assert not reports and not logged, "event loop reports: " + "; ".join(
        [f"{r.get('message')!r} {r.get('exception')!r} {r.get('task') or r.get('future')!r}" for r in reports]
        + logged
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``test_frozen`` (freezes the session's servers for seconds, with timing bounds)
    and ``test_held`` (about 45 s, what the contract suite's close tests cover) run in
    the slow tier (``./test.sh -m slow``); the rest in every run."""
    for item in items:
        if any(f"adversarial_close/{slow}.py" in item.nodeid for slow in ("test_frozen", "test_held")):
            item.add_marker(pytest.mark.slow)
