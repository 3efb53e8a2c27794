"""Fixtures: real servers (started here), and ``locks`` parametrized over every backend
of the table in ``tests/scenarios.py`` (``scenario`` is the row, ``backend_url`` its URL).

The contract suite (``test_contract.py``) takes the ``locks`` fixture and so runs once
per backend; a test needing a capability the backend lacks skips itself with a reason
(``need(locks, Capability.X)``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import re
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

import aiolock
from aiolock import Capability

from .faults.backends import RedlockServers
from .mc_server import MemcachedServer
from .mysql_server import MariaDBServer
from .pg_server import PostgresServer
from .scenarios import SCENARIOS, Scenario, params
from .servers import RedisServer
from .zk_server import ZooKeeperServer

#: the backend ids of the contract suite, in the order of the table (tests/scenarios.py)
BACKENDS = [s.id for s in SCENARIOS]

# pytest-xdist's workers export COLUMNS=80 and LINES=24: a program a test starts in a
# terminal of its own (aiolock top in tmux) would take them over that terminal's size
for _var in ("COLUMNS", "LINES"):
    os.environ.pop(_var, None)

#: ./test.sh runs the suite in two phases (see there): "parallel" (pytest-xdist workers)
#: runs every test but those marked ``serial``, "serial" runs only those; unset, all
PHASE = os.environ.get("AIOLOCK_TEST_PHASE", "")
if PHASE not in ("", "parallel", "serial"):
    raise ValueError(f"AIOLOCK_TEST_PHASE must be 'parallel', 'serial' or unset, got {PHASE!r}")


def session_server(name: str, make: Callable[[], Any], doc: str = "") -> Any:
    """A session fixture ``name``: the server ``make()`` gives, started on first use and
    closed at the end of the session."""

    def fixture() -> Iterator[Any]:
        server = make().start()
        yield server
        server.close()

    fixture.__doc__ = doc
    return pytest.fixture(scope="session", name=name)(fixture)


def _cluster() -> Any:
    from .redis_topology import RedisClusterServers

    return RedisClusterServers(masters=3)


def _sentinel() -> Any:
    from .redis_topology import RedisSentinelServers

    return RedisSentinelServers()


def _etcd(members: int) -> Any:
    from .etcd_server import EtcdCluster, EtcdServer

    return EtcdCluster(members) if members > 1 else EtcdServer()


redis_server = session_server("redis_server", RedisServer)
zk_server = session_server("zk_server", ZooKeeperServer)
postgres_server = session_server("postgres_server", PostgresServer)
mysql_server = session_server("mysql_server", MariaDBServer)
memcached_server = session_server("memcached_server", MemcachedServer)
redis_cluster = session_server("redis_cluster", _cluster,
                               "A real 3-master Redis Cluster on loopback (``redis-cli --cluster create``).")
redis_sentinel = session_server("redis_sentinel", _sentinel,
                                "A real master, replica and sentinel on loopback.")
etcd_server = session_server("etcd_server", lambda: _etcd(1))
etcd_cluster = session_server("etcd_cluster", lambda: _etcd(3))
_redlock_nodes = session_server("redlock_nodes", lambda: RedlockServers(3))


@pytest.fixture(scope="session")
def redlock_servers(redlock_nodes: Any) -> list[RedisServer]:
    """Three independent redis-servers for ``redlock://``."""
    return list(redlock_nodes.nodes)


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


def rows_fixture(name: str, rows: list[Any], doc: str) -> Any:
    """A fixture ``name`` parametrized over ``rows`` (``scenarios.params(...)``): the row."""

    def fixture(request: pytest.FixtureRequest) -> Scenario:
        row: Scenario = request.param
        return row

    fixture.__doc__ = doc
    return pytest.fixture(params=rows, name=name)(fixture)


def _needing(fixture: Callable[..., Any], *needs: str) -> Callable[..., Any]:
    """``fixture`` declared as taking the fixtures ``needs`` (by keyword): pytest learns a
    fixture's dependencies from its signature, and only a declared dependency carries
    its parametrization (``request.getfixturevalue`` would not)."""
    kind = inspect.Parameter.KEYWORD_ONLY
    fixture.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(need, kind) for need in needs])
    return fixture


def url_fixture(name: str, rows: str) -> Any:
    """A fixture ``name``: the URL of the row that the fixture ``rows`` gives (its server
    started on first use)."""

    def fixture(**given: Any) -> str:
        row: Scenario = given[rows]
        return row.url(given["request"])

    return pytest.fixture(name=name)(_needing(fixture, "request", rows))


def locks_fixture(name: str, url: str) -> Any:
    """A fixture ``name``: ``aiolock.connect()`` to the URL the fixture ``url`` gives."""

    async def fixture(**given: Any) -> AsyncIterator[aiolock.Locks]:
        async with aiolock.connect(given[url]) as conn:
            yield conn

    return pytest.fixture(name=name)(_needing(fixture, url))


def backend_fixtures(row: str, url: str, conn: str, rows: list[Any], doc: str) -> tuple[Any, Any, Any]:
    """The three fixtures a backend-parametrized test takes: ``row`` (a row of ``rows``,
    ``scenarios.params(...)``), ``url`` (its server's URL) and ``conn`` (``aiolock.connect``
    to it). Assign them to module names: ``a_row, a_url, a_locks = backend_fixtures(...)``."""
    return rows_fixture(row, rows, doc), url_fixture(url, row), locks_fixture(conn, url)


def capability_fixtures(row: str, url: str, conn: str, capability: Capability) -> tuple[Any, Any, Any]:
    """:func:`backend_fixtures` over each backend (one topology each) whose class declares
    ``capability``."""
    return backend_fixtures(row, url, conn, params(capability, topologies=False),
                            f"Backends declaring {capability.name}.")


scenario, backend_url, locks = backend_fixtures(
    "scenario", "backend_url", "locks", params(), "One row of the backend table (tests/scenarios.py).")


@pytest.fixture
def name() -> str:
    """A fresh lock name per test, so tests sharing a server never collide."""
    return f"t-{uuid.uuid4().hex}"


async def acquire_cancelled_after(lock: aiolock.Lock, steps: int, *, timeout: float | None = None,
                                  release: bool = True) -> aiolock.Lease | None:
    """Start ``lock.acquire(timeout)``, cancel it after ``steps`` loop steps: whatever step
    it lands on, nothing may leak. If the acquire finished first, its lease is released
    (``release``) or returned (else None)."""
    task = asyncio.create_task(lock.acquire(timeout=timeout))
    for _ in range(steps):
        await asyncio.sleep(0)
    task.cancel()
    try:
        lease = await task
    except asyncio.CancelledError:
        return None
    if not release:
        return lease
    await lease.release()
    return None


async def release_cancelled_after(lease: aiolock.Lease, steps: int) -> None:
    """Start ``lease.release()`` and cancel it after ``steps`` loop steps (a release
    cancelled at any point must leave nothing held)."""
    task = asyncio.create_task(lease.release())
    for _ in range(steps):
        await asyncio.sleep(0)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def need(locks: aiolock.Locks, capability: Capability) -> None:
    if capability not in locks.capabilities:
        pytest.skip(f"{locks.url} does not offer {capability.value}")


#: Kept out of the default run (and CI) to hold the whole suite under 15 minutes: each
#: repeats, on one more backend or at a larger size, a check the default run makes
#: elsewhere (on other backends, or in the contract suite). ``./test.sh -m slow`` runs them.
SLOW_TIER = {
    # the election-mode quick harness: the same faults on leaders run by default in
    # tests/adversarial_coordination/test_election_procs.py (kill -9, SIGSTOP, at most one)
    "tests/test_faults_quick.py::test_fault_harness_election_quick",
    "tests/test_redlock.py::test_node_killed_while_held[5-nodes]",  # 3 nodes: the same checks
    "tests/test_redlock.py::test_mutual_exclusion_across_processes[5-nodes]",
    "tests/adversarial_issue14/test_faults.py::test_many_leases_one_connection_kept_several_ttls[1000]",
    "tests/adversarial_issue14/test_faults.py::test_killed_holder_freed_within_documented_bound",
    "tests/adversarial_issue14/test_recipe.py::test_election_on_etcd",
    "tests/adversarial_issue12/test_election_procs.py::test_killed_leader_replaced_stopped_leader_cancelled[redis]",
    "tests/adversarial_issue12/test_election_procs.py::test_at_most_one_leader_across_processes[redlock]",
    "tests/adversarial_issue12/test_revoke.py::test_revoking_some_leases_of_a_renewal_batch_spares_the_others[redlock]",
    "tests/adversarial_issue12/test_election.py::test_observe_ends_on_current_leader[memcached]",
    "tests/adversarial_issue12/test_waiting.py::test_campaign_granted_after_a_wait_longer_than_ttl_is_live[mysql-row]",
    "tests/adversarial_issue12/test_waiting.py::test_lease_granted_after_a_wait_longer_than_ttl_is_live[mysql-row]",
    "tests/adversarial_coordination/test_election_procs.py::test_at_most_one_leader_across_processes[mysql-row]",
    "tests/adversarial_coordination/test_election_procs.py::test_at_most_one_leader_across_processes[postgres-row]",
    "tests/adversarial_coordination/test_election_procs.py::test_sigstopped_leader_loses_and_is_cancelled_on_wake[mysql-row]",
    "tests/adversarial_coordination/test_election_procs.py::test_sigstopped_leader_loses_and_is_cancelled_on_wake[postgres-row]",
    "tests/adversarial_coordination/test_election_procs.py::test_paused_lone_leader_is_seen_vacant[mysql-row]",
    "tests/adversarial/test_leases.py::test_many_leases_renewed[zookeeper]",
    "tests/test_memcached.py::test_renewal_keeps_a_lease_over_many_ttls",
}


#: Known defects that can hang a test: id -> symptom. Each is xfail (not strict: it
#: passes most runs) with a short timeout, so that a hang costs 30 s, not the run.
KNOWN_HANGS: dict[str, str] = {}


#: Redis without scripting joined the earlier adversarial suites' election, revocation and
#: listing files when it gained those capabilities; its own README+SPEC-only suite
#: (tests/adversarial_issue15/test_coordination.py) and the contract suites run them by
#: default, so these variants are in the slow tier
_NOLUA_LATER = re.compile(r"tests/(adversarial_coordination|adversarial_issue12)/"
                          r"test_(election|election_procs|revoke|scan)\.py::.*\[redis-nolua[\]-]")


#: The earlier README+SPEC-only suites run by default on each backend's main row; their
#: variants on the rows that share a main row's recipe (Cluster and Sentinel run the Redis
#: scripts, etcd-cluster is etcd on three members, the row modes share their database's
#: SQL) are in the slow tier: the contract suites run every row by default (suite time)
_SHARED_ROWS = re.compile(
    r"tests/(adversarial|adversarial_coordination|adversarial_issue12)/.*"
    r"\[(redis-sentinel|redis-cluster|etcd-cluster|postgres-row|mysql-row)[\]-]")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if PHASE:
        serial = PHASE == "serial"
        keep = [item for item in items if (item.get_closest_marker("serial") is not None) == serial]
        if len(keep) < len(items):
            kept = {id(item) for item in keep}
            config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
            items[:] = keep
    for item in items:
        if (item.nodeid in SLOW_TIER or _NOLUA_LATER.match(item.nodeid)
                or _SHARED_ROWS.match(item.nodeid)):
            item.add_marker(pytest.mark.slow)
        hang = KNOWN_HANGS.get(item.nodeid)
        if hang is not None:
            item.add_marker(pytest.mark.xfail(reason=hang, strict=False))
            item.add_marker(pytest.mark.timeout(30))
