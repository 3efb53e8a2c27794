"""A private memcached for the tests: our own child process on a free loopback port.

Nothing here talks to a memcached someone started by hand (Debian's package starts one
on 11211 at install; the tests never use it).
"""

from __future__ import annotations

import os
import shutil

from .servers import ServerProcess


class MemcachedServer(ServerProcess):
    """``memcached -l 127.0.0.1 -p <free port>``: start, kill, restart, pause."""

    def __init__(self, *, port: int | None = None, memory_mb: int = 64) -> None:
        super().__init__(port=port, prefix="aiolock-memcached-")
        self.memory_mb = memory_mb

    @property
    def url(self) -> str:
        return f"memcached://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        exe = shutil.which("memcached")
        if exe is None:
            raise RuntimeError("memcached is not installed (apt-get install memcached)")
        args = [exe, "-l", "127.0.0.1", "-p", str(self.port), "-U", "0",
                "-m", str(self.memory_mb), "-c", "1024"]
        if os.geteuid() == 0:
            args += ["-u", "root"]  # memcached refuses to run as root without it
        return args
