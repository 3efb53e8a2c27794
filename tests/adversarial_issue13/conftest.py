"""Fixtures of the issue-13 adversarial tests (observability: OpenTelemetry, logging, the
``ls`` / ``top`` / ``revoke`` commands), written from README.md, SPEC.md §9 and
docs/operations.md alone.

OpenTelemetry: the real SDK (``InMemoryMetricReader``, ``InMemorySpanExporter``) set as the
*global* providers, once, the first time a test asks for ``telemetry`` (the providers of a
process cannot be set twice). Counters and histograms are read with DELTA temporality
(each collection gives what happened since the previous one), up-down counters
cumulatively (their current value).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .._children import children, known_defects, slow_but  # noqa: F401 -- children: a fixture
from ..conftest import session_server
from ..servers import RedisServer

ROOT = Path(__file__).parents[2]

#: the password of every server here; no error, log line, span or CLI output may show it
SECRET = "Adv13-Sup3rS3cret-pw"

pw_redis = session_server(
    "pw_redis", lambda: RedisServer(args=["--requirepass", SECRET]),
    "redis-server that requires the password SECRET.")


# ---------------------------------------------------------------- OpenTelemetry


@dataclass
class Point:
    metric: str
    unit: str
    kind: str  # histogram, counter, updown, gauge
    attrs: dict[str, Any]
    count: int = 0  # histogram
    sum: float = 0.0  # histogram
    value: float = 0.0  # sums
    min: float = 0.0
    max: float = 0.0


@dataclass
class Collected:
    points: list[Point] = field(default_factory=list)
    scopes: set[str] = field(default_factory=set)

    def of(self, metric: str, **attrs: str) -> list[Point]:
        want = {f"aiolock.{k}": v for k, v in attrs.items()}
        return [p for p in self.points if p.metric == metric
                and all(p.attrs.get(k) == v for k, v in want.items())]

    def count(self, metric: str, **attrs: str) -> int:
        """Histogram points recorded (sum of counts) / counter increments."""
        pts = self.of(metric, **attrs)
        return sum(p.count if p.kind == "histogram" else int(p.value) for p in pts)

    def value(self, metric: str, **attrs: str) -> float:
        return sum(p.value for p in self.of(metric, **attrs))


class Telemetry:
    def __init__(self) -> None:
        from .._otel_global import providers

        shared = providers()  # the process's global providers, shared with tests/test_otel.py
        self.reader = shared.delta
        self.exporter = shared.exporter

    def collect(self) -> Collected:
        from opentelemetry.sdk.metrics.export import (
            Histogram,
            Sum,
        )

        out = Collected()
        data = self.reader.get_metrics_data()
        if data is None:
            return out
        for rm in data.resource_metrics:
            for sm in rm.scope_metrics:
                out.scopes.add(sm.scope.name)
                for m in sm.metrics:
                    if not m.name.startswith("aiolock"):
                        continue
                    for dp in m.data.data_points:
                        attrs = dict(dp.attributes or {})
                        if isinstance(m.data, Histogram):
                            out.points.append(Point(m.name, m.unit or "", "histogram", attrs,
                                                    count=dp.count, sum=dp.sum,
                                                    min=dp.min, max=dp.max))
                        elif isinstance(m.data, Sum):
                            kind = "counter" if m.data.is_monotonic else "updown"
                            out.points.append(Point(m.name, m.unit or "", kind, attrs,
                                                    value=dp.value))
                        else:
                            out.points.append(Point(m.name, m.unit or "", "gauge", attrs,
                                                    value=dp.value))
        return out

    def spans(self, name: str | None = None) -> list[Any]:
        got = list(self.exporter.get_finished_spans())
        return [s for s in got if name is None or s.name == name]

    def reset(self) -> None:
        self.collect()  # drains the deltas
        self.exporter.clear()


_TELEMETRY: list[Telemetry] = []


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    """The global SDK providers (set on first use), drained before the test."""
    if not _TELEMETRY:
        _TELEMETRY.append(Telemetry())
    tel = _TELEMETRY[0]
    tel.reset()
    yield tel


# ---------------------------------------------------------------- the command line


@dataclass
class Ran:
    code: int
    out: str
    err: str


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "AIOLOCK_URL"}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


async def cli(*args: str, timeout: float = 30.0, **env: str) -> Ran:
    """``python -m aiolock ARGS`` in a child process (our event loop keeps running, so the
    leases this test holds keep being renewed)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "aiolock", *args, env=cli_env(**env),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"aiolock {' '.join(args)} did not finish in {timeout}s") from None
    assert proc.returncode is not None
    return Ran(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))


@pytest.fixture
async def pw_url(pw_redis: RedisServer) -> AsyncIterator[str]:
    yield f"redis://:{SECRET}@127.0.0.1:{pw_redis.port}/0"


# Defects these tests found that are still open: test id (as pytest shows it, without the
# file) -> the one-line symptom. Each is marked xfail(strict=True): the suite stays green,
# the defect stays visible, and a fix turns the entry into an error to delete.
KNOWN_DEFECTS: dict[str, str] = {}


#: test_waiters.py: the tests that found a defect (since fixed) stay in the default run;
#: those that pin a promise the contract suite or another default test also checks run
#: in the slow tier (``./test.sh -m slow``), to keep the suite under its 15 minutes
WAITERS_DEFAULT = {
    "test_holder_still_constructs_positionally_and_waiting_is_not_compared",
    "test_semaphore_waiters_behind_own_permits_all_counted",
    "test_rwlock_waiters_behind_own_holders_counted_exactly",
    "test_election_candidates_behind_own_leader_counted",
    "test_local_waiter_timing_out_takes_no_place",
    "test_count_rewrite_does_not_wake_no_scripting_waiters",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in known_defects(items, "adversarial_issue13", KNOWN_DEFECTS):
        if slow_but(item, "test_waiters.py", WAITERS_DEFAULT):
            item.add_marker(pytest.mark.slow)


# ---------------------------------------------------------------- a backend, a child process


@pytest.fixture(params=["memory", "redis"])
def url(request: pytest.FixtureRequest) -> str:
    """Each test on ``memory://`` and on the session's private redis-server."""
    if request.param == "memory":
        return "memory://"
    return str(request.getfixturevalue("redis_server").url)


@pytest.fixture
async def locks(url: str) -> AsyncIterator[Any]:
    import aiolock

    async with aiolock.connect(url) as conn:
        yield conn


def child_result(code: str, *args: str, timeout: float, unset: tuple[str, ...] = (),
                 forbidden: tuple[str, ...] = ("Traceback", "Exception in callback")) -> dict[str, Any]:
    """Run ``code`` in a child Python (this checkout's aiolock on its path, without the
    environment variables ``unset``) and return the JSON of its last ``RESULT`` line; it
    must exit 0 with none of ``forbidden`` on its stderr."""
    env = {k: v for k, v in os.environ.items() if k != "AIOLOCK_URL" and k not in unset}
    env["PYTHONPATH"] = str(ROOT)
    env["PYTHONWARNINGS"] = "ignore"
    try:
        ran = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"child did not finish in {timeout}s: {exc.stderr!r}") from None
    lines = [ln for ln in ran.stdout.splitlines() if ln.startswith("RESULT ")]
    assert ran.returncode == 0 and lines, (
        f"child exited {ran.returncode}\nstdout: {ran.stdout[-3000:]}\nstderr: {ran.stderr[-3000:]}")
    for bad in forbidden:
        assert bad not in ran.stderr, f"the child's stderr shows {bad!r}:\n{ran.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    return result
