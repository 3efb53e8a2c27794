"""A private PostgreSQL server for the tests: ``initdb`` into a temp dir, ``postgres`` on a
free loopback port with trust authentication, and a database ``aiolock``.

Never the system server on 5432: every server here is our own child process, run as the
``postgres`` user when we are root (``initdb`` and ``postgres`` refuse to run as root),
killed at the end. Needs Debian's ``postgresql`` package (binaries under
``/usr/lib/postgresql/<version>/bin``) or ``initdb`` / ``postgres`` on ``PATH``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from .db_server import DatabaseServer
from .servers import wait_port

__all__ = ["PostgresServer", "find_pg_bin"]


def find_pg_bin() -> Path | None:
    """The directory holding ``initdb`` and ``postgres`` (newest Debian version first)."""
    env = os.environ.get("AIOLOCK_PG_BIN")
    if env:
        return Path(env)
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version, reverse=True):
        if os.path.exists(os.path.join(candidate, "initdb")):
            return Path(candidate)
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _version(path: str) -> float:
    try:
        return float(Path(path).parent.name)
    except ValueError:
        return 0.0


class PostgresServer(DatabaseServer):
    """A ``postgres`` child process on a free loopback port; ``url`` points at it."""

    account = "postgres"
    restart_signal = close_signal = signal.SIGINT  # fast shutdown: every session is terminated

    def __init__(self, *, port: int | None = None, database: str = "aiolock") -> None:
        bin_dir = find_pg_bin()
        if bin_dir is None:
            raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql)")
        super().__init__(port=port, database=database, prefix="aiolock-pg-")
        self.bin = bin_dir
        self.user = self.os_user  #: the database superuser, named as the account
        self._initdb()

    @property
    def url(self) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{self.database}"

    def _cmd(self, *args: str) -> list[str]:
        return list(args)

    def _as_user(self) -> dict[str, object]:
        """Popen arguments that drop to the ``postgres`` user when we are root (so the
        child is ``postgres`` itself and signals reach it, no ``runuser`` in between)."""
        return {"user": "postgres", "group": "postgres", "extra_groups": []} if self._as_root else {}

    def _initdb(self) -> None:
        subprocess.run(
            self._cmd(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", self.user,
                      "-E", "UTF8", "--no-sync"),
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=self.dir,
            **self._as_user(),  # type: ignore[call-overload]
        )

    def command(self) -> list[str]:
        return self._cmd(
            str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port),
            "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.dir}",
            "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
            "-c", "max_connections=200", "-c", "logging_collector=off",
        )

    def popen_options(self) -> dict[str, Any]:
        log = open(self.dir / "postgres.log", "ab")  # noqa: SIM115 -- closed by start()
        return {"stdout": log, "stderr": log, "start_new_session": True, "cwd": self.dir,
                **self._as_user()}

    def wait_ready(self) -> None:
        wait_port(self.port, 30)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            done = subprocess.run(
                self._cmd(str(self.bin / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U",
                          self.user, "-d", "postgres", "-tAc",
                          f"SELECT 1 FROM pg_database WHERE datname = '{self.database}'"),
                capture_output=True, text=True, cwd=self.dir, **self._as_user(),
            )
            if done.returncode == 0:
                if done.stdout.strip() != "1":
                    subprocess.run(
                        self._cmd(str(self.bin / "createdb"), "-h", "127.0.0.1", "-p",
                                  str(self.port), "-U", self.user, self.database),
                        check=True, capture_output=True, cwd=self.dir, **self._as_user(),
                    )
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"postgres did not become ready: {done.stderr}")
            time.sleep(0.05)

    def after_stop(self, sig: int) -> None:
        if sig == signal.SIGKILL:
            self._reap_children()

    def _reap_children(self) -> None:
        """After a SIGKILL of the postmaster its backends exit on their own (they watch
        for postmaster death); a restart must wait for them, as they keep the shared
        memory. They are the processes whose working directory is the data directory."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self._children():
            time.sleep(0.02)

    def _children(self) -> list[int]:
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{entry}/cwd") == str(self.data):
                        found.append(int(entry))
        return found

