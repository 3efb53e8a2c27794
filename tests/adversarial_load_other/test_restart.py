"""A server restart while 3 processes churn one lock on a saturated machine, on a server of
this module's own (the session's servers are shared).

What the docs promise: ZooKeeper and etcd keep sessions / leases across a restart or lose
them at their last confirmed expiry (README "Guarantees and limits"): belief intervals
never overlap. PostgreSQL and MySQL free every lock at once and the holder learns it at
its next renewal: an overlap may only be an old holder's last ``ttl/3`` after the restart.
Everywhere: tokens survive the restart and keep increasing; the churn resumes; nothing
is left held by nobody.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..scenarios import by_id
from ._load import Run, Worker, churn, overlaps, token_faults

#: the rows whose servers this module restarts (memcached forgets every lock: best effort)
ROWS = ["zookeeper", "postgres", "mysql", "etcd"]
SLACK = 2.0
TTL = 3.0


def _server(row: str) -> Any:
    if row == "zookeeper":
        from ..zk_server import ZooKeeperServer

        return ZooKeeperServer()
    if row == "postgres":
        from ..pg_server import PostgresServer

        return PostgresServer()
    if row == "mysql":
        from ..mysql_server import MariaDBServer

        return MariaDBServer()
    from ..etcd_server import EtcdServer

    return EtcdServer()


def _url(row: str, server: Any) -> str:
    fresh = f"aiolock-{uuid.uuid4().hex[:8]}"
    if row == "zookeeper":
        return f"zookeeper://{server.hosts}/{fresh}"
    if row == "etcd":
        return f"{server.url}?prefix={fresh}"
    return str(server.url)


@pytest.fixture(params=[by_id(r).param() for r in ROWS])
def own_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    """A server of the row's backend for this test alone (it is restarted)."""
    row: str = request.param.id
    server = _server(row).start()
    try:
        yield row, server
    finally:
        server.close()


def explained(run: Run, restarted: tuple[float, float]) -> list[str]:
    """Overlaps that are not an old holder's last ttl/3 after the restart."""
    bad = []
    for a in run.granted:
        if a.enter is None or a.believed is None:
            continue
        for b in run.granted:
            if b is a or b.enter is None or not (a.enter < b.enter < a.believed):
                continue
            if not (a.lost and a.enter < restarted[1]
                    and a.believed <= restarted[1] + TTL / 3 + SLACK):
                bad.append(f"{a.key} tok={a.tok} believed to {a.believed:.3f} (lost={a.lost}) "
                          f"while {b.key} tok={b.tok} entered {b.enter:.3f}; restart "
                          f"{restarted[0]:.3f}-{restarted[1]:.3f}")
    return bad


async def test_server_restart_while_processes_churn(own_server: tuple[str, Any],
                                                    tmp_path: Path) -> None:
    row, server = own_server
    url = _url(row, server)
    name = f"load-restart-{uuid.uuid4().hex[:8]}"
    cfg = [{"kind": "lock", "name": name, "ttl": TTL, "tasks": 3, "hold": 0.05}
           for _ in range(3)]
    marks: dict[str, float] = {}

    async def fault(_workers: list[Worker], go: float) -> None:
        await asyncio.sleep(1.5)
        marks["down"] = time.monotonic()
        await asyncio.to_thread(server.restart, down_for=0.5)
        marks["up"] = time.monotonic()

    run, _ = await churn(tmp_path, url, cfg, 7.0, fault)
    restarted = (marks["down"], marks["up"])
    info = run.summary()
    print(row, info, f"restart took {marks['up'] - marks['down']:.2f}s,",
          len(run.of("error")), "errors,", sum(x.lost for x in run.granted), "lost")
    bad = token_faults(run)
    assert not bad, f"{len(bad)} token faults across the restart, e.g. {bad[:3]} ({info})"
    bad = overlaps(run) if row in ("zookeeper", "etcd") else explained(run, restarted)
    assert not bad, f"{len(bad)} overlaps across the restart, e.g. {bad[:3]} ({info})"
    after = [x for x in run.granted if (x.enter or 0) > marks["up"]]
    assert after, f"nobody was granted after the restart ({info})"
    assert all(f["ok"] for f in run.of("final")), run.of("final")
