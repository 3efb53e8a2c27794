"""Telemetry: OpenTelemetry metrics and spans (SPEC §9), and the core's per-lease log lines.

What is recorded -- the instruments, their units and attributes, the loss outcomes, the
spans, the loggers -- is the user's business and is described in docs/operations.md
("Metrics, traces and logs"); this module is how. The core calls in here with one line
per event (a grant, a release, a loss, a renewal) or wears one of the decorators below
(``acquire``, ``release``, the slow path of waiting), so the locking code stays readable
and this file is the one place that knows about OpenTelemetry.

Only ``opentelemetry-api`` (the ``otel`` extra), imported on first use; aiolock records
to the *global* meter and tracer providers under the scope ``aiolock``. What a lock cycle
pays:

* ``opentelemetry-api`` not installed: the decorators return the function unchanged and
  the per-event calls only ask the logger whether DEBUG is on.
* installed, no SDK configured: each event reads whether a global provider was set (a
  module attribute, :data:`_mm` / :data:`_tm`) and returns; no span, no measurement,
  no extra frame. (The API's proxies would discard them too, but a no-op span costs
  more than a lock cycle on ``memory://``.)
* an SDK configured: two histogram points per cycle (acquire and hold durations) and,
  with a tracer provider, two spans; everything aiolock computes for them is made once
  per (backend, kind) (:class:`_Labels`). The rest is the SDK's own cost per point and
  per span (``benchmarks/bench_otel.py`` times it).

Metric points, and the start of spans, are handed to the SDK off the lock's path
(:func:`_defer`): a callback takes them once the event loop has nothing else ready to run
(:func:`_hop`; at most :data:`MAX_HOPS` turns later), which on a network backend is
after the next request went out (a backend's connection task, PostgreSQL's, sends it in
a callback of its own) and while it is on the wire, so the SDK's several microseconds per
point and a dozen per span start (its sampler, ids, attribute checks and hashing) do not
delay the lock (measured: an uncontended PostgreSQL cycle lost 10 % of its wall time
recording inline, 12 % one turn later, 2-3 % two turns later; a fixed two turns cost two
extra passes of the loop, each a poll of its selector, where one does); and every
collection takes the ones still waiting first (the observers of the asynchronous counters
run before the SDK reads its aggregations), so a reader never misses a point that was
made before it collected. A span is ended on the path (:class:`_Span`), so it
is exported when the call returns; it is never the current span (client spans made
while acquiring are its siblings), and the points made within it are recorded in its
context (exemplars point to it).

Leases held and acquisitions waiting are asynchronous up-down counters: aiolock keeps the
counts (:data:`HELD`, :data:`WAITING`) and the SDK reads them when it collects (a
synchronous ``add()`` costs about as much as a whole ``memory://`` lock cycle). So the
SDK must be configured before the first lock is taken: leases held while none was set
are not counted, and their end then counts -1.

No log line, span or error message carries a password or a claim's owner id (knowing it
would let anyone release the lease).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import importlib
import importlib.util
import inspect
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar, cast

from .errors import LockTimeout

if TYPE_CHECKING:
    from ._lease import Lease, _Hold
    from ._lock import Lock
    from .abc import Backend, Kind

__all__ = [
    "AVAILABLE", "SCOPE", "acquire_span", "flush", "hold_ended", "hold_lost", "hold_started",
    "loss_outcome", "release_span", "renewal_failed", "renewed", "waiting",
]

#: The instrumentation scope (meter and tracer name).
SCOPE = "aiolock"


def _available() -> bool:
    try:
        return importlib.util.find_spec("opentelemetry.metrics") is not None and (
            importlib.util.find_spec("opentelemetry.trace") is not None
        )
    except (ImportError, ValueError):  # e.g. sys.modules["opentelemetry"] = None
        return False


#: Whether ``opentelemetry-api`` can be imported (decided once, without importing it).
AVAILABLE = _available()

lease_log = logging.getLogger("aiolock.lease")
watchdog_log = logging.getLogger("aiolock.watchdog")
telemetry_log = logging.getLogger("aiolock.telemetry")

P = ParamSpec("P")
R = TypeVar("R")
LockT = TypeVar("LockT", bound="Lock")
LeaseT = TypeVar("LeaseT", bound="Lease")

_DEBUG = logging.DEBUG


class _OTel:
    """The instruments and tracer, made once on first use, and the cheap checks of
    whether an SDK was configured."""

    def __init__(self) -> None:
        from opentelemetry import metrics, trace

        from . import __version__

        # Where the API keeps the global providers: reading the module attribute is ~50x
        # cheaper than get_*_provider() (which also reads os.environ). If a future API
        # moves them, fall back to always recording (correct, only slower).
        self._metrics_mod = importlib.import_module("opentelemetry.metrics._internal")
        self._trace_mod = trace
        self._fast = hasattr(self._metrics_mod, "_METER_PROVIDER") and hasattr(trace, "_TRACER_PROVIDER")
        if self._fast:
            global _mm, _tm
            _mm, _tm = self._metrics_mod, trace
        # a provider named by environment variable is loaded by the first get_*_provider()
        if "OTEL_PYTHON_METER_PROVIDER" in os.environ:
            metrics.get_meter_provider()
        if "OTEL_PYTHON_TRACER_PROVIDER" in os.environ:
            trace.get_tracer_provider()
        meter = metrics.get_meter(SCOPE, __version__)
        self.tracer = trace.get_tracer(SCOPE, __version__)
        self.acquire_duration = _histogram(
            meter, "aiolock.acquire.duration", SHORT,
            "Time from acquire() to its end (granted, timeout, error, cancelled)",
        )
        self.hold_duration = _histogram(
            meter, "aiolock.hold.duration", LONG, "Time a lease was held, to its release or loss",
        )
        self.renewal_duration = _histogram(
            meter, "aiolock.renewal.duration", SHORT, "Duration of one lease renewal request",
        )
        # Asynchronous up-down counters: the SDK reads these counts when it collects (a
        # synchronous add() costs as much as a whole memory:// lock cycle, twice a cycle)
        meter.create_observable_up_down_counter(
            "aiolock.leases.held", [_observer(HELD)], unit="{lease}", description="Leases held now",
        )
        meter.create_observable_up_down_counter(
            "aiolock.waiters", [_observer(WAITING)], unit="{waiter}",
            description="Acquisitions waiting now",
        )
        self.leases_lost = meter.create_counter(
            "aiolock.leases.lost", unit="{lease}",
            description="Leases lost (expired, gone, revoked, closed)",
        )
        from opentelemetry import context
        from opentelemetry.trace import Status, StatusCode

        # the context a point was made in, for the SDK's exemplars (a point is recorded
        # later, elsewhere): ``record(..., context=)`` is in opentelemetry-api >= 1.28
        # (before it, the SDK keeps no exemplars)
        self.with_context = "context" in inspect.signature(self.acquire_duration.record).parameters
        self.current_context = context.get_current
        self.error_status = Status(StatusCode.ERROR)
        self.in_context = trace.set_span_in_context

    def metrics_on(self) -> bool:
        """An SDK meter provider was set globally."""
        return not self._fast or self._metrics_mod._METER_PROVIDER is not None

    def traces_on(self) -> bool:
        """An SDK tracer provider was set globally."""
        return not self._fast or self._trace_mod._TRACER_PROVIDER is not None


#: Bucket boundaries (s) advised to the SDK (the SDK's default ones, 0-5-10-25-...-10000,
#: are made for milliseconds): waits and requests, from 0.5 ms up; holds, from 10 ms up.
SHORT = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LONG = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 14400.0, 86400.0)


def _histogram(meter: Any, name: str, buckets: tuple[float, ...], description: str) -> Any:
    try:  # the advisory parameter is in opentelemetry-api >= 1.23 (our floor); kept defensive
        return meter.create_histogram(name, unit="s", description=description,
                                      explicit_bucket_boundaries_advisory=list(buckets))
    except TypeError:
        return meter.create_histogram(name, unit="s", description=description)


_otel: _OTel | None = None


class _Unknown:
    """Stands for the API's modules until they are loaded: "maybe set" (ask _get())."""

    _METER_PROVIDER = _TRACER_PROVIDER = True


class _Off:
    """Stands for them when OpenTelemetry is not installed: "never set"."""

    _METER_PROVIDER = _TRACER_PROVIDER = None


#: the modules holding the API's global providers, read by every hot path:
#: ``_mm._METER_PROVIDER is None`` means surely no SDK meter provider (and the like for
#: ``_tm``, tracer); anything else means "record" once ``_get()`` was called (before,
#: ``_Unknown`` says "maybe": call ``_get()``, which puts the real modules here)
_mm: Any = _Unknown if AVAILABLE else _Off
_tm: Any = _Unknown if AVAILABLE else _Off


class _Labels:
    """What the telemetry of one (backend, kind) needs, made once and never mutated:
    the metric attribute dicts, without and with each outcome (the SDK copies them)."""

    __slots__ = ("attrs", "outcomes")

    def __init__(self, backend: str, kind: str) -> None:
        self.attrs = {"aiolock.backend": backend, "aiolock.kind": kind}
        self.outcomes = {outcome: {**self.attrs, "aiolock.outcome": outcome} for outcome in _OUTCOMES}


_OUTCOMES = ("granted", "timeout", "error", "cancelled", "expired", "gone", "revoked", "closed")
_labels: dict[tuple[str, str], _Labels] = {}


def _labels_of(backend: str, kind: Kind) -> _Labels:
    # keyed by the kind's value, read as the plain attribute ``_value_``: hashing an enum
    # member, or reading ``.value`` (a descriptor), costs more than the rest of the lookup
    key = (backend, kind._value_)
    labels = _labels.get(key)
    if labels is None:
        labels = _labels[key] = _Labels(*key)
    return labels


#: leases held and acquisitions waiting now, by (backend, kind): counted while an SDK
#: meter provider is set, observed by the SDK when it collects
HELD: dict[_Labels, int] = {}
WAITING: dict[_Labels, int] = {}


def _observer(counts: dict[_Labels, int]) -> Callable[[Any], Iterable[Any]]:
    from opentelemetry.metrics import Observation

    def observe(options: Any) -> Iterable[Any]:
        flush()  # the SDK reads its aggregations after the observers: points first
        # copy() is one step under the GIL: a collecting thread sees a consistent dict
        return [Observation(n, labels.attrs) for labels, n in counts.copy().items()]

    return observe


def _get() -> _OTel | None:
    """The instruments if OpenTelemetry is installed (made on the first call), else None."""
    global _otel
    if _otel is None and AVAILABLE:
        _otel = _OTel()
    return _otel


def _meter() -> _OTel | None:
    """The instruments if an SDK meter provider may be set (called once ``_mm`` said
    "maybe"), else None."""
    otel = _otel or _get()
    return otel if _mm._METER_PROVIDER is not None else None


_backend_attrs: dict[str, dict[str, str]] = {}


def _renewal_attrs(backend: Backend) -> dict[str, str]:
    scheme = backend.url.partition("://")[0] or type(backend).__name__
    attrs = _backend_attrs.get(scheme)
    if attrs is None:
        attrs = _backend_attrs[scheme] = {"aiolock.backend": scheme}
    return attrs


def _outcome(exc: BaseException) -> str:
    if isinstance(exc, LockTimeout):
        return "timeout"
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    return "error"


# -- points: handed to the SDK off the lock's path -------------------------------------

#: Work for the SDK not yet handed to it: each item a function and its arguments (a
#: point to record, :func:`_record` / :func:`_record_in`; a span to start,
#: :func:`_begin`). Appended on any thread (``append`` is atomic); drained only under
#: :data:`_flushing`, so each item is handed over exactly once, and a collection's flush
#: (another thread) waits for an item taken off the deque but not yet handed over,
#: rather than collect without it.
_pending: deque[tuple[Any, ...]] = deque()
#: Held while draining :data:`_pending` (reentrant: a finaliser run by the garbage
#: collector inside ``record`` may make a point and flush). Never held while waiting on
#: anything of the SDK's that a collection holds while it calls the observers: the
#: SDK takes no lock of its collection's to record a point (1.23 to 1.45).
_flushing = threading.RLock()


class _Scheduled(threading.local):
    #: The loop a :func:`_turn` is scheduled on (through :func:`_hop`) from this thread
    #: and has not yet run on, or None: one scheduled flush per loop at a time, however
    #: many points wait (a task that never lets the loop turn would otherwise pile a
    #: callback up per inline flush); per thread, as each thread runs its own loop. A
    #: point appended once that flush started schedules another (it clears this first);
    #: a point whose scheduled flush never ran (its loop closed first) is taken by the
    #: thread's next loop's flush or the next collection.
    loop: asyncio.AbstractEventLoop | None = None


_scheduled = _Scheduled()
_running_loop = asyncio._get_running_loop  # None outside a running loop (never raises)
#: At most this many points wait: a task that takes and releases locks without ever
#: letting the loop turn (``memory://`` cycles need not yield) pays for them inline.
MAX_PENDING = 64
_refusals = 0  # points the SDK raised on (logged, not retried)


def _after_fork_in_child() -> None:
    """A forked child must not record its parent's points again, and must not find the
    lock held by a thread of its parent's that it does not have."""
    global _flushing
    _pending.clear()
    _flushing = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _point(otel: _OTel, record: Callable[..., None], value: float, attributes: dict[str, str]) -> None:
    """Hand one measurement to the SDK soon: once this event loop has nothing else to
    run, or at the next collection if that comes first; at once outside an event loop."""
    span = _in_span.get()
    if span is not None:  # made while releasing: in the release span's context
        _defer((_record_in, record, value, attributes, span))
    else:
        # the context now, not the flush's: with no tracer provider set, a span propagated
        # from upstream is still current and the SDK's exemplars point to it
        _defer((_record, record, value, attributes, otel.current_context() if otel.with_context else None))


def _defer(item: tuple[Any, ...]) -> None:
    _pending.append(item)
    loop = _running_loop()
    if loop is None or len(_pending) >= MAX_PENDING:
        flush()
    elif loop is not _scheduled.loop:
        _scheduled.loop = loop
        loop.call_soon(_hop, loop)


def _hop(loop: asyncio.AbstractEventLoop, hops: int = 1) -> None:
    """A turn after a point was made: while the loop has other callbacks ready (a
    backend's connection task about to send the next request, the caller going on to
    make it), let them run first, for at most :data:`MAX_HOPS` turns; then flush, the
    loop having nothing left to do but wait (each turn that had nothing else to run is an
    extra pass of the loop: a poll of its selector, a few microseconds)."""
    ready = getattr(loop, "_ready", None)  # asyncio's own loops' queue; others: two turns
    if (len(ready) if ready is not None else hops < 2) and hops < MAX_HOPS:
        loop.call_soon(_hop, loop, hops + 1)
    else:
        _turn()


#: At most this many turns of the loop between a point and its flush.
MAX_HOPS = 16


def _turn() -> None:
    """The flush scheduled a turn after a point was made."""
    _scheduled.loop = None
    flush()


def flush() -> None:
    """Hand everything waiting to the SDK (on a loop's turn, from an observer when the
    SDK collects, or from :func:`_defer` outside a loop or with too many waiting)."""
    pending = _pending
    # under the lock even to see it empty: another thread may hold an item it took off
    # the deque and has not handed over yet (a collection must wait for it)
    with _flushing:
        while pending:
            item = pending.popleft()
            try:
                item[0](*item[1:])
            except Exception:  # the SDK logs rather than raises; a point is never worth a lock
                _refused(item[1])


def _refused(what: Any) -> None:
    global _refusals
    _refusals += 1
    # the first refusal at WARNING with its traceback, then every 1000th (a refusing SDK
    # would refuse every point: a log line each would flood the log)
    if _refusals % 1000 == 1:
        telemetry_log.warning("the OpenTelemetry SDK refused %s (%d so far)",
                              getattr(what, "__self__", what), _refusals, exc_info=True)


def _record(record: Callable[..., None], value: float, attributes: dict[str, str], context: Any) -> None:
    if context is None:
        record(value, attributes)
    else:
        record(value, attributes, context)


def _record_in(record: Callable[..., None], value: float, attributes: dict[str, str], span: _Span) -> None:
    """Record a point made while ``span`` was open, in that span's context (exemplars)."""
    if not span.otel.with_context:
        record(value, attributes)
    elif span.span is None or span.span is _REFUSED:  # not started: the SDK refused it
        record(value, attributes, span.parent)
    else:
        record(value, attributes, span.otel.in_context(span.span, span.parent))


class _Span:
    """A span whose start is handed to the SDK off the lock's path, like a point (the
    SDK's sampler, ids and attribute checks are the larger part of a span's cost), and
    which is ended on the path, so that it is in the exporter when the call returns.

    It starts when :func:`flush` runs (on a network backend while the request is on the
    wire), with the time and parent context of when it was made; if no flush ran before
    it ends (nothing yielded, as on ``memory://``), :meth:`end` starts it first. So it is
    never current: a client library's spans made meanwhile are its siblings, under the
    same parent.

    Invariant: ``span`` goes from None to the SDK's span (or :data:`_REFUSED`) once,
    under :data:`_flushing`; after that the queued ``_begin`` is a no-op.
    """

    __slots__ = ("attributes", "name", "otel", "parent", "span", "start")

    def __init__(self, otel: _OTel, name: str, attributes: dict[str, Any]) -> None:
        self.otel = otel
        self.name = name
        self.attributes = attributes
        self.parent = otel.current_context()
        self.start = time.time_ns()
        self.span: Any = None
        _defer((_begin, self))

    def end(self, attributes: dict[str, Any] | None, error: BaseException | None = None) -> None:
        """Set the final attributes (and the error, if any), and end it now."""
        span = self.span
        if span is None:
            with _flushing:  # a flush on another thread may be starting it
                span = _begin(self)
        if span is _REFUSED:
            return
        try:
            if attributes:
                span.set_attributes(attributes)
            if error is not None:
                span.record_exception(error)
                span.set_status(self.otel.error_status.status_code, type(error).__name__)
            span.end()
        except Exception:
            _refused(self.otel.tracer)


_REFUSED: Any = object()


def _begin(span: _Span) -> Any:
    """Start ``span`` in the SDK unless it was (under :data:`_flushing`)."""
    started = span.span
    if started is None:
        try:
            started = span.otel.tracer.start_span(span.name, span.parent, attributes=span.attributes,
                                                  start_time=span.start)
        except Exception:
            started = _REFUSED
            _refused(span.otel.tracer)
        span.span = started
    return started


#: The release span open in this task while a lease is released: the points its release
#: makes (the hold's duration, a loss) are recorded in its context.
_in_span: contextvars.ContextVar[_Span | None] = contextvars.ContextVar("aiolock_span", default=None)


# -- acquire, wait, release: decorators ---------------------------------------------------


def acquire_span(
    func: Callable[Concatenate[LockT, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[LockT, P], Coroutine[Any, Any, R]]:
    """Decorates ``Lock.acquire``: the span ``aiolock.acquire`` and the histogram
    ``aiolock.acquire.duration``. Without an SDK the call goes straight through."""
    if not AVAILABLE:
        return func

    default = inspect.signature(func).parameters["timeout"].default
    call: Any = func

    # acquire(self, timeout) exactly, not (*args, **kwargs): the cheapest call there is
    def acquire(self: Any, timeout: Any = default) -> Coroutine[Any, Any, R]:
        if _mm._METER_PROVIDER is None and _tm._TRACER_PROVIDER is None:
            return call(self, timeout)  # type: ignore[no-any-return]  # no extra frame
        otel = _otel or _get()
        assert otel is not None
        if _mm._METER_PROVIDER is None and _tm._TRACER_PROVIDER is None:
            return call(self, timeout)  # type: ignore[no-any-return]  # (the first call)
        return _traced_acquire(otel, call, self, timeout)

    functools.update_wrapper(acquire, func)
    return cast("Callable[Concatenate[LockT, P], Coroutine[Any, Any, R]]", acquire)


async def _traced_acquire(otel: _OTel, func: Any, lock: Lock, timeout: Any) -> Any:
    labels = _labels_of(lock._engine.scheme, lock.kind)
    measure = _mm._METER_PROVIDER is not None
    outcome = "granted"
    start = time.perf_counter()
    if _tm._TRACER_PROVIDER is None:
        try:
            return await func(lock, timeout)
        except BaseException as exc:
            outcome = _outcome(exc)
            raise
        finally:
            _point(otel, otel.acquire_duration.record, time.perf_counter() - start, labels.outcomes[outcome])
    span = _Span(otel, "aiolock.acquire", {"aiolock.name": lock.name, **labels.attrs})
    try:
        lease = await func(lock, timeout)
        span.end({"aiolock.token": lease.token, "aiolock.outcome": outcome})
        return lease
    except BaseException as exc:
        outcome = _outcome(exc)
        span.end({"aiolock.outcome": outcome}, exc if outcome == "error" else None)
        raise
    finally:
        if measure:  # in the span's context: an exemplar may point to it
            _defer((_record_in, otel.acquire_duration.record, time.perf_counter() - start,
                    labels.outcomes[outcome], span))


def waiting(
    func: Callable[Concatenate[LockT, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[LockT, P], Coroutine[Any, Any, R]]:
    """Decorates the slow path of ``Lock.acquire`` (waiting behind a holder or other
    waiters): ``aiolock.waiters`` is one higher while it runs."""
    if not AVAILABLE:
        return func

    @functools.wraps(func)
    def wait(self: LockT, /, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, R]:
        if _mm._METER_PROVIDER is None or _meter() is None:
            return func(self, *args, **kwargs)
        return _counted_wait(func, self, *args, **kwargs)

    return wait


async def _counted_wait(
    func: Callable[Concatenate[LockT, P], Coroutine[Any, Any, R]], lock: LockT, /,
    *args: P.args, **kwargs: P.kwargs,
) -> R:
    labels = _labels_of(lock._engine.scheme, lock.kind)
    WAITING[labels] = WAITING.get(labels, 0) + 1
    try:
        return await func(lock, *args, **kwargs)
    finally:
        WAITING[labels] -= 1


def release_span(
    func: Callable[Concatenate[LeaseT, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[LeaseT, P], Coroutine[Any, Any, R]]:
    """Decorates ``Lease._release``: the span ``aiolock.release``."""
    if not AVAILABLE:
        return func

    call: Any = func

    def release(self: Any) -> Coroutine[Any, Any, R]:  # _release(self) exactly
        if _tm._TRACER_PROVIDER is None:
            return call(self)  # type: ignore[no-any-return]
        otel = _otel or _get()
        assert otel is not None
        if _tm._TRACER_PROVIDER is None:
            return call(self)  # type: ignore[no-any-return]
        return _traced_release(otel, call, self)

    functools.update_wrapper(release, func)
    return cast("Callable[Concatenate[LeaseT, P], Coroutine[Any, Any, R]]", release)


async def _traced_release(otel: _OTel, func: Any, lease: Lease) -> Any:
    hold = lease._hold
    attributes: dict[str, Any] = {"aiolock.name": hold.claim.name, "aiolock.token": hold.token}
    attributes.update(_labels_of(hold.engine.scheme, hold.claim.kind).attrs)
    span = _Span(otel, "aiolock.release", attributes)
    current = _in_span.set(span)  # the hold's points are made in its context
    error: Exception | None = None
    try:
        return await func(lease)
    except Exception as exc:
        error = exc
        raise
    finally:
        _in_span.reset(current)
        span.end(None, error)


# -- a lease's life: one call per event ---------------------------------------------------


def hold_started(hold: _Hold) -> None:
    """A claim was granted (``_Hold`` made)."""
    if lease_log.isEnabledFor(_DEBUG):
        lease_log.debug("acquired %r (%s) token %d, ttl %.3g s", hold.claim.name, hold.claim.kind.value,
                        hold.token, hold.ttl)
    if _mm._METER_PROVIDER is None or _meter() is None:
        return
    labels = _labels_of(hold.engine.scheme, hold.claim.kind)
    HELD[labels] = HELD.get(labels, 0) + 1


def hold_ended(hold: _Hold) -> None:
    """A hold was released on the server (by its owner, or by ``aclose()``)."""
    closed = hold.engine.closed
    if closed:
        lease_log.info("lease on %r (token %d) released by closing its connection",
                       hold.claim.name, hold.token)
    elif lease_log.isEnabledFor(_DEBUG):
        lease_log.debug("released %r token %d after %.3f s", hold.claim.name, hold.token,
                        time.monotonic() - hold.since)
    if _mm._METER_PROVIDER is None:
        return
    otel = _meter()
    if otel is not None:
        _ended(otel, hold, "closed" if closed else None)


def hold_lost(hold: _Hold, reason: str) -> None:
    """A hold was lost (``_Hold.mark_lost``; the WARNING is logged there)."""
    if _mm._METER_PROVIDER is None:
        return
    otel = _meter()
    if otel is not None:
        _ended(otel, hold, loss_outcome(reason))


def _ended(otel: _OTel, hold: _Hold, lost: str | None) -> None:
    labels = _labels_of(hold.engine.scheme, hold.claim.kind)
    HELD[labels] = HELD.get(labels, 0) - 1
    _point(otel, otel.hold_duration.record, time.monotonic() - hold.since, labels.attrs)
    if lost is not None:
        _point(otel, otel.leases_lost.add, 1, labels.outcomes[lost])


def loss_outcome(reason: str) -> str:
    """The ``aiolock.outcome`` of a loss, from the reason the core gives ``mark_lost``."""
    if "revoked" in reason:
        return "revoked"
    if "no longer has it" in reason:  # "(expired or taken over)": the server says gone
        return "gone"
    if "expir" in reason or "release failed" in reason:
        return "expired"
    return "gone"


# -- renewals -----------------------------------------------------------------------------


def renewed(backend: Backend, count: int, sent: float) -> None:
    """One renewal request of ``count`` claims, sent at ``sent`` (monotonic), answered."""
    elapsed = time.monotonic() - sent
    if watchdog_log.isEnabledFor(_DEBUG):
        watchdog_log.debug("renewed %d lease(s) in %.1f ms", count, elapsed * 1000)
    if _mm._METER_PROVIDER is None:
        return
    otel = _meter()
    if otel is not None:
        _point(otel, otel.renewal_duration.record, elapsed, _renewal_attrs(backend))


def renewal_failed(backend: Backend, holds: list[_Hold], sent: float, exc: BaseException) -> None:
    """A renewal request failed; its holds are retried soon (INFO: a retry; the loss, if
    it comes to that, is the WARNING)."""
    now = time.monotonic()
    left = min((hold.expires_at - now for hold in holds), default=0.0)
    watchdog_log.info("renewal of %d lease(s) failed (%s); retrying, the first expires in %.1f s",
                      len(holds), exc, left)
    if _mm._METER_PROVIDER is None:
        return
    otel = _meter()
    if otel is not None:
        _point(otel, otel.renewal_duration.record, now - sent, _renewal_attrs(backend))
