"""The CLI's coordination commands against a real PostgreSQL (memory:// is per process):
``aiolock ls [--json] [PREFIX]``, ``aiolock revoke NAME``, ``aiolock elect NAME -- CMD``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import aiolock

from ..mc_server import MemcachedServer

ROOT = str(Path(__file__).parents[2])


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "AIOLOCK_URL"}
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    return env


async def cli(*args: str, timeout: float = 30) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "aiolock", *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=_env())
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def start_cli(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "aiolock", *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=_env())


def no_traceback(err: str) -> None:
    assert "Traceback" not in err, err
    assert len(err.strip().splitlines()) <= 2, err


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purpose
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] != "Z"
    except OSError:
        return False


async def test_ls_lists_held_names_text_and_json(pg_url: str) -> None:
    p = f"adv-ls-{uuid.uuid4().hex[:6]}:"
    async with aiolock.connect(pg_url) as locks:
        code, out, err = await cli("ls", "--url", pg_url, "--json", p)
        assert (code, out) == (0, ""), (code, out, err)
        async with locks.lock(p + "a", ttl=5, data="data-a"), \
                locks.rwlock(p + "rw", ttl=5, data="rd").read(), \
                locks.election(p + "el", ttl=5).campaign(data="leader-d"):
            code, out, err = await cli("ls", "--url", pg_url, "--json", p)
            assert code == 0, err
            rows = [json.loads(line) for line in out.splitlines() if line.strip()]
            assert sorted(r["name"] for r in rows) == sorted(p + n for n in ("a", "rw", "el"))
            dump = json.dumps(rows)
            for d in ("data-a", "rd", "leader-d"):
                assert d in dump
            assert {r["kind"] for r in rows} >= {"lock", "election"}


async def test_ls_json_awkward_names(pg_url: str) -> None:
    p = f"adv-lsj-{uuid.uuid4().hex[:6]}:"
    names = [p + 'new\nline "q" \\ \u00e9\U0001f512', p + "tab\there", p + "%_"]
    async with aiolock.connect(pg_url) as locks:
        leases = [await locks.lock(n, ttl=5, data='d"\n').acquire() for n in names]
        try:
            code, out, err = await cli("ls", "--url", pg_url, "--json", p)
            assert code == 0, err
            rows = [json.loads(line) for line in out.splitlines()]
            assert sorted(r["name"] for r in rows) == sorted(names)
            code, out, err = await cli("ls", "--url", pg_url, "--json", p + "%")
            assert [json.loads(line)["name"] for line in out.splitlines()] == [p + "%_"]
        finally:
            for lease in leases:
                await lease.release()


async def test_ls_without_scan_is_a_clear_error(memcached_server: MemcachedServer) -> None:
    code, out, err = await cli("ls", "--url", memcached_server.url)
    assert code in (2, 70), (code, out, err)
    no_traceback(err)
    assert err.strip()


async def test_revoke_exit_codes_and_holder_loses(pg_url: str) -> None:
    name = f"adv-rv-{uuid.uuid4().hex[:6]}"
    async with aiolock.connect(pg_url) as locks:
        code, out, err = await cli("revoke", "--url", pg_url, name)
        assert code == 1, (code, out, err)
        lease = await locks.lock(name, ttl=1.5, on_lost="raise").acquire()
        code, out, err = await cli("revoke", "--url", pg_url, name)
        assert code == 0, (code, out, err)
        deadline = time.monotonic() + 1.5 / 3 + 1.0
        while not lease.lost:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        await lease.release()
        code, out, err = await cli("revoke", "--url", pg_url, name)
        assert code == 1, (code, out, err)


async def test_revoke_leader_by_cli(pg_url: str) -> None:
    name = f"adv-rvl-{uuid.uuid4().hex[:6]}"
    async with aiolock.connect(pg_url) as locks:
        term = await locks.election(name, ttl=1.5, on_lost="raise").campaign(data="x").acquire()
        code, out, err = await cli("revoke", "--url", pg_url, name)
        assert code == 0, (code, out, err)
        deadline = time.monotonic() + 1.5
        while not term.lost:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        await term.release()


async def test_elect_exit_status_data_and_token(pg_url: str, tmp_path: Path) -> None:
    name = f"adv-el-{uuid.uuid4().hex[:6]}"
    code, out, err = await cli("elect", "--url", pg_url, "--ttl", "2", name, "--",
                               "sh", "-c", "exit 3")
    assert code == 3, (code, out, err)
    tok = tmp_path / "token"
    proc = await start_cli("elect", "--url", pg_url, "--ttl", "2", "--data", "host-x:1", name,
                           "--", "sh", "-c", f'echo "$AIOLOCK_TOKEN" > {tok}; sleep 1.5')
    async with aiolock.connect(pg_url) as locks:
        el = locks.election(name, ttl=2)
        deadline = time.monotonic() + 10
        while not tok.exists() or not tok.read_text().strip():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        ldr = await el.leader()
        assert ldr is not None and ldr.data == "host-x:1"
        assert int(tok.read_text()) == ldr.token
        # someone else leads: a try with a short timeout exits 75
        code, out, err = await cli("elect", "--url", pg_url, "--timeout", "0.3", name, "--", "true")
        assert code == 75, (code, out, err)
        await asyncio.wait_for(proc.wait(), 15)
        assert proc.returncode == 0
        assert await el.leader() is None


@pytest.mark.parametrize("args", [
    ["--data", "x" * 1025, "N", "--", "true"],
    ["--ttl", "0", "N", "--", "true"],
    ["N"],
    ["N", "--"],
])
async def test_elect_usage_errors(pg_url: str, args: list[str]) -> None:
    code, out, err = await cli("elect", "--url", pg_url, *args)
    assert code == 2, (code, out, err)
    no_traceback(err)


@contextlib.asynccontextmanager
async def _elect_with_grandchild(pg_url: str, name: str, ttl: float, tmp: Path
                                 ) -> AsyncIterator[tuple[asyncio.subprocess.Process, int, Path]]:
    """``aiolock elect`` running a shell whose child (the grandchild) writes a heartbeat
    file: (the elect process, the grandchild's pid, the heartbeat file); both are killed
    on exit if still there."""
    pidfile = tmp / "gc.pid"
    beat = tmp / "beat"
    script = (f"(while true; do date +%s%N > {beat}; sleep 0.05; done) & echo $! > {pidfile}; "
              "wait")
    proc = await start_cli("elect", "--url", pg_url, "--ttl", str(ttl), "--data", "cli", name,
                           "--", "sh", "-c", script)
    gc = 0
    try:
        deadline = time.monotonic() + 15
        while not (pidfile.exists() and pidfile.read_text().strip()):
            assert time.monotonic() < deadline, "elect did not start the command"
            await asyncio.sleep(0.02)
        gc = int(pidfile.read_text())
        yield proc, gc, beat
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if gc and pid_alive(gc):
            os.kill(gc, signal.SIGKILL)


async def gone(pid: int, what: str, within: float = 2.0) -> None:
    deadline = time.monotonic() + within
    while pid_alive(pid):
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def test_elect_revoked_stops_process_group(pg_url: str, tmp_path: Path) -> None:
    name = f"adv-elr-{uuid.uuid4().hex[:6]}"
    ttl = 1.5
    async with _elect_with_grandchild(pg_url, name, ttl, tmp_path) as (proc, gc, _beat):
        code, out, err = await cli("revoke", "--url", pg_url, name)
        assert code == 0, (code, out, err)
        t0 = time.monotonic()
        await asyncio.wait_for(proc.wait(), ttl / 3 + 7)  # SIGTERM, then SIGKILL after 5 s
        assert proc.returncode == 76
        assert time.monotonic() - t0 < ttl / 3 + 6.5
        await gone(gc, "the command's child survived the loss")


async def test_elect_sigstopped_past_ttl_stops_child_on_wake(pg_url: str, tmp_path: Path) -> None:
    name = f"adv-els-{uuid.uuid4().hex[:6]}"
    ttl = 1.5
    async with _elect_with_grandchild(pg_url, name, ttl, tmp_path) as (proc, gc, beat), \
            aiolock.connect(pg_url) as locks:
        el = locks.election(name, ttl=ttl)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            term = await el.campaign(data="usurper").acquire(timeout=ttl * 2 + 3)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        took_over = time.monotonic()
        try:
            await asyncio.wait_for(proc.wait(), 8)
            assert proc.returncode == 76, proc.returncode
            await gone(gc, "the command's child survived")
            # and the stale leader's child stopped soon after it woke
            last_beat = int(beat.read_text().strip() or "0") / 1e9
            now_wall = time.time()
            assert now_wall - last_beat > 0, "still beating"
            assert time.monotonic() - took_over < 8
            ldr = await el.leader()
            assert ldr is not None and ldr.data == "usurper" and ldr.token == term.token
        finally:
            await term.release()


async def test_status_cli_sees_every_kind(pg_url: str) -> None:
    u = f"adv-stk-{uuid.uuid4().hex[:6]}"
    async with aiolock.connect(pg_url) as locks, \
            locks.semaphore(u + ":s", 3, ttl=5, data="p1"), \
            locks.rwlock(u + ":r", ttl=5).read(), \
            locks.election(u + ":e", ttl=5).campaign(data="L"):
        for n in ("s", "r", "e"):
            code, out, err = await cli("status", "--url", pg_url, f"{u}:{n}")
            assert code == 0, err
            assert "free" not in out, (n, out)


async def test_ls_text_one_line_per_name(pg_url: str) -> None:
    p = f"adv-lst-{uuid.uuid4().hex[:6]}:"
    async with aiolock.connect(pg_url) as locks, locks.lock(p + "a\nb", ttl=5), \
            locks.lock(p + "c", ttl=5):
        code, out, err = await cli("ls", "--url", pg_url, p)
        assert code == 0, err
        assert len(out.strip().splitlines()) == 2, out


async def test_unreachable_server_exit_69_and_missing_url_exit_2() -> None:
    dead = "postgresql://postgres@127.0.0.1:1/aiolock?connect_timeout=1"
    for args in (["ls", "--url", dead], ["revoke", "--url", dead, "n"],
                 ["elect", "--url", dead, "--timeout", "2", "n", "--", "true"]):
        code, out, err = await cli(*args, timeout=30)
        assert code == 69, (args, code, out, err)
        no_traceback(err)
    for args in (["ls"], ["revoke", "n"], ["elect", "n", "--", "true"]):
        code, out, err = await cli(*args)
        assert code == 2, (args, code, out, err)
        assert "AIOLOCK_URL" in err or "--url" in err, err
        no_traceback(err)


async def test_elect_sigterm_stops_child_and_resigns(pg_url: str, tmp_path: Path) -> None:
    name = f"adv-elt-{uuid.uuid4().hex[:6]}"
    async with _elect_with_grandchild(pg_url, name, 10.0, tmp_path) as (proc, gc, _beat), \
            aiolock.connect(pg_url) as locks:
        el = locks.election(name, ttl=10)
        assert await el.leader() is not None
        os.kill(proc.pid, signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 8)
        assert proc.returncode in (143, -signal.SIGTERM), proc.returncode
        assert await el.leader() is None  # resigned, not left to expire (ttl 10)
        await gone(gc, "the command's child survived elect")
