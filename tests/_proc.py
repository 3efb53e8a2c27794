"""Generic helpers for the test servers' processes (:mod:`tests.servers` has the one
server class): a bounded poll, a group of members (a cluster, an ensemble), and the
``python -m tests.x_server`` entry point."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["Member", "ServerGroup", "poll", "serve_forever"]

T = TypeVar("T")


def poll(check: Callable[[], T | None], *, timeout: float, what: str, interval: float = 0.1) -> T:
    """Call ``check`` until it returns something other than None or False; raise
    RuntimeError saying ``what`` did not happen within ``timeout`` seconds. ``check``
    may raise to give up at once (a process that exited)."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result is not None and result is not False:
            return result
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {timeout}s")
        time.sleep(interval)


class Member(Protocol):
    proc: Any

    def kill(self) -> None: ...

    def close(self) -> None: ...


M = TypeVar("M", bound=Member)


class ServerGroup(Generic[M]):
    """Several server processes run together (a cluster, an ensemble): which run, kill
    one (``kill -9``, its data stays), close them all."""

    members: Sequence[M]

    def running(self, i: int) -> bool:
        proc = self.members[i].proc
        return proc is not None and proc.poll() is None

    def kill(self, i: int) -> None:
        """``kill -9`` member ``i`` (its data stays, for a restart)."""
        self.members[i].kill()

    def close(self) -> None:
        for member in self.members:
            member.close()


def serve_forever(server: Any) -> None:
    """``python -m tests.x_server``: start ``server``, print its URL, run until Ctrl-C."""
    server.start()
    print(server.url, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
