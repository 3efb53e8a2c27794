"""A private redis-server for the benchmarks, and two ways of counting what it was asked.

:class:`RedisServer` starts Debian's ``/usr/bin/redis-server`` on a free loopback port,
in a temporary directory, without persistence (``--save "" --appendonly no``), and
kills it and removes the directory at the end. It never touches a Redis someone else
started (such as the system one on port 6379).

Counting requests, from the server:

* :func:`command_stats` reads ``INFO commandstats``. Its ``calls`` include the commands
  that Lua scripts run *inside* an ``EVALSHA`` (an ``EVALSHA`` whose script calls
  ``GET`` and ``DEL`` adds 3), so it measures server work rather than round trips.
* :class:`RequestCounter` counts round trips: it attaches ``redis-cli monitor`` (a
  separate process, writing to a file) and counts the commands that clients sent,
  leaving out the ones MONITOR tags as run by Lua (``[0 lua]``) and the ones sent by the
  benchmark's own admin connection. MONITOR costs the server some work, so the
  benchmarks use it in separate, shorter passes, never while timing throughput.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Self

__all__ = ["RedisServer", "RequestCounter", "command_stats", "free_port"]

REDIS_SERVER = "/usr/bin/redis-server"
REDIS_CLI = "/usr/bin/redis-cli"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A redis-server child process on a free loopback port; use it as a context manager."""

    def __init__(self, exe: str = REDIS_SERVER) -> None:
        if not Path(exe).exists():
            raise RuntimeError(f"{exe} not found (apt-get install redis-server)")
        self.exe = exe
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="aiolock-bench-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def version(self) -> str:
        out = subprocess.run([self.exe, "--version"], capture_output=True, text=True, check=True)
        match = re.search(r"v=(\S+)", out.stdout)
        return match.group(1) if match else out.stdout.strip()

    def start(self) -> Self:
        args = [
            self.exe, "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.dir), "--save", "", "--appendonly", "no",
            "--daemonize", "no", "--logfile", str(self.dir / "redis.log"),
            "--maxclients", "1000",
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited at start; see {self.dir}/redis.log")
            with contextlib.suppress(OSError), socket.create_connection(
                ("127.0.0.1", self.port), 0.2
            ) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within 10 s")

    def stop(self) -> None:
        """Kill the server (nothing to save) and remove its directory."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def command_stats(client: Any) -> Counter[str]:
    """``INFO commandstats`` as ``{command: calls}``, from a ``redis.asyncio`` client."""
    raw = await client.execute_command("INFO", "commandstats")
    if isinstance(raw, bytes):
        raw = raw.decode()
    if isinstance(raw, dict):  # redis-py parsed it
        return Counter({k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in raw.items()})
    calls: Counter[str] = Counter()
    for line in raw.splitlines():
        match = re.match(r"cmdstat_([^:]+):calls=(\d+)", line)
        if match:
            calls[match.group(1)] = int(match.group(2))
    return calls


def stats_delta(before: Counter[str], after: Counter[str]) -> Counter[str]:
    """Calls per command between two :func:`command_stats`, without the INFOs themselves."""
    delta = Counter({cmd: after[cmd] - before.get(cmd, 0) for cmd in after})
    delta.pop("info", None)
    return +delta  # drops zeros


class RequestCounter:
    """Counts the requests clients send to the server while the ``async with`` block runs.

    ``admin`` is the benchmark's own ``redis.asyncio`` client (its requests are left out).
    After the block, :attr:`requests` holds ``{command: count}`` of top-level requests.
    """

    def __init__(self, server: RedisServer, admin: Any) -> None:
        self.server = server
        self.admin = admin
        self.requests: Counter[str] = Counter()
        self._file = server.dir / f"monitor-{uuid.uuid4().hex}.log"
        self._marker = uuid.uuid4().hex
        self._proc: subprocess.Popen[bytes] | None = None

    async def __aenter__(self) -> Self:
        info = await self.admin.execute_command("CLIENT", "INFO")
        if isinstance(info, bytes):
            info = info.decode()
        self._admin_addr = re.search(r"addr=(\S+)", info).group(1)  # type: ignore[union-attr]
        self._start_monitor()
        await self._wait_for(lambda text: text.startswith("OK"), "MONITOR to attach")
        await self.admin.echo(f"start-{self._marker}")
        await self._wait_for(lambda text: f"start-{self._marker}" in text, "the start marker")
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.admin.echo(f"end-{self._marker}")
            await self._wait_for(lambda text: f"end-{self._marker}" in text, "the end marker")
        finally:
            if self._proc is not None:
                self._proc.terminate()
                self._proc.wait(10)
        self.requests = self._count()
        self._file.unlink(missing_ok=True)

    def _start_monitor(self) -> None:
        with open(self._file, "wb") as out:
            self._proc = subprocess.Popen(
                [REDIS_CLI, "-p", str(self.server.port), "monitor"],
                stdout=out, stderr=subprocess.DEVNULL,
            )

    def _peek(self) -> tuple[str, str]:
        """The head (for MONITOR's "OK") and the tail (for markers) of the output so far."""
        with open(self._file, "rb") as f:
            head = f.read(16).decode(errors="replace")
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 4096))
            return head, f.read().decode(errors="replace")

    async def _wait_for(self, ready: Any, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(ready(text) for text in self._peek()):
                return
            await asyncio.sleep(0.02)
        raise RuntimeError(f"timed out waiting for {what} in {self._file}")

    def _count(self) -> Counter[str]:
        # a line: 1700000000.123456 [0 127.0.0.1:40000] "evalsha" "..." ...
        line_re = re.compile(rb'^\d+\.\d+ \[\d+ ([^\]]+)\] "([^"]*)"')
        admin = self._admin_addr.encode()
        counts: Counter[str] = Counter()
        started = False
        with open(self._file, "rb") as f:
            for line in f:
                match = line_re.match(line)
                if match is None:
                    continue
                source, command = match.groups()
                if source == admin:
                    text = line.decode(errors="replace")
                    if f"start-{self._marker}" in text:
                        started = True
                    elif f"end-{self._marker}" in text:
                        break
                    continue
                if started and source != b"lua":
                    counts[command.decode(errors="replace").lower()] += 1
        return counts
