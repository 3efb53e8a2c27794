"""``aiolock top``, as a person sees it.

The main test runs the real command in a pseudo-terminal (tmux, ``capture-pane``) against
the test PostgreSQL -- a backend whose ``scan`` sees every process's locks -- while this
process takes and releases locks, and reads the screen: names and holder data appear,
disappear and change hands, ``q`` quits with exit 0. The others drive the view in-process
on ``memory://`` and render it to a recording console.
"""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("rich")
from rich.console import Console

import aiolock
from aiolock._top import TopView, watch
from aiolock.cli import main as cli_main

from .pg_server import PostgresServer

ROOT = Path(__file__).resolve().parent.parent


class Tmux:
    """One tmux server of our own (its own socket), one window running ``command``."""

    def __init__(self, command: str, env: dict[str, str]) -> None:
        self.socket = f"aiolock-top-{uuid.uuid4().hex[:8]}"
        exports = " ".join(f"{k}={v}" for k, v in env.items())
        # after top exits, its status stays on the (normal) screen for capture-pane
        script = f"env {exports} {command}; echo \"top exited $?\"; sleep 60"
        self.tmux("new-session", "-d", "-x", "150", "-y", "40", "-s", "top", script)

    def tmux(self, *args: str) -> str:
        done = subprocess.run(["tmux", "-u", "-L", self.socket, *args], capture_output=True,
                              text=True, timeout=10, env={**os.environ, "LANG": "C.UTF-8"})
        assert done.returncode == 0, done.stderr
        return done.stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "top")

    def wait_for(self, check: Callable[[str], bool], what: str, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.screen()
            if check(text):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"screen never showed {what}:\n{text}")
            time.sleep(0.1)

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=10)


@pytest.fixture
def pg(postgres_server: PostgresServer) -> PostgresServer:
    pytest.importorskip("asyncpg")
    return postgres_server


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)")
async def test_top_in_a_terminal(pg: PostgresServer) -> None:
    prefix = f"top{uuid.uuid4().hex[:6]}:"
    tmux = Tmux(f"{sys.executable} -m aiolock top --interval 0.2 {prefix}", {
        "PYTHONPATH": str(ROOT), "AIOLOCK_URL": pg.url, "LANG": "C.UTF-8", "TERM": "xterm-256color",
    })
    loop = asyncio.get_running_loop()

    async def wait_for(check: Callable[[str], bool], what: str) -> str:
        return await loop.run_in_executor(None, tmux.wait_for, check, what)

    try:
        await wait_for(lambda s: "aiolock top" in s and "(nothing held)" in s, "an empty view")
        async with aiolock.connect(pg.url) as locks:
            lease = await locks.lock(f"{prefix}orders", ttl=5, data="holder-data-42").acquire()
            read = await locks.rwlock(f"{prefix}catalog").read().acquire()
            other = await locks.lock("not-under-the-prefix", ttl=5).acquire()
            screen = await wait_for(lambda s: "holder-data-42" in s and f"{prefix}catalog" in s,
                                    "the held names")
            row = next(line for line in screen.splitlines() if f"{prefix}orders" in line)
            assert "lock" in row and str(lease.token) in row and f":{os.getpid()}" in row
            assert "█" in row and "s" in row  # the lease bar and the seconds left
            assert "not-under-the-prefix" not in screen
            assert "2 held" in screen

            await read.release()
            screen = await wait_for(lambda s: "gone" in s, "the released read lock as gone")
            assert f"{prefix}catalog  rwlock  gone: released, revoked or expired" in screen
            # a new holder of the same name: the token changes hands
            await lease.release()
            again = await locks.lock(f"{prefix}orders", ttl=5, data="second-holder").acquire()
            screen = await wait_for(lambda s: "second-holder" in s, "the second holder")
            await again.release()
            await other.release()
            screen = await wait_for(lambda s: "(nothing held)" in s, "the empty view again")
            assert "Recent changes" in screen and f"{prefix}orders" in screen

        tmux.tmux("send-keys", "-t", "top", "q")
        await wait_for(lambda s: "top exited 0" in s, "top exiting 0 on q")
    finally:
        tmux.close()


async def test_view_on_memory_shows_holders_waiters_and_changes() -> None:
    async with aiolock.connect(f"memory://top-{uuid.uuid4().hex}") as locks:
        view = TopView(locks.url, "jobs:", 0.05)
        lease = await locks.lock("jobs:a", ttl=0.4, watchdog=False, data="doing a").acquire()
        sem = await locks.semaphore("jobs:gpu", 2, data="slot one").acquire()
        waiter = asyncio.create_task(locks.lock("jobs:a", fair=True).acquire())
        await asyncio.sleep(0.05)
        view.update([i async for i in locks.scan("jobs:")])
        text = _render(view)
        a_row = next(line for line in text.splitlines() if line.startswith("jobs:a"))
        assert "'doing a'" in a_row and "lock" in a_row and " 1 " in a_row  # one waiter
        assert "'slot one'" in text and "semaphore" in text
        assert "2 held, 1 waiting" in text
        await asyncio.sleep(0.45)  # jobs:a expires; the waiter gets it: a new token
        lease2 = await waiter
        assert lease.lost
        view.update([i async for i in locks.scan("jobs:")])
        await sem.release()
        view.update([i async for i in locks.scan("jobs:")])
        text = _render(view)
        assert "jobs:a  lock  token 1 -> 2: changed hands" in text
        assert "jobs:gpu  semaphore  gone: released, revoked or expired" in text
        await lease2.release()
        await asyncio.sleep(0.01)
        view.update([], now=time.monotonic() + 100)  # long after its lease would have run out
        assert "jobs:a  lock  token 2 gone: expired" in _render(view)


async def test_watch_refreshes_until_quit() -> None:
    console = Console(file=io.StringIO(), width=120, record=True, force_terminal=True)
    async with aiolock.connect(f"memory://top-{uuid.uuid4().hex}") as locks:
        quit = asyncio.Event()
        task = asyncio.create_task(watch(locks, TopView(locks.url, "", 0.02), console, quit, screen=False))
        async with locks.lock("watched", data="live"):
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.1)
        quit.set()
        assert await asyncio.wait_for(task, 2) == 0
    text = console.export_text()
    assert "'live'" in text and "gone" in text


def test_top_refuses_a_backend_that_cannot_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["top", "--url", "memcached://127.0.0.1:1"]) == 2
    assert "cannot list its locks" in capsys.readouterr().err
    assert cli_main(["top", "--url", "memory://", "--interval", "0"]) == 2
    assert "--interval" in capsys.readouterr().err


def _render(view: TopView) -> str:
    console = Console(file=io.StringIO(), width=140, record=True)
    console.print(view.render())
    return console.export_text()
