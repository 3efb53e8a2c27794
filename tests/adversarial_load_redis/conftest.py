"""Fixtures of the load tests: Redis-family backends churned by several worker
processes while two busy-loop processes keep both cores busy (written from README.md,
SPEC.md and docs/ alone).

Rows (``load_row``): ``redis``, ``redis-nolua`` (``?scripting=off``), ``mixed`` (one lock
shared by the Lua path and both ways onto the transaction path: an ACL user without
``@scripting``, and ``?scripting=off``), ``redis-cluster``, ``redis-sentinel``,
``redlock``.

Every test is in the slow tier (``./test.sh -m slow``): none has found a defect yet (a
test that does goes back to the default run, its open defect ``xfail(strict=True)``).
Each run takes 10-25 s, most of it the workers' start under load.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

from aiolock import Capability

from .._children import Child, children  # noqa: F401 -- children: a fixture
from ..adversarial.servers import PasswordRedis
from ..conftest import session_server
from ..scenarios import by_id

#: the password of the ACL user without @scripting
SECRET = "LoadR-S3cret-pw"

load_acl_redis = session_server(
    "load_acl_redis",
    lambda: PasswordRedis(users=["default on nopass ~* &* +@all",
                                 f"noscript on >{SECRET} ~* &* +@all -@scripting"]),
    "redis-server with a user without @scripting (the transaction path by fallback).")

ROWS = ["redis", "redis-nolua", "mixed", "redis-cluster", "redis-sentinel", "redlock"]


def row_caps(row: str) -> frozenset[Capability]:
    """What every worker of the row may use (the mixed row: the transaction path's)."""
    return by_id("redis-nolua" if row == "mixed" else row).capabilities


def rows_with(*need: Capability, default: tuple[str, ...] = ()) -> pytest.MarkDecorator:
    """Parametrize ``load_row`` over the rows offering ``need``; rows not in ``default``
    (a row where the test found a defect) are in the slow tier."""
    found = []
    for row in ROWS:
        base = by_id("redis-nolua" if row == "mixed" else row)
        if base.missing or not set(need) <= row_caps(row):
            continue
        marks: list[Any] = list(base.param().marks)
        if row not in default:
            marks.append(pytest.mark.slow)
        found.append(pytest.param(row, id=row, marks=marks))
    return pytest.mark.parametrize("load_row", found, indirect=True)


@pytest.fixture
def load_row(request: pytest.FixtureRequest) -> str:
    row: str = request.param
    return row


@pytest.fixture
def load_urls(request: pytest.FixtureRequest, load_row: str) -> list[str]:
    """One URL per worker slot (workers take them in turn)."""
    if load_row == "mixed":
        server = request.getfixturevalue("load_acl_redis")
        base = f"127.0.0.1:{server.port}/0"
        return [f"redis://noscript:{SECRET}@{base}", f"redis://{base}?scripting=off",
                f"redis://{base}", f"redis://noscript:{SECRET}@{base}"]
    return [by_id(load_row).url(request)]


@pytest.fixture
def check_url(load_urls: list[str], load_row: str) -> str:
    """A URL for the test's own checks (the Lua path on the mixed row)."""
    return load_urls[2] if load_row == "mixed" else load_urls[0]


HOG = "while True: pass"


@pytest.fixture
async def hogs(children: list[Child]) -> list[Child]:  # noqa: F811
    """Two busy-loop processes (both cores busy), killed at the end of the test."""
    started = [await Child.run("-c", HOG) for _ in range(2)]
    children.extend(started)
    return started


class Worker(Child):
    """``procs/worker.py``, with a stdin to say GO and QUIT."""

    out: str
    #: when the test killed it (SIGKILL), on the monotonic clock
    killed_at: float | None = None

    @classmethod
    async def launch(cls, mode: str, url: str, name: str, out: str, *opts: str) -> Worker:
        from .._children import ROOT

        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        script = os.path.join(os.path.dirname(__file__), "procs", "worker.py")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, script, mode, url, name, out, *opts, env=env,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        worker = cls(proc)
        worker.out = out
        return worker

    def say(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode() + b"\n")

    @property
    def pid(self) -> int:
        return int(self.proc.pid)


@pytest.fixture
async def workers(children: list[Child]) -> AsyncIterator[list[Worker]]:  # noqa: F811
    """Workers started by a test (``Worker.launch``); killed at its end if still running."""
    started: list[Worker] = []
    yield started
    children.extend(started)


#: Open defects these tests found that show in a fraction of runs only: test id (as pytest
#: shows it, without the file) -> the symptom. Marked xfail(strict=False) (a strict one
#: would fail the runs where the race does not open) and kept in the default run.
RARE_DEFECTS: dict[str, str] = {
    f"test_semaphore_limit_under_load[redis-cluster-{limit}]": (
        "Redis Cluster under load: a permit's release (ttl 5 s, held < 1 s, lease not lost)"
        " takes ~1.3 s, nobody gets the permit meanwhile, then it says 'the server no longer"
        " has it' and the block raises LockLost (1 of ~37 focused runs). A cause is fixed"
        " (a renewal answered after our own release counted as a loss: tests/test_core.py"
        " test_a_renewal_answered_after_our_own_release_is_no_loss); kept until seen gone")
    for limit in (1, 3)
}
RARE_DEFECTS["test_lock_exclusion_and_tokens_under_load[redlock]"] = (
    "Redlock under load: status() showed the lock held (one holder, a worker's pid, since"
    " 0.1 s) with a token no lease was ever granted (34 between granted 33 and 35; the"
    " read took 0.27 s): an attempt that lost the vote shown as the holder, a grant half"
    " made that status() promises never to show (2 of ~37 runs)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "adversarial_load_redis" not in str(item.path):
            continue
        if item.name in RARE_DEFECTS:
            item.add_marker(pytest.mark.xfail(reason=RARE_DEFECTS[item.name], strict=False))
        if item.get_closest_marker("slow") is None:
            # its busy loops load the machine: alone, never beside other tests' timings
            item.add_marker(pytest.mark.serial)
