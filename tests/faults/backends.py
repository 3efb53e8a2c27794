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

from ..servers import ServerProcess

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

    def kill_bound(self, ttl: float) -> tuple[float, str]:
        """The liveness bound for a kill -9ed holder's lock, and its label."""
        renew = ttl / 3
        if self.key == "postgres":
            return 1.0, "1 s"
        if self.key.startswith("zookeeper"):
            st = float(self.options["session_timeout"])
            return st + 0.5, f"session {st:g}s+0.5"
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
        if self.key == "memcached":
            from ..mc_server import MemcachedServer

            return MemcachedServer()
        if self.key == "zookeeper":
            from ..zk_server import ZooKeeperServer

            return ZooKeeperServer()
        if self.key == "zookeeper-3":
            cls = ensemble_class()
            if cls is None:
                raise RuntimeError("tests/zk_server.py has no ZooKeeperEnsemble yet")
            return cls(size=3)
        raise ValueError(self.key)

    def url(self, server: Any, port: int | None = None) -> str:
        """The URL of ``server``, or of a proxy on ``port`` in front of it."""
        if self.key == "zookeeper-3":
            return str(server.url("/aiolock-faults"))
        p = port or server.port
        if self.key.startswith("redis"):
            return f"redis://127.0.0.1:{p}/0"
        if self.key == "postgres":
            return f"postgresql://{server.user}@127.0.0.1:{p}/{server.database}"
        if self.key == "memcached":
            return f"memcached://127.0.0.1:{p}"
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
    "memcached": BackendSpec(
        "memcached", "memcached", [*_PROXY, "restart"], forgets=["restart"],
        forgets_why="restart: every lock is gone (no persistence); the holder hears at its next renewal",
    ),
    "zookeeper-3": BackendSpec(
        "zookeeper-3", "zookeeper", ["stop", "kill", "leader", "stall"],
        options={"session_timeout": 4.0},
    ),
}

