"""Fixtures for the adversarial coordination tests: the backends that declare the
coordination capabilities today (memory, PostgreSQL and MySQL/MariaDB, each mode), each
on the real servers that ``tests/conftest.py`` starts. Backends without a capability skip
(or must refuse with ``ValueError``)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

import aiolock

from ..mysql_server import MariaDBServer
from ..pg_server import PostgresServer

COORD_BACKENDS = ["memory", "postgres", "postgres-row", "mysql", "mysql-row"]


@pytest.fixture
def pg_url(postgres_server: PostgresServer) -> str:
    return postgres_server.url


@pytest.fixture(params=COORD_BACKENDS)
def coord_url(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return f"memory://adv-{uuid.uuid4().hex[:8]}"
    if request.param.startswith("mysql"):
        my: MariaDBServer = request.getfixturevalue("mysql_server")
        return my.url + ("?mode=row" if request.param == "mysql-row" else "")
    pg: PostgresServer = request.getfixturevalue("postgres_server")
    return pg.url + ("?mode=row" if request.param == "postgres-row" else "")


@pytest.fixture
async def coord(coord_url: str) -> AsyncIterator[aiolock.Locks]:
    async with aiolock.connect(coord_url) as conn:
        yield conn


@pytest.fixture(params=["memory", "postgres", "mysql"])
def elect_url(request: pytest.FixtureRequest) -> str:
    """Backends that declare ELECTION (checked in the tests)."""
    if request.param == "memory":
        return f"memory://adv-{uuid.uuid4().hex[:8]}"
    if request.param == "mysql":
        my: MariaDBServer = request.getfixturevalue("mysql_server")
        return my.url
    pg: PostgresServer = request.getfixturevalue("postgres_server")
    return pg.url


@pytest.fixture
async def elocks(elect_url: str) -> AsyncIterator[aiolock.Locks]:
    async with aiolock.connect(elect_url) as conn:
        yield conn


@pytest.fixture(params=["postgres", "mysql"])
def shared_url(request: pytest.FixtureRequest) -> str:
    """A server-backed ELECTION backend, shared across processes."""
    if request.param == "mysql":
        my: MariaDBServer = request.getfixturevalue("mysql_server")
        return my.url
    pg: PostgresServer = request.getfixturevalue("postgres_server")
    return pg.url
