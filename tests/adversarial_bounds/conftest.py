"""Fixtures of the bounded-time adversarial tests, written from README.md, SPEC.md and
docs/ (the per-backend pages) only -- never from the implementation.

The promise under attack: an unreachable server gets ``BackendUnavailable`` in bounded
time (``connect_timeout`` / ``request_timeout``), nothing hangs, and a held lease whose
server freezes is reported lost by its last confirmed expiry.

Every backend runs on servers of this folder's own (never the session-shared fixtures of
``tests/conftest.py``, which other tests use), started on first use and killed at the end
of the session. A server is "frozen" with SIGSTOP (TCP still accepts, nothing answers;
PostgreSQL: the postmaster and every backend), "thawed" with SIGCONT, always in a
``finally``. Timeouts are short (1 s) so that each test is quick.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest

import aiolock

from ..servers import RedisServer, ServerProcess

#: the timeouts every test connects with (seconds)
CT = 1.0
RT = 1.0
#: slack over a documented bound (2 cores, possibly loaded: never below 0.6 s)
SLACK = 0.8
#: no test operation may take longer than this: past it, it "hung"
HANG = 30.0

T = TypeVar("T")


def _children(pid: int) -> list[int]:
    """The direct children of ``pid`` (PostgreSQL's backends each lead a session of
    their own, so a process group does not reach them)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
    return found


def _signal(server: ServerProcess, sig: int) -> None:
    """SIGSTOP/SIGCONT the server and its child processes (PostgreSQL's postmaster first,
    so that it forks no backend meanwhile, then every backend)."""
    assert server.proc is not None
    pid = server.proc.pid
    pids = [pid, *_children(pid)]
    for each in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, sig)
    if sig == signal.SIGSTOP:  # the signal is asynchronous: wait until every thread stopped
        deadline = time.monotonic() + 2.0
        while not all(_stopped(each) for each in pids) and time.monotonic() < deadline:
            time.sleep(0.002)


def _stopped(pid: int) -> bool:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for task in tasks:
        with contextlib.suppress(OSError, IndexError), open(f"/proc/{pid}/task/{task}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] not in ("T", "t", "Z", "X"):
                return False
    return True


@dataclass
class Target:
    """One backend under test: how to reach it, freeze it and thaw it."""

    id: str
    #: the URL, ``{port}`` standing for the (first) server port where a proxy may go
    template: str
    port: int
    frozen_servers: Callable[[], list[ServerProcess]]
    #: extra keywords of ``aiolock.connect`` (ZooKeeper's ``session_timeout``)
    options: dict[str, Any] = field(default_factory=dict)
    #: whether a proxy can stand in front of it (one server, one port)
    proxiable: bool = True
    #: seconds a freeze may last without the topology reacting (Sentinel failover,
    #: Cluster node timeout)
    max_freeze: float = 60.0
    _stopped: list[ServerProcess] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.template.format(port=self.port)

    def url_via(self, port: int) -> str:
        return self.template.format(port=port)

    def connect(self, url: str | None = None, **options: Any) -> aiolock.Locks:
        opts = {"connect_timeout": CT, "request_timeout": RT, **self.options, **options}
        return aiolock.connect(url or self.url, **opts)

    def freeze(self) -> None:
        for server in self.frozen_servers():
            _signal(server, signal.SIGSTOP)
            self._stopped.append(server)

    def thaw(self) -> None:
        while self._stopped:
            _signal(self._stopped.pop(), signal.SIGCONT)

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        self.freeze()
        try:
            yield
        finally:
            self.thaw()


class Servers:
    """This folder's own servers, one of each kind, started on first use."""

    def __init__(self) -> None:
        self.made: dict[str, Any] = {}
        self.closers: list[Callable[[], None]] = []

    def _get(self, kind: str, make: Callable[[], Any]) -> Any:
        if kind not in self.made:
            server = make().start()
            self.made[kind] = server
            self.closers.append(server.close)
        return self.made[kind]

    def target(self, backend: str) -> Target:
        if backend in ("redis", "redis-nolua"):
            r: RedisServer = self._get("redis", RedisServer)
            query = "?scripting=off" if backend == "redis-nolua" else ""
            return Target(backend, "redis://127.0.0.1:{port}/0" + query, r.port, lambda: [r])
        if backend == "redis-cluster":
            from ..redis_topology import RedisClusterServers

            c = self._get("cluster", lambda: RedisClusterServers(masters=3))
            hosts = ",".join(f"127.0.0.1:{p}" for p in c.ports[1:])
            return Target(backend, "redis+cluster://127.0.0.1:{port}," + hosts, c.ports[0],
                          lambda: list(c.nodes), proxiable=False, max_freeze=4.0)
        if backend == "redis-sentinel":
            from ..redis_topology import RedisSentinelServers

            s = self._get("sentinel", RedisSentinelServers)
            return Target(backend, "redis+sentinel://127.0.0.1:{port}/mymaster", s.sentinel.port,
                          lambda: [s.server(s.master_port())], proxiable=False, max_freeze=2.7)
        if backend == "redlock":
            nodes = [self._get(f"redlock{i}", RedisServer) for i in range(3)]
            rest = ",".join(f"127.0.0.1:{n.port}" for n in nodes[1:])
            return Target(backend, "redlock://127.0.0.1:{port}," + rest, nodes[0].port,
                          lambda: list(nodes), proxiable=False)
        if backend == "zookeeper":
            from ..zk_server import ZooKeeperServer

            z = self._get("zk", ZooKeeperServer)
            chroot = f"aiolock-{uuid.uuid4().hex[:8]}"
            return Target(backend, "zookeeper://127.0.0.1:{port}/" + chroot, z.port, lambda: [z],
                          options={"session_timeout": 6})
        if backend in ("postgres", "postgres-row"):
            from ..pg_server import PostgresServer

            p = self._get("pg", PostgresServer)
            query = "?mode=row" if backend == "postgres-row" else ""
            return Target(backend, f"postgresql://{p.user}@127.0.0.1:{{port}}/{p.database}{query}",
                          p.port, lambda: [p])
        if backend in ("mysql", "mysql-row"):
            from ..mysql_server import PASSWORD, USER, MariaDBServer

            m = self._get("mysql", MariaDBServer)
            query = "?mode=row" if backend == "mysql-row" else ""
            return Target(backend, f"mysql://{USER}:{PASSWORD}@127.0.0.1:{{port}}/{m.database}{query}",
                          m.port, lambda: [m])
        if backend == "memcached":
            from ..mc_server import MemcachedServer

            mc = self._get("memcached", MemcachedServer)
            return Target(backend, "memcached://127.0.0.1:{port}", mc.port, lambda: [mc])
        if backend == "etcd":
            from ..etcd_server import EtcdServer

            e = self._get("etcd", EtcdServer)
            prefix = f"aiolock-{uuid.uuid4().hex[:8]}"
            return Target(backend, "etcd://127.0.0.1:{port}?prefix=" + prefix, e.port, lambda: [e])
        raise ValueError(backend)

    def close(self) -> None:
        for close in reversed(self.closers):
            with contextlib.suppress(Exception):
                close()  # SIGKILL: also ends a stopped server


@pytest.fixture(scope="session")
def servers() -> Iterator[Servers]:
    made = Servers()
    yield made
    made.close()


@pytest.fixture
def target(request: pytest.FixtureRequest, servers: Servers) -> Iterator[Target]:
    """The backend named by the test's ``backend`` parameter, on this folder's servers;
    thawed after the test whatever happened."""
    made = servers.target(request.param)
    try:
        yield made
    finally:
        made.thaw()


ALL = ["redis", "redis-nolua", "redis-cluster", "redis-sentinel", "redlock", "zookeeper",
       "postgres", "postgres-row", "mysql", "mysql-row", "memcached", "etcd"]
#: the backends with one server on one port (a proxy can stand in front)
SINGLE = ["redis", "zookeeper", "postgres", "postgres-row", "mysql", "mysql-row", "memcached", "etcd"]


def backends(ids: list[str], default: tuple[str, ...] = ()) -> pytest.MarkDecorator:
    """Parametrize ``target`` over ``ids``; those not in ``default`` are in the slow tier."""
    params = [pytest.param(b, id=b, marks=() if b in default else (pytest.mark.slow,)) for b in ids]
    return pytest.mark.parametrize("target", params, indirect=True)


@pytest.fixture
def name() -> str:
    return f"bnd-{uuid.uuid4().hex}"


@dataclass
class Outcome:
    """How an operation ended: its duration, and the exception or result."""

    elapsed: float
    error: BaseException | None
    result: Any = None

    def describe(self) -> str:
        what = "returned" if self.error is None else type(self.error).__name__
        return f"{what} after {self.elapsed:.2f} s ({self.error or self.result!r})"


async def timed(op: Callable[[], Awaitable[T]], cap: float = HANG) -> Outcome:
    """Run ``op()``, timing it; never longer than ``cap`` (then the error is a
    ``TimeoutError`` from the cap, and the outcome says it hung)."""
    start = time.monotonic()
    try:
        async with asyncio.timeout(cap):
            result = await op()
    except BaseException as exc:  # the outcome is what the test judges
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return Outcome(time.monotonic() - start, exc)
    return Outcome(time.monotonic() - start, None, result)


def assert_unavailable(outcome: Outcome, bound: float, what: str) -> None:
    """``outcome`` raised BackendUnavailable within ``bound`` seconds."""
    assert isinstance(outcome.error, aiolock.BackendUnavailable), f"{what}: {outcome.describe()}"
    assert outcome.elapsed < bound, f"{what}: {outcome.describe()}, bound {bound:.2f} s"


async def warm(locks: aiolock.Locks, name: str) -> None:
    """One request while the server is up, so that a connection is pooled and idle."""
    await locks.status(name)
