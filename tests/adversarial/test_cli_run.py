"""``aiolock run`` keeps the child's exit status (issue 9 #7, SPEC §5) and never prints a
traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from ..servers import RedisServer

CLI = [sys.executable, "-m", "aiolock"]


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.close()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("AIOLOCK_URL", None)
    return env


def test_run_keeps_child_status_when_release_fails(own_redis: RedisServer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    started = tmp_path / "started"
    proc = subprocess.Popen(
        [*CLI, "run", "--url", own_redis.url, "--ttl", "30", f"r-{uuid.uuid4().hex}", "--",
         "sh", "-c", f"touch {started}; sleep 1.5; exit 3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    deadline = time.monotonic() + 15
    while not started.exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    own_redis.kill()  # the server dies while the child runs with a valid 30 s lease
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, (proc.returncode, err)
    assert "Traceback" not in err, err
    assert "release" in err.lower(), f"should say on stderr that the release failed: {err!r}"


def test_run_exit_status_of_signalled_child(redis_server: RedisServer) -> None:
    done = subprocess.run([*CLI, "run", "--url", redis_server.url, f"r-{uuid.uuid4().hex}",
                           "--", "sh", "-c", "kill -TERM $$"],
                          capture_output=True, text=True, env=_env(), timeout=60)
    assert done.returncode == 128 + 15, (done.returncode, done.stderr)  # as a shell reports it
    assert "Traceback" not in done.stderr


def test_run_command_not_found(redis_server: RedisServer) -> None:
    name = f"r-{uuid.uuid4().hex}"
    done = subprocess.run([*CLI, "run", "--url", redis_server.url, name, "--",
                           "/nonexistent/command-xyz"],
                          capture_output=True, text=True, env=_env(), timeout=60)
    assert done.returncode in (126, 127), (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    # the lock was released
    r = redis.Redis(port=redis_server.port)
    try:
        status = subprocess.run([*CLI, "status", "--url", redis_server.url, name],
                                capture_output=True, text=True, env=_env(), timeout=60)
        assert status.returncode == 0 and "free" in status.stdout, status.stdout + status.stderr
    finally:
        r.close()


@pytest.mark.parametrize("args", [["--ttl", "nan"], ["--ttl", "-1"], ["--ttl", "1e16"],
                                  ["--timeout", "-1"], ["--timeout", "nan"]])
def test_run_bad_numbers_one_line(args: list[str]) -> None:
    done = subprocess.run([*CLI, "run", "--url", "memory://", *args, "x", "--", "true"],
                          capture_output=True, text=True, env=_env(), timeout=60)
    assert done.returncode == 2, (done.returncode, done.stderr)  # README: 2 = usage
    assert "Traceback" not in done.stderr, done.stderr
