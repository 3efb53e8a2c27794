"""Several worker processes x several tasks churn one primitive for a few seconds while two
busy loops saturate the 2-core machine (the load under which CI caught an overlap on
Redis). Every row but Redis's: ZooKeeper, PostgreSQL and MySQL (both modes), Memcached,
etcd. What must hold exactly (SPEC §2, §3, §8):

- no two belief intervals overlap (a lock, a writer, a leader), never more than ``limit``
  permits at once;
- tokens never repeat, and each is above every acquisition that returned before its own
  acquire was called (so strictly increasing in grant order for a lock);
- no lease is lost (ttl 5 s, far above any stall here);
- a final acquire in each process, all of them still connected, succeeds (nothing leaked).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from aiolock import Capability

from ..scenarios import Scenario
from ._load import Run, churn, most_inside, other_rows, overlaps, token_faults

C = Capability
TTL = 5.0
SECONDS = 2.5
#: a timed-out or cancelled acquire, or a try, returns within this much past its bound
#: even on a saturated machine (SPEC §4: "nothing hangs"; request_timeout is 5 s)
OVERSHOOT = 5.0


def configs(kind: str, procs: int = 3, tasks: int = 4, opts: dict[str, Any] | None = None,
            **extra: Any) -> list[dict[str, Any]]:
    """``procs`` churner configs on one fresh name (``opts``: keys that are Python words)."""
    name = f"load-{kind}-{uuid.uuid4().hex[:8]}"
    return [{"kind": kind, "name": name, "ttl": TTL, "tasks": tasks, **(opts or {}), **extra}
            for _ in range(procs)]


def common_checks(run: Run, *, liveness: bool = True) -> None:
    """No lease lost, tokens in order, timeouts bounded, the final acquires succeeded."""
    info = run.summary()
    print(info, max([e["took"] for e in run.of("miss") + run.of("cancel")], default=0))
    assert run.granted, f"nothing granted: {info}"
    lost = [x.key for x in run.granted if x.lost]
    assert not lost, f"leases lost with ttl {TTL}: {lost[:5]} ({info})"
    bad = token_faults(run)
    assert not bad, f"{len(bad)} token faults, e.g. {bad[:3]} ({info})"
    errors = run.of("error")
    assert not errors, f"BackendUnavailable from a healthy server: {errors[:3]}"
    finals = run.of("final")
    assert all(f["ok"] for f in finals), f"a final acquire timed out (a leaked claim?): {finals}"
    slow = [e for e in run.of("miss") + run.of("cancel") if e["took"] > OVERSHOOT + 0.05]
    assert not slow, f"timeouts/cancels overshooting by > {OVERSHOOT}s: {slow[:3]}"
    if liveness:
        pids = {w for w in (x.pid for x in run.leases.values())}
        starved = pids - {x.pid for x in run.granted}
        assert not starved, f"processes never granted in {SECONDS}s: {starved} ({info})"


@other_rows(C.DISTRIBUTED)
async def test_lock_churn_under_load(scenario: Scenario, backend_url: str, tmp_path: Path) -> None:
    """3 processes x 4 tasks on lock(ttl=5), plus tries, bounded waits and cancelled waits."""
    run, _ = await churn(tmp_path, backend_url,
                         configs("lock", opts={"try": 0.1, "timeouts": 0.1, "cancel": 0.1}),
                         SECONDS)
    bad = overlaps(run)
    assert not bad, f"{len(bad)} overlaps, e.g. {bad[:3]} ({run.summary()})"
    common_checks(run)


@other_rows(C.DISTRIBUTED)
async def test_plain_lock_churn_under_load(scenario: Scenario, backend_url: str,
                                           tmp_path: Path) -> None:
    """Only ``async with lock``: 4 processes x 3 tasks, the simplest churn."""
    run, _ = await churn(tmp_path, backend_url, configs("lock", procs=4, tasks=3), SECONDS)
    bad = overlaps(run)
    assert not bad, f"{len(bad)} overlaps, e.g. {bad[:3]} ({run.summary()})"
    common_checks(run)


@other_rows(C.DISTRIBUTED, C.FAIR)
async def test_fair_lock_churn_under_load(scenario: Scenario, backend_url: str,
                                          tmp_path: Path) -> None:
    """lock(fair=True), with cancelled and bounded waits (queue places given up)."""
    run, _ = await churn(tmp_path, backend_url,
                         configs("fair", opts={"timeouts": 0.1, "cancel": 0.15}), SECONDS)
    bad = overlaps(run)
    assert not bad, f"{len(bad)} overlaps, e.g. {bad[:3]} ({run.summary()})"
    common_checks(run)


@other_rows(C.DISTRIBUTED, C.SEMAPHORE)
@pytest.mark.parametrize("limit", [2])
async def test_semaphore_churn_under_load(scenario: Scenario, backend_url: str, tmp_path: Path,
                                          limit: int) -> None:
    run, _ = await churn(tmp_path, backend_url,
                         configs("sem", limit=limit, hold=0.01,
                                 opts={"try": 0.05, "timeouts": 0.1, "cancel": 0.1}), SECONDS)
    inside, when = most_inside(run)
    assert inside <= limit, f"{inside} permits held at once at {when} (limit {limit}; {run.summary()})"
    common_checks(run)


@other_rows(C.DISTRIBUTED, C.RWLOCK)
async def test_rwlock_churn_under_load(scenario: Scenario, backend_url: str, tmp_path: Path) -> None:
    """A third writers, the rest readers: a writer is alone."""
    run, _ = await churn(tmp_path, backend_url,
                         configs("rw", wfrac=0.35, hold=0.01, opts={"timeouts": 0.05, "cancel": 0.1}),
                         SECONDS)
    bad = overlaps(run, exclusive=lambda x: x.role == "w")
    assert not bad, f"{len(bad)} writer overlaps, e.g. {bad[:3]} ({run.summary()})"
    assert any(x.role == "w" for x in run.granted), run.summary()
    common_checks(run, liveness=False)


@other_rows(C.DISTRIBUTED, C.ELECTION)
async def test_election_churn_under_load(scenario: Scenario, backend_url: str,
                                         tmp_path: Path) -> None:
    """Candidates campaign, lead briefly and resign: at most one believes it leads."""
    run, _ = await churn(tmp_path, backend_url,
                         configs("elect", tasks=2, hold=0.01, opts={"timeouts": 0.05, "cancel": 0.1}),
                         SECONDS)
    bad = overlaps(run)
    assert not bad, f"{len(bad)} leaders at once, e.g. {bad[:3]} ({run.summary()})"
    common_checks(run, liveness=False)


@other_rows(C.DISTRIBUTED)
async def test_lock_hard_churn_under_load(scenario: Scenario, backend_url: str,
                                          tmp_path: Path) -> None:
    """5 processes x 5 tasks on 3 connections each, holds of at most 1 ms, a quarter of
    the waits cancelled at random points, releases cancelled at random points, tries."""
    cfg = configs("lock", procs=5, tasks=5, conns=3, hold=0.001, relcancel=0.2,
                  opts={"try": 0.05, "timeouts": 0.1, "cancel": 0.25})
    run, _ = await churn(tmp_path, backend_url, cfg, 3.0)
    bad = overlaps(run)
    assert not bad, f"{len(bad)} overlaps, e.g. {bad[:3]} ({run.summary()})"
    common_checks(run, liveness=False)


@other_rows(C.DISTRIBUTED, C.SEMAPHORE)
async def test_semaphore_many_permits_short_ttl_under_load(scenario: Scenario, backend_url: str,
                                                           tmp_path: Path) -> None:
    """limit 8, 3 processes x 6 tasks on one connection each, ttl 1 s and holds up to
    1.5 s (batched renewals of many permits under load): permits may lapse (then they
    read lost), but never more than 8 are believed at once."""
    limit = 8
    name = f"load-sem-{uuid.uuid4().hex[:8]}"
    cfg = [{"kind": "sem", "name": name, "ttl": 1.0, "limit": limit, "tasks": 6, "hold": 1.5,
            "conns": 1, "cancel": 0.1} for _ in range(3)]
    run, _ = await churn(tmp_path, backend_url, cfg, 4.0)
    inside, when = most_inside(run)
    assert inside <= limit, f"{inside} permits held at once at {when} (limit {limit}; {run.summary()})"
    bad = token_faults(run)
    assert not bad, f"{len(bad)} token faults, e.g. {bad[:3]} ({run.summary()})"
    assert all(f["ok"] for f in run.of("final")), run.of("final")
    assert not run.of("error"), f"BackendUnavailable from a healthy server: {run.of('error')[:3]}"
    print(run.summary(), "most inside", inside)


@other_rows(C.DISTRIBUTED, C.RWLOCK)
async def test_writer_not_starved_by_reader_churn_under_load(scenario: Scenario, backend_url: str,
                                                             tmp_path: Path) -> None:
    """3 processes x 4 tasks keep readers inside at every instant; one writer process
    loops on write(): it is served again and again (SPEC §3: waiting writers are not
    starved), and no reader is inside with it."""
    name = f"load-rw-{uuid.uuid4().hex[:8]}"
    base = {"kind": "rw", "name": name, "ttl": TTL}
    cfg = [{**base, "tasks": 1, "wfrac": 1.0, "hold": 0.01, "conns": 1}] + [
        {**base, "tasks": 4, "wfrac": 0.0, "hold": 0.08} for _ in range(3)]
    run, _ = await churn(tmp_path, backend_url, cfg, 3.0)
    bad = overlaps(run, exclusive=lambda x: x.role == "w")
    assert not bad, f"{len(bad)} writer overlaps, e.g. {bad[:3]} ({run.summary()})"
    writes = [x for x in run.granted if x.role == "w"]
    reads = [x for x in run.granted if x.role == "r"]
    assert len(writes) >= 3, (f"the writer was served {len(writes)} times in 3 s against "
                              f"{len(reads)} reads ({run.summary()})")
    common_checks(run, liveness=False)
