"""Fixtures for the adversarial coordination tests: the backends that declare the
coordination capabilities today (memory, PostgreSQL and MySQL/MariaDB in each mode, etcd), each
on the real servers that ``tests/conftest.py`` starts. Backends without a capability skip
(or must refuse with ``ValueError``)."""

from __future__ import annotations

import importlib.util
import shutil
import uuid
from collections.abc import AsyncIterator

import pytest

import aiolock

from ..mysql_server import MariaDBServer
from ..pg_server import PostgresServer

HAVE_ETCD = importlib.util.find_spec("etcd3aio") is not None and shutil.which("etcd") is not None
ETCD = ["etcd"] if HAVE_ETCD else []
COORD_BACKENDS = ["memory", "postgres", "postgres-row", "mysql", "mysql-row", *ETCD]


def _server_url(request: pytest.FixtureRequest, param: str) -> str:
    if param.startswith("mysql"):
        my: MariaDBServer = request.getfixturevalue("mysql_server")
        return my.url + ("?mode=row" if param == "mysql-row" else "")
    if param == "etcd":  # a fresh key prefix per test
        etcd = request.getfixturevalue("etcd_server")
        return f"{etcd.url}?prefix=aiolock-{uuid.uuid4().hex[:8]}"
    pg: PostgresServer = request.getfixturevalue("postgres_server")
    return pg.url + ("?mode=row" if param == "postgres-row" else "")


@pytest.fixture
def pg_url(postgres_server: PostgresServer) -> str:
    return postgres_server.url


@pytest.fixture(params=COORD_BACKENDS)
def coord_url(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return f"memory://adv-{uuid.uuid4().hex[:8]}"
    return _server_url(request, request.param)


@pytest.fixture
async def coord(coord_url: str) -> AsyncIterator[aiolock.Locks]:
    async with aiolock.connect(coord_url) as conn:
        yield conn


@pytest.fixture(params=["memory", "postgres", "mysql", *ETCD])
def elect_url(request: pytest.FixtureRequest) -> str:
    """Backends that declare ELECTION (checked in the tests)."""
    if request.param == "memory":
        return f"memory://adv-{uuid.uuid4().hex[:8]}"
    if request.param != "postgres":
        return _server_url(request, request.param)
    pg: PostgresServer = request.getfixturevalue("postgres_server")
    return pg.url


@pytest.fixture
async def elocks(elect_url: str) -> AsyncIterator[aiolock.Locks]:
    async with aiolock.connect(elect_url) as conn:
        yield conn


@pytest.fixture(params=["postgres", "mysql", *ETCD])
def shared_url(request: pytest.FixtureRequest) -> str:
    """A server-backed ELECTION backend, shared across processes."""
    if request.param != "postgres":
        return _server_url(request, request.param)
    pg: PostgresServer = request.getfixturevalue("postgres_server")
    return pg.url


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
