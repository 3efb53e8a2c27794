"""The global OpenTelemetry SDK providers of a test process, set once for every suite.

The API lets a process set its global meter and tracer providers once; aiolock records
to the global ones. Suites that read them (tests/test_otel.py: cumulative;
tests/adversarial_issue13/: delta) may share a pytest-xdist worker in either order, so
they share one ``MeterProvider`` with a reader of each temporality and one
``TracerProvider`` with one in-memory span exporter (bounded), made here on first use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Providers:
    meter_provider: Any
    tracer_provider: Any
    #: ``InMemoryMetricReader``, cumulative (the SDK's default)
    cumulative: Any
    #: ``InMemoryMetricReader``, delta for counters and histograms, cumulative for up-down
    #: counters and gauges (their current value)
    delta: Any
    #: :func:`kept_spans`'s exporter behind a ``SimpleSpanProcessor``
    exporter: Any


#: the most spans the exporter keeps: every later test of the process makes spans too
KEEP = 20_000


def kept_spans() -> Any:
    """An in-memory span exporter (``get_finished_spans()``, ``clear()``) that keeps
    the last :data:`KEEP` spans: the providers stay set for the rest of the process,
    whose other tests take locks too."""
    from collections import deque

    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class KeptSpans(SpanExporter):
        def __init__(self) -> None:
            self._spans: deque[Any] = deque(maxlen=KEEP)

        def export(self, spans: Any) -> SpanExportResult:
            self._spans.extend(spans)
            return SpanExportResult.SUCCESS

        def get_finished_spans(self) -> tuple[Any, ...]:
            return tuple(self._spans)

        def clear(self) -> None:
            self._spans.clear()

        def shutdown(self) -> None:
            self._spans.clear()

    return KeptSpans()


_providers: list[Providers] = []


def providers() -> Providers:
    """The process's global SDK providers (set on the first call); raises if another
    global ``MeterProvider`` was set in this process first."""
    if _providers:
        return _providers[0]
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import (
        Counter,
        Histogram,
        MeterProvider,
        ObservableCounter,
        ObservableGauge,
        ObservableUpDownCounter,
        UpDownCounter,
    )
    from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    delta, cum = AggregationTemporality.DELTA, AggregationTemporality.CUMULATIVE
    cumulative = InMemoryMetricReader()
    delta_reader = InMemoryMetricReader(preferred_temporality={
        Counter: delta, Histogram: delta, ObservableCounter: delta,
        UpDownCounter: cum, ObservableUpDownCounter: cum, ObservableGauge: cum})
    exporter = kept_spans()
    meter_provider = MeterProvider(metric_readers=[cumulative, delta_reader])
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    metrics.set_meter_provider(meter_provider)
    trace.set_tracer_provider(tracer_provider)
    if metrics.get_meter_provider() is not meter_provider:
        raise RuntimeError("another global MeterProvider was set in this process first")
    if trace.get_tracer_provider() is not tracer_provider:
        raise RuntimeError("another global TracerProvider was set in this process first")
    _providers.append(Providers(meter_provider, tracer_provider, cumulative, delta_reader, exporter))
    return _providers[0]
