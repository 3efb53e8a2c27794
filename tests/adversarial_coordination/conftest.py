"""Fixtures for the adversarial coordination tests: the backends of tests/scenarios.py that
declare the coordination capabilities (read from the backend classes, so a backend that
gains one joins), each on the real servers that ``tests/conftest.py`` starts. Backends
without a capability skip (or must refuse with ``ValueError``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

import aiolock
from aiolock import Capability

from ..pg_server import PostgresServer
from ..scenarios import Scenario, params

# each backend once (not again on another topology), chosen by what it declares
COORD = params(Capability.HOLDERS, topologies=False)
ELECT = params(Capability.ELECTION, topologies=False)
SHARED = params(Capability.ELECTION, Capability.DISTRIBUTED, topologies=False)


@pytest.fixture
def pg_url(postgres_server: PostgresServer) -> str:
    return postgres_server.url


@pytest.fixture(params=COORD)
def coord_url(request: pytest.FixtureRequest) -> str:
    """Backends that declare HOLDERS (the tests check the other capabilities)."""
    row: Scenario = request.param
    return row.url(request)


@pytest.fixture
async def coord(coord_url: str) -> AsyncIterator[aiolock.Locks]:
    async with aiolock.connect(coord_url) as conn:
        yield conn


@pytest.fixture(params=ELECT)
def elect_url(request: pytest.FixtureRequest) -> str:
    """Backends that declare ELECTION."""
    row: Scenario = request.param
    return row.url(request)


@pytest.fixture
async def elocks(elect_url: str) -> AsyncIterator[aiolock.Locks]:
    async with aiolock.connect(elect_url) as conn:
        yield conn


@pytest.fixture(params=SHARED)
def shared_scenario(request: pytest.FixtureRequest) -> Scenario:
    """A server-backed ELECTION backend, shared across processes."""
    row: Scenario = request.param
    return row


@pytest.fixture
def shared_url(shared_scenario: Scenario, request: pytest.FixtureRequest) -> str:
    return shared_scenario.url(request)


# Parametrizations run only with the slow tests (-m slow): the default run keeps one or two
# backends per costly test, and every backend where that test found a defect.
SLOW_PARAMS: dict[str, set[str]] = {
    "test_local_waiter_gets_revoked_lock_at_next_renewal": {"mysql", "mysql-row", "etcd"},
    "test_holder_after_a_revoked_one_is_listed_and_revocable": {"postgres", "mysql", "etcd"},
    "test_observe_current_state_first_and_settles": {"mysql", "etcd"},
    "test_at_most_one_leader_across_processes": {"mysql", "etcd"},
    "test_sigstopped_leader_loses_and_is_cancelled_on_wake": {"mysql", "etcd"},
    "test_paused_lone_leader_is_seen_vacant": {"mysql", "etcd"},
    "test_killed_leader_replaced_quickly": {"mysql"},
    "test_killed_holders_record_does_not_come_back": {"mysql", "etcd"},
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "adversarial_coordination" not in str(item.path):
            continue
        base, _, param = item.name.partition("[")
        if param.rstrip("]") in SLOW_PARAMS.get(base, ()):
            item.add_marker(pytest.mark.slow)
