"""``aiolock ls``, ``revoke`` and ``elect`` (SPEC §9), on the embedded backend in this
process (its store is shared by every connection of one process) and as a subprocess."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid

import pytest

import aiolock
from aiolock._cli_ops import list_held, revoke
from aiolock.cli import EXIT_NOT_ACQUIRED


async def test_ls_lists_holders_and_revoke_frees(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"memory://cli-{uuid.uuid4().hex[:6]}"
    async with aiolock.connect(url) as locks:
        lease = await locks.lock("orders:42", ttl=30, data="request 7f3a").acquire()
        reader = await locks.rwlock("orders:catalog", ttl=30).read().acquire()
        await locks.lock("other", ttl=30).acquire()
        assert await list_held(url, "orders:", as_json=True) == 0
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [(r["name"], r["kind"]) for r in rows] == [("orders:42", "lock"),
                                                          ("orders:catalog", "rwlock")]
        assert rows[0]["holders"][0]["data"] == "request 7f3a" and rows[0]["token"] == lease.token
        assert await list_held(url, "orders:4", as_json=False) == 0
        line = capsys.readouterr().out
        assert "orders:42" in line and "request 7f3a" in line and "catalog" not in line
        assert await revoke(url, "orders:42") == 0
        assert "revoked (lock)" in capsys.readouterr().out
        await asyncio.sleep(0)
        assert not (await locks.status("orders:42")).held
        with pytest.raises(aiolock.LockLost):
            await lease.extend()
        assert await revoke(url, "orders:42") == 1
        await reader.release()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "aiolock", *args], capture_output=True,
                          text=True, timeout=60)


def test_elect_runs_the_command_as_leader() -> None:
    code = "import os; print(os.environ['AIOLOCK_TOKEN']); raise SystemExit(4)"
    done = _cli("elect", "--url", "memory://", "--data", "me:1", "sched", "--",
                sys.executable, "-c", code)
    assert done.returncode == 4, done.stderr
    assert done.stdout.strip() == "1"


def test_elect_and_ls_usage_errors() -> None:
    done = _cli("elect", "--url", "memory://", "sched")
    assert done.returncode == 2 and "after '--'" in done.stderr
    done = _cli("elect", "--url", "memory://", "--data", "x" * 2000, "sched", "--", "true")
    assert done.returncode == 2 and "data must be" in done.stderr
    assert EXIT_NOT_ACQUIRED == 75


def test_options_after_the_name_are_options() -> None:
    done = _cli("elect", "--url", "memory://", "sched", "--data", "me:1", "--ttl", "5", "--",
                sys.executable, "-c", "raise SystemExit(5)")
    assert done.returncode == 5, done.stderr
    done = _cli("run", "--url", "memory://", "job", "--ttl", "5", "--",
                sys.executable, "-c", "import sys; raise SystemExit(len(sys.argv))", "--", "x")
    assert done.returncode == 3, done.stderr  # the command's own '--' reaches it
