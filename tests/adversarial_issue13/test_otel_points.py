"""Adversarial tests of the promise that aiolock's OpenTelemetry metric points are handed to
the SDK once the event loop has nothing else to run (the docs said "two turns" when these
were written), "and a collection (a periodic reader's, the
provider's shutdown) first takes every point still waiting, so none is missed or counted
twice" (README "Metrics, traces and logs", docs/operations.md, SPEC.md §9), written from
those promises alone.

Each scenario runs in a child process of its own (the global providers can be set once per
process) with the real OpenTelemetry SDK: readers with DELTA temporality must see each
point in exactly one collection, cumulative ones every point, whatever thread collects and
whenever (right after ``release()`` with no loop turn, from another thread while the loop
is blocked, at the provider's shutdown after the loop was closed, at process exit).
"""

from __future__ import annotations

import textwrap
from typing import Any

from .conftest import ROOT, child_result

#: the code every child runs first: the SDK's pieces and a ``Tally`` of collections
PRELUDE = r'''
import asyncio, contextlib, gc, json, os, sys, threading, time, tracemalloc
import aiolock
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import (
    Counter, Histogram, MeterProvider, ObservableCounter, ObservableGauge,
    ObservableUpDownCounter, UpDownCounter)
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality, InMemoryMetricReader, MetricExporter, MetricExportResult,
    PeriodicExportingMetricReader)
from opentelemetry.sdk.metrics.export import Histogram as HistogramData, Sum as SumData
from opentelemetry.sdk.metrics.view import View
from opentelemetry.sdk.metrics._internal.exemplar import (
    SimpleFixedSizeExemplarReservoir, TraceBasedExemplarFilter)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

DELTA = AggregationTemporality.DELTA
CUMULATIVE = AggregationTemporality.CUMULATIVE


def temporality(delta):
    t = DELTA if delta else CUMULATIVE
    return {Counter: t, Histogram: t, ObservableCounter: t, UpDownCounter: CUMULATIVE,
            ObservableUpDownCounter: CUMULATIVE, ObservableGauge: CUMULATIVE}


def reader(delta=True):
    return InMemoryMetricReader(preferred_temporality=temporality(delta))


class Tally:
    """What collections gave: histogram counts and counter increments summed over every
    collection (keys: metric, metric/outcome, metric/backend, metric/kind,
    metric/backend/outcome); up-down counters as the last collection gave them (``now``);
    exemplars of acquire.duration / hold.duration as (trace_id, span_id) hex pairs."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {}
        self.now = {}
        self.attr_keys = set()
        self.attr_values = set()
        self.collections = 0
        self.exemplars = {}

    def add(self, data):
        if data is None:
            return self
        with self.lock:
            self.collections += 1
            now = {}
            for rm in data.resource_metrics:
                for sm in rm.scope_metrics:
                    if sm.scope.name != "aiolock":
                        continue
                    for m in sm.metrics:
                        for dp in m.data.data_points:
                            attrs = dict(dp.attributes or {})
                            self.attr_keys.update(attrs)
                            self.attr_values.update(str(v) for v in attrs.values())
                            keys = [m.name] + [f"{m.name}/{attrs[k]}" for k in (
                                "aiolock.outcome", "aiolock.backend", "aiolock.kind") if k in attrs]
                            if "aiolock.outcome" in attrs and "aiolock.backend" in attrs:
                                keys.append(f"{m.name}/{attrs['aiolock.backend']}/{attrs['aiolock.outcome']}")
                            if isinstance(m.data, HistogramData):
                                value = dp.count
                                for e in getattr(dp, "exemplars", None) or ():
                                    self.exemplars.setdefault(m.name, []).append(
                                        [format(e.trace_id or 0, "032x"), format(e.span_id or 0, "016x")])
                            elif isinstance(m.data, SumData) and m.data.is_monotonic:
                                value = dp.value
                            else:
                                for k in keys:
                                    now[k] = now.get(k, 0) + dp.value
                                continue
                            for k in keys:
                                self.counts[k] = self.counts.get(k, 0) + value
            self.now = now
        return self

    def result(self):
        with self.lock:
            return {"counts": dict(self.counts), "now": dict(self.now),
                    "attr_keys": sorted(self.attr_keys), "attr_values": sorted(self.attr_values),
                    "collections": self.collections, "exemplars": dict(self.exemplars)}


def snap(r):
    """One collection of reader ``r``, as a Tally result."""
    return Tally().add(r.get_metrics_data()).result()


class TallyExporter(MetricExporter):
    """A push exporter (for PeriodicExportingMetricReader) adding every export to a Tally;
    ``on_shutdown`` is called with the tally when the provider shuts it down."""

    def __init__(self, delta=True, on_shutdown=None):
        super().__init__(preferred_temporality=temporality(delta))
        self.tally = Tally()
        self.on_shutdown = on_shutdown

    def export(self, metrics_data, timeout_millis=10_000, **kwargs):
        self.tally.add(metrics_data)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis=10_000):
        return True

    def shutdown(self, timeout_millis=30_000, **kwargs):
        if self.on_shutdown is not None:
            self.on_shutdown(self.tally)


def setup(*readers, traces=True, views=(), **options):
    provider = MeterProvider(metric_readers=list(readers), views=list(views), **options)
    metrics.set_meter_provider(provider)
    spans = InMemorySpanExporter()
    if traces:
        tp = TracerProvider()
        tp.add_span_processor(SimpleSpanProcessor(spans))
        trace.set_tracer_provider(tp)
    return provider, spans


class SeenFilter(TraceBasedExemplarFilter):
    """An exemplar filter (the SDK asks it once per synchronous measurement, as the
    measurement reaches the SDK): records which aiolock histogram points reached the SDK,
    and when, without a collection."""

    def __init__(self):
        self.seen = []

    def should_sample(self, value, time_unix_nano, attributes, context):
        attrs = dict(attributes or {})
        if "aiolock.kind" in attrs:
            self.seen.append([value, attrs.get("aiolock.outcome")])
        return super().should_sample(value, time_unix_nano, attributes, context)


def hexid(ctx):
    return [format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")]


def emit(**result):
    result.setdefault("aiolock_file", aiolock.__file__)
    print("RESULT " + json.dumps(result, default=str), flush=True)
'''


def run_child(body: str, *, timeout: float = 25.0) -> dict[str, Any]:
    """Run PRELUDE + ``body`` in a child Python (the worktree's aiolock on its path) and
    return the JSON of its ``RESULT`` line."""
    return child_result(PRELUDE + "\n" + textwrap.dedent(body), timeout=timeout,
                        unset=("OTEL_METRICS_EXEMPLAR_FILTER",),
                        forbidden=("Traceback", "Exception in callback", "Non-thread-safe"))


def c(snapshot: dict[str, Any], key: str) -> float:
    """A summed count (histogram points / counter increments) of a Tally result."""
    return float(snapshot["counts"].get(key, 0))


def now(snapshot: dict[str, Any], key: str) -> float:
    """An up-down counter's value in a Tally result's last collection."""
    return float(snapshot["now"].get(key, 0))


def assert_nothing(snapshot: dict[str, Any], what: str) -> None:
    """A DELTA collection that must hold no new point (no point counted twice)."""
    new = {k: v for k, v in snapshot["counts"].items() if v}
    assert not new, f"{what}: points collected a second time: {new}"


# ---------------------------------------------------------------- no loop turn needed


def test_collection_right_after_acquire_and_release_has_every_point_once() -> None:
    """Collect synchronously right after ``await lock.acquire()`` and right after ``await
    lease.release()`` (no loop turn in between): the points are there; the loop's later
    turns hand nothing twice; a cumulative reader saw exactly one of each."""
    got = run_child('''
        rd, rc = reader(True), reader(False)
        provider, spans = setup(rd, rc)
        out = {}

        async def main():
            async with aiolock.connect("memory://") as locks:
                lease = await locks.lock("secret-lock-name-A").acquire()
                out["acquired"] = snap(rd)
                out["spans_acquired"] = [s.name for s in spans.get_finished_spans()]
                await lease.release()
                out["released"] = snap(rd)
                out["spans_released"] = [s.name for s in spans.get_finished_spans()]
                for _ in range(5):
                    await asyncio.sleep(0)
                await asyncio.sleep(0.02)
                out["turns"] = snap(rd)
            out["cumulative"] = snap(rc)

        asyncio.run(main())
        emit(**out)
    ''')
    assert got["aiolock_file"].startswith(str(ROOT / "aiolock")), got["aiolock_file"]
    acq, rel = got["acquired"], got["released"]
    assert c(acq, "aiolock.acquire.duration/granted") == 1, acq
    assert c(acq, "aiolock.acquire.duration") == 1, acq
    assert c(acq, "aiolock.hold.duration") == 0, acq
    assert now(acq, "aiolock.leases.held") == 1, acq
    assert got["spans_acquired"] == ["aiolock.acquire"]
    assert c(rel, "aiolock.hold.duration/memory") == 1, rel
    assert c(rel, "aiolock.acquire.duration") == 0, f"acquire point counted twice: {rel}"
    assert now(rel, "aiolock.leases.held") == 0, rel
    assert sorted(got["spans_released"]) == ["aiolock.acquire", "aiolock.release"]
    assert_nothing(got["turns"], "after the loop's next turns")
    cum = got["cumulative"]
    assert c(cum, "aiolock.acquire.duration/memory/granted") == 1, cum
    assert c(cum, "aiolock.hold.duration/lock") == 1, cum
    for snapshot in (acq, rel, cum):
        assert set(snapshot["attr_keys"]) <= {"aiolock.backend", "aiolock.kind", "aiolock.outcome"}
        assert "secret-lock-name-A" not in snapshot["attr_values"]


def test_timeout_and_cancelled_outcomes_collected_in_the_failing_task_itself() -> None:
    """``LockTimeout`` (timeout=0 and a waited timeout), a cancelled waiter and an
    ``asyncio.timeout`` around acquire: a collection made in the ``except`` block of the
    very task, with no loop turn, has the point with its outcome, exactly once; the
    waiters counter shows the waiter and then drops back to 0."""
    got = run_child('''
        rd = reader(True)
        provider, spans = setup(rd)
        out = {}

        async def main():
            async with aiolock.connect("memory://") as locks:
                holder = await asyncio.create_task(locks.lock("b").acquire())  # another task's
                out["start"] = snap(rd)
                lock = locks.lock("b")
                try:
                    await lock.acquire(timeout=0)
                except aiolock.LockTimeout:
                    out["try0"] = snap(rd)
                try:
                    await lock.acquire(timeout=0.05)
                except aiolock.LockTimeout:
                    out["waited"] = snap(rd)

                async def victim():
                    try:
                        await lock.acquire()
                    except asyncio.CancelledError:
                        out["cancelled"] = snap(rd)
                        raise

                task = asyncio.create_task(victim())
                await asyncio.sleep(0.05)
                out["waiting"] = snap(rd)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                try:
                    async with asyncio.timeout(0.05):
                        await lock.acquire()
                except TimeoutError:
                    out["asyncio_timeout"] = snap(rd)
                await holder.release()
                out["released"] = snap(rd)
                for _ in range(5):
                    await asyncio.sleep(0)
                out["turns"] = snap(rd)
            out["spans"] = [[s.attributes.get("aiolock.outcome"), s.status.status_code.name]
                            for s in spans.get_finished_spans() if s.name == "aiolock.acquire"]

        asyncio.run(main())
        emit(**out)
    ''')
    for step, outcome in (("try0", "timeout"), ("waited", "timeout"), ("cancelled", "cancelled"),
                          ("asyncio_timeout", "cancelled")):
        assert step in got, f"{step}: the expected exception was not raised"
        snapshot = got[step]
        assert c(snapshot, f"aiolock.acquire.duration/{outcome}") == 1, (step, snapshot)
        assert c(snapshot, "aiolock.acquire.duration") == 1, (step, snapshot)
        assert now(snapshot, "aiolock.waiters") == 0, (step, snapshot)
    assert now(got["waiting"], "aiolock.waiters") == 1, got["waiting"]
    assert c(got["released"], "aiolock.hold.duration") == 1, got["released"]
    assert now(got["released"], "aiolock.leases.held") == 0, got["released"]
    assert_nothing(got["turns"], "after the loop's next turns")
    assert got["spans"] == [["granted", "UNSET"], ["timeout", "UNSET"], ["timeout", "UNSET"],
                            ["cancelled", "UNSET"], ["cancelled", "UNSET"]], got["spans"]


def test_error_outcome_and_gone_loss_on_a_private_redis() -> None:
    """A private redis-server: a lease whose keys vanish (FLUSHALL) is lost ``gone``; the
    server killed, acquire fails with outcome ``error`` (span status ERROR). Each point is
    in a collection made right after, no loop turn in between, exactly once."""
    got = run_child('''
        from tests.servers import RedisServer
        import redis.asyncio as redis_asyncio

        rd = reader(True)
        provider, spans = setup(rd)
        out = {}
        server = RedisServer().start()

        async def main():
            locks = aiolock.connect(server.url, connect_timeout=0.5, request_timeout=0.5)
            try:
                lease = await locks.lock("c").acquire()
                await lease.release()
                out["ok"] = snap(rd)
                lease = await locks.lock("gone", ttl=0.9).acquire()
                snap(rd)
                client = redis_asyncio.Redis(host="127.0.0.1", port=server.port)
                await client.flushall()
                await client.aclose()
                async with asyncio.timeout(5):
                    await lease.wait_lost()
                out["gone"] = snap(rd)
                await lease.release()
                for _ in range(5):
                    await asyncio.sleep(0)
                out["gone_turns"] = snap(rd)
                server.kill()
                try:
                    await locks.lock("c").acquire(timeout=2)
                except Exception as exc:
                    out["error_type"] = type(exc).__name__
                    out["error"] = snap(rd)
                for _ in range(5):
                    await asyncio.sleep(0)
                out["error_turns"] = snap(rd)
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(locks.aclose(), 3)
            out["spans"] = [[s.attributes.get("aiolock.outcome"), s.status.status_code.name]
                            for s in spans.get_finished_spans() if s.name == "aiolock.acquire"]

        try:
            asyncio.run(main())
        finally:
            server.close()
        emit(**out)
    ''')
    ok = got["ok"]
    assert c(ok, "aiolock.acquire.duration/redis/granted") == 1, ok
    assert c(ok, "aiolock.hold.duration/redis") == 1, ok
    gone = got["gone"]
    assert c(gone, "aiolock.leases.lost/gone") == 1, gone
    assert c(gone, "aiolock.leases.lost") == 1, gone
    assert c(gone, "aiolock.hold.duration") == 1, gone
    assert now(gone, "aiolock.leases.held") == 0, gone
    assert_nothing(got["gone_turns"], "after the lost lease's release and turns")
    assert "error" in got, "acquire on a killed server raised nothing"
    err = got["error"]
    assert c(err, "aiolock.acquire.duration/redis/error") == 1, (got["error_type"], err)
    assert c(err, "aiolock.acquire.duration") == 1, err
    assert_nothing(got["error_turns"], "after the failed acquire's turns")
    assert ["error", "ERROR"] in got["spans"], got["spans"]
    assert all(status != "ERROR" for outcome, status in got["spans"] if outcome != "error")


def test_lost_leases_collected_at_once_expired_revoked_closed() -> None:
    """``expired`` (watchdog off), ``revoked`` (force_release) and ``closed`` (aclose while
    held): the lost counter and the hold point are in a collection made right after the
    loss is seen, once; leases.held back to 0."""
    got = run_child('''
        rd = reader(True)
        provider, spans = setup(rd)
        out = {}

        async def main():
            async with aiolock.connect("memory://") as locks:
                lease = await locks.lock("exp", ttl=0.2, watchdog=False).acquire()
                snap(rd)
                async with asyncio.timeout(5):
                    await lease.wait_lost()
                out["expired"] = snap(rd)
                await lease.release()
                out["expired_release"] = snap(rd)

                lock = locks.lock("rev", ttl=0.6)
                lease = await lock.acquire()
                snap(rd)
                assert await locks.lock("rev").force_release()
                async with asyncio.timeout(5):
                    await lease.wait_lost()
                out["revoked"] = snap(rd)
                await lease.release()
                out["revoked_release"] = snap(rd)

            closing = aiolock.connect("memory://closing")
            lease = await closing.lock("cl").acquire()
            snap(rd)
            await closing.aclose()
            out["closed"] = snap(rd)
            for _ in range(5):
                await asyncio.sleep(0)
            await asyncio.sleep(0.05)
            out["turns"] = snap(rd)

        asyncio.run(main())
        emit(**out)
    ''')
    for step in ("expired", "revoked", "closed"):
        snapshot = got[step]
        assert c(snapshot, f"aiolock.leases.lost/{step}") == 1, (step, snapshot)
        assert c(snapshot, "aiolock.leases.lost") == 1, (step, snapshot)
        assert c(snapshot, "aiolock.hold.duration") == 1, (step, snapshot)
        assert now(snapshot, "aiolock.leases.held") == 0, (step, snapshot)
    assert_nothing(got["expired_release"], "releasing an expired lease")
    assert_nothing(got["revoked_release"], "releasing a revoked lease")
    assert_nothing(got["turns"], "after the loop's next turns")


def test_points_reach_the_sdk_on_the_next_turn_not_inside_acquire_or_release() -> None:
    """Watched with an exemplar filter (the SDK asks it as each measurement arrives), no
    collection: nothing reaches the SDK inside ``acquire()`` / ``release()``; one loop
    turn later the point is there, with the duration of the event itself (not stretched by
    a loop that stays blocked before its next turn)."""
    got = run_child('''
        seen = SeenFilter()
        provider, spans = setup(reader(True), exemplar_filter=seen, traces=False)
        out = {}

        async def main():
            async with aiolock.connect("memory://") as locks:
                lease = await locks.lock("n").acquire()
                out["inside_acquire"] = list(seen.seen)
                time.sleep(0.5)  # the loop is blocked before its next turn
                await asyncio.sleep(0.001)  # the loop idles: handed over (README)
                out["acquire_turn"] = list(seen.seen)
                await asyncio.sleep(0.1)
                await lease.release()
                out["inside_release"] = list(seen.seen)
                time.sleep(0.5)
                await asyncio.sleep(0.001)  # the loop idles: handed over (README)
                out["release_turn"] = list(seen.seen)

                async def holder():
                    held = await locks.lock("n").acquire()
                    await asyncio.sleep(0.8)
                    await held.release()

                task = asyncio.create_task(holder())
                await asyncio.sleep(0.01)
                try:
                    await locks.lock("n").acquire(timeout=0.1)
                except aiolock.LockTimeout:
                    time.sleep(0.5)
                    await asyncio.sleep(0.001)  # the loop idles: handed over (README)
                    out["timeout_turn"] = list(seen.seen)
                await task

        asyncio.run(main())
        emit(**out)
    ''')
    assert got["inside_acquire"] == [], f"handed to the SDK inside acquire(): {got['inside_acquire']}"
    assert len(got["acquire_turn"]) == 1 and got["acquire_turn"][0][1] == "granted", got["acquire_turn"]
    assert got["acquire_turn"][0][0] < 0.4, f"acquire.duration counts the blocked loop: {got['acquire_turn']}"
    assert got["inside_release"] == got["acquire_turn"], (
        f"handed to the SDK inside release(): {got['inside_release']}")
    assert len(got["release_turn"]) == 2, got["release_turn"]
    hold = got["release_turn"][1][0]
    assert 0.59 <= hold < 0.95, f"hold.duration {hold}: not from grant to release"
    timeout = [v for v, outcome in got["timeout_turn"] if outcome == "timeout"]
    assert len(timeout) == 1 and 0.09 <= timeout[0] < 0.45, got["timeout_turn"]


def test_points_stranded_by_a_closed_loop_do_not_stop_a_new_loop_handing_its_own() -> None:
    """A loop stopped and closed right after a release (its next turn never comes): a new
    loop's points still reach the SDK on its next turn, and a collection then has every
    point of both loops exactly once."""
    got = run_child('''
        seen = SeenFilter()
        rd = reader(True)
        provider, spans = setup(rd, exemplar_filter=seen, traces=False)
        out = {}
        loop = asyncio.new_event_loop()

        async def first():
            locks = aiolock.connect("memory://a")
            lease = await locks.lock("s").acquire()
            await lease.release()
            loop.stop()

        loop.create_task(first())
        loop.run_forever()
        loop.close()
        out["after_close"] = len(seen.seen)

        async def second():
            async with aiolock.connect("memory://b") as locks:
                for _ in range(3):
                    before = len(seen.seen)
                    lease = await locks.lock("s").acquire()
                    await lease.release()
                    await asyncio.sleep(0.001)  # the loop idles: handed over (README)
                    out.setdefault("handed_per_cycle", []).append(len(seen.seen) - before)
            out["tally"] = snap(rd)

        asyncio.run(second())
        emit(**out)
    ''')
    assert all(n >= 2 for n in got["handed_per_cycle"]), (
        f"the new loop's points did not reach the SDK on its next turn: {got}")
    t = got["tally"]
    assert c(t, "aiolock.acquire.duration") == 4, t["counts"]
    assert c(t, "aiolock.hold.duration") == 4, t["counts"]


# ---------------------------------------------------------------- collections in other threads


def test_collection_from_another_thread_while_the_loop_is_blocked() -> None:
    """The loop's thread releases and then blocks (no next turn): a collection from
    another thread, and a periodic reader's, take the waiting points at once, with
    exemplars still pointing to the acquire and release spans; once the loop turns again
    nothing is handed twice."""
    got = run_child('''
        rd = reader(True)
        exporter = TallyExporter(True)
        periodic = PeriodicExportingMetricReader(exporter, export_interval_millis=20)
        view = View(instrument_name="aiolock.*", exemplar_reservoir_factory=lambda agg: (
            lambda **kw: SimpleFixedSizeExemplarReservoir(size=64)))
        provider, spans = setup(rd, periodic, views=[view])
        out = {}
        released, taken = threading.Event(), threading.Event()

        def loop_thread():
            async def main():
                async with aiolock.connect("memory://") as locks:
                    lease = await locks.lock("g").acquire()
                    await lease.release()
                    released.set()
                    out["blocked"] = taken.wait(10)  # the loop cannot turn meanwhile
                    for _ in range(5):
                        await asyncio.sleep(0)
                    await asyncio.sleep(0.1)
            asyncio.run(main())

        th = threading.Thread(target=loop_thread)
        th.start()
        assert released.wait(10)
        out["other_thread"] = snap(rd)
        time.sleep(0.3)
        out["periodic_while_blocked"] = exporter.tally.result()
        taken.set()
        th.join(10)
        out["after"] = snap(rd)
        provider.shutdown()
        out["periodic_total"] = exporter.tally.result()
        out["spans"] = {s.name: hexid(s.context) for s in spans.get_finished_spans()}
        emit(**out)
    ''')
    assert got["blocked"] is True
    other = got["other_thread"]
    assert c(other, "aiolock.acquire.duration/granted") == 1, other
    assert c(other, "aiolock.hold.duration") == 1, other
    assert other["exemplars"].get("aiolock.acquire.duration") == [got["spans"]["aiolock.acquire"]], other
    assert other["exemplars"].get("aiolock.hold.duration") == [got["spans"]["aiolock.release"]], other
    blocked = got["periodic_while_blocked"]
    assert c(blocked, "aiolock.acquire.duration") == 1, blocked
    assert c(blocked, "aiolock.hold.duration") == 1, blocked
    assert_nothing(got["after"], "after the loop turned again")
    total = got["periodic_total"]
    assert c(total, "aiolock.acquire.duration") == 1, total
    assert c(total, "aiolock.hold.duration") == 1, total


def test_tight_collector_thread_and_periodic_reader_while_50_tasks_cycle() -> None:
    """50 tasks on 4 memory:// locks (with timeout=0 tries that fail), two threads each
    collecting a DELTA reader of their own in a tight loop (racing each other to take the
    waiting points), a periodic reader every millisecond (DELTA) and a cumulative reader:
    each reader sees every acquire and every hold exactly once."""
    got = run_child('''
        rd, rd2, rc = reader(True), reader(True), reader(False)
        exporter = TallyExporter(True)
        periodic = PeriodicExportingMetricReader(exporter, export_interval_millis=1)
        provider, spans = setup(rd, rd2, rc, periodic, traces=False)
        tight, tight2 = Tally(), Tally()
        stop = threading.Event()
        expected = {"granted": 0, "timeout": 0}

        def collector(r, tally):
            while not stop.is_set():
                tally.add(r.get_metrics_data())

        async def worker(locks, i):
            lock = locks.lock(f"e{i % 4}")
            for j in range(120):
                if j % 10 == 3:
                    try:
                        lease = await lock.acquire(timeout=0)
                    except aiolock.LockTimeout:
                        expected["timeout"] += 1
                        continue
                else:
                    lease = await lock.acquire()
                expected["granted"] += 1
                if j % 3 == 0:
                    await asyncio.sleep(0)
                await lease.release()

        async def main():
            async with aiolock.connect("memory://") as locks:
                await asyncio.gather(*(worker(locks, i) for i in range(50)))

        threads = [threading.Thread(target=collector, args=(rd, tight)),
                   threading.Thread(target=collector, args=(rd2, tight2))]
        for th in threads:
            th.start()
        asyncio.run(main())
        stop.set()
        for th in threads:
            th.join()
        tight.add(rd.get_metrics_data())
        tight2.add(rd2.get_metrics_data())
        cum = snap(rc)
        provider.shutdown()
        emit(expected=expected, tight=tight.result(), tight2=tight2.result(), cum=cum,
             periodic=exporter.tally.result())
    ''')
    exp = got["expected"]
    assert exp["timeout"] > 0
    for which in ("tight", "tight2", "cum", "periodic"):
        t = got[which]
        assert c(t, "aiolock.acquire.duration/granted") == exp["granted"], (which, exp, t["counts"])
        assert c(t, "aiolock.acquire.duration/timeout") == exp["timeout"], (which, exp, t["counts"])
        assert c(t, "aiolock.acquire.duration") == exp["granted"] + exp["timeout"], (which, t["counts"])
        assert c(t, "aiolock.hold.duration") == exp["granted"], (which, exp, t["counts"])
        assert now(t, "aiolock.leases.held") == 0, (which, t["now"])
        assert now(t, "aiolock.waiters") == 0, (which, t["now"])
    assert got["tight"]["collections"] > 20 and got["tight2"]["collections"] > 20, (
        "a collector thread hardly ran")
    assert got["periodic"]["collections"] > 5, "the periodic reader hardly ran"


def test_several_loops_in_threads_memory_and_redis_while_collecting() -> None:
    """Three threads each running their own loop on memory://, one on a private redis, all
    at once (two in asyncio debug mode: a loop touched from another thread says so), while a
    thread collects every millisecond: exact counts per backend."""
    got = run_child('''
        from tests.servers import RedisServer

        rd, rc = reader(True), reader(False)
        provider, spans = setup(rd, rc, traces=False)
        tight = Tally()
        stop = threading.Event()
        server = RedisServer().start()
        done = {}
        errors = []

        async def loop_main(url, tasks, cycles, key):
            count = 0
            async with aiolock.connect(url) as locks:
                async def worker(i):
                    nonlocal count
                    lock = locks.lock(f"{key}-{i % 3}", ttl=5)
                    for j in range(cycles):
                        lease = await lock.acquire(timeout=10)
                        count += 1
                        if j % 2:
                            await asyncio.sleep(0)
                        await lease.release()
                await asyncio.gather(*(worker(i) for i in range(tasks)))
            done[key] = count

        def thread(url, tasks, cycles, key, debug):
            try:
                asyncio.run(loop_main(url, tasks, cycles, key), debug=debug)
            except BaseException as exc:
                errors.append(repr(exc))

        def collector():
            while not stop.is_set():
                tight.add(rd.get_metrics_data())
                time.sleep(0.001)  # debug-mode loops crawl under a GIL-bound thread

        col = threading.Thread(target=collector)
        col.start()
        workers = [threading.Thread(target=thread, args=(f"memory://m{k}", 10, 50, f"m{k}", k == 0))
                   for k in range(3)]
        workers.append(threading.Thread(target=thread, args=(server.url, 5, 20, "redis", True)))
        try:
            for w in workers:
                w.start()
            for w in workers:
                w.join(20)
        finally:
            stop.set()
            col.join()
            server.close()
        tight.add(rd.get_metrics_data())
        emit(done=done, errors=errors, tight=tight.result(), cum=snap(rc))
    ''')
    assert not got["errors"], got["errors"]
    done = got["done"]
    memory = sum(v for k, v in done.items() if k.startswith("m"))
    assert memory == 3 * 10 * 50 and done["redis"] == 5 * 20, done
    for which in ("tight", "cum"):
        t = got[which]
        assert c(t, "aiolock.acquire.duration/memory/granted") == memory, (which, t["counts"])
        assert c(t, "aiolock.acquire.duration/redis/granted") == done["redis"], (which, t["counts"])
        assert c(t, "aiolock.hold.duration/memory") == memory, (which, t["counts"])
        assert c(t, "aiolock.hold.duration/redis") == done["redis"], (which, t["counts"])
        assert c(t, "aiolock.acquire.duration") == memory + done["redis"], (which, t["counts"])
        assert now(t, "aiolock.leases.held") == 0, (which, t["now"])


def test_task_that_never_yields_with_a_collector_thread_racing() -> None:
    """One task cycles 15,000 times on memory:// without ever letting the loop turn
    (uncontended acquire and release need no await that suspends) while another thread
    collects in a tight loop: every point once, across the racing collections."""
    got = run_child('''
        rd = reader(True)
        provider, spans = setup(rd, traces=False)
        tight = Tally()
        stop = threading.Event()
        out = {}

        def collector():
            while not stop.is_set():
                tight.add(rd.get_metrics_data())

        async def main():
            ticks = 0

            async def ticker():
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0)

            tick_task = asyncio.create_task(ticker())
            await asyncio.sleep(0)
            async with aiolock.connect("memory://") as locks:
                lock = locks.lock("ny")
                th = threading.Thread(target=collector)
                th.start()
                before = ticks
                for _ in range(15_000):
                    lease = await lock.acquire()
                    await lease.release()
                out["turns_during"] = ticks - before
                stop.set()
                th.join()
                tight.add(rd.get_metrics_data())
            tick_task.cancel()

        asyncio.run(main())
        tight.add(rd.get_metrics_data())
        emit(tight=tight.result(), **out)
    ''')
    t = got["tight"]
    assert got["turns_during"] == 0, "the cycle yielded: the scenario does not test what it says"
    assert t["collections"] > 5, t["collections"]
    assert c(t, "aiolock.acquire.duration/granted") == 15_000, t["counts"]
    assert c(t, "aiolock.hold.duration") == 15_000, t["counts"]
    assert now(t, "aiolock.leases.held") == 0, t["now"]


def test_never_yielding_task_memory_is_bounded_once_points_are_collected() -> None:
    """Rounds of 5,000 cycles with no loop turn, each followed by a synchronous
    collection (which takes every waiting point): the memory kept must not grow round
    after round (no point waits any more after a collection). It found a defect, fixed:
    each inline flush scheduled another callback on the loop that never turned (~300
    bytes per 64 cycles)."""
    got = run_child('''
        rd = reader(True)
        provider, spans = setup(rd, traces=False)
        out = {"after_round": []}
        total = Tally()

        async def main():
            async with aiolock.connect("memory://") as locks:
                lock = locks.lock("mem")
                for _ in range(200):
                    lease = await lock.acquire()
                    await lease.release()
                await asyncio.sleep(0.01)
                total.add(rd.get_metrics_data())
                gc.collect()
                tracemalloc.start(1)
                base = tracemalloc.get_traced_memory()[0]
                for _ in range(4):
                    for _ in range(5_000):
                        lease = await lock.acquire()
                        await lease.release()
                    total.add(rd.get_metrics_data())
                    gc.collect()
                    out["after_round"].append(tracemalloc.get_traced_memory()[0] - base)
                await asyncio.sleep(0)
                gc.collect()
                out["after_turn"] = tracemalloc.get_traced_memory()[0] - base
                tracemalloc.stop()

        asyncio.run(main())
        emit(total=total.result(), **out)
    ''', timeout=40)
    t = got["total"]
    assert c(t, "aiolock.acquire.duration") == 200 + 4 * 5_000, t["counts"]
    assert c(t, "aiolock.hold.duration") == 200 + 4 * 5_000, t["counts"]
    rounds = got["after_round"]
    growth = rounds[-1] - rounds[0]
    assert growth < 24_000, (
        f"memory grew by {growth} bytes over 3 rounds of 5,000 collected cycles: {rounds} "
        f"(after one loop turn: {got['after_turn']})")


def test_cancelled_releases_on_redis_record_one_hold_each() -> None:
    """On a private redis, releases cancelled after 0..7 loop steps, each followed by a
    second (no-op) release, and a lease released twice: one hold point per lease, never
    two, never none; leases.held back to 0; nothing handed twice on later turns."""
    got = run_child('''
        from tests.servers import RedisServer

        rd = reader(True)
        provider, spans = setup(rd, traces=False)
        out = {"per_step": []}
        server = RedisServer().start()

        async def release_cancelled_after(lease, steps):
            task = asyncio.create_task(lease.release())
            for _ in range(steps):
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        async def main():
            async with aiolock.connect(server.url) as locks:
                lock = locks.lock("cr", ttl=5)
                for steps in range(8):
                    lease = await lock.acquire(timeout=5)
                    snap(rd)
                    await release_cancelled_after(lease, steps)
                    await lease.release()
                    await lease.release()
                    out["per_step"].append(snap(rd))
                    assert not await lock.locked()
                for _ in range(5):
                    await asyncio.sleep(0)
                await asyncio.sleep(0.05)
                out["turns"] = snap(rd)

        try:
            asyncio.run(main())
        finally:
            server.close()
        emit(**out)
    ''')
    for steps, snapshot in enumerate(got["per_step"]):
        assert c(snapshot, "aiolock.hold.duration/redis") == 1, (steps, snapshot["counts"])
        assert now(snapshot, "aiolock.leases.held") == 0, (steps, snapshot["now"])
        assert c(snapshot, "aiolock.leases.lost") == 0, (steps, snapshot["counts"])
    assert_nothing(got["turns"], "after the loop's later turns")


def test_every_kind_collected_right_after_its_release() -> None:
    """Read and write leases, a semaphore permit and a leadership on memory://: a
    collection right after each release has its acquire and hold points with the right
    ``aiolock.kind``, once."""
    got = run_child('''
        rd = reader(True)
        provider, spans = setup(rd, traces=False)
        out = {}

        async def main():
            async with aiolock.connect("memory://") as locks:
                rw = locks.rwlock("rw")
                for kind, primitive in (("read", rw.read()), ("write", rw.write()),
                                        ("permit", locks.semaphore("sem", limit=2)),
                                        ("leader", locks.election("el").campaign())):
                    lease = await primitive.acquire()
                    await lease.release()
                    out[kind] = snap(rd)

        asyncio.run(main())
        emit(**out)
    ''')
    for kind in ("read", "write", "permit", "leader"):
        snapshot = got[kind]
        assert c(snapshot, f"aiolock.acquire.duration/{kind}") == 1, (kind, snapshot["counts"])
        assert c(snapshot, f"aiolock.hold.duration/{kind}") == 1, (kind, snapshot["counts"])
        assert c(snapshot, "aiolock.acquire.duration") == 1, (kind, snapshot["counts"])
        assert now(snapshot, "aiolock.leases.held") == 0, (kind, snapshot["now"])


def test_points_after_the_provider_shut_down_raise_nothing() -> None:
    """The provider shut down from inside the loop right after releases (no turn): its
    exporter got every point; cycles after that (with turns) raise nothing, log no
    callback error, and the lock still works."""
    got = run_child('''
        out = {}
        exporter = TallyExporter(True, lambda tally: out.__setitem__("at_shutdown", tally.result()))
        provider, spans = setup(PeriodicExportingMetricReader(
            exporter, export_interval_millis=3_600_000))

        async def main():
            async with aiolock.connect("memory://") as locks:
                for _ in range(4):
                    lease = await locks.lock("sd").acquire()
                    await lease.release()
                provider.shutdown()
                for i in range(200):
                    lease = await locks.lock("sd").acquire()
                    if i % 2:
                        await asyncio.sleep(0)
                    await lease.release()
                await asyncio.sleep(0.05)
                out["token"] = lease.token

        asyncio.run(main())
        emit(**out)
    ''')
    shut = got["at_shutdown"]
    assert c(shut, "aiolock.acquire.duration") == 4, shut["counts"]
    assert c(shut, "aiolock.hold.duration") == 4, shut["counts"]
    assert got["token"] == 204


# ---------------------------------------------------------------- loops that end abruptly


def test_loop_stopped_before_its_next_turn_then_provider_shutdown() -> None:
    """``loop.stop()`` right after a release, then ``loop.close()`` (its ready callbacks
    are dropped, the next turn never comes), then the provider's shutdown: the exporter
    gets every point. Then a second, fresh loop's points are recorded too."""
    got = run_child('''
        out = {}

        def on_shutdown(tally):
            out["at_shutdown"] = tally.result()

        exporter = TallyExporter(True, on_shutdown)
        periodic = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
        rc = reader(False)
        provider, spans = setup(periodic, rc)

        loop = asyncio.new_event_loop()

        async def first():
            locks = aiolock.connect("memory://first")
            for _ in range(3):
                lease = await locks.lock("h").acquire()
                await lease.release()
            loop.stop()

        loop.create_task(first())
        loop.run_forever()
        loop.close()
        out["cum_after_close"] = snap(rc)

        loop2 = asyncio.new_event_loop()

        async def second():
            async with aiolock.connect("memory://second") as locks:
                for _ in range(2):
                    lease = await locks.lock("h").acquire()
                    await lease.release()

        loop2.run_until_complete(second())
        loop2.close()
        provider.shutdown()
        emit(**out)
    ''')
    cum = got["cum_after_close"]
    assert c(cum, "aiolock.acquire.duration") == 3, cum
    assert c(cum, "aiolock.hold.duration") == 3, cum
    shut = got["at_shutdown"]
    assert c(shut, "aiolock.acquire.duration/granted") == 5, shut
    assert c(shut, "aiolock.hold.duration") == 5, shut


def test_run_until_complete_then_close_then_shutdown() -> None:
    """``loop.run_until_complete`` whose coroutine ends on a release, ``loop.close()`` (no
    ``asyncio.run`` shutdown), then ``provider.shutdown()``: the exporter gets every point
    exactly once."""
    got = run_child('''
        out = {}
        exporter = TallyExporter(True, lambda tally: out.__setitem__("at_shutdown", tally.result()))
        provider, spans = setup(PeriodicExportingMetricReader(
            exporter, export_interval_millis=3_600_000))

        async def cycle():
            locks = aiolock.connect("memory://")
            lease = await locks.lock("ruc").acquire()
            out["token"] = lease.token
            await lease.release()

        loop = asyncio.new_event_loop()
        loop.run_until_complete(cycle())
        loop.close()
        provider.shutdown()
        emit(**out)
    ''')
    shut = got["at_shutdown"]
    assert c(shut, "aiolock.acquire.duration/granted") == 1, shut
    assert c(shut, "aiolock.hold.duration") == 1, shut
    assert c(shut, "aiolock.acquire.duration") == 1, shut


def test_process_exit_after_asyncio_run_exports_every_point() -> None:
    """``asyncio.run`` then the interpreter's exit, with no explicit shutdown: the
    provider's own exit hook shuts its periodic reader down, and its last export has every
    point of the run (the last release's too)."""
    got = run_child('''
        def on_shutdown(tally):
            emit(at_exit=tally.result())

        exporter = TallyExporter(True, on_shutdown)
        provider, spans = setup(PeriodicExportingMetricReader(
            exporter, export_interval_millis=3_600_000), traces=False)

        async def main():
            async with aiolock.connect("memory://") as locks:
                for i in range(300):
                    lease = await locks.lock(f"x{i % 7}").acquire()
                    await lease.release()
                lease = await locks.lock("last").acquire()
                await lease.release()

        asyncio.run(main())
    ''')
    t = got["at_exit"]
    assert c(t, "aiolock.acquire.duration/granted") == 301, t
    assert c(t, "aiolock.hold.duration") == 301, t
    assert now(t, "aiolock.leases.held") == 0, t


# ---------------------------------------------------------------- exemplars and spans


def test_exemplars_point_to_each_tasks_own_spans_under_concurrency() -> None:
    """Twelve tasks, each in its own trace, acquire and release concurrently (points
    waiting for the same next turn): every acquire.duration exemplar is the trace and span
    of that task's own ``aiolock.acquire`` span, every hold.duration one its own
    ``aiolock.release`` span, and the acquire spans are children of the task's span."""
    got = run_child('''
        rd = reader(True)
        view = View(instrument_name="aiolock.*", exemplar_reservoir_factory=lambda agg: (
            lambda **kw: SimpleFixedSizeExemplarReservoir(size=256)))
        provider, spans = setup(rd, views=[view])
        tracer = trace.get_tracer("user")
        out = {"users": []}

        async def one(locks, i):
            with tracer.start_as_current_span(f"user{i}") as span:
                out["users"].append(hexid(span.get_span_context()))
                for _ in range(2):
                    lease = await locks.lock(f"k{i % 3}").acquire()
                    await asyncio.sleep(0.001 * (i % 4))
                    await lease.release()

        async def main():
            async with aiolock.connect("memory://") as locks:
                await asyncio.gather(*(one(locks, i) for i in range(12)))
            out["tally"] = snap(rd)

        asyncio.run(main())
        out["spans"] = [[s.name, hexid(s.context), s.parent and format(s.parent.span_id, "016x")]
                        for s in spans.get_finished_spans() if s.name.startswith("aiolock.")]
        emit(**out)
    ''')
    t = got["tally"]
    assert c(t, "aiolock.acquire.duration") == 24 and c(t, "aiolock.hold.duration") == 24, t
    acquire_spans = sorted(ids for name, ids, _ in got["spans"] if name == "aiolock.acquire")
    release_spans = sorted(ids for name, ids, _ in got["spans"] if name == "aiolock.release")
    assert len(acquire_spans) == 24 and len(release_spans) == 24
    user_spans = {tuple(ids) for ids in got["users"]}
    parents = {(ids[0], parent) for name, ids, parent in got["spans"] if name == "aiolock.acquire"}
    assert parents <= user_spans, "an aiolock.acquire span is not a child of its task's span"
    assert sorted(t["exemplars"].get("aiolock.acquire.duration", [])) == acquire_spans, (
        "acquire.duration exemplars are not exactly the acquire spans")
    assert sorted(t["exemplars"].get("aiolock.hold.duration", [])) == release_spans, (
        "hold.duration exemplars are not exactly the release spans")
