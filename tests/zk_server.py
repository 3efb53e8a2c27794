"""ZooKeeper servers (Debian's ``zookeeper`` package) for the tests: standalone, or a
small ensemble on loopback.

Nothing is installed here: the server runs from the jars under ``/usr/share/java`` (the
``zookeeper.jar`` manifest names its dependencies) as our own child process, on a free
loopback port, with a temporary ``dataDir``, the admin server disabled and the four-letter
commands allowed. ``kill()`` / ``restart()`` / ``pause()`` / ``resume()`` drive fault tests.

:class:`ZooKeeperEnsemble` runs ``size`` quorum peers (3 by default) on loopback ports,
with a short ``tickTime`` and ``initLimit``/``syncLimit`` so that a leader election after a
``kill(i)`` takes a few seconds; ``leader_index()``, ``kill(i)`` and ``restart(i)`` drive
failover tests.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Self

from ._proc import ServerGroup, serve_forever
from .servers import ServerProcess, free_port

JAVA_DIR = Path("/usr/share/java")


def zookeeper_classpath() -> str | None:
    """The classpath of Debian's ZooKeeper server, or None when it is not installed."""
    main = JAVA_DIR / "zookeeper.jar"
    if not main.exists() or shutil.which("java") is None:
        return None
    jars = [main]
    # the jar's manifest lists its dependencies; add a logging binding (quiet, to a file)
    for extra in ("zookeeper-jute.jar", "slf4j-api.jar", "slf4j-simple.jar"):
        if (JAVA_DIR / extra).exists():
            jars.append(JAVA_DIR / extra)
    return ":".join(str(j) for j in jars)


def four_letter(port: int, cmd: str, timeout: float = 1.0) -> str:
    """Send a four-letter command (``ruok``, ``srvr``, ``cons``...) and return the reply."""
    with socket.create_connection(("127.0.0.1", port), timeout) as s:
        s.sendall(cmd.encode())
        chunks = []
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


#: the ``mntr`` counters of triggered watchers, one per kind of watch
WATCH_METRICS = tuple(f"zk_sum_node_{e}_watch_count" for e in ("created", "deleted", "changed", "children"))


def packets_and_watches(port: int) -> tuple[int, int]:
    """(requests received, watchers triggered) so far, from ``mntr``: on a private
    standalone server, what the clients under test caused (pings included)."""
    stats = dict(line.partition("\t")[::2] for line in four_letter(port, "mntr", 2.0).splitlines())
    return int(stats["zk_packets_received"]), sum(int(stats[k]) for k in WATCH_METRICS)


class ZooKeeperServer(ServerProcess):
    """A standalone ZooKeeper server child process on a free loopback port."""

    def __init__(self, *, tick_ms: int = 200, port: int | None = None,
                 min_session_ms: int = 400, max_session_ms: int = 60_000) -> None:
        cp = zookeeper_classpath()
        if cp is None:
            raise RuntimeError("ZooKeeper is not installed (apt-get install zookeeper; needs java)")
        super().__init__(port=port, prefix="aiolock-zk-")
        self.classpath = cp
        self.tick_ms = tick_ms
        self.min_session_ms = min_session_ms
        self.max_session_ms = max_session_ms

    @property
    def hosts(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"zookeeper://127.0.0.1:{self.port}/aiolock-test"

    def fresh_url(self) -> str:
        """A URL with a chroot of its own: nothing a test leaves behind disturbs another."""
        return f"zookeeper://127.0.0.1:{self.port}/aiolock-{uuid.uuid4().hex[:8]}"

    def _write_config(self) -> Path:
        data = self.dir / "data"
        data.mkdir(exist_ok=True)
        cfg = self.dir / "zoo.cfg"
        cfg.write_text(
            f"tickTime={self.tick_ms}\n"
            f"dataDir={data}\n"
            f"clientPort={self.port}\n"
            "clientPortAddress=127.0.0.1\n"
            f"minSessionTimeout={self.min_session_ms}\n"
            f"maxSessionTimeout={self.max_session_ms}\n"
            "maxClientCnxns=0\n"
            "admin.enableServer=false\n"
            "4lw.commands.whitelist=*\n"
            "forceSync=no\n"
            "autopurge.purgeInterval=0\n"
        )
        return cfg

    def command(self) -> list[str]:
        return [
            "java", "-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
            "-Dzookeeper.admin.enableServer=false", "-Dzookeeper.4lw.commands.whitelist=*",
            "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
            "-cp", self.classpath, "org.apache.zookeeper.server.quorum.QuorumPeerMain",
            str(self._write_config()),
        ]

    def popen_options(self) -> dict[str, Any]:
        log = open(self.dir / "zookeeper.log", "ab")  # noqa: SIM115 -- closed by start()
        return {"stdout": log, "stderr": subprocess.STDOUT}

    def wait_ready(self, timeout: float = 30.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"ZooKeeper exited with {self.proc.returncode}; see {self.dir / 'zookeeper.log'}"
                )
            with contextlib.suppress(OSError):
                if "Mode:" in four_letter(self.port, "srvr", 0.5):
                    return
            time.sleep(0.1)
        raise RuntimeError(f"ZooKeeper did not come up on 127.0.0.1:{self.port} within {timeout}s")

    # restart() keeps the port and data: sessions survive if the server is back in time


def server_mode(port: int, timeout: float = 1.0) -> str | None:
    """``leader``, ``follower``, ``standalone``...: the ``Mode:`` line of ``srvr``; None if
    the server does not answer or does not serve (no quorum: "not currently serving")."""
    try:
        reply = four_letter(port, "srvr", timeout)
    except OSError:
        return None
    for line in reply.splitlines():
        if line.startswith("Mode:"):
            return line.partition(":")[2].strip()
    return None


class _QuorumPeer(ZooKeeperServer):
    """One member of a :class:`ZooKeeperEnsemble` (its ``wait_ready`` only checks that the
    process runs: a peer serves once a quorum has formed, which the ensemble waits for)."""

    def __init__(self, ensemble: ZooKeeperEnsemble, myid: int, port: int) -> None:
        super().__init__(tick_ms=ensemble.tick_ms, port=port,
                         min_session_ms=ensemble.min_session_ms,
                         max_session_ms=ensemble.max_session_ms)
        self.ensemble = ensemble
        self.myid = myid

    def _write_config(self) -> Path:
        cfg = super()._write_config()
        data = self.dir / "data"
        (data / "myid").write_text(f"{self.myid}\n")
        e = self.ensemble
        servers = "".join(f"server.{i + 1}=127.0.0.1:{q}:{el}\n"
                          for i, (q, el) in enumerate(zip(e.quorum_ports, e.election_ports, strict=True)))
        with cfg.open("a") as fh:
            fh.write(f"initLimit={e.init_limit}\nsyncLimit={e.sync_limit}\n"
                     "quorumListenOnAllIPs=false\nreconfigEnabled=false\n" + servers)
        return cfg

    def command(self) -> list[str]:
        cmd = super().command()
        # connect to a dead peer's election port fails fast on loopback anyway; keep the
        # election's connect timeout short for the case it does not
        cmd.insert(1, "-Dzookeeper.cnxTimeout=1000")
        return cmd

    def wait_ready(self, timeout: float = 30.0) -> None:
        assert self.proc is not None
        time.sleep(0.05)
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"ZooKeeper peer {self.myid} exited with {self.proc.returncode}; "
                f"see {self.dir / 'zookeeper.log'}"
            )


class ZooKeeperEnsemble(ServerGroup["_QuorumPeer"]):
    """``size`` ZooKeeper quorum peers on loopback, each our own child process.

    ``ZooKeeperEnsemble(size=3).start()`` returns once a quorum serves (one leader, the
    others followers, as ``srvr`` reports). Peers are numbered 0..size-1 (myid = i + 1);
    :attr:`hosts` is the connect string; :meth:`kill` (``kill -9``) and :meth:`restart`
    (same ports and data) drive failover tests. ``tickTime`` is 200 ms, ``initLimit`` 10
    and ``syncLimit`` 5 ticks: a new leader is elected and serving within a few seconds.
    """

    def __init__(self, size: int = 3, *, tick_ms: int = 200, init_limit: int = 10,
                 sync_limit: int = 5, min_session_ms: int = 400,
                 max_session_ms: int = 60_000) -> None:
        if size < 1:
            raise ValueError("an ensemble needs at least one server")
        self.size = size
        self.tick_ms = tick_ms
        self.init_limit = init_limit
        self.sync_limit = sync_limit
        self.min_session_ms = min_session_ms
        self.max_session_ms = max_session_ms
        self.peers: list[_QuorumPeer] = []
        self._new_peers()

    def _new_peers(self) -> None:
        """Fresh ports (client, quorum, election: all distinct) and peers using them."""
        size = self.size
        self.client_ports = self._distinct_ports(size)
        self.quorum_ports = self._distinct_ports(size, avoid=self.client_ports)
        self.election_ports = self._distinct_ports(size, avoid=self.client_ports + self.quorum_ports)
        self.peers = [_QuorumPeer(self, i + 1, port) for i, port in enumerate(self.client_ports)]
        self.members = self.peers

    @staticmethod
    def _distinct_ports(n: int, avoid: list[int] | None = None) -> list[int]:
        ports: list[int] = []
        taken = set(avoid or ())
        while len(ports) < n:
            port = free_port()
            if port not in taken:
                taken.add(port)
                ports.append(port)
        return ports

    @property
    def hosts(self) -> str:
        """``127.0.0.1:p1,127.0.0.1:p2,...``: every peer's client port."""
        return ",".join(f"127.0.0.1:{p}" for p in self.client_ports)

    def url(self, chroot: str = "/aiolock-test") -> str:
        """``zookeeper://<hosts><chroot>``."""
        return f"zookeeper://{self.hosts}{chroot}"

    def start(self, timeout: float = 60.0, attempts: int = 3) -> Self:
        """Start every peer; return once a quorum serves.

        A peer that exits at once has usually lost one of its ports to another process
        (they are picked free, then bound by the JVM seconds later): then the ensemble
        starts again on fresh ports, up to ``attempts`` times.
        """
        for attempt in range(1, attempts + 1):
            try:
                for peer in self.peers:
                    peer.start()
                self.wait_quorum(timeout)
                return self
            except RuntimeError as exc:
                tail = self._log_tails()
                self.close()
                if attempt == attempts:
                    raise RuntimeError(f"{exc}\n{tail}") from exc
                self._new_peers()
            except BaseException:
                self.close()
                raise
        raise AssertionError("unreachable")

    def _log_tails(self, lines: int = 5) -> str:
        out = []
        for i, peer in enumerate(self.peers):
            with contextlib.suppress(OSError):
                text = (peer.dir / "zookeeper.log").read_text(errors="replace").splitlines()
                errors = [ln for ln in text if "ERROR" in ln or "Exception" in ln][-lines:]
                if errors:
                    out.append(f"peer {i}: " + " | ".join(errors))
        return "\n".join(out)

    def modes(self) -> list[str | None]:
        """Each peer's ``Mode`` (``leader``/``follower``), None if down or not serving."""
        return [server_mode(p.port, 0.5) if self.running(i) else None
                for i, p in enumerate(self.peers)]

    def wait_quorum(self, timeout: float = 60.0) -> None:
        """Wait until a leader serves and every running peer is leader or follower."""
        deadline = time.monotonic() + timeout
        while True:
            modes = self.modes()
            live = [m for i, m in enumerate(modes) if self.running(i)]
            if live.count("leader") == 1 and all(m in ("leader", "follower") for m in live):
                return
            for i, peer in enumerate(self.peers):
                proc = peer.proc
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"ZooKeeper peer {i} exited with {proc.returncode}; "
                                       f"see {peer.dir / 'zookeeper.log'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no ZooKeeper quorum within {timeout}s (modes {modes})")
            time.sleep(0.1)

    def leader_index(self, timeout: float = 30.0) -> int:
        """The index of the peer that is leader now (waits for an election to finish)."""
        deadline = time.monotonic() + timeout
        while True:
            modes = self.modes()
            if "leader" in modes:
                return modes.index("leader")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no ZooKeeper leader within {timeout}s (modes {modes})")
            time.sleep(0.1)

    def restart(self, i: int, timeout: float = 60.0) -> None:
        """Start peer ``i`` again (after :meth:`kill`, or killing it first); return once it
        serves again as leader or follower."""
        peer = self.peers[i]
        if self.running(i):
            peer.kill()
        peer.start()
        deadline = time.monotonic() + timeout
        while server_mode(peer.port, 0.5) not in ("leader", "follower"):
            if not self.running(i):
                assert peer.proc is not None
                raise RuntimeError(f"ZooKeeper peer {i} exited with {peer.proc.returncode}; "
                                   f"see {peer.dir / 'zookeeper.log'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"ZooKeeper peer {i} did not rejoin within {timeout}s")
            time.sleep(0.1)

if __name__ == "__main__":  # manual use: python -m tests.zk_server
    serve_forever(ZooKeeperServer())
