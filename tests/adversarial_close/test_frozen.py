"""Closing while the server is frozen (SIGSTOP: TCP still accepts, nothing answers): the
close cannot release on the server, but it must end in bounded time (README: every
request is bounded by ``request_timeout``; "nothing hangs forever"), raising at most a
``LockError``; the connection's waiters end at once with a ``LockError``; after the thaw
the name is free within the row's documented dead-holder bound (tests/scenarios.py).
The session servers of tests/conftest.py are frozen (each xdist worker has its own) and
always thawed in a ``finally``. Written from README.md, SPEC.md and docs/ only."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

import aiolock

from ..scenarios import Scenario
from .conftest import assert_lock_error, take_lock, timed

#: request / connect timeout of the frozen connection (Sentinel and Cluster: a shorter
#: one, so that the whole test fits in their freeze budget, before a failover)
RT = {"redis-sentinel": 0.5, "redis-cluster": 0.5}
#: longest a freeze may last without the topology reacting
MAX_FREEZE = {"redis-sentinel": 2.5, "redis-cluster": 3.5}
TTL = 1.0


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
    return found


def _stopped(pid: int) -> bool:
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for t in threads:
        with contextlib.suppress(OSError, IndexError), open(f"/proc/{pid}/task/{t}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] not in ("T", "t", "Z", "X"):
                return False
    return True


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    if sig == signal.SIGSTOP:
        deadline = time.monotonic() + 2.0
        while not all(_stopped(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.002)


def _servers(scenario: Scenario, request: pytest.FixtureRequest) -> list[Any]:
    """The server processes behind the row (its session fixtures, already started by
    ``backend_url``)."""
    sid = scenario.id
    if sid in ("redis", "redis-nolua"):
        return [request.getfixturevalue("redis_server")]
    if sid == "redis-cluster":
        return list(request.getfixturevalue("redis_cluster").nodes)
    if sid == "redis-sentinel":
        s = request.getfixturevalue("redis_sentinel")
        return [s.server(s.master_port())]
    if sid == "redlock":
        return list(request.getfixturevalue("redlock_servers"))
    if sid == "zookeeper":
        return [request.getfixturevalue("zk_server")]
    if sid.startswith("postgres"):
        return [request.getfixturevalue("postgres_server")]
    if sid.startswith("mysql"):
        return [request.getfixturevalue("mysql_server")]
    if sid == "memcached":
        return [request.getfixturevalue("memcached_server")]
    if sid == "etcd":
        return [request.getfixturevalue("etcd_server")]
    if sid == "etcd-cluster":
        return list(request.getfixturevalue("etcd_cluster").members)
    raise AssertionError(f"no server known for {sid}")


@contextlib.contextmanager
def frozen(servers: list[Any]) -> Iterator[list[int]]:
    """SIGSTOP every server process (and its children: PostgreSQL's backends), SIGCONT
    them on exit whatever happened; yields the pids (thaw early with ``_signal``)."""
    pids: list[int] = []
    for server in servers:
        pid = server.proc.pid
        pids += [pid, *_children(pid)]
    _signal(pids, signal.SIGSTOP)
    try:
        yield pids
    finally:
        _signal(pids, signal.SIGCONT)


async def test_close_while_the_server_is_frozen_is_bounded(
    scenario: Scenario, backend_url: str, judge: aiolock.Locks, name: str, request: pytest.FixtureRequest
) -> None:
    """Hold a lease (ttl 1 s) and queue a waiter behind the judge, freeze the server,
    ``aclose()``: it ends within ``3 * request_timeout + 1 s`` (a release request and
    the connections' goodbyes, each bounded) with at most a ``LockError``; the waiter
    ends with a ``LockError`` by then (+1 s); a second ``aclose()`` and a call after
    it are quick. After the thaw both names are free within the dead-holder bound."""
    if scenario.id == "memory":
        pytest.skip("memory:// has no server to freeze")
    rt = RT.get(scenario.id, 1.0)
    bound = 3 * rt + 1.0
    if scenario.id == "redis-cluster":
        # a Cluster request is bounded by 4 x request_timeout + 0.25 s (its module doc:
        # redis-py's retries), not one: the close (a release, an abandon, overlapping)
        # must end before the thaw at MAX_FREEZE, which would let anything finish
        bound = MAX_FREEZE["redis-cluster"] - 0.3
    options: dict[str, Any] = {"connect_timeout": rt, "request_timeout": rt}
    if scenario.id == "zookeeper":
        options["session_timeout"] = 4.0
    servers = _servers(scenario, request)
    blocker = await judge.lock(f"{name}-busy", ttl=30).acquire(timeout=5)
    await blocker.release()  # the judge connected; the name is free again
    doomed = aiolock.connect(backend_url, **options)
    lease = await doomed.lock(name, ttl=TTL).acquire(timeout=5)
    blocker = await judge.lock(f"{name}-busy", ttl=TTL * 3).acquire(timeout=5)
    waiter = asyncio.create_task(
        timed("waiter", lambda: doomed.lock(f"{name}-busy", ttl=TTL).acquire(timeout=30))
    )
    await asyncio.sleep(0.3)
    with frozen(servers) as pids:
        thaw_at = MAX_FREEZE.get(scenario.id, 8.0)
        loop = asyncio.get_running_loop()
        thaw = loop.call_later(thaw_at, _signal, pids, signal.SIGCONT)  # the topology's budget
        try:
            closed = await timed("aclose() while frozen", doomed.aclose, cap=20)
            waited = await waiter
            again = await timed("aclose() again", doomed.aclose, cap=20)
            after = await timed("status() after", lambda: doomed.status(name), cap=20)
        finally:
            thaw.cancel()
    failures = []
    if (
        closed.error is not None and not isinstance(closed.error, aiolock.LockError)
    ) or closed.elapsed > bound:
        failures.append(f"bound {bound:.1f} s (request_timeout {rt}): " + closed.describe())
    try:
        assert_lock_error(waited, closed.elapsed + 1.0)
    except AssertionError as e:
        failures.append(str(e))
    if (again.error is not None and not isinstance(again.error, aiolock.LockError)) or again.elapsed > 1.0:
        failures.append(again.describe())
    try:
        assert_lock_error(after)
    except AssertionError as e:
        failures.append(str(e))
    if not (lease.released or lease.lost):
        failures.append(f"the lease held at the close is neither released nor lost: {lease!r}")
    await blocker.release()
    free_within = scenario.dead_holder(TTL) + (4.0 if scenario.id == "zookeeper" else 0) + 2.0
    try:
        await take_lock(judge, name, within=free_within)
        await take_lock(judge, f"{name}-busy", within=free_within)
    except (AssertionError, aiolock.LockError) as e:
        failures.append(f"after the thaw: {e!r}")
    assert not failures, "\n".join(failures)
