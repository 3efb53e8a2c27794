"""The backends under test, as data: one row per backend (tooz's ``scenarios``, anyio's
``pytest.param(id=, marks=)``).

Each :class:`Scenario` says how to reach a running server (``url``, a factory given the
pytest request so that it can start the session's servers on demand), an unreachable
one (``bad_url``), the capabilities the backend must at least declare, and its documented
bounds. Fixtures and skips read the capabilities the backend class *declares*
(:meth:`Scenario.capabilities`), never a list kept here: a backend that gains one joins
the tests that need it by itself. ``expects`` only guards against losing one.
"""

from __future__ import annotations

import importlib.util
import math
import shutil
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import pytest

from aiolock import Capability

__all__ = ["SCENARIOS", "SECRET", "Scenario", "by_id", "params", "params_of"]

C = Capability
#: the password every ``bad_url`` carries where its scheme takes one: no error or log may show it
SECRET = "pw-s3cret-unreach"
_LOCKS = frozenset({C.EXPIRY})
_SERVER = _LOCKS | {C.DISTRIBUTED, C.EVENTS}
_COORD = frozenset({C.HOLDERS, C.SCAN, C.REVOKE, C.ELECTION})


def _fresh(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _fixture_url(fixture: str, suffix: str = "") -> Callable[[pytest.FixtureRequest], str]:
    def url(request: pytest.FixtureRequest) -> str:
        return str(request.getfixturevalue(fixture).url) + suffix

    return url


def _zookeeper(request: pytest.FixtureRequest) -> str:
    return f"zookeeper://{request.getfixturevalue('zk_server').hosts}/{_fresh('aiolock')}"  # fresh chroot


def _redlock(request: pytest.FixtureRequest) -> str:
    servers = request.getfixturevalue("redlock_servers")
    return "redlock://" + ",".join(f"127.0.0.1:{s.port}" for s in servers)


def _etcd(fixture: str) -> Callable[[pytest.FixtureRequest], str]:
    def url(request: pytest.FixtureRequest) -> str:  # a fresh key prefix per test
        return f"{request.getfixturevalue(fixture).url}?prefix={_fresh('aiolock')}"

    return url


def _ceil(ttl: float) -> float:
    return float(math.ceil(ttl))


@dataclass(frozen=True)
class Scenario:
    """One backend (one mode of it) under test."""

    id: str
    #: the URL of a running server (the factory starts the session's server if needed)
    url: Callable[[pytest.FixtureRequest], str]
    #: an unreachable server of this backend: ``{0}``, ``{1}``, ``{2}`` are ports where
    #: nothing answers (refused or silent); ``None``: nothing to reach (memory://). The
    #: capabilities are read from a backend built from it (not connected).
    bad_url: str | None
    #: capabilities the backend must declare at least (the tests use what it declares)
    expects: frozenset[Capability]
    #: documented bound: a holder that stops renewing (process frozen, connection kept)
    #: frees its lock within ``dead_holder(ttl)`` seconds of its acquisition
    dead_holder: Callable[[float], float] = lambda ttl: ttl + 0.3
    #: documented bound after ``kill -9`` (its connections close); default: ``dead_holder``
    killed_holder: Callable[[float], float] | None = None
    #: what must be installed: importable modules and executables
    modules: tuple[str, ...] = ()
    binaries: tuple[str, ...] = ()
    marks: tuple[Any, ...] = field(default=())
    #: the same backend as that row, on another topology: suites that test the code
    #: rather than the deployment (tests/adversarial*) run that row only
    topology_of: str = ""

    @cached_property
    def missing(self) -> str:
        """What is not installed for this scenario ("" when all is)."""
        absent = [m for m in self.modules if importlib.util.find_spec(m) is None]
        absent += [b for b in self.binaries if shutil.which(b) is None]
        return ", ".join(absent)

    @cached_property
    def capabilities(self) -> frozenset[Capability]:
        """What the backend class declares (built from ``bad_url``, never connected)."""
        from aiolock._connect import backend_from_url

        if self.missing:
            return frozenset()
        probe = "memory://" if self.bad_url is None else self.bad_url.format(1, 2, 3)
        caps: frozenset[Capability] = backend_from_url(probe).capabilities
        return caps

    def kill_bound(self, ttl: float) -> float:
        return (self.killed_holder or self.dead_holder)(ttl)

    def param(self) -> Any:
        marks = list(self.marks)
        if self.missing:
            marks.append(pytest.mark.skip(reason=f"not installed: {self.missing}"))
        return pytest.param(self, id=self.id, marks=marks)


_SQL_KILLED = 1.5  # a killed holder's connection drops: the server frees its claim at once

SCENARIOS: list[Scenario] = [
    Scenario("memory", lambda _request: f"memory://{_fresh('test')}", None, _LOCKS | _COORD),
    Scenario("redis", _fixture_url("redis_server"), f"redis://:{SECRET}@127.0.0.1:{{0}}/0",
             _SERVER, binaries=("redis-server",)),
    # Redis without scripting (issue 15): lock() and elections as WATCH/MULTI/EXEC
    # transactions, with holders, scan and revocation (not fair; no rwlock, semaphore)
    Scenario("redis-nolua", _fixture_url("redis_server", "?scripting=off"),
             f"redis://:{SECRET}@127.0.0.1:{{0}}/0?scripting=off", _SERVER | _COORD,
             binaries=("redis-server",)),
    # the lease clocks find a dead holder's node stale at ttl, the next look is within ttl/3
    # (or the session expires first); a killed holder's session is not closed at once
    Scenario("zookeeper", _zookeeper, "zookeeper://127.0.0.1:{0},127.0.0.1:{1}/x",
             _SERVER | _COORD, killed_holder=lambda ttl: ttl + ttl / 3 + 0.3,
             modules=("aiozk",), binaries=("java",)),
    Scenario("postgres", _fixture_url("postgres_server"),
             f"postgresql://u:{SECRET}@127.0.0.1:{{0}}/db", _SERVER | _COORD,
             killed_holder=lambda _ttl: _SQL_KILLED, modules=("asyncpg",)),
    Scenario("postgres-row", _fixture_url("postgres_server", "?mode=row"),
             f"postgresql://u:{SECRET}@127.0.0.1:{{0}}/db?mode=row", _SERVER | _COORD,
             killed_holder=lambda _ttl: _SQL_KILLED, modules=("asyncpg",)),
    # whole-second expiries: ceil(ttl) + 2 after the last renewal (the module's doc)
    Scenario("memcached", _fixture_url("memcached_server"), "memcached://127.0.0.1:{0}",
             _LOCKS | {C.DISTRIBUTED, C.HOLDERS, C.REVOKE, C.ELECTION},
             dead_holder=lambda ttl: _ceil(ttl) + 2 + 0.3,
             binaries=("memcached",)),
    # a frozen holder's connection ends at wait_timeout: ceil(ttl) after the last renewal
    Scenario("mysql", _fixture_url("mysql_server"), f"mysql://u:{SECRET}@127.0.0.1:{{0}}/db",
             _SERVER | _COORD, dead_holder=lambda ttl: _ceil(ttl) + 0.3,
             killed_holder=lambda _ttl: _SQL_KILLED, modules=("asyncmy",)),
    Scenario("mysql-row", _fixture_url("mysql_server", "?mode=row"),
             f"mysql://u:{SECRET}@127.0.0.1:{{0}}/db?mode=row", _SERVER | {C.HOLDERS, C.ELECTION},
             dead_holder=lambda ttl: _ceil(ttl) + 0.3, killed_holder=lambda _ttl: _SQL_KILLED,
             modules=("asyncmy",)),
    Scenario("redis-cluster", _fixture_url("redis_cluster"),
             f"redis+cluster://:{SECRET}@127.0.0.1:{{0}},127.0.0.1:{{1}}", _SERVER,
             binaries=("redis-server", "redis-cli")),
    Scenario("redis-sentinel", _fixture_url("redis_sentinel"),
             f"redis+sentinel://127.0.0.1:{{0}},127.0.0.1:{{1}}/mymaster?password={SECRET}",
             _SERVER, binaries=("redis-server",)),
    Scenario("redlock", _redlock,
             f"redlock://:{SECRET}@127.0.0.1:{{0}},127.0.0.1:{{1}},127.0.0.1:{{2}}", _SERVER | _COORD,
             binaries=("redis-server",)),
    # whole-second etcd leases (at least 1 s), revoked by the leader's sweep (every 0.5 s)
    Scenario("etcd", _etcd("etcd_server"), "etcd://127.0.0.1:{0},127.0.0.1:{1}",
             _SERVER | _COORD, dead_holder=lambda ttl: max(_ceil(ttl), 1) + 1.3,
             modules=("etcd3aio",), binaries=("etcd",)),
    Scenario("etcd-cluster", _etcd("etcd_cluster"), "etcd://127.0.0.1:{0},127.0.0.1:{1}",
             _SERVER | _COORD,
             dead_holder=lambda ttl: max(_ceil(ttl), 1) + 1.3, modules=("etcd3aio",),
             binaries=("etcd",), topology_of="etcd"),
]


def by_id(key: str) -> Scenario:
    return next(s for s in SCENARIOS if s.id == key)


def params(*need: Capability, topologies: bool = True) -> list[Any]:
    """``pytest.param`` per scenario whose backend declares every one of ``need``
    (``topologies=False``: not the rows that only run a backend on another topology)."""
    return [s.param() for s in SCENARIOS
            if set(need) <= s.capabilities and (topologies or not s.topology_of)]


def params_of(*ids: str) -> list[Any]:
    """``pytest.param`` of the rows ``ids`` (a test that picks its backends by name)."""
    return [by_id(key).param() for key in ids]


def rows(*need: Capability, default: Iterable[str] = ()) -> pytest.MarkDecorator:
    """Parametrize the ``scenario`` fixture (tests/conftest.py) over every row declaring
    ``need`` (one topology each); the rows not in ``default`` are in the slow tier (the
    adversarial folders keep the rows where they found something in the default run)."""
    keep = set(default)
    found = []
    for s in SCENARIOS:
        if s.topology_of or (not s.missing and not set(need) <= s.capabilities):
            continue
        marks: list[Any] = list(s.param().marks)
        if s.id not in keep:
            marks.append(pytest.mark.slow)
        found.append(pytest.param(s, id=s.id, marks=marks))
    return pytest.mark.parametrize("scenario", found, indirect=True)
