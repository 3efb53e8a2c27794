"""The ``aiolock`` command line: run, status, demo (as subprocesses)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import redis

from .servers import RedisServer

CLI = [sys.executable, "-m", "aiolock"]


def cli(*args: str, url: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("AIOLOCK_URL", None)
    if url:
        env["AIOLOCK_URL"] = url
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_demo_on_embedded_default() -> None:
    done = cli("demo")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "FREEZES while holding" in out
    assert "stale write REJECTED by fencing" in out
    assert out.count("PASS") == 4 and "FAIL" not in out


def test_demo_on_redis(redis_server: RedisServer) -> None:
    done = cli("demo", "--url", redis_server.url)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "stale write REJECTED" in done.stdout


def test_run_passes_token_and_exit_status(redis_server: RedisServer) -> None:
    name = f"cli-{uuid.uuid4().hex}"
    done = cli("run", name, "--", "sh", "-c", 'echo "token=$AIOLOCK_TOKEN"; exit 7',
               url=redis_server.url)
    assert done.returncode == 7, done.stderr
    assert done.stdout.strip() == "token=1"
    done = cli("run", "--url", redis_server.url, name, "--", "sh", "-c", 'echo "$AIOLOCK_TOKEN"')
    assert done.returncode == 0 and done.stdout.strip() == "2"
    status = cli("status", name, url=redis_server.url)
    assert status.returncode == 0 and "free" in status.stdout and "last token 2" in status.stdout


def test_run_exits_75_when_not_acquired(redis_server: RedisServer) -> None:
    name = f"cli-{uuid.uuid4().hex}"
    holder = subprocess.Popen(
        [*CLI, "run", "--url", redis_server.url, name, "--", "sleep", "30"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 10
        while "held" not in cli("status", name, url=redis_server.url).stdout:
            assert time.monotonic() < deadline, "holder never acquired"
            time.sleep(0.1)
        status = cli("status", name, url=redis_server.url)
        assert "held, token 1" in status.stdout and "time left" in status.stdout
        started = time.monotonic()
        done = cli("run", "--timeout", "0.5", name, "--", "true", url=redis_server.url)
        assert done.returncode == 75, done.stderr
        assert time.monotonic() - started < 10
        assert "not acquired" in done.stderr
    finally:
        holder.terminate()
        holder.wait(10)


def test_run_exits_76_and_stops_child_when_lease_lost(redis_server: RedisServer) -> None:
    name = f"cli-{uuid.uuid4().hex}"
    marker = f"/tmp/aiolock-cli-{uuid.uuid4().hex}"
    proc = subprocess.Popen(
        [*CLI, "run", "--ttl", "1", "--url", redis_server.url, name, "--",
         "sh", "-c", f"sleep 20; touch {marker}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    client = redis.Redis(port=redis_server.port)
    try:
        deadline = time.monotonic() + 10
        while not client.keys(f"aiolock:lock:{{{name}}}"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        client.delete(f"aiolock:lock:{{{name}}}")  # the lease vanishes from the server
        _, err = proc.communicate(timeout=15)
        assert proc.returncode == 76, err
        assert "lost" in err
        assert not os.path.exists(marker)  # the child was stopped before finishing
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()


def test_run_and_status_need_a_url() -> None:
    for args in (["status", "x"], ["run", "x", "--", "true"]):
        done = cli(*args)
        assert done.returncode == 2
        assert "AIOLOCK_URL" in done.stderr and "--url" in done.stderr


def test_unreachable_server_exits_69() -> None:
    done = cli("status", "--url", "redis://127.0.0.1:1/0", "x", timeout=30)
    assert done.returncode == 69 and "cannot reach" in done.stderr


def test_bad_url_is_a_usage_error() -> None:
    done = cli("status", "--url", "nosuch://x", "x")
    assert done.returncode == 2 and "supported schemes" in done.stderr
