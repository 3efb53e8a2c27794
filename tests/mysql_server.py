"""A private MariaDB server for the tests: ``mariadb-install-db`` into a temp dir, ``mariadbd``
on a free loopback port with its own socket, a database ``aiolock`` and a user with a
password (grant tables on: refused credentials are a real test).

Never the system server on 3306: every server here is our own child process, run as the
``mysql`` user when we are root, killed at the end. Needs Debian's ``mariadb-server``
package (``/usr/sbin/mariadbd``, ``mariadb-install-db``, the ``mariadb`` client).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from typing import Any

from .db_server import DatabaseServer
from .servers import wait_port

__all__ = ["MariaDBServer", "find_mariadbd"]

USER = "aiolock"
PASSWORD = "s3cret-pw"


def find_mariadbd() -> str | None:
    """The server binary (``$AIOLOCK_MARIADBD``, ``/usr/sbin/mariadbd`` or on ``PATH``)."""
    env = os.environ.get("AIOLOCK_MARIADBD")
    if env:
        return env
    for candidate in ("/usr/sbin/mariadbd", shutil.which("mariadbd"), "/usr/sbin/mysqld"):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


class MariaDBServer(DatabaseServer):
    """A ``mariadbd`` child process on a free loopback port; ``url`` points at it."""

    account = "mysql"
    restart_signal = close_signal = signal.SIGKILL  # a crash: InnoDB recovers committed tokens

    def __init__(self, *, port: int | None = None, database: str = "aiolock") -> None:
        exe = find_mariadbd()
        install = shutil.which("mariadb-install-db") or shutil.which("mysql_install_db")
        client = shutil.which("mariadb") or shutil.which("mysql")
        if exe is None or install is None or client is None:
            raise RuntimeError("MariaDB is not installed (apt-get install mariadb-server)")
        super().__init__(port=port, database=database, prefix="aiolock-mariadb-")
        self.exe = exe
        self.client = client
        self.socket = self.dir / "mysqld.sock"
        done = subprocess.run(
            [install, "--no-defaults", f"--datadir={self.data}", f"--user={self.os_user}",
             "--auth-root-authentication-method=normal", "--skip-test-db", "--skip-name-resolve",
             # its bootstrap server's temporary tables too (concurrent installs sharing
             # /tmp failed: "Could not remove temporary table: '/tmp/#sql-temptable-...'")
             f"--tmpdir={self.dir}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=self.dir, text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{install} failed ({done.returncode}): {done.stderr[-2000:]}")
        self._created = False

    @property
    def url(self) -> str:
        """``mysql://aiolock:PASSWORD@127.0.0.1:PORT/aiolock``."""
        return f"mysql://{USER}:{PASSWORD}@127.0.0.1:{self.port}/{self.database}"

    def command(self) -> list[str]:
        return [
            self.exe, "--no-defaults", f"--datadir={self.data}", f"--socket={self.socket}",
            f"--port={self.port}", "--bind-address=127.0.0.1", f"--user={self.os_user}",
            f"--pid-file={self.dir / 'mysqld.pid'}", f"--log-error={self.dir / 'mariadb.log'}",
            # a temporary directory of its own: servers sharing /tmp removed each other's
            # temporary tables ("Error on delete of '/tmp/#sql-temptable-...'")
            f"--tmpdir={self.dir}",
            "--skip-name-resolve", "--innodb-flush-log-at-trx-commit=2",
            "--innodb-buffer-pool-size=32M", "--innodb-log-file-size=16M", "--max-connections=300",
            "--skip-log-bin", "--performance-schema=OFF", "--innodb-fast-shutdown=2",
        ]

    def popen_options(self) -> dict[str, Any]:
        return {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL,
                "start_new_session": True, "cwd": self.dir}

    def sql(self, statement: str) -> str:
        """Run ``statement`` as root over the private socket; its output (tab-separated)."""
        done = subprocess.run(
            [self.client, "--no-defaults", f"--socket={self.socket}", "-uroot", "-N", "-B",
             "-e", statement],
            capture_output=True, text=True, timeout=30,
        )
        if done.returncode != 0:
            raise RuntimeError(f"mariadb {statement!r} failed: {done.stderr.strip()}")
        return done.stdout

    def wait_ready(self) -> None:
        wait_port(self.port, 60)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.sql("SELECT 1")
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        if not self._created:
            self.sql(
                f"CREATE DATABASE IF NOT EXISTS `{self.database}`;"
                f" CREATE USER IF NOT EXISTS '{USER}'@'127.0.0.1' IDENTIFIED BY '{PASSWORD}';"
                f" GRANT ALL ON `{self.database}`.* TO '{USER}'@'127.0.0.1';"
            )
            self._created = True
