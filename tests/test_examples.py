"""The examples in ``examples/`` run as written, on the embedded default and on Redis.

Each example is run as a user would run it (``python examples/X.py`` with ``AIOLOCK_URL``
set), must exit 0 within a few seconds and print the line that states what it shows.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
#: Each example finishes in a few seconds; this only stops a hung one.
RUN_TIMEOUT = 60.0
#: What a healthy run should stay under (the brief: "a few seconds", ~10 s at most).
EXPECTED_SECONDS = 10.0


def run_example(
    script: str, url: str, *args: str
) -> tuple[subprocess.CompletedProcess[str], float]:
    env = dict(os.environ, AIOLOCK_URL=url, PYTHONUNBUFFERED="1")
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )
    return done, time.monotonic() - start


def check(done: subprocess.CompletedProcess[str], elapsed: float, *expected: str) -> str:
    out = done.stdout
    report = f"exit {done.returncode} after {elapsed:.1f}s\n--- stdout\n{out}\n--- stderr\n{done.stderr}"
    assert done.returncode == 0, report
    for line in expected:
        assert line in out, f"missing {line!r}\n{report}"
    assert "FAIL" not in out, report
    assert "Traceback" not in done.stderr, report
    assert elapsed < EXPECTED_SECONDS, report
    return out


@pytest.fixture(params=["memory", "redis"])
def url(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return "memory://"
    redis_url: str = request.getfixturevalue("redis_url")
    return redis_url


def test_every_example_is_tested() -> None:
    tested = {"web_handler.py", "worker_pool.py", "task_coordination.py",
              "leader_scheduler.py"}  # the last in tests/test_leader_example.py (PostgreSQL)
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_web_handler(url: str) -> None:
    out = check(*run_example("web_handler.py", url), "charged exactly once")
    assert f"lock backend: {url}" in out
    assert " 1 x 201 charged" in out
    assert "19 x 200 already_charged" in out
    assert "payment provider calls for" in out and ": 1;" in out
    assert "busy order answered 409 Conflict without charging" in out


def test_worker_pool(url: str) -> None:
    out = check(*run_example("worker_pool.py", url), "each job processed exactly once")
    assert "all 40 jobs have a result" in out


def test_worker_pool_processes(redis_url: str) -> None:
    out = check(
        *run_example("worker_pool.py", redis_url, "--processes", "3", "--workers", "4"),
        "each job processed exactly once",
    )
    assert "3 processes x 4 workers" in out


def test_worker_pool_processes_need_a_shared_backend() -> None:
    done, _ = run_example("worker_pool.py", "memory://", "--processes", "2")
    assert done.returncode == 2
    assert "needs a lock server shared by processes" in done.stderr


def test_task_coordination(url: str) -> None:
    out = check(
        *run_example("task_coordination.py", url),
        "migration ran exactly once",
        "leader election OK",
    )
    assert out.count("got the migration lock") == 1
    assert out.count("schema already at v2") == 7
    assert "still held after the reentrant steps: True" in out
    assert "released the migration lock at the outermost exit" in out
    assert "reentrant=False, acquiring again: LockError" in out
    assert "work hangs" in out and "lease LOST: leader work cancelled" in out
