"""Fixtures of the waiting-across-processes adversarial tests (README "Waiting", "No
process starves", fair=True, "Cancellation safety", "Fencing tokens"; SPEC §2; docs/
concepts.md "Waiting" and each backend page), written from those alone.

A row is a backend of ``tests/scenarios.py`` (its session server started by the fixtures
of ``tests/conftest.py``), plus ``redis-mixed``: one redis-server, the child processes
alternating between the Lua path and ``?scripting=off`` (docs/backends/redis-noscripting.md:
"Both paths on one lock ... share one waiting queue").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ..scenarios import Scenario, by_id

ROOT = Path(__file__).resolve().parents[2]

#: rows that promise first come, first served across processes (README "Guarantees and
#: limits": Redis with fair=True, ZooKeeper and etcd always, PostgreSQL advisory)
FAIR_ROWS = {"redis", "redis-cluster", "zookeeper", "etcd", "postgres"}
#: rows whose backend offers fair=True (the others refuse it: ValueError)
FAIR_FLAG = {"redis", "redis-cluster", "postgres"}

ALL = ["redis", "redis-nolua", "redis-mixed", "zookeeper", "postgres", "postgres-row",
       "mysql", "mysql-row", "etcd", "redis-cluster"]


@dataclass
class Row:
    id: str
    scenario: Scenario
    base: str
    #: the URL of the i-th process
    url: Callable[[int], str] = field(repr=False, default=lambda _i: "")


@pytest.fixture
def row(request: pytest.FixtureRequest) -> Row:
    key: str = request.param
    scen = by_id("redis" if key == "redis-mixed" else key)
    if scen.missing:
        pytest.skip(f"not installed: {scen.missing}")
    base = scen.url(request)
    if key == "redis-mixed":
        return Row(key, scen, base, lambda i: base if i % 2 == 0 else base + "?scripting=off")
    return Row(key, scen, base, lambda _i: base)


def rows(*ids: str) -> pytest.MarkDecorator:
    return pytest.mark.parametrize("row", list(ids or ALL), indirect=True)


def fresh(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


class Kid:
    """A ``_child`` process: stdout lines read as they come."""

    def __init__(self, proc: asyncio.subprocess.Process, idx: int) -> None:
        self.proc = proc
        self.idx = idx
        self.lines: list[str] = []

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def expect(self, prefix: str | tuple[str, ...], within: float = 20.0) -> str:
        assert self.proc.stdout is not None
        async with asyncio.timeout(within):
            while True:
                raw = await self.proc.stdout.readline()
                if not raw:
                    err = b""
                    if self.proc.stderr is not None:
                        err = await self.proc.stderr.read()
                    raise AssertionError(f"child {self.idx} ended before {prefix!r}: "
                                         f"{self.lines[-5:]} {err.decode(errors='replace')[-2000:]}")
                line = raw.decode().rstrip("\n")
                self.lines.append(line)
                if line.startswith("ERROR"):
                    raise AssertionError(f"child {self.idx}: {line}")
                if line.startswith(prefix):
                    return line

    async def go(self, arg: str = "") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"GO {arg}\n".encode())
        await self.proc.stdin.drain()

    async def results(self, within: float = 20.0) -> tuple[dict[str, int], list[list[Any]]]:
        counts = json.loads((await self.expect("COUNTS", within)).split(" ", 1)[1])
        recs = json.loads((await self.expect("RECORDS", within)).split(" ", 1)[1])
        await self.expect("END", within)
        return counts, recs

    def kill9(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


class Kids:
    def __init__(self) -> None:
        self.all: list[Kid] = []

    async def spawn(self, url: str, name: str, **cfg: Any) -> Kid:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.adversarial_waiting._child", url, name, json.dumps(cfg),
            env=env, cwd=str(ROOT), stdin=asyncio.subprocess.PIPE, limit=1 << 24,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        kid = Kid(proc, len(self.all))
        self.all.append(kid)
        return kid

    async def spawn_ready(self, specs: list[tuple[str, str, dict[str, Any]]]) -> list[Kid]:
        """Start every child at once, return them once each printed READY."""
        kids = [await self.spawn(u, n, **c) for u, n, c in specs]
        await asyncio.gather(*(k.expect("READY", 30) for k in kids))
        return kids


@pytest.fixture
async def kids() -> AsyncIterator[Kids]:
    k = Kids()
    try:
        yield k
    finally:
        for kid in k.all:
            if kid.proc.returncode is None:
                kid.kill9()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(kid.proc.wait(), 5)


#: the default run (about 10 s on 2 cores): one or two rows of the passing checks; every
#: other test is in the slow tier (./test.sh -m slow), the findings below among them
DEFAULT = {
    "test_release_chain_across_processes_is_prompt_and_in_order[redis-mixed]",
    "test_waiter_killed_with_minus_9_never_strands_the_lock[mysql]",
    "test_timeout_racing_the_hand_off_never_strands_the_next_waiter[redis-mixed]",
    "test_cancelled_waiters_in_other_processes_do_not_hold_up_a_patient_one[zookeeper]",
}

_K5 = ("a waiting process saw more than 2 x k x 5 grants of others in a row (README: 'a "
       "waiting process with k processes ahead of it gets the lock within k x 5 "
       "acquisitions'); ")
#: found by this suite, open (xfail, not strict: they fail in some runs, under load)
FOUND = {
    "test_five_busy_processes_none_waits_more_than_k_times_5[mysql]": _K5 + (
        "MySQL: 46-151 in 6 of 13 runs (the server promises no order among GET_LOCK "
        "waiters; the k x 5 bound is stated for Redis)"),
    "test_first_wait_of_a_fresh_connection_within_k_times_5[mysql]": _K5 + "MySQL: 88, 99 in 2 of 8 runs",
    "test_first_wait_of_a_fresh_connection_within_k_times_5[postgres]": _K5 + (
        "PostgreSQL: 192 grants (236 ms) in 1 of 8 runs"),
    "test_fair_order_across_processes_under_random_arrivals[postgres]": (
        "fair=True on PostgreSQL: one acquire waited 0.29 s while acquires that came "
        "120-207 ms later were granted first (1 of 3 runs, under load)"),
    "test_five_busy_processes_none_waits_more_than_k_times_5[redis]": _K5 + (
        "Redis: 51-445 in 5 of ~15 runs under load, a process's first waits; its inbox is "
        "now subscribed before its first busy attempt (Signals.hear), not seen in 12 runs since"),
    "test_first_wait_of_a_fresh_connection_within_k_times_5[redis]": _K5 + (
        "Redis: 45 in 1 of 8 runs; as above, not seen in 12 runs since Signals.hear"),
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "adversarial_waiting" not in str(item.path):
            continue
        if item.name not in DEFAULT:
            item.add_marker(pytest.mark.slow)
        if item.name in FOUND:
            item.add_marker(pytest.mark.xfail(strict=False, reason=FOUND[item.name]))
