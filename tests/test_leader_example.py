"""``examples/leader_scheduler.py`` on a real PostgreSQL: worker processes elect one
scheduler, the parent ``kill -9``'s it, and another worker takes over with a higher term."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .pg_server import PostgresServer, find_pg_bin

pytest.importorskip("asyncpg")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "leader_scheduler.py"
#: the run takes ~5 s (process start-up, --kill-after, the takeover, --after): this only
#: stops a hung one
RUN_TIMEOUT = 60.0


def run(url: str, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    env = dict(os.environ, AIOLOCK_URL=url, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT)
    return done, time.monotonic() - start


@pytest.mark.skipif(find_pg_bin() is None, reason="PostgreSQL is not installed")
def test_leader_is_killed_and_another_takes_over(postgres_server: PostgresServer) -> None:
    done, elapsed = run(postgres_server.url, "--workers", "3", "--ttl", "2", "--kill-after",
                        "1", "--after", "0.7")
    out = done.stdout
    report = f"exit {done.returncode} after {elapsed:.1f}s\n{out}\n--- stderr\n{done.stderr}"
    assert done.returncode == 0, report
    assert "Traceback" not in done.stderr and "FAIL" not in out, report
    killed = re.search(r"kill -9 (worker-\d) \(pid \d+\), term=(\d+)", out)
    took = re.search(r"takeover: (worker-\d) leads with term=(\d+) > (\d+), ([\d.]+) s", out)
    assert killed and took, report
    assert took.group(1) != killed.group(1) and int(took.group(2)) > int(killed.group(2))
    assert float(took.group(4)) < 1.5, report  # PostgreSQL frees a dead leader at once
    # both leaders ran the schedule, each with its own term
    terms = {int(t) for t in re.findall(r"TICK \d+ term=(\d+)", out)}
    assert {int(killed.group(2)), int(took.group(2))} <= terms, report
    # the other workers observed the new leader
    assert re.search(rf"sees leader {took.group(1)} \(pid \d+\) term={took.group(2)}", out), report
    assert elapsed < 30, report


def test_leader_example_refuses_a_backend_not_shared_by_processes() -> None:
    done, _ = run("memory://")
    assert done.returncode == 2, done.stderr
    assert "Capability.ELECTION shared across processes" in done.stderr
