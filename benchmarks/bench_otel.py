"""What OpenTelemetry costs aiolock: uncontended acquire+release cycles per second.

One task acquires and releases one lock in a loop (watchdog on), on ``memory://`` and on a
private ``redis-server`` (``--backends`` picks others: ``zookeeper``, ``postgres``,
private servers too; ``--no-redis`` is ``--backends memory``), in four setups, each in its own
child process, alternating in the same run (``--runs`` rounds, the order rotated each
round, so drifting machine load hits every setup alike):

* ``absent``: ``opentelemetry`` cannot be imported (blocked in the child): the baseline;
* ``api``: ``opentelemetry-api`` installed, no SDK configured (a library's usual case);
* ``sdk-metrics``: the SDK's ``MeterProvider`` with a metric reader (no tracer provider);
* ``sdk-sampled``: metrics and traces as production usually runs them: a ``TracerProvider``
  sampling 1 % of traces (``ParentBased(TraceIdRatioBased(0.01))``) with a
  ``BatchSpanProcessor`` whose exporter drops the spans;
* ``sdk``: metrics and every trace: the same, sampling all (what an OTLP exporter costs the
  caller's thread, minus I/O).

It prints, per backend and setup, the median over the rounds, the range, and the median's
cost against ``absent``, of cycles per second of the process's CPU time (all its threads:
the span exporter's too) and of wall time. On a busy machine the wall time mostly measures
the neighbours; CPU time is what telemetry adds. Targets (issue 13): ``api`` <= 1 %, the
SDK <= 5 %. aiolock hands metric points to the SDK two turns of the event loop later (while a
network backend's request is on the wire), so on a network backend their cost shows in
CPU time more than in wall time; on ``memory://`` there is no wait to put it in.
``AIOLOCK_BENCH_INLINE=1`` in the environment records them inside acquire/release instead
(what it was before; for comparison).

Two direct timings say where the cost is: the ``api`` hooks (what a cycle pays with the
API and no SDK), and, for ``sdk-metrics`` and ``sdk``, the SDK's own calls -- the two
histogram points and two spans a cycle makes, made alone, with nothing of aiolock around
them. The latter is a floor no instrumentation of a lock cycle can go under while it
records every cycle as SPEC §9 asks; what the whole cycles add above it is aiolock's.

    python benchmarks/bench_otel.py [--runs 5] [--seconds 2] [--backends memory,redis,zookeeper,postgres]
    python benchmarks/bench_otel.py --paired 60 --runs 3 [--backends ...]   # see _paired()

Needs ``opentelemetry-sdk`` (``pip install 'aiolock[otel]' opentelemetry-sdk``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
import timeit
from pathlib import Path
from typing import Any

MODES = ("absent", "api", "sdk-metrics", "sdk-sampled", "sdk")
HERE = Path(__file__).resolve().parent


def _child(mode: str, url: str, seconds: float) -> None:
    """Run cycles for ``seconds`` in this process, set up as ``mode``; print cycles/s."""
    if mode == "absent":
        sys.modules["opentelemetry"] = None  # type: ignore[assignment]  # import fails
    elif mode.startswith("sdk"):
        from opentelemetry import metrics
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader

        metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))
        if mode in ("sdk", "sdk-sampled"):
            from opentelemetry import trace
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
            from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, TraceIdRatioBased

            class Drop(SpanExporter):
                def export(self, spans: object) -> SpanExportResult:
                    return SpanExportResult.SUCCESS

            sampler = ALWAYS_ON if mode == "sdk" else ParentBased(TraceIdRatioBased(0.01))
            provider = TracerProvider(sampler=sampler)
            provider.add_span_processor(BatchSpanProcessor(Drop()))
            trace.set_tracer_provider(provider)
    import aiolock
    from aiolock import _telemetry

    if os.environ.get("AIOLOCK_BENCH_INLINE"):  # points recorded inside acquire/release (A/B)
        _telemetry.MAX_PENDING = 0

    assert _telemetry.AVAILABLE is (mode != "absent")

    async def run() -> tuple[float, float]:
        async with aiolock.connect(url) as locks:
            lock = locks.lock("bench-otel", ttl=30)
            for _ in range(200):  # warm up
                async with lock:
                    pass
            count = 0
            start, cpu_start = time.perf_counter(), time.process_time()
            end = start + seconds
            while True:
                for _ in range(100):
                    async with lock:
                        pass
                count += 100
                now = time.perf_counter()
                if now >= end:
                    cpu = time.process_time() - cpu_start  # every thread of this process
                    return count / (now - start), count / cpu

    async def hooks() -> float:
        """What the hooks add to one cycle without an SDK, timed directly (ns): the
        acquire() and _release() wrappers (the coroutine made and closed, wrapped vs
        unwrapped) and the two one-attribute checks of the grant and release hooks."""
        async with aiolock.connect(url) as locks:
            lock = locks.lock("bench-otel-hooks", ttl=30)
            lease = await lock.acquire()
            pairs = [(lambda: lock.acquire().close(),
                      lambda: aiolock.Lock.acquire.__wrapped__(lock).close()),  # type: ignore[attr-defined]
                     (lambda: lease._release().close(),
                      lambda: aiolock.Lease._release.__wrapped__(lease).close())]  # type: ignore[attr-defined]
            n = 20000
            added = 0.0
            for wrapped, raw in pairs:
                best = [min(timeit.repeat(f, number=n, repeat=7, timer=time.process_time)) / n
                        for f in (wrapped, raw)]
                added += best[0] - best[1]
            check = min(timeit.repeat(lambda: _telemetry._mm._METER_PROVIDER is None, number=n, repeat=7,
                                      timer=time.process_time)) / n
            await lease.release()
            return (added + 2 * check) * 1e9

    def sdk_floor() -> float:
        """What the SDK's own calls cost one cycle, timed directly (ns): the calls aiolock
        makes per cycle, made the same way but with nothing of aiolock around them -- two
        histogram points and, with a tracer provider, two spans started and ended."""
        otel = _telemetry._get()
        assert otel is not None
        labels = _telemetry._labels_of(url.partition("://")[0], aiolock.Kind.LOCK)
        outcome = labels.outcomes["granted"]

        def span(name: str, attributes: dict[str, Any]) -> None:
            current = otel.tracer.start_span(name, otel.current_context(), attributes=attributes,
                                             start_time=time.time_ns())
            current.set_attributes({"aiolock.token": 1, "aiolock.outcome": "granted"})
            current.end()

        def cycle() -> None:
            otel.acquire_duration.record(0.0001, outcome)
            otel.hold_duration.record(0.0001, labels.attrs)
            if mode != "sdk-metrics":
                span("aiolock.acquire", {"aiolock.name": "bench-otel", **labels.attrs})
                span("aiolock.release", {"aiolock.name": "bench-otel", "aiolock.token": 1, **labels.attrs})

        n = 5000
        # with the garbage collector on, as in the cycles (timeit turns it off): the SDK's
        # allocations make it run more often, which is part of their cost
        return min(timeit.repeat(cycle, "gc.enable()", number=n, repeat=5, timer=time.process_time)) / n * 1e9

    async def ours() -> float:
        """What aiolock's own telemetry code adds to one cycle with this SDK setup (ns):
        cycles with the SDK's calls swapped for no-ops vs cycles with telemetry off,
        alternating in this process, on this thread's CPU clock; the least time of each
        (a neighbour's load only ever adds time)."""
        otel = _telemetry._get()
        assert otel is not None
        real = dict(vars(otel))
        modules = _telemetry._mm, _telemetry._tm
        nop_span = _NopSpan()
        nops = dict(acquire_duration=nop_span, hold_duration=nop_span, leases_lost=nop_span,
                    tracer=nop_span, in_context=_nop)
        times: dict[bool, list[float]] = {False: [], True: []}
        async with aiolock.connect(url) as locks:
            lock = locks.lock("bench-otel-ours", ttl=30)
            start = time.perf_counter()
            for _ in range(50):
                async with lock:
                    pass
            # rounds of about 20 ms (500 cycles on memory://, fewer on a slower backend)
            n = max(10, min(500, int(0.02 / ((time.perf_counter() - start) / 50))))
            for i in range(60):
                on = bool(i % 2)
                if on:
                    _telemetry._mm, _telemetry._tm = modules
                    vars(otel).update(nops)
                else:
                    _telemetry._mm = _telemetry._tm = _telemetry._Off
                start = time.thread_time()
                for _ in range(n):
                    async with lock:
                        pass
                times[on].append((time.thread_time() - start) / n * 1e9)
        vars(otel).update(real)
        _telemetry._mm, _telemetry._tm = modules
        return min(times[True]) - min(times[False])

    wall, cpu = asyncio.run(run())
    extra = ours_ns = float("nan")
    if mode == "api":
        extra = asyncio.run(hooks())
    elif mode.startswith("sdk"):
        extra, ours_ns = sdk_floor(), asyncio.run(ours())
    print(f"{wall:.1f} {cpu:.1f} {extra:.1f} {ours_ns:.1f}")


class _NopSpan:
    """Stands for the SDK's instruments, tracer and spans in ``ours()``: takes every call
    aiolock makes, doing nothing."""

    def record(self, value: float, attributes: object = None, context: object = None) -> None:
        return None

    def add(self, value: float, attributes: object = None, context: object = None) -> None:
        return None

    def start_span(self, name: str, context: object = None, attributes: object = None,
                   start_time: object = None) -> _NopSpan:
        return self

    def set_attributes(self, attributes: object) -> None:
        return None

    def set_attribute(self, key: str, value: object) -> None:
        return None

    def end(self) -> None:
        return None


def _nop(*args: object) -> None:
    return None


PAIRED = ("off", "metrics", "sampled", "traces", "inline")


def _paired(url: str, blocks: int) -> None:
    """``--paired``: in this one process, with the SDK's metrics and traces configured
    (every span sampled, a ``BatchSpanProcessor`` whose exporter drops them), blocks of
    100 cycles with telemetry off, with metrics only (``metrics``), with metrics and
    traces sampled at 1 % (``sampled``: ``ParentBased(TraceIdRatioBased(0.01))``, a
    tracer of a second provider), with metrics and every trace (``traces``), and with
    both but the SDK's work done inside acquire/release
    (``inline``: what it costs without aiolock's deferral), the order rotated block by
    block; prints the median of each block's cost against the
    ``off`` block next to it (what drifts between blocks cancels: the steadiest figure
    on a noisy machine)."""
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Drop(SpanExporter):
        def export(self, spans: object) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    trace.set_tracer_provider(provider)
    sampling = TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.01)))
    sampling.add_span_processor(BatchSpanProcessor(Drop()))
    import aiolock
    from aiolock import _telemetry

    async def run() -> dict[str, list[tuple[float, float]]]:
        async with aiolock.connect(url) as locks:
            lock = locks.lock("bench-otel-paired", ttl=30)
            for _ in range(200):
                async with lock:
                    pass
            otel = _telemetry._get()
            assert otel is not None
            (mm, tm), limit = (_telemetry._mm, _telemetry._tm), _telemetry.MAX_PENDING
            full, sampled = otel.tracer, sampling.get_tracer(_telemetry.SCOPE)
            out: dict[str, list[tuple[float, float]]] = {name: [] for name in PAIRED}
            for i in range(blocks):
                k = i % len(PAIRED)
                for name in PAIRED[k:] + PAIRED[:k]:
                    _telemetry.flush()
                    _telemetry._mm = _telemetry._Off if name == "off" else mm
                    _telemetry._tm = _telemetry._Off if name in ("off", "metrics") else tm
                    _telemetry.MAX_PENDING = 0 if name == "inline" else limit
                    otel.tracer = sampled if name == "sampled" else full
                    start, cpu = time.perf_counter(), time.process_time()
                    for _ in range(100):
                        async with lock:
                            pass
                    _telemetry.flush()  # the block's work still waiting is the block's cost
                    out[name].append((time.perf_counter() - start, time.process_time() - cpu))
            _telemetry._mm, _telemetry._tm = mm, tm
            _telemetry.MAX_PENDING = limit
            otel.tracer = full
            return out

    out = asyncio.run(run())
    provider.shutdown()
    sampling.shutdown()
    per_cycle = statistics.median(w for w, _ in out["off"]) / 100 * 1e6
    cells = [f"off {per_cycle:.0f} us/cycle"]
    for name in PAIRED[1:]:
        wall = [100 * (w / o[0] - 1) for (w, _), o in zip(out[name], out["off"], strict=True)]
        cpu = [100 * (c / o[1] - 1) for (_, c), o in zip(out[name], out["off"], strict=True)]
        cells.append(f"{name} wall {statistics.median(wall):+.1f} % cpu {statistics.median(cpu):+.1f} %")
    print(f"{url.partition('://')[0]} paired, {blocks} blocks: " + "; ".join(cells), flush=True)


def _measure(mode: str, url: str, seconds: float) -> tuple[float, ...]:
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--url", url,
         "--seconds", str(seconds)],
        check=True, capture_output=True, text=True,
    )
    return tuple(float(field) for field in out.stdout.split())


def _report(url: str, results: dict[str, list[tuple[float, ...]]]) -> None:
    runs = len(results["absent"])
    print(f"\n{url}: median [min - max] over {runs} runs; cost = the medians' drop vs absent;")
    print("  paired = the median [range] of each round's drop against that round's absent run")
    print("  (the setups of a round run back to back: what drifts between rounds cancels)")
    print(f"  {'setup':<12} {'cycles per CPU second':>36} {'paired':>22}   "
          f"{'cycles per wall second':>36} {'paired':>22}")
    base = [statistics.median(r[i] for r in results["absent"]) for i in (0, 1)]
    for mode in MODES:
        cells = []
        for i in (1, 0):
            values = [r[i] for r in results[mode]]
            med = statistics.median(values)
            cost = paired = ""
            if mode != "absent":
                cost = f"{100 * (base[i] - med) / base[i]:+.1f} %"
                pairs = zip(results[mode], results["absent"], strict=True)
                drops = [100 * (1 - r[i] / a[i]) for r, a in pairs]
                paired = f"{statistics.median(drops):+.1f} % [{min(drops):+.0f} .. {max(drops):+.0f}]"
            cells.append(f"{med:>8,.0f} [{min(values):>7,.0f} - {max(values):>7,.0f}] {cost:>8} {paired:>22}")
        print(f"  {mode:<12} {cells[0]}   {cells[1]}")
    hooks = statistics.median(r[2] for r in results["api"])
    per_cycle = 1e9 / base[1]
    print(f"  api hooks timed directly: {hooks:.0f} ns per cycle = {100 * hooks / per_cycle:.2f} % of an "
          f"absent cycle ({per_cycle / 1000:.1f} us of CPU)")
    for mode in MODES[2:]:
        floor, own = (statistics.median(r[i] for r in results[mode]) for i in (2, 3))
        spent = 1e9 / statistics.median(r[1] for r in results[mode]) - per_cycle
        print(f"  {mode}: telemetry added {spent / 1000:.1f} us per cycle; of it aiolock's own code "
              f"{own / 1000:.2f} us ({100 * own / per_cycle:.1f} % of an absent cycle); the SDK's "
              f"calls alone, timed directly: {floor / 1000:.1f} us ({100 * floor / per_cycle:.0f} %)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="rounds of every setup (5)")
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds per measurement (2)")
    parser.add_argument("--no-redis", action="store_true", help="memory:// only")
    parser.add_argument("--backends", default="memory,redis",
                        help=f"comma-separated, of {', '.join(SERVERS)} (memory,redis)")
    parser.add_argument("--paired", type=int, metavar="BLOCKS", default=0,
                        help="instead: off / inline / deferred points in one process, BLOCKS "
                             "blocks of 100 cycles each (see _paired)")
    parser.add_argument("--paired-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--url", default="memory://", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.url, args.seconds)
        return 0
    if args.paired_child:
        _paired(args.url, args.paired)
        return 0
    backends = ["memory"] if args.no_redis else [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in SERVERS]
    if unknown:
        parser.error(f"unknown backend(s) {', '.join(unknown)}: choose among {', '.join(SERVERS)}")
    sys.path.insert(0, str(HERE.parent))  # tests/: the servers the suite starts
    urls, servers = [], []
    try:
        for backend in backends:
            url, server = SERVERS[backend]()
            urls.append(url)
            if server is not None:
                servers.append(server)
        for url in urls:
            if args.paired:
                for _ in range(args.runs):  # each run in a process of its own
                    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--paired-child",
                                    "--paired", str(args.paired), "--url", url], check=True)
                continue
            results: dict[str, list[tuple[float, ...]]] = {mode: [] for mode in MODES}
            for i in range(args.runs):
                order = MODES[i % len(MODES):] + MODES[: i % len(MODES)]
                for mode in order:
                    results[mode].append(_measure(mode, url, args.seconds))
                print(f"{url} round {i + 1}/{args.runs} done", file=sys.stderr)
            _report(url, results)
    finally:
        for server in servers:
            server.close()
    return 0


def _redis() -> tuple[str, Any]:
    sys.path.insert(0, str(HERE))
    from _redis import RedisServer  # the benchmarks' own (what the earlier figures used)

    server = RedisServer().__enter__()

    class Closing:
        def close(self) -> None:
            server.__exit__(None, None, None)

    return server.url, Closing()


def _zookeeper() -> tuple[str, Any]:
    from tests.zk_server import ZooKeeperServer

    server = ZooKeeperServer().start()
    return f"zookeeper://{server.hosts}/aiolock-bench-otel", server


def _postgres() -> tuple[str, Any]:
    from tests.pg_server import PostgresServer

    server = PostgresServer().start()
    return server.url, server


#: backend -> () -> (url, private server or None)
SERVERS: dict[str, Any] = {"memory": lambda: ("memory://", None), "redis": _redis,
                           "zookeeper": _zookeeper, "postgres": _postgres}


if __name__ == "__main__":
    sys.exit(main())
