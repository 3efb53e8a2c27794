"""``aiolock ls --json``, ``aiolock revoke``, exit codes and errors, and ``aiolock top``
driven in tmux as a person would see it (docs/operations.md)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest

import aiolock

from ..servers import RedisServer, free_port
from .conftest import ROOT, SECRET, cli, cli_env

LS_KEYS = {"name", "kind", "token", "last_token", "ttl_left", "waiters", "holders"}
HOLDER_KEYS = {"host", "pid", "task", "data", "since", "waiting"}  # waiting: since Holder.waiting


def prefix() -> str:
    return f"adv13-{uuid.uuid4().hex[:10]}:"


def no_traceback(text: str) -> None:
    assert "Traceback" not in text, text
    assert 'File "' not in text, text


async def test_ls_json_shape(redis_server: RedisServer) -> None:
    p = prefix()
    url = redis_server.url
    async with aiolock.connect(url) as locks, aiolock.connect(url) as other_conn:
        lock = await locks.lock(p + "a", ttl=20, data="request 7f3a").acquire()
        read = await locks.rwlock(p + "b", ttl=20).read().acquire()
        permit = await locks.semaphore(p + "c", limit=3, ttl=20).acquire()
        other = await locks.lock("elsewhere-" + p, ttl=20).acquire()
        waiter = asyncio.create_task(other_conn.lock(p + "a", ttl=20).acquire())
        await asyncio.sleep(0.3)
        ran = await cli("ls", "--json", "--url", url, p)
        waiter.cancel()
        for lease in (lock, read, permit, other):
            await lease.release()
    assert ran.code == 0, ran.err
    rows = [json.loads(line) for line in ran.out.splitlines() if line.strip()]
    by_name = {r["name"]: r for r in rows}
    assert set(by_name) == {p + "a", p + "b", p + "c"}, ran.out
    for r in rows:
        assert set(r) == LS_KEYS, r
        assert isinstance(r["waiters"], int)
        assert isinstance(r["holders"], list) and r["holders"]
        for h in r["holders"]:
            assert set(h) == HOLDER_KEYS, h
            assert h["host"] == socket.gethostname()
            assert h["pid"] == os.getpid()
            assert isinstance(h["since"], int | float) and 0 <= h["since"] < 30
    a = by_name[p + "a"]
    assert a["kind"] == "lock"
    assert a["token"] == lock.token
    assert a["holders"][0]["data"] == "request 7f3a"
    assert a["waiters"] == 1
    assert isinstance(a["ttl_left"], int | float) and 0 < a["ttl_left"] <= 20
    assert len(by_name[p + "c"]["holders"]) == 1


async def test_ls_counts_waiter_on_holders_connection(redis_server: RedisServer) -> None:
    """One connection per application is the common case: a task of it waiting for a
    lock another of its tasks holds is a waiter, and `ls` must count it."""
    name = prefix() + "w"
    url = redis_server.url
    async with aiolock.connect(url) as locks, locks.lock(name, ttl=20):
        waiters = [asyncio.create_task(locks.lock(name, ttl=20).acquire()) for _ in range(2)]
        await asyncio.sleep(0.3)
        ran = await cli("ls", "--json", "--url", url, name)
        for w in waiters:
            w.cancel()
    assert ran.code == 0, ran.err
    (row,) = [json.loads(line) for line in ran.out.splitlines() if line.strip()]
    assert row["waiters"] == 2, row


async def test_ls_plain_one_line_per_name(redis_server: RedisServer) -> None:
    p = prefix()
    async with aiolock.connect(redis_server.url) as locks:
        leases = [await locks.lock(p + str(i), ttl=20).acquire() for i in range(3)]
        ran = await cli("ls", p, AIOLOCK_URL=redis_server.url)
        for lease in leases:
            await lease.release()
    assert ran.code == 0, ran.err
    for i in range(3):
        assert sum(1 for line in ran.out.splitlines() if line.startswith(p + str(i))) == 1, ran.out


async def test_ls_on_backend_that_cannot_list(memcached_server) -> None:  # type: ignore[no-untyped-def]
    url = f"memcached://127.0.0.1:{memcached_server.port}"
    for cmd in ("ls", "top"):
        ran = await cli(cmd, "--url", url)
        assert ran.code == 2, (cmd, ran)
        assert ran.err.strip(), cmd
        no_traceback(ran.err + ran.out)


async def test_revoke(redis_server: RedisServer) -> None:
    """revoke: exit 0, the holder's lease lost within ttl/3 (+ slack), its block raises
    LockLost; revoking again exits 1; the next token is greater."""
    url = redis_server.url
    name = prefix() + "r"
    async with aiolock.connect(url) as locks:
        with pytest.raises(aiolock.LockLost):
            async with locks.lock(name, ttl=1.5) as lease:
                token = lease.token
                ran = await cli("revoke", "--url", url, name)
                assert ran.code == 0, ran
                t0 = time.monotonic()
                await lease.wait_lost()  # (not wait_for: see test_body_cancelled_while_in_wait_for)
                assert time.monotonic() - t0 < 0.5 + 1.0
                await asyncio.sleep(5)
        again = await cli("revoke", "--url", url, name)
        assert again.code == 1, again
        async with locks.lock(name, ttl=5) as lease2:
            assert lease2.token > token


@pytest.mark.parametrize("cmd", ["ls", "top", "revoke"])
async def test_bad_urls_exit_codes(cmd: str, pw_redis: RedisServer) -> None:
    """Bad URL 2, none given 2, unreachable 69, refused credentials 77: one line on
    stderr, never a traceback, never the password."""
    extra = ["x"] if cmd == "revoke" else []
    cases = [
        ("bogus", ["--url", f"bogus://u:{SECRET}@127.0.0.1:1/0"], {2}),
        ("none", [], {2}),
        ("unreachable", ["--url", f"redis://:{SECRET}@127.0.0.1:{free_port()}/0"], {69}),
        ("refused", ["--url", f"redis://:{SECRET}x@127.0.0.1:{pw_redis.port}/0"], {77}),
    ]
    for what, args, codes in cases:
        ran = await cli(cmd, *args, *extra, timeout=40)
        assert ran.code in codes, (what, ran)
        no_traceback(ran.err + ran.out)
        assert SECRET not in ran.err + ran.out, (what, ran)
        lines = [line for line in ran.err.splitlines()
                 if line.strip() and not line.startswith("usage:")]
        assert len(lines) == 1, (what, ran.err)
        if what == "none":
            assert "AIOLOCK_URL" in ran.err or "--url" in ran.err, ran.err


# ------------------------------------------------------------------ top in tmux


class Tmux:
    def __init__(self) -> None:
        self.session = f"adv13-{uuid.uuid4().hex[:8]}"
        self.sock = f"adv13-{uuid.uuid4().hex[:8]}"

    def run(self, *args: str) -> str:
        done = subprocess.run(["tmux", "-L", self.sock, *args], capture_output=True, text=True,
                              timeout=10)
        return done.stdout

    def start(self, command: str) -> None:
        env = cli_env(TERM="xterm-256color")
        subprocess.run(["tmux", "-L", self.sock, "-f", "/dev/null", "new-session", "-d", "-s",
                        self.session, "-x", "200", "-y", "50", command],
                       check=True, env=env, timeout=10)

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", self.session)

    def keys(self, *keys: str) -> None:
        self.run("send-keys", "-t", self.session, *keys)

    def kill(self) -> None:
        self.run("kill-server")


@pytest.fixture
def tmux() -> Iterator[Tmux]:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    t = Tmux()
    yield t
    t.kill()


async def wait_screen(tmux: Tmux, check, within: float = 10.0) -> str:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within
    while True:
        screen = tmux.screen()
        if check(screen):
            return screen
        if time.monotonic() > deadline:
            raise AssertionError(f"screen never matched:\n{screen}")
        await asyncio.sleep(0.1)


async def test_top_live(tmux: Tmux, redis_server: RedisServer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """top shows held names with holder, token, data; refreshes in place (a release
    shows as a recent change, a new name appears); q quits with exit 0."""
    url = redis_server.url
    p = prefix()
    status = tmp_path / "status"
    tmux.start(f"{sys.executable} -m aiolock top --url {url} --interval 0.3 {p}; "
               f"echo $? > {status}; sleep 30")
    async with aiolock.connect(url) as locks:
        first = await locks.lock(p + "first", ttl=20, data="job-17").acquire()
        screen = await wait_screen(tmux, lambda s: p + "first" in s)
        line = next(x for x in screen.splitlines() if p + "first" in x)
        assert "job-17" in line, screen
        assert f"{socket.gethostname()}:{os.getpid()}" in line or \
            f":{os.getpid()}" in line, screen
        assert f" {first.token} " in line, screen
        assert "█" in line or "#" in line, screen  # the lease bar
        assert "elsewhere" not in screen
        other = await locks.lock("elsewhere-" + p, ttl=20).acquire()
        second = await locks.lock(p + "second", ttl=20).acquire()
        await wait_screen(tmux, lambda s: p + "second" in s)
        await first.release()
        screen = await wait_screen(
            tmux, lambda s: p + "first" in s and not any(
                (p + "first") in x and "job-17" in x and "gone" not in x
                and "released" not in x for x in s.splitlines()))
        assert "Recent" in screen or "gone" in screen, screen
        assert "elsewhere" not in screen
        tmux.keys("q")
        deadline = time.monotonic() + 10
        while not status.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await second.release()
        await other.release()
    assert status.exists(), f"q did not quit top:\n{tmux.screen()}"
    assert status.read_text().strip() == "0"
    assert "Traceback" not in tmux.screen()


async def test_top_refreshes_in_place(tmux: Tmux, redis_server: RedisServer) -> None:
    """The header's clock moves and the screen is redrawn, not scrolled."""
    tmux.start(f"{sys.executable} -m aiolock top --url {redis_server.url} --interval 0.3 {prefix()}")
    first = await wait_screen(tmux, lambda s: "q quits" in s)
    await asyncio.sleep(1.5)
    later = tmux.screen()
    assert later != first
    assert later.count("q quits") == 1, later
    tmux.keys("q")


async def test_top_bad_url_no_traceback(tmux: Tmux, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """In a terminal, a bad --url is a clear one-line error and a nonzero exit."""
    status = tmp_path / "status"
    tmux.start(f"{sys.executable} -m aiolock top --url redis://127.0.0.1:{free_port()}/0; "
               f"echo EXIT=$? > {status}; sleep 30")
    deadline = time.monotonic() + 30
    while not status.exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    screen = tmux.screen()
    assert status.exists(), screen
    assert status.read_text().strip() == "EXIT=69", (status.read_text(), screen)
    assert "Traceback" not in screen
    assert screen.strip(), "no message at all"


_ = ROOT
