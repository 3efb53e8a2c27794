"""A standalone ZooKeeper server (Debian's ``zookeeper`` package) for the tests.

Nothing is installed here: the server runs from the jars under ``/usr/share/java`` (the
``zookeeper.jar`` manifest names its dependencies) as our own child process, on a free
loopback port, with a temporary ``dataDir``, the admin server disabled and the four-letter
commands allowed. ``kill()`` / ``restart()`` / ``pause()`` / ``resume()`` drive fault tests.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from .servers import ServerProcess

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


if __name__ == "__main__":  # manual use: python -m tests.zk_server
    server = ZooKeeperServer().start()
    print(server.url, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
