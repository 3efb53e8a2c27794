"""Real Redis topologies for the tests, on free loopback ports: a Redis Cluster of N
masters (``redis-cli --cluster create``) and a Sentinel-managed master with one replica.

Every server is our own child process (see :mod:`tests.servers`); ``close()`` kills them
all and removes their temp dirs. Startup waits for readiness, bounded, and says clearly
what is missing when ``redis-server`` or ``redis-cli`` is not installed.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Callable
from typing import Any, Self

import redis

from .servers import RedisServer, free_port

#: Sentinel's name for the monitored master.
SERVICE = "mymaster"
#: The replication user (its ACL can be switched off to cut replication, see
#: :meth:`RedisSentinelServers.cut_replication`).
REPL_USER, REPL_PASSWORD = "repl", "repl-secret"


def _exe(name: str) -> str:
    exe = shutil.which(name)
    if exe is None:
        raise RuntimeError(f"{name} is not installed (apt-get install redis-server ships it)")
    return exe


def wait_for(what: str, check: Callable[[], bool], timeout: float = 20.0) -> None:
    """Poll ``check`` (exceptions count as "not yet") until true; RuntimeError after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception as exc:
            last = exc
        time.sleep(0.05)
    raise RuntimeError(f"timed out after {timeout} s waiting for {what} (last error: {last!r})")


def client(port: int, **options: Any) -> redis.Redis:
    """A short-lived synchronous client for test plumbing."""
    return redis.Redis(port=port, socket_timeout=5, socket_connect_timeout=2,
                       decode_responses=True, **options)


class ClusterNodeServer(RedisServer):
    """One ``redis-server --cluster-enabled yes`` with its bus on its own free port."""

    def __init__(self) -> None:
        super().__init__()
        self.bus_port = free_port()

    def command(self) -> list[str]:
        return [*super().command(), "--cluster-enabled", "yes",
                "--cluster-config-file", str(self.dir / "nodes.conf"),
                "--cluster-port", str(self.bus_port), "--cluster-node-timeout", "5000"]


class RedisClusterServers:
    """A Redis Cluster of ``masters`` masters (no replicas) on loopback."""

    def __init__(self, masters: int = 3) -> None:
        if masters < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        self.cli = _exe("redis-cli")
        self.nodes = [ClusterNodeServer() for _ in range(masters)]

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self) -> Self:
        try:
            for node in self.nodes:
                node.start()
            result = subprocess.run(
                [self.cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                 "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True, text=True, timeout=60, check=False,
            )
            if result.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed:\n{result.stdout}\n{result.stderr}")
            wait_for("cluster_state:ok on every node", lambda: all(self._ok(p) for p in self.ports), 30)
        except BaseException:
            self.close()
            raise
        return self

    def _ok(self, port: int) -> bool:
        with client(port) as c:
            info = c.execute_command("CLUSTER", "INFO")
            slots = c.execute_command("CLUSTER", "SLOTS")
        return "cluster_state:ok" in str(info) and len(slots) == len(self.nodes)

    def owner_of(self, slot: int) -> int:
        """The port of the master that serves ``slot``."""
        with client(self.ports[0]) as c:
            for start, end, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if int(start) <= slot <= int(end):
                    return int(master[1])
        raise LookupError(f"no master serves slot {slot}")

    def close(self) -> None:
        for node in self.nodes:
            node.close()


class _DataServer(RedisServer):
    """A master or replica of the Sentinel setup: a replication user, and optionally
    ``replicaof``."""

    def __init__(self, replica_of: int | None = None) -> None:
        super().__init__()
        self.replica_of = replica_of

    def command(self) -> list[str]:
        acl = self.dir / "users.acl"
        acl.write_text(f"user default on nopass ~* &* +@all\n"
                       f"user {REPL_USER} on >{REPL_PASSWORD} ~* &* +@all\n")
        cmd = [*super().command(), "--aclfile", str(acl),
               "--masteruser", REPL_USER, "--masterauth", REPL_PASSWORD,
               "--repl-diskless-sync-delay", "0"]  # replicas sync at once
        if self.replica_of is not None:
            cmd += ["--replicaof", "127.0.0.1", str(self.replica_of)]
        return cmd


class SentinelServer(RedisServer):
    """``redis-server sentinel.conf --sentinel`` watching one master (quorum 1)."""

    def __init__(self, master_port: int) -> None:
        super().__init__()
        self.master_port = master_port

    def command(self) -> list[str]:
        conf = self.dir / "sentinel.conf"
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndaemonize no\ndir {self.dir}\n"
            f"logfile {self.dir / 'sentinel.log'}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.master_port} 1\n"
            # not 1 s: a loaded 2-core CI machine can stall a master that long, and a
            # failover nobody asked for makes tests (and the fault harness) fail
            f"sentinel down-after-milliseconds {SERVICE} 3000\n"
            f"sentinel failover-timeout {SERVICE} 10000\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        return [self.exe, str(conf), "--sentinel"]


class RedisSentinelServers:
    """A master, one replica and one sentinel (quorum 1) on loopback."""

    def __init__(self) -> None:
        _exe("redis-server")
        self.master = _DataServer()
        self.replica = _DataServer(replica_of=self.master.port)
        self.sentinel = SentinelServer(self.master.port)
        self.data = [self.master, self.replica]

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel.port}/{SERVICE}"

    def start(self) -> Self:
        try:
            self.master.start()
            self.replica.start()
            wait_for("the replica to sync", lambda: self._link_up(self.replica.port))
            self.sentinel.start()
            wait_for("the sentinel to see master and replica", self._sentinel_ready)
            self.wait_replicated()  # the replica acknowledges writes (WAIT works)
        except BaseException:
            self.close()
            raise
        return self

    def _link_up(self, port: int) -> bool:
        with client(port) as c:
            info: dict[str, Any] = c.info("replication")
        return bool(info.get("role") == "slave" and info.get("master_link_status") == "up")

    def _sentinel_ready(self) -> bool:
        with client(self.sentinel.port) as s:
            replicas = s.execute_command("SENTINEL", "REPLICAS", SERVICE)
        up = [r for r in replicas if "s_down" not in str(r) and "disconnected" not in str(r)]
        return self.master_port() > 0 and len(up) >= 1

    def master_port(self) -> int:
        """The master's port as the sentinel reports it now."""
        with client(self.sentinel.port) as s:
            _, port = s.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
        return int(port)

    def server(self, port: int) -> _DataServer:
        return next(s for s in self.data if s.port == port)

    def role(self, port: int) -> str:
        with client(port) as c:
            info: dict[str, Any] = c.info("replication")
        return str(info["role"])

    def wait_replicated(self, timeout_ms: int = 5000) -> None:
        """Block until the master's writes so far reached the replica (WAIT on the master
        after a no-op write on the same connection)."""
        with client(self.master_port()) as c:
            c.set("aiolock-test:replication-probe", "1")
            acked = c.execute_command("WAIT", 1, timeout_ms)
        if int(acked) < 1:
            raise RuntimeError("the replica did not acknowledge")

    def cut_replication(self) -> None:
        """From now on the master's writes do not reach the replica (the replication user
        is switched off and the replica's link killed); :meth:`restore_replication` undoes."""
        with client(self.master_port()) as c:
            c.execute_command("ACL", "SETUSER", REPL_USER, "off")
            c.execute_command("CLIENT", "KILL", "TYPE", "replica")
        replica = next(s for s in self.data if s.port != self.master_port())
        wait_for("the replication link to go down",
                 lambda: client(replica.port).info("replication")["master_link_status"] == "down")

    def restore_replication(self) -> None:
        for server in self.data:
            with contextlib.suppress(redis.RedisError), client(server.port) as c:
                c.execute_command("ACL", "SETUSER", REPL_USER, "on")

    def failover(self, timeout: float = 30.0) -> int:
        """``SENTINEL FAILOVER``: the replica becomes master. Returns once the sentinel
        names the new master and that server says it is master; returns its port."""
        old = self.master_port()
        with client(self.sentinel.port) as s:
            s.execute_command("SENTINEL", "FAILOVER", SERVICE)
        return self.wait_new_master(old, timeout)

    def kill_master(self, timeout: float = 30.0) -> int:
        """SIGKILL the master; returns the port of the replica the sentinel promotes."""
        old = self.master_port()
        self.server(old).kill()
        return self.wait_new_master(old, timeout)

    def wait_new_master(self, old: int, timeout: float = 30.0) -> int:
        """Wait until the failover away from ``old`` is over: the sentinel switched its
        configuration (what ``SENTINEL MASTERS`` reports, which redis-py asks) to a
        server that says it is master. Returns that server's port."""
        wait_for("the sentinel to promote a new master and switch to it",
                 lambda: self._switched(old), timeout)
        return self.master_port()

    def _switched(self, old: int) -> bool:
        with client(self.sentinel.port) as s:
            state = s.execute_command("SENTINEL", "MASTER", SERVICE)
        if isinstance(state, list):
            state = dict(zip(state[::2], state[1::2], strict=True))
        port = int(state["port"])
        flags = str(state["flags"])
        return (port != old and self.master_port() == port and "failover" not in flags
                and self.role(port) == "master")

    def wait_demoted(self, port: int, timeout: float = 30.0) -> None:
        """Wait until the old master at ``port`` replicates from the new one."""
        wait_for(f"127.0.0.1:{port} to become a replica", lambda: self._link_up(port), timeout)

    def close(self) -> None:
        for server in (self.sentinel, self.replica, self.master):
            server.close()
