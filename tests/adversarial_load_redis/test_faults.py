"""Faults under load: worker processes frozen (SIGSTOP, shorter than their ttl) or
killed (``kill -9``, holding or waiting) while the others churn one lock, and waiters
cancelled or timed out at random points. Exclusion must hold exactly; a frozen holder's
lease must survive (or report itself lost); a killed holder's lock comes back within
the documented bound; nothing leaks."""

from __future__ import annotations

import asyncio
import random
import signal
import time
import uuid
from pathlib import Path

import pytest

import aiolock
from aiolock import Capability as C

from .._children import Child
from .conftest import Worker, row_caps, rows_with
from .harness import churn, judged, kill9, longest_idle, report, token_faults, violations

pytestmark = pytest.mark.timeout(120)


def fresh(kind: str) -> str:
    return f"load-{kind}-{uuid.uuid4().hex[:8]}"


#: the workers frozen or killed: on the mixed row, 0 is on the transaction path (a user
#: without @scripting) and 2 on the Lua path (tests/adversarial_load_redis/conftest.py)
VICTIMS = (0, 2)


def open_hold(worker: Worker) -> bool:
    """Is the worker inside a hold now (its last record an enter)?"""
    try:
        with open(worker.out, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 400))
            tail = f.read().decode(errors="replace").splitlines()
    except OSError:
        return False
    return bool(tail) and tail[-1].startswith("E ")


async def when_holding(worker: Worker, within: float) -> None:
    end = time.monotonic() + within
    while time.monotonic() < end and not open_hold(worker):
        await asyncio.sleep(0.002)


@pytest.mark.parametrize(("ttl", "stop"), [(5.0, 1.5), (1.2, 0.9), (1.2, 1.6)],
                         ids=["ttl5-stop1.5", "ttl1.2-stop0.9", "ttl1.2-stop1.6"])
@rows_with()
async def test_sigstopped_worker_keeps_its_lease_or_reports_it_lost(
        load_row: str, load_urls: list[str], hogs: list[Child], workers: list[Worker],
        tmp_path: Path, ttl: float, stop: float) -> None:
    """Two workers (leases of ``ttl``) are frozen in turn for ``stop`` s, mostly while
    they hold, else while they wait; the two others (ttl 5 s) churn on. Nobody ever
    holds next to a holder whose lease is not lost; with ttl 5 s (renewed every 5/3 s)
    a 1.5 s freeze loses nothing."""
    stops: list[tuple[int, float, bool]] = []

    def opts(i: int) -> tuple[str, ...]:
        return ("--ttl", str(ttl)) if i in VICTIMS else ("--ttl", "5")

    async def during(ws: list[Worker], end: float) -> None:
        rng = random.Random()
        for victim in (ws[i] for i in VICTIMS):
            await asyncio.sleep(0.5 + rng.random() * 0.3)
            if rng.random() < 0.7:
                await when_holding(victim, 1.0)
            stops.append((victim.pid, time.monotonic(), open_hold(victim)))
            victim.signal(signal.SIGSTOP)
            await asyncio.sleep(stop)
            victim.signal(signal.SIGCONT)
        await asyncio.sleep(max(0.0, end - time.monotonic()))

    run = await churn(workers, tmp_path, load_urls, "lock", fresh("stop"), procs=4,
                      seconds=2 * stop + 2.5, opts=("--tasks", "3"), per_proc=opts,
                      during=during)
    text, excused = judged(run, note=f"\nstops (pid, at, holding): {stops}")
    if ttl > 3 * stop:
        assert not run.lost and not excused, text
        assert not run.errors, text
    else:  # a lost lease is allowed (and reported: LockLost is recorded as an "R" line)
        assert not [e for e in run.errors if "LockLost" not in e], text
    gap = longest_idle(run, run.start + 0.3, run.end - 0.2)
    assert gap < max(stop, ttl) + 2.5, f"nobody held for {gap:.2f}s\n{text}"


@rows_with()
async def test_killed_workers_holding_or_waiting_free_the_lock(
        load_row: str, load_urls: list[str], hogs: list[Child], workers: list[Worker],
        tmp_path: Path) -> None:
    """Two of four workers (ttl 1.5 s) are killed with -9, one while it holds, one at a
    random moment (most likely waiting); the two others (ttl 5 s) go on, the lock never
    stays with the dead longer than the documented bound (plus slack for the load)."""
    ttl = 1.5
    kills: list[tuple[int, float, bool]] = []

    def opts(i: int) -> tuple[str, ...]:
        return ("--ttl", str(ttl)) if i in VICTIMS else ("--ttl", "5")

    async def during(ws: list[Worker], end: float) -> None:
        first, second = (ws[i] for i in VICTIMS)
        await asyncio.sleep(0.8)
        await when_holding(first, 2.0)
        kills.append((first.pid, time.monotonic(), open_hold(first)))
        kill9(first)
        await asyncio.sleep(1.0 + random.random())
        kills.append((second.pid, time.monotonic(), open_hold(second)))
        kill9(second)
        await asyncio.sleep(max(0.0, end - time.monotonic()))

    run = await churn(workers, tmp_path, load_urls, "lock", fresh("kill"), procs=4,
                      seconds=5.5, opts=("--tasks", "3"), per_proc=opts, during=during)
    text, excused = judged(run, note=f"\nkills (pid, at, holding): {kills}")
    assert not run.errors, text
    assert not run.lost and not excused, text
    # a killed holder frees the lock within its ttl; on Cluster and Sentinel a dead
    # waiter may be handed it once more (another ttl); a waiter dying with the holder
    # adds a third of its ttl; then slack for the load
    bound = ttl + ttl / 3 + 0.3 + (ttl if load_row in ("redis-cluster", "redis-sentinel") else 0)
    gap = longest_idle(run, run.start + 0.3, run.end - 0.2)
    assert gap < bound + 2.0, f"nobody held for {gap:.2f}s (bound {bound:.2f}s)\n{text}"
    survivors = {w.pid for i, w in enumerate(workers) if i not in VICTIMS}
    after = [h for h in run.holds if h.pid in survivors and h.start > kills[-1][1]]
    assert after, f"the survivors never held after the kills\n{text}"


@rows_with()
async def test_cancelled_and_timed_out_waiters_leak_nothing_under_load(
        load_row: str, load_urls: list[str], check_url: str, hogs: list[Child],
        workers: list[Worker], tmp_path: Path) -> None:
    """16 tasks in 4 processes: about a third of their acquires cancelled at a random
    point, a third with a timeout of 0-20 ms. Exclusion holds; when they stop (still
    connected) the lock is free at once: well before the ttl (5 s) a leaked grant would
    need to lapse; timeouts do not overshoot by much even under load."""
    name = fresh("cancel")
    free: list[float] = []

    async def idle() -> None:
        async with aiolock.connect(check_url) as locks:
            start = time.monotonic()
            try:
                lease = await locks.lock(name, ttl=5).acquire(timeout=2.5)
            except aiolock.LockTimeout:
                info = await locks.status(name)
                raise AssertionError(f"lock leaked: still held after the churn: {info}") from None
            free.append(time.monotonic() - start)
            await lease.release()

    run = await churn(workers, tmp_path, load_urls, "cancel", name, procs=4, seconds=3.0,
                      opts=("--tasks", "4"), idle=idle)
    text, excused = judged(run)
    assert not run.errors, text
    assert not run.lost and not excused, text
    assert len(run.holds) >= 20, text
    gap = longest_idle(run, run.start + 1.0, run.end - 0.2)
    assert gap < 3.0, f"nobody held for {gap:.2f}s: a leaked grant?\n{text}"
    assert run.timeouts, "no acquire timed out"
    over = max(elapsed - wanted for wanted, elapsed in run.timeouts)
    assert over < 1.0, f"an acquire(timeout) overshot by {over:.3f}s ({len(run.timeouts)} timeouts)"


async def free_within(locks: aiolock.Locks, mode: str, name: str, timeout: float) -> None:
    """Take every share of ``name`` at once within ``timeout`` (a leak makes it time out)."""
    if mode == "fair":
        takes = [locks.lock(name, ttl=5, fair=True).acquire(timeout=timeout)]
    elif mode == "sem":
        sem = locks.semaphore(name, limit=2, ttl=5)
        takes = [sem.acquire(timeout=timeout), sem.acquire(timeout=timeout)]
    elif mode == "rw":
        takes = [locks.rwlock(name, ttl=5).write().acquire(timeout=timeout)]
    elif mode == "elect":
        takes = [locks.election(name, ttl=5).campaign().acquire(timeout=timeout)]
    else:
        takes = [locks.lock(name, ttl=5).acquire(timeout=timeout)]
    got = await asyncio.gather(*takes, return_exceptions=True)
    try:
        for g in got:
            if isinstance(g, BaseException):
                info = await locks.status(name)
                raise AssertionError(f"{mode} {name}: not free after the churn ({g!r}): {info}")
    finally:
        for g in got:
            if isinstance(g, aiolock.Lease):
                await g.release()


CANCEL_MODES = {"fair": C.FAIR, "sem": C.SEMAPHORE, "rw": C.RWLOCK, "elect": C.ELECTION}


@pytest.mark.parametrize("mode", list(CANCEL_MODES))
@rows_with()
async def test_cancelled_waiters_of_every_primitive_leak_nothing(
        load_row: str, load_urls: list[str], check_url: str, mode: str, hogs: list[Child],
        workers: list[Worker], tmp_path: Path) -> None:
    """As above, on fair locks, semaphores (limit 2), read-write locks (2 writer tasks)
    and elections: a cancelled waiter's server-side place (fair queue, writer queue,
    candidate) must go with it, else the next ones wait for it to lapse (a ttl)."""
    if CANCEL_MODES[mode] not in row_caps(load_row):
        pytest.skip(f"{load_row} offers no {mode}")
    name = fresh(f"cancel-{mode}")

    async def idle() -> None:
        async with aiolock.connect(check_url) as locks:
            await free_within(locks, mode, name, 2.5)

    run = await churn(workers, tmp_path, load_urls, mode, name, procs=4, seconds=3.0,
                      opts=("--tasks", "4", "--cancel", "--limit", "2", "--writers", "2"),
                      idle=idle)
    bad, excused = violations(run, limit=2 if mode == "sem" else (10**6 if mode == "rw" else 1))
    tokens = token_faults(run, exclusive=mode not in ("sem", "rw"))
    text = report(run, bad, tokens)
    assert not bad, text
    assert not tokens, text
    assert not run.errors, text
    assert not run.lost and not excused, text
    gap = longest_idle(run, run.start + 1.0, run.end - 0.2)
    assert gap < 3.0, f"nobody held for {gap:.2f}s: a leaked place?\n{text}"
    over = max((elapsed - wanted for wanted, elapsed in run.timeouts), default=0.0)
    assert over < 1.0, f"an acquire(timeout) overshot by {over:.3f}s ({len(run.timeouts)} timeouts)"


@rows_with()
async def test_rapid_handoffs_many_processes(load_row: str, load_urls: list[str],
                                             hogs: list[Child], workers: list[Worker],
                                             tmp_path: Path) -> None:
    """6 processes x 4 tasks on 2 connections each, holding 0-1 ms: hand-offs as fast
    as the paths go, more processes than cores."""
    run = await churn(workers, tmp_path, load_urls, "lock", fresh("rapid"), procs=6,
                      seconds=3.0, opts=("--tasks", "4", "--hold", "0.001"))
    text, excused = judged(run)
    assert not run.errors, text
    assert not run.lost and not excused, text


@rows_with()
async def test_short_leases_lost_under_load_never_overlap_silently(
        load_row: str, load_urls: list[str], hogs: list[Child], workers: list[Worker],
        tmp_path: Path) -> None:
    """ttl 0.3 s (renewed every 0.1 s) while 10% of the bodies stall their event loop
    for 0.2-0.6 s and two busy loops take the cores: leases get lost, and that is
    allowed; a holder that does not report its lease lost is never next to another."""
    run = await churn(workers, tmp_path, load_urls, "lock", fresh("short"), procs=4,
                      seconds=3.0, opts=("--tasks", "3", "--ttl", "0.3", "--hold", "0.02",
                                         "--spin-chance", "0.1", "--spin", "0.4"))
    bad, excused = violations(run)
    tokens = token_faults(run)
    text = report(run, bad, tokens) + f"\n{len(excused)} overlaps with a lost lease"
    assert not bad, text
    assert not tokens, text
    assert not [e for e in run.errors if "LockLost" not in e], text
    assert len(run.holds) >= 10, text
