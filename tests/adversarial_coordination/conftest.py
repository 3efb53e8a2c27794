"""Fixtures for the adversarial coordination tests: the backends of tests/scenarios.py that
declare the coordination capabilities (read from the backend classes, so a backend that
gains one joins), each on the real servers that ``tests/conftest.py`` starts. Backends
without a capability skip (or must refuse with ``ValueError``)."""

from __future__ import annotations

import pytest

from aiolock import Capability

from ..conftest import capability_fixtures, rows_fixture, url_fixture
from ..pg_server import PostgresServer
from ..scenarios import params


@pytest.fixture
def pg_url(postgres_server: PostgresServer) -> str:
    return postgres_server.url


# each backend once (not again on another topology), chosen by what its class declares
# (HOLDERS: the tests check the other capabilities)
coord_scenario, coord_url, coord = capability_fixtures("coord_scenario", "coord_url", "coord",
                                                       Capability.HOLDERS)
elect_scenario, elect_url, elocks = capability_fixtures("elect_scenario", "elect_url", "elocks",
                                                        Capability.ELECTION)
shared_scenario = rows_fixture(
    "shared_scenario", params(Capability.ELECTION, Capability.DISTRIBUTED, topologies=False),
    "A server-backed ELECTION backend, shared across processes.")
shared_url = url_fixture("shared_url", "shared_scenario")


# Parametrizations run only with the slow tests (-m slow): the default run keeps one or two
# backends per costly test, and every backend where that test found a defect.
_LATER = {"redis-cluster", "redis-sentinel", "redlock", "memcached"}  # joined in issue 12
# Redis without scripting joined with its elections: a killed or paused leader's lease
# expires on the server as on the Lua path; tests/test_redis_nolua_coordination.py runs
# candidates in three processes over both paths (test_killed_leader_replaced_quickly
# stays: its waiters are woken differently)
_NOLUA = {"redis-nolua"}
SLOW_PARAMS: dict[str, set[str]] = {
    "test_local_waiter_gets_revoked_lock_at_next_renewal": {"mysql", "mysql-row", "etcd", *_LATER},
    "test_holder_after_a_revoked_one_is_listed_and_revocable": {"postgres", "mysql", "etcd",
                                                                *_LATER},
    "test_observe_current_state_first_and_settles": {"mysql", "etcd", *_LATER},
    "test_at_most_one_leader_across_processes": {"mysql", "etcd", "zookeeper", *_LATER, *_NOLUA},
    "test_sigstopped_leader_loses_and_is_cancelled_on_wake": {"mysql", "etcd", "zookeeper",
                                                              *_LATER, *_NOLUA},
    "test_paused_lone_leader_is_seen_vacant": {"mysql", "etcd", "zookeeper", *_LATER, *_NOLUA},
    "test_killed_leader_replaced_quickly": {"mysql", "etcd", *_LATER},
    "test_killed_holders_record_does_not_come_back": {"mysql", "etcd", "zookeeper", *_LATER,
                                                      *_NOLUA},
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "adversarial_coordination" not in str(item.path):
            continue
        base, _, param = item.name.partition("[")
        if param.rstrip("]") in SLOW_PARAMS.get(base, ()):
            item.add_marker(pytest.mark.slow)
