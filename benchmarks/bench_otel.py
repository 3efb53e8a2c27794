"""What OpenTelemetry costs aiolock: uncontended acquire+release cycles per second.

One task acquires and releases one lock in a loop (watchdog on), on ``memory://`` and on a
private ``redis-server`` (``--no-redis`` to skip it), in four setups, each in its own
child process, alternating in the same run (``--runs`` rounds, the order rotated each
round, so drifting machine load hits every setup alike):

* ``absent``: ``opentelemetry`` cannot be imported (blocked in the child): the baseline;
* ``api``: ``opentelemetry-api`` installed, no SDK configured (a library's usual case);
* ``sdk-metrics``: the SDK's ``MeterProvider`` with a metric reader (no tracer provider);
* ``sdk``: metrics and traces: a ``TracerProvider`` with a ``BatchSpanProcessor`` whose
  exporter drops the spans (what an OTLP exporter costs the caller's thread, minus I/O).

It prints, per backend and setup, the median over the rounds, the range, and the median's
cost against ``absent``, of cycles per second of the process's CPU time (all its threads:
the span exporter's too) and of wall time. On a busy machine the wall time mostly measures
the neighbours; CPU time is what telemetry adds. Targets (issue 13): ``api`` <= 1 %,
``sdk`` <= 5 %.

    python benchmarks/bench_otel.py [--runs 5] [--seconds 2] [--no-redis]

Needs ``opentelemetry-sdk`` (``pip install 'aiolock[otel]' opentelemetry-sdk``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
import timeit
from pathlib import Path

MODES = ("absent", "api", "sdk-metrics", "sdk")
HERE = Path(__file__).resolve().parent


def _child(mode: str, url: str, seconds: float) -> None:
    """Run cycles for ``seconds`` in this process, set up as ``mode``; print cycles/s."""
    if mode == "absent":
        sys.modules["opentelemetry"] = None  # type: ignore[assignment]  # import fails
    elif mode in ("sdk", "sdk-metrics"):
        from opentelemetry import metrics
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader

        metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))
        if mode == "sdk":
            from opentelemetry import trace
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

            class Drop(SpanExporter):
                def export(self, spans: object) -> SpanExportResult:
                    return SpanExportResult.SUCCESS

            provider = TracerProvider()
            provider.add_span_processor(BatchSpanProcessor(Drop()))
            trace.set_tracer_provider(provider)
    import aiolock
    from aiolock import _telemetry

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

    wall, cpu = asyncio.run(run())
    extra = asyncio.run(hooks()) if mode == "api" else float("nan")
    print(f"{wall:.1f} {cpu:.1f} {extra:.1f}")


def _measure(mode: str, url: str, seconds: float) -> tuple[float, float, float]:
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--url", url,
         "--seconds", str(seconds)],
        check=True, capture_output=True, text=True,
    )
    wall, cpu, hooks = out.stdout.split()
    return float(wall), float(cpu), float(hooks)


def _report(url: str, results: dict[str, list[tuple[float, float, float]]]) -> None:
    runs = len(results["absent"])
    print(f"\n{url}: median [min - max] over {runs} runs; cost = the medians' drop vs absent")
    print(f"  {'setup':<12} {'cycles per CPU second':>36}   {'cycles per wall second':>36}")
    base = [statistics.median(r[i] for r in results["absent"]) for i in (0, 1)]
    for mode in MODES:
        cells = []
        for i in (1, 0):
            values = [r[i] for r in results[mode]]
            med = statistics.median(values)
            cost = "" if mode == "absent" else f"{100 * (base[i] - med) / base[i]:+.1f} %"
            cells.append(f"{med:>8,.0f} [{min(values):>7,.0f} - {max(values):>7,.0f}] {cost:>8}")
        print(f"  {mode:<12} {cells[0]}   {cells[1]}")
    hooks = statistics.median(r[2] for r in results["api"])
    per_cycle = 1e9 / base[1]
    print(f"  api hooks timed directly: {hooks:.0f} ns per cycle = {100 * hooks / per_cycle:.2f} % of an "
          f"absent cycle ({per_cycle / 1000:.1f} us of CPU)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="rounds of every setup (5)")
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds per measurement (2)")
    parser.add_argument("--no-redis", action="store_true", help="memory:// only")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--url", default="memory://", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.url, args.seconds)
        return 0
    sys.path.insert(0, str(HERE))
    from _redis import RedisServer

    urls = ["memory://"]
    server = None
    if not args.no_redis:
        server = RedisServer().__enter__()
        urls.append(server.url)
    try:
        for url in urls:
            results: dict[str, list[tuple[float, float, float]]] = {mode: [] for mode in MODES}
            for i in range(args.runs):
                order = MODES[i % len(MODES):] + MODES[: i % len(MODES)]
                for mode in order:
                    results[mode].append(_measure(mode, url, args.seconds))
                print(f"{url} round {i + 1}/{args.runs} done", file=sys.stderr)
            _report(url, results)
    finally:
        if server is not None:
            server.__exit__(None, None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
