"""Faults while the machine is saturated and other processes churn the same lock: SIGSTOP
of a holder (shorter than its ttl, and past it), ``kill -9`` of a holder or of a waiter,
and ``status()`` / ``leader()`` read all along.

Exactly: no two belief intervals overlap (a stopped holder's lease survives or reads
lost, never a silent overlap), tokens in order, only the victim's leases may be lost,
nothing leaked (each survivor's final acquire succeeds). Bounds (the row's documented
``dead_holder`` / ``killed_holder`` of tests/scenarios.py, plus ``SLACK`` for the load):
the others are granted again within them.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import aiolock
from aiolock import Capability

from ..scenarios import Scenario
from ._load import Run, Worker, churn, most_inside, other_rows, overlaps, token_faults

C = Capability
#: what a saturated 2-core machine may add to a documented bound (scheduling, imports)
SLACK = 2.0
#: the short ttl of test_short_ttl_long_holds_under_load: leases lapse now and then
TTL_SHORT = 0.25
#: the longest event-loop stall of the stall tests (1.5 x their ttl; request_timeout is 5 s)
STALL = 1.5


def cfgs(kind: str, ttl: float, victim_hold: float, others: int = 3,
         **extra: Any) -> list[dict[str, Any]]:
    """The victim first (holds ``victim_hold`` s each time, one task), then ``others``."""
    name = f"load-{kind}-{uuid.uuid4().hex[:8]}"
    base = {"kind": kind, "name": name, "ttl": ttl, **extra}
    return [{**base, "tasks": 1, "hold": victim_hold, "conns": 1}] + [
        {**base, "tasks": 3, "hold": 0.004} for _ in range(others)]


def last_state(w: Worker) -> str:
    """``held`` if the worker's last lease record is an open lease, ``waiting`` if it
    started an acquire that has not returned, else ``idle``."""
    try:
        raw = w.out.read_text().splitlines()
    except FileNotFoundError:
        return "idle"
    for line in reversed(raw):
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        if e["ev"] in ("enter", "chk"):
            return "held"
        if e["ev"] == "start":
            return "waiting"
        return "idle"
    return "idle"


async def until_state(w: Worker, state: str, within: float = 8.0) -> float:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if last_state(w) == state:
            return time.monotonic()
        await asyncio.sleep(0.005)
    raise AssertionError(f"the victim was never {state} within {within}s")


def check(run: Run, victim: int, *, exclusive: bool = True) -> None:
    info = run.summary()
    if exclusive:
        bad = overlaps(run)
        assert not bad, f"{len(bad)} overlaps, e.g. {bad[:3]} ({info})"
    bad = token_faults(run)
    assert not bad, f"{len(bad)} token faults, e.g. {bad[:3]} ({info})"
    errors = run.of("error")
    assert not errors, f"BackendUnavailable from a healthy server: {errors[:3]}"
    lost = [x.key for x in run.granted if x.lost and x.pid != victim]
    assert not lost, f"leases of the bystanders lost: {lost[:5]} ({info})"
    finals = [f for f in run.of("final") if f["pid"] != victim]
    assert finals and all(f["ok"] for f in finals), f"a final acquire timed out: {finals}"


def first_grant_after(run: Run, t: float, but: int) -> float | None:
    after = [x.enter for x in run.granted if x.pid != but and x.enter is not None and x.enter > t]
    return min(after, default=None)


@other_rows(C.DISTRIBUTED)
@pytest.mark.parametrize("state", ["held", "waiting"])
@pytest.mark.parametrize("pause", ["short", "long"])
async def test_sigstopped_worker_while_others_churn(scenario: Scenario, backend_url: str,
                                                    tmp_path: Path, pause: str, state: str) -> None:
    """SIGSTOP the victim while it holds (or waits) for ttl/3 ("short": its lease should
    survive, or read lost; never overlap) or 1.5 x ttl ("long": a held lease is lost and
    the others get the lock within the row's dead-holder bound; a waiter woken late is
    not handed a lease someone else holds)."""
    ttl = 3.0
    stop_for = ttl / 3 if pause == "short" else 1.5 * ttl
    marks: dict[str, float] = {}

    async def fault(workers: list[Worker], _go: float) -> None:
        victim = workers[0]
        await asyncio.sleep(0.3)
        await until_state(victim, state)
        victim.signal(signal.SIGSTOP)
        marks["stop"] = time.monotonic()
        await asyncio.sleep(stop_for)
        victim.signal(signal.SIGCONT)
        marks["cont"] = time.monotonic()

    victim_hold = 0.6 if state == "held" else 0.004
    run, workers = await churn(tmp_path, backend_url, cfgs("lock", ttl, victim_hold),
                               2.5 + stop_for, fault)
    victim = workers[0].pid
    check(run, victim)
    nxt = first_grant_after(run, marks["stop"], victim)
    assert nxt is not None, f"nobody else was granted after the stop ({run.summary()})"
    assert any(x.pid != victim and (x.enter or 0) > marks["cont"] + 0.5 for x in run.granted), (
        f"the others were stuck after the victim woke ({run.summary()})")
    if state == "held":
        held = [x for x in run.granted if x.pid == victim and x.enter is not None
                and x.enter < marks["stop"] and (x.exit is None or x.exit > marks["stop"])]
        assert held, "the victim held nothing when stopped"
        if pause == "long":
            assert held[0].lost, f"stopped 1.5 x ttl, woke without reading lost: {held[0]}"
            bound = scenario.dead_holder(ttl)
            took = nxt - (held[0].enter or 0)
            assert took <= bound + SLACK, (
                f"others granted {took:.2f}s after the stopped holder's grant "
                f"(bound {bound:.2f}s + {SLACK}s slack)")
    print(run.summary(), "next grant after stop", round(nxt - marks["stop"], 3))


@other_rows(C.DISTRIBUTED)
@pytest.mark.parametrize("state", ["held", "waiting"])
async def test_killed_worker_while_others_churn(scenario: Scenario, backend_url: str,
                                                tmp_path: Path, state: str) -> None:
    """``kill -9`` the victim while it holds (the others are granted within the row's
    killed-holder bound of the kill) or while it waits (the others are not held up)."""
    ttl = 2.0
    marks: dict[str, float] = {}

    async def fault(workers: list[Worker], _go: float) -> None:
        victim = workers[0]
        await asyncio.sleep(0.3)
        await until_state(victim, state)
        victim.signal(signal.SIGKILL)
        marks["kill"] = time.monotonic()
        await victim.proc.wait()

    seconds = 2.5 + scenario.kill_bound(ttl)
    run, workers = await churn(tmp_path, backend_url, cfgs("lock", ttl, 0.6), seconds, fault)
    victim = workers[0].pid
    check(run, victim)
    nxt = first_grant_after(run, marks["kill"], victim)
    assert nxt is not None, f"nobody was granted after the kill ({run.summary()})"
    bound = scenario.kill_bound(ttl) if state == "held" else 0.0
    assert nxt - marks["kill"] <= bound + SLACK, (
        f"the others were granted {nxt - marks['kill']:.2f}s after the kill of a {state} "
        f"victim (bound {bound:.2f}s + {SLACK}s slack)")
    print(run.summary(), f"next grant {nxt - marks['kill']:.3f}s after the kill")


@other_rows(C.DISTRIBUTED, C.HOLDERS)
async def test_status_under_load_names_a_real_grant(scenario: Scenario, backend_url: str,
                                                    tmp_path: Path) -> None:
    """While 3 processes churn, ``status()`` read in a loop: a held lock shows a token
    that some process was granted, by that process (``held_by``), whose acquire began
    before the read ended (SPEC §7; concepts: never a grant half made)."""
    ttl = 5.0
    seen: list[tuple[float, float, aiolock.LockInfo]] = []
    cfg = cfgs("lock", ttl, 0.02, others=2)

    async def fault(_workers: list[Worker], go: float) -> None:
        async with aiolock.connect(backend_url) as locks:
            while time.monotonic() < go + 2.5:
                s0 = time.monotonic()
                info = await locks.status(cfg[0]["name"])
                seen.append((s0, time.monotonic(), info))

    run, _ = await churn(tmp_path, backend_url, cfg, 2.5, fault)
    check(run, -1)
    by_tok = {x.tok: x for x in run.granted}
    bad = []
    for s0, s1, info in seen:
        if not info.held:
            continue
        x = by_tok.get(info.token)
        pids = [h.pid for h in info.held_by]
        if x is None or x.start > s1 or pids != [x.pid]:
            bad.append((round(s0, 4), round(s1, 4), info.token, pids,
                        None if x is None else (x.pid, round(x.start, 4), x.exit)))
    held = sum(1 for *_, i in seen if i.held)
    assert held, f"status() never saw the lock held in {len(seen)} reads"
    assert not bad, f"{len(bad)} of {held} 'held' reads name no such grant: {bad[:5]}"
    print(run.summary(), f"{len(seen)} status reads, {held} held")


@other_rows(C.DISTRIBUTED, C.ELECTION)
async def test_leader_under_load_names_a_real_term(scenario: Scenario, backend_url: str,
                                                   tmp_path: Path) -> None:
    """While candidates churn, ``leader()`` read in a loop names a term that was granted
    (token), to that process (holder pid), and the terms are exclusive."""
    ttl = 5.0
    seen: list[tuple[float, float, aiolock.Leader | None]] = []
    cfg = cfgs("elect", ttl, 0.02, others=2)

    async def fault(_workers: list[Worker], go: float) -> None:
        async with aiolock.connect(backend_url) as locks:
            el = locks.election(cfg[0]["name"], ttl=ttl)
            while time.monotonic() < go + 2.5:
                s0 = time.monotonic()
                ldr = await el.leader()
                seen.append((s0, time.monotonic(), ldr))

    run, _ = await churn(tmp_path, backend_url, cfg, 2.5, fault)
    check(run, -1)
    by_tok = {x.tok: x for x in run.granted}
    bad = []
    for s0, s1, ldr in seen:
        if ldr is None:
            continue
        x = by_tok.get(ldr.token)
        pid = ldr.holder.pid if ldr.holder is not None else None
        if x is None or x.start > s1 or pid != x.pid or ldr.data != f"pid-{x.pid}":
            bad.append((round(s0, 4), round(s1, 4), ldr, None if x is None else (x.pid, x.start)))
    led = sum(1 for *_, ldr in seen if ldr is not None)
    assert led, f"leader() never saw a leader in {len(seen)} reads"
    assert not bad, f"{len(bad)} of {led} leader() reads name no such term: {bad[:5]}"
    print(run.summary(), f"{len(seen)} leader reads, {led} with a leader")


@other_rows(C.DISTRIBUTED)
@pytest.mark.parametrize("kind", ["lock", "elect"])
async def test_short_ttl_long_holds_under_load(scenario: Scenario, backend_url: str,
                                               tmp_path: Path, kind: str) -> None:
    """ttl 0.25 s, holds up to 0.6 s (several renewals each), machine saturated: leases may
    lapse (then they must read lost), but no two belief intervals ever overlap."""
    if kind == "elect" and Capability.ELECTION not in scenario.capabilities:
        pytest.skip("no elections")
    name = f"load-short-{uuid.uuid4().hex[:8]}"
    cfg = [{"kind": kind, "name": name, "ttl": TTL_SHORT, "tasks": 2, "hold": 0.6, "conns": 1}
           for _ in range(4)]
    run, _ = await churn(tmp_path, backend_url, cfg, 4.0)
    bad = overlaps(run)
    assert not bad, f"{len(bad)} overlaps, e.g. {bad[:3]} ({run.summary()})"
    bad = token_faults(run)
    assert not bad, f"{len(bad)} token faults, e.g. {bad[:3]} ({run.summary()})"
    assert not run.of("error"), f"BackendUnavailable from a healthy server: {run.of('error')[:3]}"
    print(run.summary())


@other_rows(C.DISTRIBUTED)
@pytest.mark.parametrize("kind", ["lock", "sem"])
async def test_event_loop_stalls_under_load(scenario: Scenario, backend_url: str,
                                            tmp_path: Path, kind: str) -> None:
    """Every process blocks its own event loop now and then for up to 1.5 x ttl (ttl 1 s,
    several tasks per connection, holds up to 1.5 s): leases lapse and must read lost
    (SPEC §2: "lease.lost reads the clock itself"); belief intervals never overlap, never
    more than ``limit`` permits."""
    if kind == "sem" and Capability.SEMAPHORE not in scenario.capabilities:
        pytest.skip("no semaphores")
    name = f"load-stall-{uuid.uuid4().hex[:8]}"
    limit = 2
    cfg = [{"kind": kind, "name": name, "ttl": 1.0, "limit": limit, "tasks": 3, "hold": 1.5,
            "conns": 1, "stall": 1.5} for _ in range(4)]
    run, _ = await churn(tmp_path, backend_url, cfg, 5.0)
    if kind == "lock":
        bad = overlaps(run)
        assert not bad, f"{len(bad)} overlaps, e.g. {bad[:3]} ({run.summary()})"
    else:
        inside, when = most_inside(run)
        assert inside <= limit, f"{inside} permits believed at once at {when} ({run.summary()})"
    bad = token_faults(run)
    assert not bad, f"{len(bad)} token faults, e.g. {bad[:3]} ({run.summary()})"
    assert all(f["ok"] for f in run.of("final")), run.of("final")
    print(run.summary(), len(run.of("stall")), "stalls")
    errors = run.of("error")
    assert not errors, (f"{len(errors)} acquires (timeout=None) failed with "
                        f"BackendUnavailable, the server up, after the loop stalled: {errors[:2]}")


@other_rows(C.DISTRIBUTED)
async def test_waiters_survive_event_loop_stalls(scenario: Scenario, backend_url: str,
                                                 tmp_path: Path) -> None:
    """Waiting acquires (``timeout=None``) in processes whose event loop is stalled most of
    the time (0.7 to 0.9 s at a time, below ``request_timeout``, 5 s), ttl 1 s, the server
    up all along: a lease that lapsed reads lost, a waiter whose place lapsed waits on;
    neither is failed with BackendUnavailable (README: that error means the server could
    not be reached within ``connect_timeout`` / ``request_timeout``)."""
    name = f"load-wstall-{uuid.uuid4().hex[:8]}"
    base = {"kind": "lock", "name": name, "ttl": 1.0, "conns": 1}
    cfg = [{**base, "tasks": 1, "hold": 1.5} for _ in range(2)] + [
        {**base, "tasks": 3, "hold": 0.2, "stall": 0.9, "stall_min": 0.7, "stall_gap": 0.04}
        for _ in range(3)]
    run, _ = await churn(tmp_path, backend_url, cfg, 9.0)
    print(run.summary(), len(run.of("stall")), "stalls")
    bad = overlaps(run)
    assert not bad, f"{len(bad)} overlaps, e.g. {bad[:3]} ({run.summary()})"
    errors = run.of("error")
    assert not errors, (f"{len(errors)} acquires (timeout=None) failed with BackendUnavailable, "
                        f"the server up, after the loop stalled: {errors[:2]}")


@other_rows(C.DISTRIBUTED)
async def test_waiter_in_a_stalled_loop_is_not_failed(scenario: Scenario, backend_url: str,
                                                      tmp_path: Path) -> None:
    """Three tasks of the test process wait on the lock (``acquire()``, ttl 1 s, one
    connection) again and again while
    its own event loop is stalled 0.6 to 0.9 s at a time (two churners hold it up to
    1.5 s each time): every wait ends with a lease, never with BackendUnavailable (the
    server is up and answers; request_timeout is 5 s)."""
    name = f"load-tstall-{uuid.uuid4().hex[:8]}"
    cfg = [{"kind": "lock", "name": name, "ttl": 1.0, "conns": 1, "tasks": 1, "hold": 1.5}
           for _ in range(2)]
    outcomes: list[str] = []

    async def fault(_workers: list[Worker], go: float) -> None:
        async with aiolock.connect(backend_url) as locks:
            lock = locks.lock(name, ttl=1.0)

            async def waiter() -> None:
                while time.monotonic() < go + 8.0:
                    try:
                        lease = await lock.acquire()
                    except aiolock.BackendUnavailable as e:
                        outcomes.append(f"{type(e).__name__}: {e}")
                        continue
                    outcomes.append("ok")
                    await lease.release()

            waiters = [asyncio.create_task(waiter()) for _ in range(3)]
            while not all(w.done() for w in waiters):
                time.sleep(0.6 + 0.3 * (time.monotonic() % 1))  # the loop stalls
                await asyncio.sleep(0.02)
            for w in waiters:
                w.result()

    run, _ = await churn(tmp_path, backend_url, cfg, 9.0, fault)
    errors = [o for o in outcomes if o != "ok"]
    print(run.summary(), f"{len(outcomes)} waits in the stalled loop, {len(errors)} failed")
    assert outcomes, "the stalled waiter never finished a wait"
    assert not errors, (f"{len(errors)} of {len(outcomes)} waits (timeout=None) failed, the "
                        f"server up, after the loop stalled: {errors[:2]}")


@other_rows(C.DISTRIBUTED, C.REVOKE)
async def test_revocations_while_others_churn(scenario: Scenario, backend_url: str,
                                              tmp_path: Path) -> None:
    """``force_release()`` every 0.1-0.5 s while 3 processes churn (ttl 3): a revoked
    holder reads lost (its block raises LockLost) at its next renewal, within ttl/3 (+
    slack); an overlap may only be a revoked lease's last moments; tokens keep increasing;
    nothing is left held by nobody."""
    ttl = 3.0
    name = f"load-revoke-{uuid.uuid4().hex[:8]}"
    cfg = [{"kind": "lock", "name": name, "ttl": ttl, "tasks": 3, "hold": 0.15}
           for _ in range(3)]
    revokes: list[tuple[float, float, bool]] = []

    async def fault(_workers: list[Worker], go: float) -> None:
        async with aiolock.connect(backend_url) as locks:
            lock = locks.lock(name, ttl=ttl)
            while time.monotonic() < go + 2.5:
                await asyncio.sleep(0.1 + 0.4 * (time.monotonic() % 1))
                r0 = time.monotonic()
                was = await lock.force_release()
                revokes.append((r0, time.monotonic(), was))

    run, _ = await churn(tmp_path, backend_url, cfg, 3.0, fault)
    info = run.summary()
    bad = token_faults(run)
    assert not bad, f"{len(bad)} token faults, e.g. {bad[:3]} ({info})"
    assert all(f["ok"] for f in run.of("final")), run.of("final")
    assert not run.of("error"), f"BackendUnavailable from a healthy server: {run.of('error')[:3]}"
    assert any(was for *_, was in revokes), f"nothing revoked in {len(revokes)} tries ({info})"
    late = []
    ivs = sorted(run.granted, key=lambda x: x.enter or 0)
    for a in ivs:
        if a.believed is None or a.enter is None:
            continue
        for b in ivs:
            if b is a or b.enter is None or not (a.enter < b.enter < a.believed):
                continue
            # a believed while b was granted: only a revoked lease (a revocation that
            # ended after a's acquire began, began before b's grant), in its last ttl/3
            rv = [r0 for r0, r1, _ in revokes if a.start <= r1 and r0 <= b.enter]
            if not a.lost or not rv or a.believed - max(rv) > ttl / 3 + SLACK:
                near = [(round(r0, 3), round(r1, 3), w) for r0, r1, w in revokes
                        if a.start - 1 <= r1 and r0 <= b.enter + 1]
                late.append((a.key, a.tok, a.lost, round(a.start, 3), round(a.enter, 3),
                             round(a.believed, 3), b.key, b.tok, round(b.start, 3),
                             round(b.enter, 3), near))
    assert not late, f"{len(late)} overlaps not explained by a revocation: {late[:3]} ({info})"
    print(info, f"{len(revokes)} revokes, {sum(w for *_, w in revokes)} held, "
          f"{len(overlaps(run))} overlaps (revoked leases' last moments)")
