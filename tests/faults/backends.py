"""What the harness knows about each backend, as data: its servers, URL, fault actions,
bounds and the guarantees it cannot give.

Servers come from ``tests/servers.py``, ``tests/pg_server.py``, ``tests/mc_server.py``
and ``tests/zk_server.py`` (used as they are: this package only wraps them).
"""

from __future__ import annotations

import importlib
import math
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

from aiolock import Capability

from ..scenarios import by_id
from ..servers import RedisServer, ServerProcess
from . import actions
from .actions import Fault

__all__ = ["BACKENDS", "BackendSpec", "ensemble_class"]

if TYPE_CHECKING:
    from .harness import BackendRun


@dataclass
class BackendSpec:
    """One column of the table: how to start the backend's server(s) and reach them, the
    faults it takes (kind -> action, see actions.py), its bounds and what it cannot give."""

    key: str
    #: which kind of nonce echo (see common.echo)
    echo: str
    #: the server(s), not started (``start()``, ``close()``)
    server: Callable[[], Any]
    #: the URL of a started server, or of proxies on these ports in front of it
    url: Callable[[Any, list[int] | None], str]
    #: fault kinds injected in the workload (besides the workers' own cancellations)
    faults: dict[str, Fault]
    #: fault kinds that make the server forget a lease before its holder can know (the
    #: backend says so in its docs): a lease believed after someone else was granted the
    #: lock inside such a fault's window is reported as "n/a", not as a failure
    forgets: list[str] = field(default_factory=list)
    #: why, for the table and the docs
    forgets_why: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    #: an extra scenario after the workload (its figure is added to the table)
    extra: Callable[[BackendRun], Awaitable[dict[str, Any]]] | None = None
    #: each worker reaches the server(s) through its own proxies (one per node)
    proxied: bool = True
    #: fault kinds left out, and why (for the table's footnote and the docs)
    not_injected: str = ""
    #: the liveness bound of a kill -9ed holder's lock, and its label, for a ttl
    kill: Callable[[float], tuple[float, str]] = field(default=lambda ttl: _expiry_bound(ttl))
    #: the port(s) a worker's proxies forward to
    ports: Callable[[Any], list[int]] = lambda server: [server.port]
    #: the server keeps one connection per held lease (PostgreSQL, MySQL): fewer holds
    #: in the fault-free probe, and a pool large enough for them
    connection_per_hold: bool = False
    #: leases held at once in the fault-free probe (None: all of them)
    holds_at_once: int | None = None
    #: acquires sent at once in that probe (redis-py pools: one connection per request;
    #: PostgreSQL and MySQL: one new server session each, whose set-up on a loaded 2-core
    #: box delayed the renewals of the leases already granted past a 1 s ttl)
    burst: int = 500
    #: the least ttl of the fault-free holds (the run's own if longer): a 3-node ensemble
    #: on two loaded cores drops a lagging follower (syncLimit 1 s) and its clients move
    #: to another member, a second's gap that a 1 s lease does not outlive
    min_hold_ttl: float = 0.0
    #: seconds a quick run takes, roughly: the longest start first
    weight: float = 20.0
    #: the backend's row in tests/scenarios.py (default: ``key``), for its capabilities
    row: str = ""

    @property
    def capabilities(self) -> frozenset[Capability]:
        """What the backend class declares (tests/scenarios.py reads it)."""
        return by_id(self.row or self.key).capabilities

    def kill_bound(self, ttl: float) -> tuple[float, str]:
        """The liveness bound for a kill -9ed holder's lock, and its label."""
        return self.kill(ttl)


def _expiry_bound(ttl: float) -> tuple[float, str]:
    bound = ttl + ttl / 3 + 0.25
    return bound, f"ttl+ttl/3+0.25={bound:.2f}s"


def _session_bound(session_timeout: float) -> Callable[[float], tuple[float, str]]:
    return lambda _ttl: (session_timeout + 0.5, f"session {session_timeout:g}s+0.5")


def _etcd_bound(ttl: float) -> tuple[float, str]:
    # whole-second etcd leases (at least 1 s), swept every 0.5 s (backend doc)
    lease = max(math.ceil(ttl), 1)
    bound = lease + 0.5 + ttl / 3 + 0.25
    return bound, f"lease {lease}s+0.5+ttl/3+0.25={bound:.2f}s"


def _memcached_bound(ttl: float) -> tuple[float, str]:
    # whole-second expiries: E = ceil(ttl) + 2 after the last renewal (module doc)
    bound = math.ceil(ttl) + 2 + 0.25
    return bound, f"n/a: whole-s expiry, doc bound {bound:g}s"


def _connection_bound(_ttl: float) -> tuple[float, str]:
    return 1.0, "1 s"  # the killed holder's connection drops: the server frees at once


def _at(template: str) -> Callable[[Any, list[int] | None], str]:
    """The URL ``template`` with ``{port}`` the first proxy's port or the server's."""
    return lambda server, ports: template.format(port=ports[0] if ports else server.port)


def _own_url(suffix: str = "") -> Callable[[Any, list[int] | None], str]:
    """The server's own URL (clients follow addresses the servers announce: no proxy)."""
    return lambda server, _ports: str(server.url) + suffix


def _redlock_url(server: Any, ports: list[int] | None) -> str:
    ports = ports or [node.port for node in server.nodes]
    return "redlock://" + ",".join(f"127.0.0.1:{p}" for p in ports) + "/0"


def _postgres_url(server: Any, ports: list[int] | None) -> str:
    return f"postgresql://{server.user}@127.0.0.1:{ports[0] if ports else server.port}/{server.database}"


def _mysql_url(server: Any, ports: list[int] | None) -> str:
    return str(server.url).replace(f":{server.port}/", f":{ports[0] if ports else server.port}/")


def _zk_ensemble() -> Any:
    cls = ensemble_class()
    if cls is None:
        raise RuntimeError("tests/zk_server.py has no ZooKeeperEnsemble yet")
    return cls(size=3)


def _server(module: str, name: str, *args: Any, **kwargs: Any) -> Callable[[], Any]:
    """A server class of the tests' helpers, imported when the backend runs."""

    def make() -> Any:
        return getattr(importlib.import_module(f"tests.{module}"), name)(*args, **kwargs)

    return make


class AofRedisServer(ServerProcess):
    """``tests.servers.RedisServer`` with AOF and a chosen ``appendfsync``.

    ``redis-aof`` uses ``always``: with Redis's default ``everysec`` the write of the AOF
    buffer may be postponed while a background fsync is slow, replies still go out, and a
    ``kill -9`` then loses acknowledged writes -- token increments included (the
    ``redis-aof-everysec`` column shows it).
    """

    def __init__(self, fsync: str) -> None:
        from ..servers import RedisServer

        self._inner = RedisServer(appendonly=True)
        shutil.rmtree(self._inner.dir, ignore_errors=True)  # ours is used instead
        super().__init__(port=self._inner.port, prefix="aiolock-redis-aof-")
        self.fsync = fsync

    def command(self) -> list[str]:
        self._inner.dir = self.dir
        return [*self._inner.command(), "--appendfsync", self.fsync]


class RedlockServers:
    """``n`` independent Redis masters for ``redlock://``, **without** AOF: a restarted
    node comes back empty (no leases, token counter at 0), the case the backend says a
    minority of nodes may go through (docs/redlock.md)."""

    def __init__(self, n: int) -> None:
        self.nodes = [RedisServer(appendonly=False) for _ in range(n)]

    def start(self) -> RedlockServers:
        try:
            for node in self.nodes:
                node.start()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for node in self.nodes:
            node.close()


def _aof_cluster_node() -> Any:
    from ..redis_topology import ClusterNodeServer

    class AofClusterNode(ClusterNodeServer):
        """A cluster master with AOF (``appendfsync always``): a restarted master keeps
        its leases and token counters (and its ``nodes.conf``, in the same dir)."""

        def command(self) -> list[str]:
            self.appendonly = True
            return [*super().command(), "--appendfsync", "always"]

    return AofClusterNode()


class _Wrapper:
    """A server setup of tests/redis_topology.py (``inner``) with a few more actions."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @property
    def url(self) -> str:
        return str(self.inner.url)

    def start(self) -> Self:
        self.inner.start()
        return self

    def close(self) -> None:
        self.inner.close()


class AofClusterServers(_Wrapper):
    """``tests.redis_topology.RedisClusterServers`` whose masters run with AOF."""

    def __init__(self, masters: int) -> None:
        from ..redis_topology import RedisClusterServers

        super().__init__(RedisClusterServers(masters=masters))
        for node in self.inner.nodes:
            shutil.rmtree(node.dir, ignore_errors=True)
        self.inner.nodes = [_aof_cluster_node() for _ in range(masters)]

    @property
    def nodes(self) -> list[Any]:
        return list(self.inner.nodes)

    def owner_of(self, slot: int) -> int:
        return int(self.inner.owner_of(slot))

    def wait_ok(self, timeout: float = 30.0) -> None:
        from ..redis_topology import wait_for

        wait_for("cluster_state:ok on every node",
                 lambda: all(self.inner._ok(p) for p in self.inner.ports), timeout)


def _sentinel_setup() -> SentinelSetup:
    from ..redis_topology import RedisSentinelServers

    return SentinelSetup(RedisSentinelServers())


class SentinelSetup(_Wrapper):
    """``tests.redis_topology.RedisSentinelServers`` plus a restart of a killed master
    (it comes back and the sentinel turns it into a replica of the new master)."""

    def failover(self) -> tuple[int, int]:
        old = self.inner.master_port()
        new = self.inner.failover()
        self._demoted(old, new)
        return old, new

    def kill_master(self) -> tuple[int, int]:
        old = self.inner.master_port()
        new = self.inner.kill_master()
        self.inner.server(old).start()
        self._demoted(old, new)
        return old, new

    def _demoted(self, old: int, new: int) -> None:
        """Wait until the old master replicates from the new one. The sentinel does it
        (about 10 s after a failover); a restarted old master is sometimes left a master
        for longer (seen after back-to-back failovers): after 20 s the harness sends it
        the ``REPLICAOF`` the sentinel would have sent, so the next failover has a replica."""
        from ..redis_topology import client

        try:
            self.inner.wait_demoted(old, timeout=20.0)
        except RuntimeError:
            with client(old) as c:
                c.execute_command("REPLICAOF", "127.0.0.1", str(new))
            self.inner.wait_demoted(old, timeout=30.0)


def ensemble_class() -> Any:
    """``tests.zk_server.ZooKeeperEnsemble`` if it exists (another change adds it)."""
    from .. import zk_server

    return getattr(zk_server, "ZooKeeperEnsemble", None)


_WORKER: dict[str, Fault] = {"stop": actions.stop, "kill": actions.kill, "stall": actions.stall}
_PROXY: dict[str, Fault] = {**_WORKER, "proxy": actions.proxy}
_RESTART: dict[str, Fault] = {**_PROXY, "restart": actions.restart}
_SENTINEL: dict[str, Fault] = {**_WORKER, "failover": actions.failover, "killmaster": actions.killmaster}
_ENSEMBLE: dict[str, Fault] = {**_WORKER, "leader": actions.leader}
_REDIS = _at("redis://127.0.0.1:{port}/0")
_SENTINEL_NO_PROXY = ("proxy: clients connect to the address the sentinel announces, which "
                      "bypasses a proxy")
# redis-py's master pool: at most 100 connections by default, and one per request in flight;
# more concurrent requests fail at once (MaxConnectionsError, raised as BackendUnavailable).
# The probes run 500 acquires at once.
_SENTINEL_POOL = {"max_connections": 2000}

BACKENDS: dict[str, BackendSpec] = {spec.key: spec for spec in [
    BackendSpec("redis", "redis", lambda: RedisServer(appendonly=False), _REDIS, _PROXY,
                extra=actions.restart_no_aof, weight=22,
                forgets_why="restart without AOF: leases and the token counter are gone"),
    BackendSpec("redis-aof", "redis", lambda: AofRedisServer("always"), _REDIS, _RESTART, weight=21,
                row="redis"),
    BackendSpec("redis-nolua", "redis", lambda: AofRedisServer("always"),
                _at("redis://127.0.0.1:{port}/0?scripting=off"), _RESTART, weight=21),
    BackendSpec("redis-aof-everysec", "redis", lambda: AofRedisServer("everysec"), _REDIS, _RESTART,
                forgets=["restart"], row="redis",
                forgets_why="appendfsync everysec: a kill -9 may lose the last acknowledged writes "
                            "(leases and token increments)"),
    BackendSpec("zookeeper", "zookeeper", _server("zk_server", "ZooKeeperServer"),
                _at("zookeeper://127.0.0.1:{port}/aiolock-faults"),
                {**_RESTART, "expire": actions.session_expiry}, forgets=["expire"],
                forgets_why="session expired from the server side: its nodes go before the holder hears",
                options={"session_timeout": 2.0}, kill=_session_bound(2.0), holds_at_once=1000,
                weight=28),
    BackendSpec("postgres", "postgres", _server("pg_server", "PostgresServer"), _postgres_url, _RESTART,
                forgets=["restart", "proxy:reset"],
                forgets_why="a dropped connection frees the advisory lock at once; the holder hears at "
                            "its next renewal",
                kill=_connection_bound, connection_per_hold=True, burst=10, weight=25),
    BackendSpec("mysql", "mysql", _server("mysql_server", "MariaDBServer"), _mysql_url, _RESTART,
                forgets=["restart", "proxy:reset"],
                forgets_why="a dropped connection frees the GET_LOCK lock at once; the holder hears at "
                            "its next renewal",
                kill=_connection_bound, connection_per_hold=True, burst=10),
    BackendSpec("memcached", "memcached", _server("mc_server", "MemcachedServer"),
                _at("memcached://127.0.0.1:{port}"), _RESTART, forgets=["restart"],
                forgets_why="restart: every lock is gone (no persistence); the holder hears at its "
                            "next renewal",
                kill=_memcached_bound, weight=24),
    BackendSpec("zookeeper-3", "zookeeper", _zk_ensemble,
                lambda server, _ports: str(server.url("/aiolock-faults")), _ENSEMBLE,
                options={"session_timeout": 4.0}, kill=_session_bound(4.0), proxied=False,
                holds_at_once=1000, min_hold_ttl=2.0, weight=27, row="zookeeper"),
    BackendSpec("redlock", "redlock", lambda: RedlockServers(3), _redlock_url,
                {**_PROXY, "restart": actions.restart_node},
                ports=lambda server: [node.port for node in server.nodes], weight=22,
                not_injected="restart of a majority of the nodes without AOF: the backend documents "
                             "that tokens may then repeat (as redis without AOF)"),
    BackendSpec("redis-cluster", "redis-cluster", lambda: AofClusterServers(masters=3), _own_url(),
                {**_WORKER, "restart": actions.restart_slot_owner}, proxied=False, burst=50, weight=25,
                not_injected="proxy: cluster clients follow the node addresses the cluster announces "
                             "(CLUSTER SLOTS / MOVED), which bypass a proxy"),
    BackendSpec("redis-sentinel", "redis", _sentinel_setup, _own_url(), _SENTINEL,
                forgets=["failover", "killmaster"], proxied=False, options=_SENTINEL_POOL, burst=50,
                forgets_why="failover without wait_replicas: the promoted replica may miss the latest "
                            "grants and token increments (asynchronous replication)",
                not_injected=_SENTINEL_NO_PROXY, weight=47),
    # etcd answers a keep-alive only once it applied the writes before it: a storm of
    # thousands of acquisitions (two writes each) delays the first leases' renewals past
    # a 2 s ttl (6,000 at once lapsed on this 2-core box; 3,000 did not)
    BackendSpec("etcd", "etcd", _server("etcd_server", "EtcdServer"),
                _at("etcd://127.0.0.1:{port}?prefix=aiolock-faults"), _RESTART, kill=_etcd_bound,
                holds_at_once=1000),
    BackendSpec("etcd-3", "etcd", _server("etcd_server", "EtcdCluster", 3),
                _own_url("?prefix=aiolock-faults"), _ENSEMBLE, kill=_etcd_bound, proxied=False,
                holds_at_once=1000, row="etcd-cluster"),
    BackendSpec("redis-sentinel-wait", "redis", _sentinel_setup, _own_url(), _SENTINEL, proxied=False,
                options={**_SENTINEL_POOL, "wait_replicas": 1}, burst=50,
                not_injected=_SENTINEL_NO_PROXY, weight=47, row="redis-sentinel"),
]}
