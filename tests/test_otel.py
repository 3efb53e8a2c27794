"""OpenTelemetry (SPEC §9), with the real SDK: an ``InMemoryMetricReader`` and an
in-memory span exporter on the *global* providers, as an application would set them.

The global providers can be set once per process, so one module fixture sets them and
every test compares the cumulative metrics before and after what it does. What must hold
without OpenTelemetry (``import aiolock`` works, nothing is wrapped) and with only the API
(no span is made) runs in child processes, where nothing set a provider.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace
from opentelemetry.sdk.metrics.export import Histogram, Sum
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import StatusCode

import aiolock
from aiolock import _telemetry

from .servers import free_port

ROOT = Path(__file__).resolve().parent.parent
#: metric -> (type, monotonic, unit, attribute keys)
INSTRUMENTS: dict[str, tuple[type, bool | None, str, frozenset[str]]] = {
    "aiolock.acquire.duration": (Histogram, None, "s",
                                 frozenset({"aiolock.backend", "aiolock.kind", "aiolock.outcome"})),
    "aiolock.hold.duration": (Histogram, None, "s", frozenset({"aiolock.backend", "aiolock.kind"})),
    "aiolock.renewal.duration": (Histogram, None, "s", frozenset({"aiolock.backend"})),
    "aiolock.leases.held": (Sum, False, "{lease}", frozenset({"aiolock.backend", "aiolock.kind"})),
    "aiolock.waiters": (Sum, False, "{waiter}", frozenset({"aiolock.backend", "aiolock.kind"})),
    "aiolock.leases.lost": (Sum, True, "{lease}",
                            frozenset({"aiolock.backend", "aiolock.kind", "aiolock.outcome"})),
}
Key = tuple[str, frozenset[tuple[str, Any]]]


class Telemetry:
    """The global SDK providers' cumulative in-memory reader and the span exporter."""

    def __init__(self) -> None:
        from ._otel_global import providers

        shared = providers()  # set once per process, shared with tests/adversarial_issue13
        self.reader = shared.cumulative
        self.exporter = shared.exporter
        self.meter_provider = shared.meter_provider
        self.tracer_provider = shared.tracer_provider

    def collect(self) -> dict[Key, float]:
        """Every data point now: a sum's value, a histogram's count (cumulative)."""
        out: dict[Key, float] = {}
        data = self.reader.get_metrics_data()
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                assert sm.scope.name == "aiolock"
                for metric in sm.metrics:
                    kind, monotonic, unit, keys = INSTRUMENTS[metric.name]
                    assert isinstance(metric.data, kind), metric.name
                    assert metric.unit == unit, metric.name
                    if monotonic is not None:
                        assert isinstance(metric.data, Sum)
                        assert metric.data.is_monotonic is monotonic, metric.name
                    for point in metric.data.data_points:
                        attrs = dict(point.attributes or {})
                        assert set(attrs) == keys, (metric.name, attrs)
                        value = point.count if isinstance(metric.data, Histogram) else point.value
                        out[(metric.name, frozenset(attrs.items()))] = value
        return out

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if name is None or s.name == name]


@pytest.fixture(scope="module")
def otel() -> Iterator[Telemetry]:
    try:
        tel = Telemetry()
    except RuntimeError as exc:  # a global provider this suite does not know was set
        pytest.skip(str(exc))
    yield tel
    tel.exporter.clear()


class Delta:
    """What changed in the metrics since it was made."""

    def __init__(self, tel: Telemetry) -> None:
        self.tel = tel
        self.before = tel.collect()
        tel.exporter.clear()

    def now(self) -> dict[Key, float]:
        after = self.tel.collect()
        return {k: v - self.before.get(k, 0) for k, v in after.items() if v != self.before.get(k, 0)}

    def get(self, metric: str, **attrs: str) -> float:
        want = {f"aiolock.{k}": v for k, v in attrs.items()}
        return sum(v for (name, a), v in self.now().items()
                   if name == metric and all(dict(a).get(k) == v for k, v in want.items()))


def url() -> str:
    return f"memory://otel-{uuid.uuid4().hex}"


def assert_one_lock_lost(d: Delta, outcome: str) -> None:
    """One lease lost, a memory lock's, for ``outcome``; none held any more."""
    assert d.get("aiolock.leases.lost", backend="memory", kind="lock", outcome=outcome) == 1
    assert d.get("aiolock.leases.lost") == 1
    assert d.get("aiolock.leases.held") == 0


NAME = "orders:otel-secret-name-7f3a"  # must never appear in a metric attribute


def _no_name_in_metrics(tel: Telemetry) -> None:
    for (_, attrs) in tel.collect():
        for _, value in attrs:
            assert "otel-secret-name" not in str(value)


async def test_cycle_records_every_lease_instrument_and_both_spans(otel: Telemetry) -> None:
    d = Delta(otel)
    async with aiolock.connect(url()) as locks:
        lock = locks.lock(NAME, ttl=5)
        async with lock as lease:
            token = lease.token
            assert d.get("aiolock.leases.held", backend="memory", kind="lock") == 1
            assert d.get("aiolock.hold.duration") == 0
        assert d.get("aiolock.leases.held", backend="memory", kind="lock") == 0
        assert d.get("aiolock.hold.duration", backend="memory", kind="lock") == 1
        assert d.get("aiolock.acquire.duration", backend="memory", kind="lock", outcome="granted") == 1
        assert d.get("aiolock.leases.lost") == 0
        assert d.get("aiolock.waiters") == 0  # uncontended: never waited
    (acq,) = otel.spans("aiolock.acquire")
    assert dict(acq.attributes or {}) == {
        "aiolock.name": NAME, "aiolock.backend": "memory", "aiolock.kind": "lock",
        "aiolock.token": token, "aiolock.outcome": "granted",
    }
    assert acq.status.status_code is StatusCode.UNSET
    assert acq.instrumentation_scope is not None and acq.instrumentation_scope.name == "aiolock"
    (rel,) = otel.spans("aiolock.release")
    assert dict(rel.attributes or {}) == {
        "aiolock.name": NAME, "aiolock.backend": "memory", "aiolock.kind": "lock", "aiolock.token": token,
    }
    _no_name_in_metrics(otel)


async def test_acquire_span_is_a_child_of_the_callers_span(otel: Telemetry) -> None:
    Delta(otel)
    tracer = trace.get_tracer("test")
    async with aiolock.connect(url()) as locks:
        with tracer.start_as_current_span("handler") as parent:
            async with locks.lock(NAME):
                pass
    (acq,) = otel.spans("aiolock.acquire")
    assert acq.parent is not None and acq.parent.span_id == parent.get_span_context().span_id


def _of_token(spans: list[ReadableSpan], token: int) -> list[ReadableSpan]:
    return [s for s in spans if (s.attributes or {}).get("aiolock.token") == token]


async def test_spans_cover_the_wait_and_are_exported_when_the_call_returns(otel: Telemetry) -> None:
    """A span's start is handed to the SDK later (while the request is out), but with the
    time the call began, and it is ended before the call returns: an acquire that waited
    0.2 s behind a holder has a span of >= 0.2 s in the exporter the moment it returns,
    and so does its release; neither is left current."""
    Delta(otel)
    async with aiolock.connect(url()) as locks:
        lock = locks.lock(NAME)
        held = asyncio.Event()

        async def hold() -> None:
            async with lock:
                held.set()
                await asyncio.sleep(0.2)

        releasing = asyncio.create_task(hold())
        await held.wait()
        before = trace.get_current_span()
        lease = await lock.acquire(timeout=5)
        assert trace.get_current_span() is before
        (span,) = _of_token(otel.spans("aiolock.acquire"), lease.token)
        assert span.end_time is not None and span.start_time is not None
        assert (span.end_time - span.start_time) / 1e9 >= 0.19
        await lease.release()
        assert len(_of_token(otel.spans("aiolock.release"), lease.token)) == 1
        assert trace.get_current_span() is before
        await releasing


async def test_kinds(otel: Telemetry) -> None:
    d = Delta(otel)
    async with aiolock.connect(url()) as locks:
        rw = locks.rwlock(NAME)
        async with rw.read():
            pass
        async with rw.write():
            pass
        async with locks.semaphore(NAME, 2) as one, locks.semaphore(NAME, 2):
            assert one.token
            assert d.get("aiolock.leases.held", kind="permit") == 2
        async with locks.election(NAME).campaign("me"):
            assert d.get("aiolock.leases.held", kind="leader") == 1
    for kind in ("read", "write", "permit", "leader"):
        assert d.get("aiolock.acquire.duration", backend="memory", kind=kind, outcome="granted") >= 1, kind
        assert d.get("aiolock.leases.held", kind=kind) == 0, kind
    assert {dict(s.attributes or {})["aiolock.kind"] for s in otel.spans("aiolock.acquire")} == {
        "read", "write", "permit", "leader"}
    _no_name_in_metrics(otel)


async def test_timeout_and_cancelled_outcomes_and_waiters_back_to_zero(otel: Telemetry) -> None:
    d = Delta(otel)
    async with aiolock.connect(url()) as locks:
        lock = locks.lock(NAME, ttl=5)
        async with lock:
            waiting = [asyncio.create_task(lock.acquire(timeout=None)) for _ in range(3)]
            timing_out = asyncio.create_task(lock.acquire(timeout=0.2))
            for _ in range(200):
                await asyncio.sleep(0.005)
                if d.get("aiolock.waiters", backend="memory", kind="lock") == 4:
                    break
            assert d.get("aiolock.waiters", backend="memory", kind="lock") == 4
            with pytest.raises(aiolock.LockTimeout):
                await timing_out
            assert d.get("aiolock.waiters") == 3
            waiting[0].cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting[0]
            assert d.get("aiolock.waiters") == 2
        for task in waiting[1:]:
            lease = await task
            await lease.release()
        assert d.get("aiolock.waiters") == 0
        assert d.get("aiolock.leases.held") == 0
    assert d.get("aiolock.acquire.duration", outcome="granted") == 3
    assert d.get("aiolock.acquire.duration", outcome="timeout") == 1
    assert d.get("aiolock.acquire.duration", outcome="cancelled") == 1
    outcomes = sorted(dict(s.attributes or {})["aiolock.outcome"] for s in otel.spans("aiolock.acquire"))
    assert outcomes == ["cancelled", "granted", "granted", "granted", "timeout"]
    # a timeout or a cancellation is not an error of the span
    assert all(s.status.status_code is StatusCode.UNSET for s in otel.spans("aiolock.acquire"))
    _no_name_in_metrics(otel)


async def test_error_outcome_on_an_unreachable_server(otel: Telemetry) -> None:
    pytest.importorskip("redis")
    d = Delta(otel)
    locks = aiolock.connect(f"redis://:pw-otel-secret@127.0.0.1:{free_port()}/0", connect_timeout=1)
    try:
        with pytest.raises(aiolock.BackendUnavailable):
            await locks.lock(NAME).acquire(timeout=2)
    finally:
        await locks.aclose()
    assert d.get("aiolock.acquire.duration", backend="redis", kind="lock", outcome="error") == 1
    (span,) = otel.spans("aiolock.acquire")
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes is not None and span.attributes["aiolock.outcome"] == "error"
    assert "aiolock.token" not in span.attributes
    assert [e.name for e in span.events] == ["exception"]
    assert "pw-otel-secret" not in str(span.to_json())


async def test_lost_expired_with_watchdog_off(otel: Telemetry) -> None:
    d = Delta(otel)
    async with aiolock.connect(url()) as locks:
        lease = await locks.lock(NAME, ttl=0.2, watchdog=False).acquire()
        await lease.wait_lost()
        assert lease.lost
        assert d.get("aiolock.leases.lost", backend="memory", kind="lock", outcome="expired") == 1
        assert d.get("aiolock.leases.held") == 0
        assert d.get("aiolock.hold.duration", backend="memory", kind="lock") == 1
        await lease.release()  # lost: no second end
    assert d.get("aiolock.leases.lost") == 1
    assert d.get("aiolock.hold.duration") == 1
    assert d.get("aiolock.leases.held") == 0


async def test_lost_revoked_and_renewal_duration(otel: Telemetry) -> None:
    d = Delta(otel)
    async with aiolock.connect(url()) as locks:
        lock = locks.lock(NAME, ttl=1.5)
        lease = await lock.acquire()
        await asyncio.sleep(0.6)  # renewed at ~0.5 s
        assert d.get("aiolock.renewal.duration", backend="memory") >= 1
        assert await lock.force_release()
        await asyncio.wait_for(lease.wait_lost(), 2)
        assert lease.lost
    assert_one_lock_lost(d, "revoked")


async def test_lost_gone_when_the_server_dropped_it(otel: Telemetry) -> None:
    d = Delta(otel)
    async with aiolock.connect(url()) as locks:
        lease = await locks.lock(NAME, ttl=5).acquire()
        locks.backend._store.resources.clear()  # type: ignore[attr-defined]  # e.g. FLUSHALL
        with pytest.raises(aiolock.LockLost):
            await lease.extend()
    assert_one_lock_lost(d, "gone")


async def test_lost_closed_when_the_connection_closes_under_a_lease(otel: Telemetry) -> None:
    d = Delta(otel)
    locks = aiolock.connect(url())
    lease = await locks.lock(NAME, ttl=5).acquire()
    read = await locks.rwlock(NAME).read().acquire()
    assert d.get("aiolock.leases.held") == 2
    await locks.aclose()
    assert lease.released and not lease.lost and read.released
    assert d.get("aiolock.leases.lost", backend="memory", kind="lock", outcome="closed") == 1
    assert d.get("aiolock.leases.lost", backend="memory", kind="read", outcome="closed") == 1
    assert d.get("aiolock.leases.held") == 0
    assert d.get("aiolock.hold.duration") == 2


async def test_reentry_is_an_acquire_but_not_a_lease(otel: Telemetry) -> None:
    d = Delta(otel)
    async with aiolock.connect(url()) as locks:
        lock = locks.lock(NAME, reentrant=True)
        async with lock, lock:
            assert d.get("aiolock.leases.held") == 1
    assert d.get("aiolock.acquire.duration", outcome="granted") == 2
    assert d.get("aiolock.hold.duration") == 1
    assert d.get("aiolock.leases.held") == 0


async def test_instruments_are_made_once(otel: Telemetry) -> None:
    first = _telemetry._get()
    assert first is not None
    instruments = dict(vars(first))
    async with aiolock.connect(url()) as locks:
        for _ in range(3):
            async with locks.lock(NAME):
                pass
    assert _telemetry._get() is first
    assert dict(vars(first)) == instruments


def test_every_loss_reason_of_the_core_has_its_outcome() -> None:
    """Each reason string the core gives mark_lost() maps to a named outcome (a new or
    reworded reason must be classified on purpose)."""
    reasons: dict[str, str] = {}
    for path in (ROOT / "aiolock").glob("*.py"):
        for reason in re.findall(r'mark_lost\(\s*f?"([^"]*)"', path.read_text()):
            reasons[reason] = _telemetry.loss_outcome(reason)
    assert reasons == {
        "its last confirmed expiry passed without a renewal": "expired",
        "its last confirmed expiry passed before the renewal was sent": "expired",
        "revoked by an operator (force_release)": "revoked",
        "the server no longer has it (expired or taken over)": "gone",
        "release failed ({exc}); it expires by its ttl": "expired",
        "release failed ({exc})": "expired",
        "the server refused its renewal ({exc}); it expires unrenewed": "expired",
    }


def _child(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=60, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_without_opentelemetry_nothing_is_wrapped() -> None:
    out = _child("""
        import asyncio, sys
        sys.modules["opentelemetry"] = None  # not installed
        import aiolock
        from aiolock import _telemetry
        assert not _telemetry.AVAILABLE
        assert aiolock.Lock.acquire.__code__.co_name == "acquire"
        assert aiolock.Lease._release.__code__.co_name == "_release"
        async def main():
            async with aiolock.connect("memory://") as locks:
                async with locks.lock("x", ttl=1.5):
                    await asyncio.sleep(0.6)
        asyncio.run(main())
        assert not any(m.startswith("opentelemetry") and sys.modules[m] for m in sys.modules)
        print("ok")
    """)
    assert out.strip() == "ok"


def test_api_without_sdk_makes_no_span() -> None:
    out = _child("""
        import asyncio, sys
        import aiolock
        from aiolock import _telemetry
        assert _telemetry.AVAILABLE
        async def main():
            async with aiolock.connect("memory://") as locks:
                lock = locks.lock("x", ttl=1.5)
                coro = lock.acquire()
                assert coro.cr_code.co_name == "acquire", coro  # not the traced wrapper
                lease = await coro
                await asyncio.sleep(0.6)
                await lease.release()
        asyncio.run(main())
        otel = _telemetry._get()
        assert not otel.metrics_on() and not otel.traces_on()
        print("ok")
    """)
    assert out.strip() == "ok"


async def test_duration_buckets_are_made_for_seconds(otel: Telemetry) -> None:
    async with aiolock.connect(url()) as locks, locks.lock(NAME):
        pass
    data = otel.reader.get_metrics_data()
    assert data is not None
    bounds = {m.name: list(m.data.data_points[0].explicit_bounds)
              for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
              if isinstance(m.data, Histogram) and m.data.data_points}
    if bounds["aiolock.acquire.duration"][:3] == [0.0, 5.0, 10.0]:
        pytest.skip("this opentelemetry-sdk ignores bucket advisories (1.23 does; 1.45 honours them)")
    assert bounds["aiolock.acquire.duration"][:3] == [0.0005, 0.001, 0.0025]
    assert bounds["aiolock.hold.duration"][-1] == 86400.0


# -- points are handed to the SDK off the lock's path, and never lost ---------------------


async def test_points_wait_for_the_loop_to_idle_or_a_collection(otel: Telemetry) -> None:
    """A point is not recorded inside acquire()/release() (the SDK's per-point work would
    delay the lock) but once the loop has nothing else ready to run; a collection made
    before still sees it (the observers flush first)."""
    d = Delta(otel)
    async with aiolock.connect(url()) as locks:
        lock = locks.lock(NAME)
        lease = await lock.acquire()
        assert len(_telemetry._pending) >= 1  # the acquire point, not yet the SDK's
        await asyncio.sleep(0)
        assert _telemetry._pending  # this task was ready to run again: it goes first
        await asyncio.sleep(0.001)
        assert not _telemetry._pending  # the loop idled: handed over
        await lease.release()
        assert _telemetry._pending  # the hold point
        # no turn of the loop since: the collection itself takes it
        assert d.get("aiolock.hold.duration", backend="memory", kind="lock") == 1
        assert d.get("aiolock.acquire.duration", outcome="granted") == 1
        assert not _telemetry._pending


async def test_a_loop_never_idle_hands_points_over_within_max_hops_turns(otel: Telemetry) -> None:
    """Tasks that keep the loop busy (always another callback ready) delay the hand-over
    by at most MAX_HOPS turns, then it happens anyway."""
    Delta(otel)
    stop = False

    async def spin() -> None:
        while not stop:
            await asyncio.sleep(0)

    spinner = asyncio.create_task(spin())
    try:
        async with aiolock.connect(url()) as locks:
            await asyncio.sleep(0)
            lease = await locks.lock(NAME).acquire()
            assert _telemetry._pending
            turns = 0
            while _telemetry._pending:
                await asyncio.sleep(0)
                turns += 1
                assert turns <= _telemetry.MAX_HOPS + 1, "never handed over"
            assert turns >= 2, turns  # it did wait while the loop was busy
            await lease.release()
    finally:
        stop = True
        await spinner


async def test_no_point_lost_or_doubled_while_another_thread_collects(otel: Telemetry) -> None:
    """Many tasks cycle while a thread collects in a tight loop (as a periodic exporting
    reader does, from its own thread): every point is counted exactly once."""
    import threading

    d = Delta(otel)
    stop = threading.Event()
    collections = 0

    def collector() -> None:
        nonlocal collections
        while not stop.is_set():
            otel.reader.get_metrics_data()
            collections += 1

    thread = threading.Thread(target=collector)
    thread.start()
    tasks, cycles = 20, 100
    try:
        async with aiolock.connect(url()) as locks:
            async def worker(i: int) -> None:
                lock = locks.lock(f"{NAME}-{i % 4}")
                for _ in range(cycles):
                    async with lock:
                        if i % 2:
                            await asyncio.sleep(0)

            await asyncio.gather(*(worker(i) for i in range(tasks)))
    finally:
        stop.set()
        await asyncio.to_thread(thread.join)
    assert collections > 1
    assert d.get("aiolock.acquire.duration", outcome="granted") == tasks * cycles
    assert d.get("aiolock.hold.duration") == tasks * cycles
    assert d.get("aiolock.leases.held") == 0
    # spans start in the same flushes, racing the ends on the loop's thread: each once
    for name in ("aiolock.acquire", "aiolock.release"):
        spans = otel.spans(name)
        assert len(spans) == tasks * cycles, name
        assert len({s.context.span_id for s in spans if s.context}) == tasks * cycles, name


async def test_the_acquire_points_exemplar_is_its_span(otel: Telemetry) -> None:
    """The acquire point is recorded later, but in the context it was made in: with a
    sampled acquire span, the SDK's exemplar points to that span."""
    got = _telemetry._get()
    assert got is not None
    if not got.with_context:
        pytest.skip("this opentelemetry-api's record() takes no context (< 1.27): no exemplar link")
    otel.reader.get_metrics_data()  # exemplars so far are collected and gone
    otel.exporter.clear()
    async with aiolock.connect(url()) as locks, locks.lock(NAME):
        pass
    [span] = otel.spans("aiolock.acquire")
    data = otel.reader.get_metrics_data()
    assert data is not None
    exemplars = [e for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
                 if m.name == "aiolock.acquire.duration" for p in m.data.data_points
                 for e in getattr(p, "exemplars", ())]
    if not exemplars:
        pytest.skip("this opentelemetry-sdk keeps no exemplars")
    assert span.context is not None
    assert span.context.span_id in {e.span_id for e in exemplars}


def test_points_of_the_last_cycle_reach_the_exporter_at_shutdown() -> None:
    """A program that takes a lock and exits: the periodic reader's last export (at the
    provider's shutdown) has the last cycle's points, though no interval ever passed."""
    out = _child("""
        import asyncio
        from opentelemetry import metrics
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import (
            MetricExporter, MetricExportResult, PeriodicExportingMetricReader)
        class Keep(MetricExporter):
            def __init__(self):
                super().__init__()
                self.exported = []
            def export(self, data, timeout_millis=10_000, **kwargs):
                self.exported.append(data)
                return MetricExportResult.SUCCESS
            def force_flush(self, timeout_millis=10_000):
                return True
            def shutdown(self, timeout_millis=30_000, **kwargs):
                pass
        exporter = Keep()
        provider = MeterProvider(metric_readers=[PeriodicExportingMetricReader(
            exporter, export_interval_millis=3_600_000)])
        metrics.set_meter_provider(provider)
        import aiolock
        async def main():
            async with aiolock.connect("memory://") as locks:
                for _ in range(3):
                    async with locks.lock("x"):
                        pass
        asyncio.run(main())
        provider.shutdown()
        counts = {}
        for data in exporter.exported:
            for rm in data.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        if m.name in ("aiolock.acquire.duration", "aiolock.hold.duration"):
                            counts[m.name] = sum(p.count for p in m.data.data_points)
        print(sorted(counts.items()))
    """)
    assert out.strip() == "[('aiolock.acquire.duration', 3), ('aiolock.hold.duration', 3)]"


def test_points_made_outside_an_event_loop_are_recorded_at_once(otel: Telemetry) -> None:
    """Outside a running loop (a thread, the interpreter's exit) nothing would flush on a
    next turn: the point goes to the SDK at once."""
    got = _telemetry._get()
    assert got is not None
    d = Delta(otel)
    labels = _telemetry._labels_of("memory", aiolock.Kind.LOCK)
    _telemetry._point(got, got.leases_lost.add, 1, labels.outcomes["gone"])
    assert not _telemetry._pending
    assert d.get("aiolock.leases.lost", outcome="gone") == 1


async def test_a_task_that_never_yields_does_not_pile_points_up(otel: Telemetry) -> None:
    """memory:// cycles can run without the loop turning: the points waiting stay few
    (the task pays for them inline) and none is lost."""
    d = Delta(otel)
    async with aiolock.connect(url()) as locks:
        lock = locks.lock(NAME, watchdog=False)
        most = 0
        for _ in range(1000):
            async with lock:
                pass
            most = max(most, len(_telemetry._pending))
    assert most <= _telemetry.MAX_PENDING
    assert d.get("aiolock.hold.duration") == 1000


async def test_a_point_the_sdk_refuses_is_logged_once_and_the_lock_goes_on(
        otel: Telemetry, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """An SDK that raises on record() (it should not: it logs) costs neither the lock
    nor the log: the first refusal is a WARNING with its traceback, the next ones quiet."""
    got = _telemetry._get()
    assert got is not None

    class Refusing:
        def record(self, *args: object) -> None:
            raise RuntimeError("refused")

    monkeypatch.setattr(got, "hold_duration", Refusing())
    monkeypatch.setattr(_telemetry, "_refusals", 0)
    with caplog.at_level("WARNING", logger="aiolock.telemetry"):
        async with aiolock.connect(url()) as locks:
            for _ in range(5):
                async with locks.lock(NAME):
                    pass
                await asyncio.sleep(0.001)  # the loop idles: the points' turn
    warnings = [r for r in caplog.records if r.name == "aiolock.telemetry"]
    assert len(warnings) == 1 and warnings[0].exc_info is not None
    assert _telemetry._refusals == 5


def test_a_forked_child_does_not_record_its_parents_waiting_points() -> None:
    out = _child("""
        import asyncio, os
        from opentelemetry import metrics
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))
        import aiolock
        from aiolock import _telemetry
        async def main():
            async with aiolock.connect("memory://") as locks:
                lease = await locks.lock("x").acquire()
                assert _telemetry._pending  # the acquire point, waiting for its turn
                pid = os.fork()
                if pid == 0:
                    os._exit(0 if not _telemetry._pending else 1)
                _, status = os.waitpid(pid, 0)
                assert _telemetry._pending  # the parent's are still its own
                await lease.release()
                return os.waitstatus_to_exitcode(status)
        print(asyncio.run(main()))
    """)
    assert out.strip() == "0"


def test_exemplars_take_each_points_own_context_without_a_tracer_provider() -> None:
    """Metrics only (no tracer provider), tasks running inside propagated, sampled remote
    parents (a traceparent an incoming request carried): each point's exemplar names its
    own task's trace, not the trace of whichever task scheduled the flush. The reservoir
    keeps the last point of each bucket: B's and D's (released after A and C)."""
    out = _child("""
        import asyncio, inspect
        from opentelemetry import context as ctx, metrics
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context
        reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        import aiolock
        from aiolock import _telemetry
        async def main():
            async with aiolock.connect("memory://") as locks:
                async def task(trace_id, hold):
                    parent = NonRecordingSpan(SpanContext(trace_id, 0x1000 + trace_id, True, TraceFlags(1)))
                    token = ctx.attach(set_span_in_context(parent))
                    try:
                        async with locks.lock(f"n{trace_id}", watchdog=False):
                            await asyncio.sleep(hold)
                    finally:
                        ctx.detach(token)
                await asyncio.gather(task(0xA, 0.02), task(0xB, 0.02))  # one bucket
                await asyncio.gather(task(0xC, 0.2), task(0xD, 0.2))  # another
        asyncio.run(main())
        if not _telemetry._get().with_context:
            print("no context parameter")
        else:
            data = reader.get_metrics_data()
            print(sorted(hex(e.trace_id) for rm in data.resource_metrics for sm in rm.scope_metrics
                         for m in sm.metrics if m.name == "aiolock.hold.duration"
                         for p in m.data.data_points for e in p.exemplars))
    """)
    if out.strip() == "no context parameter":
        pytest.skip("this opentelemetry-api's record() takes no context (< 1.28): no exemplars")
    assert out.strip() == "['0xb', '0xd']"


async def test_a_loop_in_another_thread_does_not_make_this_one_pile_flushes(otel: Telemetry) -> None:
    """One scheduled flush per loop at a time, per thread: a loop cycling in another
    thread does not make this loop, which never turns meanwhile, queue a flush per
    inline flush."""
    import threading
    import time

    stop = threading.Event()

    def other() -> None:
        async def main() -> None:
            async with aiolock.connect(url()) as locks:
                while not stop.is_set():
                    async with locks.lock(NAME):
                        pass
                    await asyncio.sleep(0)

        asyncio.run(main())

    thread = threading.Thread(target=other)
    thread.start()
    loop = asyncio.get_running_loop()
    try:
        async with aiolock.connect(url()) as locks:
            lock = locks.lock(NAME, watchdog=False)
            start = time.perf_counter()
            while time.perf_counter() - start < 0.5:  # never lets the loop turn
                async with lock:
                    pass
            hops = sum(1 for h in loop._ready  # type: ignore[attr-defined]
                       if getattr(h, "_callback", None) is _telemetry._hop)
    finally:
        stop.set()
        await asyncio.to_thread(thread.join)
    assert hops <= 1


def test_a_collection_waits_for_a_point_being_recorded_by_another_thread(otel: Telemetry) -> None:
    """The loop's thread took a point off the queue and is inside the SDK's record()
    when another thread collects: the collection waits for it, rather than find the queue
    empty and collect without it (at the provider's shutdown it would be lost)."""
    import threading

    got = _telemetry._get()
    assert got is not None
    d = Delta(otel)
    labels = _telemetry._labels_of("memory", aiolock.Kind.LOCK)
    inside, go = threading.Event(), threading.Event()

    def slow_record(value: float, attributes: Any, context: Any = None) -> None:
        inside.set()
        go.wait(5)
        got.hold_duration.record(value, attributes)

    seen: list[float] = []

    def collector() -> None:
        inside.wait(5)
        threading.Timer(0.2, go.set).start()  # the record finishes 0.2 s into the collection
        seen.append(d.get("aiolock.hold.duration"))

    thread = threading.Thread(target=collector)
    thread.start()
    _telemetry._pending.append((slow_record, 0.01, labels.attrs, None))
    _telemetry.flush()  # this thread: takes the point, records it slowly
    thread.join(10)
    assert seen == [1]
