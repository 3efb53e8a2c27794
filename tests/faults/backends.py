"""What the harness knows about each backend: its servers, URL, fault kinds, bounds and
the guarantees it cannot give.

Servers come from ``tests/servers.py``, ``tests/pg_server.py``, ``tests/mc_server.py``
and ``tests/zk_server.py`` (used as they are: this package only wraps them).
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field
from typing import Any

from ..servers import RedisServer, ServerProcess

__all__ = ["BACKENDS", "BackendSpec", "ensemble_class"]


@dataclass
class BackendSpec:
    """One column of the table."""

    key: str
    #: which kind of nonce echo (see common.echo)
    echo: str
    #: fault kinds injected in the workload (besides the workers' own cancellations)
    faults: list[str]
    #: fault kinds that make the server forget a lease before its holder can know (the
    #: backend says so in its docs): a lease believed after someone else was granted the
    #: lock inside such a fault's window is reported as "n/a", not as a failure
    forgets: list[str] = field(default_factory=list)
    #: why, for the table and the docs
    forgets_why: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    #: extra per-backend scenario ("restart-no-aof")
    extra: str = ""
    #: each worker reaches the server(s) through its own proxies (one per node)
    proxied: bool = True
    #: fault kinds left out, and why (for the table's footnote and the docs)
    not_injected: str = ""

    def kill_bound(self, ttl: float) -> tuple[float, str]:
        """The liveness bound for a kill -9ed holder's lock, and its label."""
        renew = ttl / 3
        if self.key in ("postgres", "mysql"):
            return 1.0, "1 s"
        if self.key.startswith("zookeeper"):
            st = float(self.options["session_timeout"])
            return st + 0.5, f"session {st:g}s+0.5"
        if self.key.startswith("etcd"):
            # whole-second etcd leases (at least 1 s), swept every 0.5 s (backend doc)
            bound = max(math.ceil(ttl), 1) + 0.5 + renew + 0.25
            return bound, f"lease {max(math.ceil(ttl), 1)}s+0.5+ttl/3+0.25={bound:.2f}s"
        if self.key == "memcached":
            # whole-second expiries: E = ceil(ttl) + 2 after the last renewal (module doc)
            bound = math.ceil(ttl) + 2 + 0.25
            return bound, f"n/a: whole-s expiry, doc bound {bound:g}s"
        return ttl + renew + 0.25, f"ttl+ttl/3+0.25={ttl + renew + 0.25:.2f}s"

    def make_server(self) -> Any:
        if self.key == "redis":
            from ..servers import RedisServer

            return RedisServer(appendonly=False)
        if self.key.startswith("redis-aof"):
            return AofRedisServer(fsync="everysec" if self.key == "redis-aof-everysec" else "always")
        if self.key == "postgres":
            from ..pg_server import PostgresServer

            return PostgresServer()
        if self.key == "mysql":
            from ..mysql_server import MariaDBServer

            return MariaDBServer()
        if self.key == "memcached":
            from ..mc_server import MemcachedServer

            return MemcachedServer()
        if self.key == "zookeeper":
            from ..zk_server import ZooKeeperServer

            return ZooKeeperServer()
        if self.key == "redlock":
            return RedlockServers(3)
        if self.key == "redis-cluster":
            return AofClusterServers(masters=3)
        if self.key.startswith("redis-sentinel"):
            from ..redis_topology import RedisSentinelServers

            return SentinelSetup(RedisSentinelServers())
        if self.key == "etcd":
            from ..etcd_server import EtcdServer

            return EtcdServer()
        if self.key == "etcd-3":
            from ..etcd_server import EtcdCluster

            return EtcdCluster(3)
        if self.key == "zookeeper-3":
            cls = ensemble_class()
            if cls is None:
                raise RuntimeError("tests/zk_server.py has no ZooKeeperEnsemble yet")
            return cls(size=3)
        raise ValueError(self.key)

    def ports(self, server: Any) -> list[int]:
        """The port(s) a worker's proxies forward to."""
        if self.key == "redlock":
            return [node.port for node in server.nodes]
        return [server.port]

    def url(self, server: Any, port: int | list[int] | None = None) -> str:
        """The URL of ``server``, or of proxies on ``port`` (redlock: one per node) in
        front of it."""
        if self.key == "zookeeper-3":
            return str(server.url("/aiolock-faults"))
        if self.key == "etcd-3":
            return f"{server.url}?prefix=aiolock-faults"
        if self.key == "etcd":
            p = (port[0] if isinstance(port, list) else port) or server.port
            return f"etcd://127.0.0.1:{p}?prefix=aiolock-faults"
        if self.key == "redlock":
            ports = port if isinstance(port, list) else self.ports(server)
            return "redlock://" + ",".join(f"127.0.0.1:{p}" for p in ports) + "/0"
        if self.key in ("redis-cluster", "redis-sentinel", "redis-sentinel-wait"):
            return str(server.url)
        if isinstance(port, list):
            port = port[0]
        p = port or server.port
        if self.key.startswith("redis"):
            return f"redis://127.0.0.1:{p}/0"
        if self.key == "postgres":
            return f"postgresql://{server.user}@127.0.0.1:{p}/{server.database}"
        if self.key == "memcached":
            return f"memcached://127.0.0.1:{p}"
        if self.key == "mysql":
            return str(server.url).replace(f":{server.port}/", f":{p}/")
        return f"zookeeper://127.0.0.1:{p}/aiolock-faults"


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


class AofClusterServers:
    """``tests.redis_topology.RedisClusterServers`` whose masters run with AOF."""

    def __init__(self, masters: int) -> None:
        from ..redis_topology import RedisClusterServers

        self.inner = RedisClusterServers(masters=masters)
        for node in self.inner.nodes:
            shutil.rmtree(node.dir, ignore_errors=True)
        self.inner.nodes = [_aof_cluster_node() for _ in range(masters)]

    @property
    def nodes(self) -> list[Any]:
        return list(self.inner.nodes)

    @property
    def url(self) -> str:
        return str(self.inner.url)

    def start(self) -> AofClusterServers:
        self.inner.start()
        return self

    def owner_of(self, slot: int) -> int:
        return int(self.inner.owner_of(slot))

    def wait_ok(self, timeout: float = 30.0) -> None:
        from ..redis_topology import wait_for

        wait_for("cluster_state:ok on every node",
                 lambda: all(self.inner._ok(p) for p in self.inner.ports), timeout)

    def close(self) -> None:
        self.inner.close()


class SentinelSetup:
    """``tests.redis_topology.RedisSentinelServers`` plus a restart of a killed master
    (it comes back and the sentinel turns it into a replica of the new master)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @property
    def url(self) -> str:
        return str(self.inner.url)

    def start(self) -> SentinelSetup:
        self.inner.start()
        return self

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

    def close(self) -> None:
        self.inner.close()


def ensemble_class() -> Any:
    """``tests.zk_server.ZooKeeperEnsemble`` if it exists (another change adds it)."""
    from .. import zk_server

    return getattr(zk_server, "ZooKeeperEnsemble", None)


_PROXY = ["stop", "kill", "proxy", "stall"]

BACKENDS: dict[str, BackendSpec] = {
    "redis": BackendSpec(
        "redis", "redis", _PROXY, extra="restart-no-aof",
        forgets_why="restart without AOF: leases and the token counter are gone",
    ),
    "redis-aof": BackendSpec("redis-aof", "redis", [*_PROXY, "restart"]),
    "redis-aof-everysec": BackendSpec(
        "redis-aof-everysec", "redis", [*_PROXY, "restart"], forgets=["restart"],
        forgets_why="appendfsync everysec: a kill -9 may lose the last acknowledged writes "
                    "(leases and token increments)",
    ),
    "zookeeper": BackendSpec(
        "zookeeper", "zookeeper", [*_PROXY, "restart", "expire"], forgets=["expire"],
        forgets_why="session expired from the server side: its nodes go before the holder hears",
        options={"session_timeout": 2.0},
    ),
    "postgres": BackendSpec(
        "postgres", "postgres", [*_PROXY, "restart"], forgets=["restart", "proxy:reset"],
        forgets_why="a dropped connection frees the advisory lock at once; the holder hears at "
                    "its next renewal",
    ),
    "mysql": BackendSpec(
        "mysql", "mysql", [*_PROXY, "restart"], forgets=["restart", "proxy:reset"],
        forgets_why="a dropped connection frees the GET_LOCK lock at once; the holder hears at "
                    "its next renewal",
    ),
    "memcached": BackendSpec(
        "memcached", "memcached", [*_PROXY, "restart"], forgets=["restart"],
        forgets_why="restart: every lock is gone (no persistence); the holder hears at its next renewal",
    ),
    "zookeeper-3": BackendSpec(
        "zookeeper-3", "zookeeper", ["stop", "kill", "leader", "stall"],
        options={"session_timeout": 4.0},
    ),
    "redlock": BackendSpec(
        "redlock", "redlock", [*_PROXY, "restart"],
        not_injected="restart of a majority of the nodes without AOF: the backend documents "
                     "that tokens may then repeat (as redis without AOF)",
    ),
    "redis-cluster": BackendSpec(
        "redis-cluster", "redis-cluster", ["stop", "kill", "stall", "restart"], proxied=False,
        not_injected="proxy: cluster clients follow the node addresses the cluster announces "
                     "(CLUSTER SLOTS / MOVED), which bypass a proxy",
    ),
    "redis-sentinel": BackendSpec(
        "redis-sentinel", "redis", ["stop", "kill", "stall", "failover", "killmaster"],
        forgets=["failover", "killmaster"], proxied=False,
        # redis-py's master pool: at most 100 connections by default, and one per request
        # in flight; more concurrent requests fail at once (MaxConnectionsError, raised
        # as BackendUnavailable). The probes run 500 acquires at once.
        options={"max_connections": 2000},
        forgets_why="failover without wait_replicas: the promoted replica may miss the latest "
                    "grants and token increments (asynchronous replication)",
        not_injected="proxy: clients connect to the address the sentinel announces, which "
                     "bypasses a proxy",
    ),
    "etcd": BackendSpec("etcd", "etcd", [*_PROXY, "restart"]),
    "etcd-3": BackendSpec("etcd-3", "etcd", ["stop", "kill", "leader", "stall"], proxied=False),
    "redis-sentinel-wait": BackendSpec(
        "redis-sentinel-wait", "redis", ["stop", "kill", "stall", "failover", "killmaster"], proxied=False,
        options={"max_connections": 2000, "wait_replicas": 1},
        not_injected="proxy: clients connect to the address the sentinel announces, which "
                     "bypasses a proxy",
    ),
}
