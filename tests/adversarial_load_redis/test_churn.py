"""Mutual exclusion, limits and fencing tokens of every primitive, churned by several
worker processes while two busy loops keep both cores busy.

Each worker records, in its own file, the moment each hold's body began and ended on the
system-wide monotonic clock; the test merges them: no two holds may overlap (a writer
alone; at most ``limit`` permits) unless one reports its lease lost, and with ttl 5 s no
lease may be lost at all; every token exceeds that of every hold that ended before it
began, and none repeats.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from pathlib import Path

import pytest

import aiolock
from aiolock import Capability as C

from .._children import Child
from .conftest import Worker, rows_with
from .harness import churn, judged, longest_idle

pytestmark = pytest.mark.timeout(120)

PROCS = 4
TASKS = 4
SECONDS = 2.5


def fresh(kind: str) -> str:
    return f"load-{kind}-{uuid.uuid4().hex[:8]}"


#: (asked, answered, LockInfo) of every status() read that found the lock held
READS: list[tuple[float, float, object]] = []


async def poll_status(url: str, name: str, until: float,
                      seen: list[tuple[int, tuple[int, ...], int]]) -> None:
    """Read ``status(name)`` back to back until ``until``: (token, holder pids, holders)
    of each read that found it held; successive reads never go back to an older token."""
    last = 0
    async with aiolock.connect(url) as locks:
        while time.monotonic() < until:
            asked = time.monotonic()
            info = await locks.status(name)
            if info.held:
                token = int(info.token or 0)
                seen.append((token, tuple(h.pid for h in info.held_by), int(info.holders)))
                READS.append((asked, time.monotonic(), info))
                assert token >= last, f"status went back from token {last} to {token}"
                last = token
            await asyncio.sleep(0.002)


def judge(run_: object, *, limit: int = 1, idle: float = 3.0) -> None:
    from .harness import Run

    assert isinstance(run_, Run)
    text, excused = judged(run_, limit=limit)
    assert not run_.errors, text
    assert not run_.lost and not excused, text  # ttl 5 s: no stall here comes near it
    assert len(run_.holds) >= 20, text
    # liveness: with 16 tasks churning, the lock is never idle for long
    gap = longest_idle(run_, run_.start + 1.0, run_.end - 0.2)
    assert gap < idle, f"nobody held for {gap:.2f}s\n{text}"


@rows_with(default=("redlock",))
async def test_lock_exclusion_and_tokens_under_load(
        load_row: str, load_urls: list[str], check_url: str, hogs: list[Child],
        workers: list[Worker], tmp_path: Path) -> None:
    name = fresh("lock")
    seen: list[tuple[int, tuple[int, ...], int]] = []
    READS.clear()

    async def during(_ws: list[Worker], end: float) -> None:
        # status() read through each path of the row (the mixed row: Lua and transactions)
        await asyncio.gather(*(poll_status(url, name, end, seen)
                               for url in dict.fromkeys([check_url, load_urls[0]])))

    run = await churn(workers, tmp_path, load_urls, "lock", name, procs=PROCS,
                      seconds=SECONDS, opts=("--tasks", str(TASKS)), during=during)
    judge(run)
    # status(): a held lock shows one holder, the process its token was granted to
    owner = {h.token: h.pid for h in run.holds}
    for token, pids, holders in seen:
        assert holders == 1 and len(pids) == 1, (token, pids, holders)
        if token not in owner:
            asked, answered, info = next(r for r in READS if getattr(r[2], "token", None) == token)
            near = [str(h) for h in run.holds if h.start < answered + 0.05 and h.end > asked - 0.05]
            raise AssertionError(
                f"status showed token {token}, never granted: read [{asked:.4f}, {answered:.4f}]"
                f" {info}\nholds around it: {near}\ngranted tokens: {sorted(owner)[:200]}")
        assert pids[0] == owner[token], f"token {token}: status says pid {pids[0]}, granted to {owner[token]}"
    assert seen, "status never saw the lock held"


@rows_with()
async def test_reentrant_lock_under_load(load_row: str, load_urls: list[str],
                                         hogs: list[Child], workers: list[Worker],
                                         tmp_path: Path) -> None:
    run = await churn(workers, tmp_path, load_urls, "reentrant", fresh("re"), procs=PROCS,
                      seconds=SECONDS, opts=("--tasks", str(TASKS)))
    judge(run)


@rows_with(C.FAIR)
async def test_fair_lock_under_load(load_row: str, load_urls: list[str], hogs: list[Child],
                                    workers: list[Worker], tmp_path: Path) -> None:
    run = await churn(workers, tmp_path, load_urls, "fair", fresh("fair"), procs=PROCS,
                      seconds=SECONDS, opts=("--tasks", str(TASKS)))
    judge(run)
    # first come, first served across processes: every process gets its turns
    per_pid: dict[int, int] = {}
    for h in run.holds:
        per_pid[h.pid] = per_pid.get(h.pid, 0) + 1
    assert len(per_pid) == PROCS, per_pid


@pytest.mark.parametrize("limit", [1, 3])
@rows_with(C.SEMAPHORE, default=("redis-cluster",))
async def test_semaphore_limit_under_load(load_row: str, load_urls: list[str], limit: int,
                                          hogs: list[Child], workers: list[Worker],
                                          tmp_path: Path) -> None:
    run = await churn(workers, tmp_path, load_urls, "sem", fresh("sem"), procs=PROCS,
                      seconds=SECONDS, opts=("--tasks", str(TASKS), "--limit", str(limit)))
    judge(run, limit=limit)


@rows_with(C.RWLOCK)
async def test_rwlock_writer_alone_under_load(load_row: str, load_urls: list[str],
                                              hogs: list[Child], workers: list[Worker],
                                              tmp_path: Path) -> None:
    run = await churn(workers, tmp_path, load_urls, "rw", fresh("rw"), procs=PROCS,
                      seconds=SECONDS, opts=("--tasks", str(TASKS), "--writers", "2"))
    judge(run, limit=10**6)
    writes = [h for h in run.holds if h.kind == "w"]
    assert len(writes) >= 5, f"writers starved: {len(writes)} writes"


@rows_with(C.ELECTION)
async def test_at_most_one_leader_under_load(load_row: str, load_urls: list[str],
                                             check_url: str, hogs: list[Child],
                                             workers: list[Worker], tmp_path: Path) -> None:
    """Candidates in 4 processes campaign and resign for 2.5 s: at most one leads at any
    instant, terms increase; an observer (in this process) never goes back to an older
    term, and once the candidates stop its last value is None within one ttl."""
    name = fresh("elect")
    seen: list[object] = []
    observer: list[asyncio.Task[None]] = []

    async def observe() -> None:
        async with aiolock.connect(check_url) as locks:
            async for leader in locks.election(name, ttl=5).observe():
                seen.append(leader)

    async def during(_ws: list[Worker], end: float) -> None:
        observer.append(asyncio.create_task(observe()))
        await asyncio.sleep(max(0.0, end - time.monotonic()))

    async def idle() -> None:  # every candidate resigned, still connected
        deadline = time.monotonic() + 5 + 2.0
        while time.monotonic() < deadline and (not seen or seen[-1] is not None):
            await asyncio.sleep(0.05)

    try:
        run = await churn(workers, tmp_path, load_urls, "elect", name, procs=PROCS,
                          seconds=SECONDS, opts=("--tasks", "3"), during=during, idle=idle)
    finally:
        for task in observer:
            task.cancel()
        await asyncio.gather(*observer, return_exceptions=True)
    judge(run)
    terms = [int(getattr(x, "token", 0)) for x in seen if x is not None]
    back = [(a, b) for a, b in itertools.pairwise(terms) if b < a]
    assert not back, f"observe() went back to an older term: {back[:5]}"
    assert seen and seen[-1] is None, f"observe() ended on {seen[-1] if seen else 'nothing'}"
