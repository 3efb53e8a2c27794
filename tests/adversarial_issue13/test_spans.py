"""Adversarial tests of aiolock's ``aiolock.acquire`` / ``aiolock.release`` spans, written
from SPEC.md §9, README "Metrics, traces and logs" and docs/operations.md alone.

The promise under attack: the SDK work of *starting* a span is handed to the SDK off the
lock's path (a loop callback while the request is on the wire, or the next metrics
collection), with the call's own start time and the caller's context as its parent, and
the span is *ended* on the path: behind a ``SimpleSpanProcessor`` it is exported the
moment ``acquire()`` / ``release()`` returns (or raises). The caller's current span is the
same after the call as before; metric exemplars point to the acquire span
(``acquire.duration``) and to the release span (``hold.duration``).

In-process tests use the process's global providers (``telemetry`` fixture, a
``SimpleSpanProcessor``); those needing a provider of their own (a sampler, a provider set
late, ``asyncio.run`` twice, a fork) run in a child Python.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import textwrap
import threading
import time
import uuid
from typing import Any

import pytest

import aiolock

from ..servers import RedisServer, free_port
from .conftest import Telemetry, child_result

#: slack (ns) between aiolock's clock and ``time.time_ns()`` read around the call
SLACK = 20_000_000



def fresh() -> str:
    return f"adv13s-{uuid.uuid4().hex}"


async def hold(locks: aiolock.Locks, name: str) -> aiolock.Lease:
    """The lease of ``name`` acquired by another task (so this task may wait for it)."""
    return await asyncio.create_task(locks.lock(name, ttl=5).acquire())


def tracer() -> Any:
    from opentelemetry import trace

    return trace.get_tracer("adv13-user")


def acq(tel: Telemetry, name: str) -> list[Any]:
    return [s for s in tel.spans("aiolock.acquire") if s.attributes.get("aiolock.name") == name]


def rel(tel: Telemetry, name: str) -> list[Any]:
    """Release spans of ``name`` (by its name attribute if they carry one, else all)."""
    spans = tel.spans("aiolock.release")
    named = [s for s in spans if "aiolock.name" in (s.attributes or {})]
    if named:
        return [s for s in spans if s.attributes.get("aiolock.name") == name]
    return spans


def ctx_now() -> Any:
    from opentelemetry import context

    return context.get_current()


def ids(span: Any) -> tuple[int, int]:
    ctx = span.get_span_context() if hasattr(span, "get_span_context") else span.context
    return ctx.trace_id, ctx.span_id


def child_of(span: Any, parent: Any) -> bool:
    trace_id, span_id = ids(parent)
    return (span.parent is not None and span.parent.span_id == span_id
            and span.context.trace_id == trace_id)


# ---------------------------------------------------------------- on the path, in process


async def test_granted_spans_exported_the_moment_acquire_and_release_return(
        telemetry: Telemetry, locks: aiolock.Locks, url: str) -> None:
    """No loop turn between the call's return and the check: the acquire span (outcome
    granted, the token, the name, the backend, kind lock, child of the caller's span) is
    already exported when ``acquire()`` returns, the release span when ``release()`` does;
    the caller's context is unchanged after each; the span covers the call."""
    from opentelemetry.trace import StatusCode

    name = fresh()
    with tracer().start_as_current_span("user") as user:
        before = ctx_now()
        t0 = time.time_ns()
        lease = await locks.lock(name, ttl=5).acquire()
        t1 = time.time_ns()
        spans = acq(telemetry, name)  # no await in between
        assert ctx_now() == before, "acquire() left another context current"
        assert len(spans) == 1, [s.name for s in telemetry.spans()]
        s = spans[0]
        assert s.attributes.get("aiolock.outcome") == "granted"
        assert s.attributes.get("aiolock.token") == lease.token
        assert s.attributes.get("aiolock.backend") == url.split("://")[0]
        assert s.attributes.get("aiolock.kind") == "lock"
        assert s.status.status_code != StatusCode.ERROR
        assert child_of(s, user), (s.parent, ids(user))
        assert t0 - SLACK <= s.start_time <= s.end_time <= t1 + SLACK, (t0, s.start_time, s.end_time, t1)
        t2 = time.time_ns()
        await lease.release()
        t3 = time.time_ns()
        released = rel(telemetry, name)
        assert ctx_now() == before, "release() left another context current"
        assert len(released) == 1, [x.name for x in telemetry.spans()]
        r = released[0]
        assert child_of(r, user), (r.parent, ids(user))
        assert t2 - SLACK <= r.start_time <= r.end_time <= t3 + SLACK
        assert r.start_time >= s.end_time - SLACK


async def test_async_with_spans_exported_at_enter_and_exit(
        telemetry: Telemetry, locks: aiolock.Locks) -> None:
    """``async with lock``: the acquire span is there inside the body, the release span
    right after the block; the body's own spans are children of the caller's span (no
    aiolock span is current in the body)."""
    name = fresh()
    with tracer().start_as_current_span("user") as user:
        async with locks.lock(name, ttl=5) as lease:
            assert len(acq(telemetry, name)) == 1
            assert acq(telemetry, name)[0].attributes.get("aiolock.token") == lease.token
            with tracer().start_as_current_span("body") as body:
                pass
            assert rel(telemetry, name) == []
        assert len(rel(telemetry, name)) == 1
    body_span = [s for s in telemetry.spans("body") if ids(s) == ids(body)]
    assert len(body_span) == 1 and child_of(body_span[0], user)


async def test_timeout_span_exported_when_locktimeout_raised_and_covers_the_wait(
        telemetry: Telemetry, locks: aiolock.Locks) -> None:
    """A 0.4 s wait ending in LockTimeout: its span is exported as the exception reaches
    the caller, outcome timeout, no token, status not ERROR, start time the call's start
    (not when the SDK got to start it), covering the wait; context unchanged."""
    from opentelemetry.trace import StatusCode

    name = fresh()
    holder = await hold(locks, name)
    try:
        with tracer().start_as_current_span("user") as user:
            before = ctx_now()
            t0 = time.time_ns()
            try:
                await locks.lock(name, ttl=5).acquire(timeout=0.4)
            except aiolock.LockTimeout:
                t1 = time.time_ns()
                spans = acq(telemetry, name)
                assert ctx_now() == before
            else:
                pytest.fail("acquire on a held lock did not time out")
        assert len(spans) == 2, [(x.attributes.get("aiolock.outcome")) for x in spans]
        s = [x for x in spans if x.attributes.get("aiolock.outcome") != "granted"]
        assert len(s) == 1, [x.attributes for x in spans]
        s0 = s[0]
        assert s0.attributes.get("aiolock.outcome") == "timeout"
        assert "aiolock.token" not in s0.attributes
        assert s0.status.status_code != StatusCode.ERROR
        assert child_of(s0, user)
        assert t0 - SLACK <= s0.start_time <= t0 + 100_000_000, (
            "the span starts when the SDK got to it, not when the call began",
            (s0.start_time - t0) / 1e9)
        assert s0.end_time <= t1 + SLACK
        assert (s0.end_time - s0.start_time) / 1e9 >= 0.35
    finally:
        await holder.release()


async def test_waiter_span_started_by_a_collection_in_another_thread_keeps_parent_and_start(
        telemetry: Telemetry, locks: aiolock.Locks) -> None:
    """A waiter blocks 0.5 s while another thread collects metrics in a loop (a collection
    may hand waiting span starts to the SDK, from that thread): the span still has the
    waiter's span as parent, the call's start time, and is exported at the grant."""
    name = fresh()
    holder = await hold(locks, name)
    stop = threading.Event()
    collections = [0]

    def collect() -> None:
        while not stop.is_set():
            telemetry.reader.get_metrics_data()
            collections[0] += 1
            time.sleep(0.005)

    th = threading.Thread(target=collect)
    th.start()
    try:
        async def waiter() -> tuple[Any, int, int, Any]:
            with tracer().start_as_current_span("waiter") as user:
                t0 = time.time_ns()
                lease = await locks.lock(name, ttl=5).acquire(timeout=10)
                spans = [s for s in acq(telemetry, name) if s.attributes.get("aiolock.token") == lease.token]
                assert trace_current() is user
                await lease.release()
                return user, t0, len(spans), spans[0] if spans else None

        task = asyncio.create_task(waiter())
        await asyncio.sleep(0.5)
        await holder.release()
        user, t0, n, span = await asyncio.wait_for(task, 10)
    finally:
        stop.set()
        th.join(5)
    assert collections[0] > 5
    assert n == 1 and span is not None
    assert child_of(span, user), (span.parent, ids(user))
    assert t0 - SLACK <= span.start_time <= t0 + 100_000_000, (span.start_time - t0) / 1e9
    assert (span.end_time - span.start_time) / 1e9 >= 0.45


def trace_current() -> Any:
    from opentelemetry import trace

    return trace.get_current_span()


async def test_cancelled_at_every_step_one_span_exported_by_the_time_the_task_ends(
        telemetry: Telemetry, locks: aiolock.Locks) -> None:
    """acquire() cancelled after 0..24 loop steps, on a free and on a held name: when the
    awaiting code sees the task end, every acquire() call that began has exactly one
    exported span, outcome granted (with the lease's token) or cancelled (as the caller
    saw it); the task's own context is unchanged after the call."""
    rng = random.Random(1313)
    problems: list[Any] = []
    for steps in [*range(25), *(rng.randrange(25, 60) for _ in range(6))]:
        for held in (False, True):
            name = fresh()
            holder = await hold(locks, name) if held else None
            began: list[Any] = []

            async def call(name: str = name, began: list[Any] = began,
                           where: tuple[int, bool] = (steps, held)) -> Any:
                with tracer().start_as_current_span("caller") as user:
                    began.append(user)
                    before = ctx_now()
                    try:
                        return await locks.lock(name, ttl=5).acquire()
                    finally:
                        if ctx_now() != before:
                            problems.append((*where, "context changed"))

            task = asyncio.create_task(call())
            for _ in range(steps):
                await asyncio.sleep(0)
            task.cancel()
            try:
                lease = await task
                outcome, token = "granted", lease.token
            except asyncio.CancelledError:
                lease, outcome, token = None, "cancelled", None
            spans = [s for s in acq(telemetry, name)
                     if holder is None or s.attributes.get("aiolock.token") != holder.token]
            if not began:
                if spans:
                    problems.append((steps, held, "span without a call", len(spans)))
            else:
                mine = [s for s in spans if s.attributes.get("aiolock.outcome") != "granted"
                        or s.attributes.get("aiolock.token") == token]
                if len(mine) != 1:
                    problems.append((steps, held, outcome, "spans", [s.attributes for s in spans]))
                else:
                    s = mine[0]
                    if s.attributes.get("aiolock.outcome") != outcome:
                        problems.append((steps, held, outcome, dict(s.attributes)))
                    if not child_of(s, began[0]):
                        problems.append((steps, held, "parent", s.parent))
            if lease is not None:
                await lease.release()
            if holder is not None:
                await holder.release()
    assert not problems, problems[:8]


async def test_error_outcome_unreachable_server(telemetry: Telemetry) -> None:
    """Nothing listens: acquire raises; its span is exported as the error reaches the
    caller, outcome error, status ERROR, child of the caller's span; context unchanged."""
    from opentelemetry.trace import StatusCode

    name = fresh()
    url = f"redis://127.0.0.1:{free_port()}/0?connect_timeout=0.5&request_timeout=0.5"
    locks = aiolock.connect(url)
    try:
        with tracer().start_as_current_span("user") as user:
            before = ctx_now()
            with pytest.raises(Exception) as err:  # whatever it raises
                await locks.lock(name).acquire(timeout=2)
            spans = acq(telemetry, name)
            assert ctx_now() == before
        assert not isinstance(err.value, aiolock.LockTimeout), err.value
        assert len(spans) == 1, [s.attributes for s in spans]
        assert spans[0].attributes.get("aiolock.outcome") == "error"
        assert spans[0].status.status_code == StatusCode.ERROR
        assert "aiolock.token" not in spans[0].attributes
        assert child_of(spans[0], user)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(locks.aclose(), 3)


async def test_release_on_a_killed_server_span_exported_context_unchanged(telemetry: Telemetry) -> None:
    """A private redis-server killed while a lease is held: release() returns or raises
    within bounds; by then its release span is exported, child of the caller's span, and
    the caller's context is unchanged. A later acquire fails with an error span."""
    from opentelemetry.trace import StatusCode

    server = RedisServer().start()
    locks = aiolock.connect(server.url + "?connect_timeout=0.5&request_timeout=0.5")
    name = fresh()
    try:
        lease = await locks.lock(name, ttl=5).acquire()
        server.kill()
        with tracer().start_as_current_span("user") as user:
            before = ctx_now()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(lease.release(), 5)
            released = rel(telemetry, name)
            assert ctx_now() == before
            with pytest.raises(Exception):  # noqa: B017 -- whatever it raises
                await locks.lock(name).acquire(timeout=1)
            spans = acq(telemetry, name)
            assert ctx_now() == before
        assert len(released) == 1, released
        assert child_of(released[0], user)
        errs = [s for s in spans if s.attributes.get("aiolock.outcome") != "granted"]
        assert len(errs) == 1 and errs[0].attributes.get("aiolock.outcome") == "error", (
            [s.attributes for s in spans])
        assert errs[0].status.status_code == StatusCode.ERROR
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(locks.aclose(), 3)
        server.close()


async def test_concurrent_tasks_each_parent_own_span_while_a_thread_collects(
        telemetry: Telemetry, locks: aiolock.Locks) -> None:
    """40 tasks, each in a span (and trace) of its own, contend for 3 names for 4 cycles
    each, with timeout tries mixed in, while a thread collects metrics in a tight loop:
    each call's span is exported when it returns, exactly one span per call, unique span
    ids, each the child of its own task's span (no cross-talk of parents), contexts
    unchanged."""
    names = [fresh() for _ in range(3)]
    stop = threading.Event()
    calls: list[tuple[tuple[int, int], str, str, int | None]] = []
    problems: list[Any] = []

    def collect() -> None:
        while not stop.is_set():
            telemetry.reader.get_metrics_data()

    async def one(i: int) -> None:
        with tracer().start_as_current_span(f"task{i}") as user:
            before = ctx_now()
            for k in range(4):
                name = names[(i + k) % 3]
                timeout = 0 if (i + k) % 5 == 0 else 10
                try:
                    lease = await locks.lock(name, ttl=5).acquire(timeout=timeout)
                except aiolock.LockTimeout:
                    calls.append((ids(user), name, "timeout", None))
                    if ctx_now() != before:
                        problems.append((i, k, "context after timeout"))
                    continue
                calls.append((ids(user), name, "granted", lease.token))
                if not [s for s in acq(telemetry, name) if s.attributes.get("aiolock.token") == lease.token]:
                    problems.append((i, k, "granted span not exported at return"))
                if ctx_now() != before:
                    problems.append((i, k, "context after acquire"))
                await asyncio.sleep(0.001 * (i % 3))
                await lease.release()
                if ctx_now() != before:
                    problems.append((i, k, "context after release"))

    th = threading.Thread(target=collect)
    th.start()
    try:
        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(40))), 30)
    finally:
        stop.set()
        th.join(5)
    assert not problems, problems[:8]
    spans = [s for n in names for s in acq(telemetry, n)]
    assert len(spans) == len(calls) == 160, (len(spans), len(calls))
    assert len({ids(s) for s in spans}) == len(spans), "span ids not unique"
    by_token = {(s.attributes["aiolock.name"], s.attributes.get("aiolock.token")): s
                for s in spans if s.attributes.get("aiolock.outcome") == "granted"}
    granted = [c for c in calls if c[2] == "granted"]
    assert len(by_token) == len(granted)
    for user, name, _, token in granted:
        s = by_token[(name, token)]
        assert (s.context.trace_id, s.parent.span_id if s.parent else None) == user, (
            "an acquire span's parent is another task's span")
    timeouts = [s for s in spans if s.attributes.get("aiolock.outcome") == "timeout"]
    assert len(timeouts) == len(calls) - len(granted)
    users = {c[0] for c in calls if c[2] == "timeout"}
    assert {(s.context.trace_id, s.parent.span_id if s.parent else None) for s in timeouts} <= users
    released = telemetry.spans("aiolock.release")
    users_all = {c[0] for c in calls}
    mine = [s for s in released if s.parent is not None
            and (s.context.trace_id, s.parent.span_id) in users_all]
    assert len(mine) == len(granted), (len(mine), len(granted))
    assert len({ids(s) for s in mine}) == len(mine)


async def test_anyio_cancel_scopes_and_task_groups_around_acquire(
        telemetry: Telemetry, locks: aiolock.Locks) -> None:
    """anyio ``move_on_after`` around a waiting acquire, and a task group cancelled with
    five waiters in it: one span each, outcome cancelled, exported when the scope exits;
    context unchanged; the scope's own cancellation handled by anyio as usual."""
    import anyio

    name = fresh()
    holder = await hold(locks, name)
    try:
        with tracer().start_as_current_span("user") as user:
            before = ctx_now()
            with anyio.move_on_after(0.3) as scope:
                await locks.lock(name, ttl=5).acquire()
            assert scope.cancelled_caught
            assert ctx_now() == before
            spans = acq(telemetry, name)
            assert [s.attributes.get("aiolock.outcome") for s in spans] == ["granted", "cancelled"]
            assert child_of(spans[1], user)

            async def waiter() -> None:
                with tracer().start_as_current_span("tg-waiter"):
                    await locks.lock(name, ttl=5).acquire()

            async with anyio.create_task_group() as tg:
                for _ in range(5):
                    tg.start_soon(waiter)
                await anyio.sleep(0.2)
                tg.cancel_scope.cancel()
            assert ctx_now() == before
            spans = acq(telemetry, name)
            outcomes = [s.attributes.get("aiolock.outcome") for s in spans]
            assert sorted(outcomes) == ["cancelled"] * 6 + ["granted"], outcomes
            waiters = [s for s in telemetry.spans("tg-waiter")]
            assert {ids(s) for s in waiters} == {(s.context.trace_id, s.parent.span_id)
                                                 for s in spans[2:] if s.parent}
    finally:
        await holder.release()


async def test_reentrant_and_same_task_reacquire_spans(
        telemetry: Telemetry, locks: aiolock.Locks) -> None:
    """A reentrant lock acquired three times by one task: every acquire() call has one
    span, exported at return, child of the span current at that call; at most one
    release span per release() call. A non-reentrant lock acquired again by its holder
    raises LockError at once: one span for that call too, not granted, context
    unchanged."""
    name = fresh()
    lock = locks.lock(name, ttl=5, reentrant=True)
    leases = []
    users = []
    for depth in range(3):
        with tracer().start_as_current_span(f"depth{depth}") as user:
            users.append(user)
            leases.append(await lock.acquire())
            assert len(acq(telemetry, name)) == depth + 1
            assert child_of(acq(telemetry, name)[-1], user)
    for lease in reversed(leases):
        await lease.release()
    assert 1 <= len(rel(telemetry, name)) <= 3
    assert len({ids(s) for s in acq(telemetry, name)}) == 3

    other = fresh()
    plain = locks.lock(other, ttl=5)
    async with plain:
        with tracer().start_as_current_span("again"):
            before = ctx_now()
            with pytest.raises(aiolock.LockError):
                await plain.acquire(timeout=1)
            spans = acq(telemetry, other)
            assert ctx_now() == before
    assert len(spans) == 2, [s.attributes for s in spans]
    assert spans[1].attributes.get("aiolock.outcome") in ("error", "timeout", "cancelled")
    assert "aiolock.token" not in spans[1].attributes


async def test_kinds_spans_exported_at_return(telemetry: Telemetry, locks: aiolock.Locks) -> None:
    """read, write, permit (and leader where offered): each acquisition's span is exported
    by the time the block is entered, with its kind and a token; its release span by the
    time the block is left."""
    prims: list[tuple[str, Any]] = []
    names = {k: fresh() for k in ("read", "write", "permit", "leader")}
    prims.append(("read", locks.rwlock(names["read"]).read()))
    prims.append(("write", locks.rwlock(names["write"]).write()))
    prims.append(("permit", locks.semaphore(names["permit"], limit=2)))
    if aiolock.Capability.ELECTION in locks.capabilities:
        prims.append(("leader", locks.election(names["leader"], ttl=5).campaign(data="x")))
    for kind, cm in prims:
        name = names[kind]
        n_rel = len(telemetry.spans("aiolock.release"))
        async with cm:
            spans = acq(telemetry, name)
            assert len(spans) == 1, (kind, [s.attributes for s in telemetry.spans("aiolock.acquire")])
            assert spans[0].attributes.get("aiolock.kind") == kind
            assert spans[0].attributes.get("aiolock.outcome") == "granted"
            assert isinstance(spans[0].attributes.get("aiolock.token"), int)
        assert len(telemetry.spans("aiolock.release")) == n_rel + 1, kind


async def test_release_by_another_task_and_after_a_failing_body(
        telemetry: Telemetry, locks: aiolock.Locks) -> None:
    """A lease released by another task (in its own span): the release span is that
    task's child, exported when its release() returns. ``async with`` whose body raises:
    the release span is exported by the time the exception reaches the caller, child of
    the caller's span, context unchanged."""
    name = fresh()
    with tracer().start_as_current_span("acquirer"):
        lease = await locks.lock(name, ttl=5).acquire()

    async def releaser() -> tuple[Any, int]:
        with tracer().start_as_current_span("releaser") as other:
            await lease.release()
            return other, len(rel(telemetry, name))

    other, n = await asyncio.create_task(releaser())
    assert n == 1
    assert child_of(rel(telemetry, name)[0], other)

    name2 = fresh()
    with tracer().start_as_current_span("user") as user:
        before = ctx_now()
        with pytest.raises(ZeroDivisionError):
            async with locks.lock(name2, ttl=5):
                raise ZeroDivisionError
        released = rel(telemetry, name2)
        assert ctx_now() == before
    assert len(released) == 1 and child_of(released[0], user)


@pytest.mark.parametrize("how", ["asyncio.timeout", "wait_for"])
async def test_asyncio_timeout_and_wait_for_around_a_waiting_acquire(
        telemetry: Telemetry, locks: aiolock.Locks, how: str) -> None:
    """``asyncio.timeout(0.3)`` / ``asyncio.wait_for(acquire(), 0.3)`` around a waiting
    acquire: TimeoutError reaches the caller with exactly one span exported for that call
    (outcome cancelled or timeout, never granted or error, no token), child of the
    caller's span, covering the wait; context unchanged; the lock is not left held."""
    name = fresh()
    holder = await hold(locks, name)
    try:
        with tracer().start_as_current_span("user") as user:
            before = ctx_now()
            t0 = time.time_ns()
            with pytest.raises(TimeoutError):
                if how == "wait_for":
                    await asyncio.wait_for(locks.lock(name, ttl=5).acquire(), 0.3)
                else:
                    async with asyncio.timeout(0.3):
                        await locks.lock(name, ttl=5).acquire()
            spans = [s for s in acq(telemetry, name) if s.attributes.get("aiolock.token") != holder.token]
            assert ctx_now() == before
        assert len(spans) == 1, [s.attributes for s in spans]
        s = spans[0]
        assert s.attributes.get("aiolock.outcome") in ("cancelled", "timeout"), s.attributes
        assert "aiolock.token" not in s.attributes
        assert child_of(s, user)
        assert t0 - SLACK <= s.start_time <= t0 + 100_000_000
        assert (s.end_time - s.start_time) / 1e9 >= 0.25
    finally:
        await holder.release()
    assert not await locks.lock(name).locked()


# ---------------------------------------------------------------- the documented siblings
# (written first against the earlier docs, which had the acquire span current while
# acquiring; it found that the docs had not followed the change)


async def test_documented_acquire_request_goes_out_under_the_callers_span(
        telemetry: Telemetry, redis_server: Any) -> None:
    """What runs on the wire for an acquire (here: the transport writes of the request
    that carries the lock's name, as a client library's instrumentation would wrap them)
    sees the caller's span as the current one, never the acquire span (docs/operations.md:
    the acquire span is never current; client spans are its siblings)."""
    import asyncio.selector_events as sel

    name = fresh()
    seen: list[Any] = []
    original = sel._SelectorSocketTransport.write

    def write(self: Any, data: Any) -> None:
        if name.encode() in bytes(data):
            seen.append(trace_current())
        original(self, data)

    async with aiolock.connect(redis_server.url) as locks:
        await locks.lock(fresh()).acquire(timeout=1)  # connected before patching
        sel._SelectorSocketTransport.write = write  # type: ignore[method-assign]
        try:
            with tracer().start_as_current_span("user") as user:
                lease = await locks.lock(name, ttl=5).acquire()
        finally:
            sel._SelectorSocketTransport.write = original  # type: ignore[method-assign]
        await lease.release()
    if not seen:  # the probe missed (another transport): say so, not xfail for it
        pytest.skip("no transport write carried the lock's name")
    spans = acq(telemetry, name)
    assert len(spans) == 1
    for current in seen:
        assert ids(current) == ids(user) != ids(spans[0]), (
            "the acquire request was not sent under the caller's span")
    assert spans[0].parent is not None and spans[0].parent.span_id == user.get_span_context().span_id


# ---------------------------------------------------------------- child processes

PRELUDE = r'''
import asyncio, contextlib, json, os, sys, threading, time
import aiolock
from opentelemetry import context, metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.metrics.view import View
from opentelemetry.sdk.metrics._internal.exemplar import SimpleFixedSizeExemplarReservoir
from opentelemetry.sdk.metrics.export import Histogram as HistogramData
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


def setup(sampler=None, traces=True, exemplars=False):
    rd = InMemoryMetricReader()
    views = []
    if exemplars:
        views.append(View(instrument_name="aiolock.*", exemplar_reservoir_factory=lambda agg: (
            lambda **kw: SimpleFixedSizeExemplarReservoir(size=256))))
    mp = MeterProvider(metric_readers=[rd], views=views)
    metrics.set_meter_provider(mp)
    exp = InMemorySpanExporter()
    tp = TracerProvider(sampler=sampler) if sampler is not None else TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exp))
    if traces:
        trace.set_tracer_provider(tp)
    return rd, exp, tp


def hexid(ctx):
    return [format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")]


def spans_of(exp, kind="aiolock.acquire", name=None):
    return [s for s in exp.get_finished_spans() if s.name == kind
            and (name is None or s.attributes.get("aiolock.name") == name)]


def desc(s):
    return {"name": s.name, "attrs": dict(s.attributes or {}), "id": hexid(s.context),
            "parent": s.parent and hexid(s.parent), "start": s.start_time, "end": s.end_time,
            "status": s.status.status_code.name}


def exemplars(rd):
    return exemplars_of(rd.get_metrics_data())


def exemplars_of(data):
    out = {}
    for rm in (data.resource_metrics if data else ()):
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if isinstance(m.data, HistogramData):
                    for dp in m.data.data_points:
                        for e in dp.exemplars or ():
                            out.setdefault(m.name, []).append(
                                [format(e.trace_id or 0, "032x"), format(e.span_id or 0, "016x"),
                                 dict(dp.attributes).get("aiolock.outcome")])
    return out


user = trace.get_tracer("adv13-user")


def emit(**result):
    print("RESULT " + json.dumps(result, default=str), flush=True)
'''


def run_child(body: str, *args: str, timeout: float = 25.0) -> dict[str, Any]:
    return child_result(PRELUDE + "\n" + textwrap.dedent(body), *args, timeout=timeout,
                        unset=("OTEL_METRICS_EXEMPLAR_FILTER", "OTEL_TRACES_SAMPLER"),
                        forbidden=("Traceback", "Exception in callback", "Task was destroyed"))


def test_parent_based_sampler_unsampled_parent_exports_nothing_lock_still_works(
        redis_server: Any) -> None:
    """``ParentBased(ALWAYS_ON)``: under an unsampled (remote) parent no aiolock span is
    exported, no exemplar points anywhere, the locks work and the points are counted;
    under a sampled remote parent the spans are exported as its children, and the
    exemplars are those spans."""
    got = run_child('''
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
        from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

        rd, exp, tp = setup(sampler=ParentBased(ALWAYS_ON), exemplars=True)
        out = {}

        def remote(sampled, n):
            sc = SpanContext(trace_id=0xABC0 + n, span_id=0xDEF0 + n, is_remote=True,
                             trace_flags=TraceFlags(TraceFlags.SAMPLED if sampled else 0))
            return trace.set_span_in_context(NonRecordingSpan(sc))

        async def cycles(locks, tag):
            tokens = []
            for i in range(5):
                lease = await locks.lock(tag).acquire()
                tokens.append(lease.token)
                with contextlib.suppress(aiolock.LockTimeout):
                    await asyncio.create_task(locks.lock(tag).acquire(timeout=0))
                await lease.release()
            return tokens

        async def main(url):
            out = {}
            async with aiolock.connect(url) as locks:
                tok = context.attach(remote(False, 1))
                try:
                    out["unsampled_tokens"] = await cycles(locks, "u")
                    out["unsampled_current"] = hexid(trace.get_current_span().get_span_context())
                finally:
                    context.detach(tok)
                out["unsampled_spans"] = [s.name for s in exp.get_finished_spans()]
                out["unsampled_exemplars"] = exemplars(rd)
                tok = context.attach(remote(True, 2))
                try:
                    out["sampled_tokens"] = await cycles(locks, "s")
                finally:
                    context.detach(tok)
                out["sampled_spans"] = [desc(s) for s in exp.get_finished_spans()]
                out["sampled_exemplars"] = exemplars(rd)
            return out

        for url in (sys.argv[1], "memory://"):
            exp.clear()
            rd.get_metrics_data()
            out[url] = asyncio.run(main(url))
        emit(**out)
    ''', redis_server.url)
    for url in (redis_server.url, "memory://"):
        r = got[url]
        assert len(r["unsampled_tokens"]) == 5
        assert r["unsampled_current"] == [format(0xABC1, "032x"), format(0xDEF1, "016x")]
        assert r["unsampled_spans"] == [], r["unsampled_spans"]
        assert r["unsampled_exemplars"] == {}, r["unsampled_exemplars"]
        spans = r["sampled_spans"]
        acquire = [s for s in spans if s["name"] == "aiolock.acquire"]
        release = [s for s in spans if s["name"] == "aiolock.release"]
        assert len(acquire) == 10 and len(release) == 5, [s["name"] for s in spans]
        for s in acquire + release:
            assert s["parent"] == [format(0xABC2, "032x"), format(0xDEF2, "016x")], s
        granted = sorted(s["attrs"]["aiolock.token"] for s in acquire
                         if s["attrs"].get("aiolock.outcome") == "granted")
        assert granted == sorted(r["sampled_tokens"])
        ex = r["sampled_exemplars"]
        assert sorted(e[:2] for e in ex.get("aiolock.acquire.duration", [])) == sorted(
            s["id"] for s in acquire), ex
        assert sorted(e[:2] for e in ex.get("aiolock.hold.duration", [])) == sorted(
            s["id"] for s in release), ex
        by_id = {tuple(s["id"]): s["attrs"].get("aiolock.outcome") for s in acquire}
        for trace_id, span_id, outcome in ex.get("aiolock.acquire.duration", []):
            assert by_id[(trace_id, span_id)] == outcome, "exemplar of another outcome's span"


def test_asyncio_run_twice_pending_waiter_cancelled_by_run_teardown(redis_server: Any) -> None:
    """``asyncio.run`` twice in one process, memory:// and redis. The first run returns
    while a task waits on a held lock (asyncio.run cancels it): its span is exported,
    outcome cancelled, by the time asyncio.run returns. The second run's spans are each
    exported at return, parented right, exemplars pointing to them; nothing from the
    first loop shows up late."""
    got = run_child('''
        rd, exp, tp = setup(exemplars=True)
        out = {"runs": []}

        async def first(url):
            locks = aiolock.connect(url)
            holder = await locks.lock("h").acquire()
            with user.start_as_current_span("orphan"):
                asyncio.get_running_loop().create_task(locks.lock("h").acquire())
            for _ in range(3):
                await asyncio.sleep(0.05)
            # leave without releasing or closing: asyncio.run cancels the waiter
            out["first_holder"] = holder.token

        async def second(url):
            res = {"missing": 0, "bad_parent": 0, "ctx": 0}
            async with aiolock.connect(url) as locks:
                for i in range(20):
                    with user.start_as_current_span(f"s{i}") as u:
                        before = context.get_current()
                        lease = await locks.lock(f"n{i % 2}").acquire(timeout=10)
                        mine = [s for s in spans_of(exp) if s.attributes.get("aiolock.token") == lease.token
                                and s.attributes.get("aiolock.name") == f"n{i % 2}"]
                        if len(mine) != 1:
                            res["missing"] += 1
                        elif mine[0].parent is None or mine[0].parent.span_id != u.get_span_context().span_id:
                            res["bad_parent"] += 1
                        n = len(spans_of(exp, "aiolock.release"))
                        await lease.release()
                        if len(spans_of(exp, "aiolock.release")) != n + 1:
                            res["missing"] += 1
                        if context.get_current() != before:
                            res["ctx"] += 1
            return res

        for url in (sys.argv[1], "memory://"):
            exp.clear()
            asyncio.run(first(url))
            after_first = [desc(s) for s in spans_of(exp, name="h")]
            n_first = len([s for s in exp.get_finished_spans() if s.name.startswith("aiolock.")])
            res = asyncio.run(second(url))
            rd.get_metrics_data()
            late = [desc(s) for s in spans_of(exp, name="h")][len(after_first):]
            out["runs"].append({"url": url, "after_first": after_first, "second": res, "late": late,
                                "n_second": len([s for s in exp.get_finished_spans()
                                                 if s.name.startswith("aiolock.")]) - n_first})
        emit(**out)
    ''', f"{redis_server.url}")
    for run in got["runs"]:
        outcomes = sorted(s["attrs"].get("aiolock.outcome") for s in run["after_first"])
        assert outcomes == ["cancelled", "granted"], (run["url"], run["after_first"])
        assert run["second"] == {"missing": 0, "bad_parent": 0, "ctx": 0}, run
        assert run["late"] == [], run
        assert run["n_second"] == 40, run


def test_spans_in_threads_running_their_own_loops_and_in_a_forked_child() -> None:
    """Four threads each run their own loop on memory:// (each task in its own span),
    spans exported at return, parented to their own thread's task; then the process
    forks and the child, with the parent's providers, does the same in asyncio.run: its
    spans are exported at return and parented right too."""
    got = run_child('''
        rd, exp, tp = setup()
        out = {"problems": [], "counts": {}}

        async def work(tag, n, problems):
            async with aiolock.connect("memory://") as locks:
                async def one(i):
                    with user.start_as_current_span(f"{tag}-{i}") as u:
                        before = context.get_current()
                        for k in range(n):
                            lease = await locks.lock(f"{tag}-{k % 2}").acquire()
                            mine = [s for s in spans_of(exp, name=f"{tag}-{k % 2}")
                                    if s.attributes.get("aiolock.token") == lease.token]
                            if len(mine) != 1 or mine[0].parent.span_id != u.get_span_context().span_id:
                                problems.append([tag, i, k, len(mine)])
                            await asyncio.sleep(0)
                            await lease.release()
                            if context.get_current() != before:
                                problems.append([tag, i, k, "ctx"])
                await asyncio.gather(*(one(i) for i in range(5)))

        threads = [threading.Thread(target=lambda t=t: asyncio.run(work(f"t{t}", 10, out["problems"])))
                   for t in range(4)]
        for th in threads:
            th.start()
        stop = threading.Event()
        def collect():
            while not stop.is_set():
                rd.get_metrics_data()
        col = threading.Thread(target=collect)
        col.start()
        for th in threads:
            th.join(20)
        stop.set()
        col.join(5)
        out["counts"]["threads"] = len(spans_of(exp))
        out["unique"] = len({hexid(s.context)[1] for s in spans_of(exp)})

        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                import faulthandler
                faulthandler.dump_traceback_later(10, exit=True)
                exp.clear()
                problems = []
                asyncio.run(work("child", 10, problems))
                msg = json.dumps({"problems": problems, "spans": len(spans_of(exp)),
                                  "release": len(spans_of(exp, "aiolock.release"))})
            except BaseException as exc:
                msg = json.dumps({"error": repr(exc)})
            os.write(w, msg.encode())
            os._exit(0)
        os.close(w)
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
        _, status = os.waitpid(pid, 0)
        out["child"] = json.loads(data or b"{}")
        out["child_status"] = status
        emit(**out)
    ''')
    assert got["problems"] == [], got["problems"][:8]
    assert got["counts"]["threads"] == 4 * 5 * 10 and got["unique"] == 200, got
    assert got["child_status"] == 0
    child = got["child"]
    assert child.get("problems") == [] and child.get("spans") == 50 and child.get("release") == 50, child


def test_tracer_provider_set_after_locks_were_taken() -> None:
    """Locks taken with no tracer provider set (the API's proxy), then the SDK's set, in
    the same loop and connection: the later acquisitions are recorded as spans, exported
    at return, parented to the caller; no exception, and nothing from before (no SDK)
    shows up half-made."""
    got = run_child('''
        rd, exp, tp = setup(traces=False)
        out = {}

        async def main():
            async with aiolock.connect("memory://") as locks:
                for i in range(3):
                    async with locks.lock("early"):
                        pass
                waiter_holder = await locks.lock("w").acquire()
                waiter = asyncio.create_task(locks.lock("w").acquire())
                await asyncio.sleep(0.05)
                trace.set_tracer_provider(tp)
                out["before"] = len(exp.get_finished_spans())
                res = []
                for i in range(3):
                    with user.start_as_current_span(f"late{i}") as u:
                        lease = await locks.lock("late").acquire()
                        mine = [s for s in spans_of(exp, name="late")
                                if s.attributes.get("aiolock.token") == lease.token]
                        res.append([len(mine), bool(mine) and mine[0].parent is not None
                                    and mine[0].parent.span_id == u.get_span_context().span_id])
                        await lease.release()
                out["late"] = res
                await waiter_holder.release()
                lease = await asyncio.wait_for(waiter, 5)
                await lease.release()
                out["waiter_spans"] = [desc(s) for s in spans_of(exp, name="w")]
                out["early_spans"] = len(spans_of(exp, name="early"))

        asyncio.run(main())
        emit(**out)
    ''')
    assert got["before"] == 0
    assert got["early_spans"] == 0
    assert got["late"] == [[1, True]] * 3, got["late"]
    # the waiter's call began before the provider was set: at most one span, a whole one
    assert len(got["waiter_spans"]) <= 1, got["waiter_spans"]


def test_processor_sees_each_span_started_once_ended_once_with_the_callers_context(
        redis_server: Any) -> None:
    """A span processor records on_start / on_end: 30 tasks per backend, each in a span
    of its own with baggage of its own, acquire (granted, timeout=0 failures, cancelled
    waits) and release, while two threads, each inside a span of their own, collect
    metrics in a tight loop (a collection may start waiting spans in that thread): every
    aiolock span is started once and ended once, none is left started but not ended,
    its parent is the calling task's span (never a collector's), and the context the SDK
    is given at its start carries the caller's baggage."""
    got = run_child('''
        from opentelemetry import baggage
        from opentelemetry.sdk.trace import SpanProcessor

        class Watch(SpanProcessor):
            def __init__(self):
                self.lock = threading.Lock()
                self.started, self.ended, self.bags = {}, {}, {}

            def on_start(self, span, parent_context=None):
                if not span.name.startswith("aiolock."):
                    return
                sid = span.context.span_id
                with self.lock:
                    self.started[sid] = self.started.get(sid, 0) + 1
                    self.bags[sid] = baggage.get_baggage("who", parent_context)

            def on_end(self, span):
                if not span.name.startswith("aiolock."):
                    return
                with self.lock:
                    sid = span.context.span_id
                    self.ended[sid] = self.ended.get(sid, 0) + 1

        rd, exp, tp = setup()
        watch = Watch()
        tp.add_span_processor(watch)
        out = {}

        async def main(url):
            users, problems = {}, []
            async with aiolock.connect(url) as locks:
                async def one(i):
                    tok = context.attach(baggage.set_baggage("who", f"task{i}"))
                    try:
                        with user.start_as_current_span(f"task{i}") as u:
                            users[format(u.get_span_context().span_id, "016x")] = f"task{i}"
                            before = context.get_current()
                            for k in range(6):
                                name = f"n{(i + k) % 3}"
                                if k % 3 == 2:
                                    t = asyncio.create_task(locks.lock(name).acquire())
                                    await asyncio.sleep(0.002 * (i % 4))
                                    t.cancel()
                                    try:
                                        lease = await t
                                    except asyncio.CancelledError:
                                        continue
                                else:
                                    try:
                                        lease = await locks.lock(name).acquire(timeout=0 if k % 3 else 10)
                                    except aiolock.LockTimeout:
                                        continue
                                await asyncio.sleep(0.001)
                                await lease.release()
                                if context.get_current() != before:
                                    problems.append([i, k, "ctx"])
                    finally:
                        context.detach(tok)
                await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(30))), 30)
            return users, problems

        stop = threading.Event()
        collector_spans = []

        def collect(n):
            with user.start_as_current_span(f"collector{n}") as c:
                collector_spans.append(format(c.get_span_context().span_id, "016x"))
                while not stop.is_set():
                    rd.get_metrics_data()

        cols = [threading.Thread(target=collect, args=(n,)) for n in range(2)]
        for th in cols:
            th.start()
        try:
            for url in (sys.argv[1], "memory://"):
                exp.clear()
                users, problems = asyncio.run(main(url))
                spans = [desc(s) for s in exp.get_finished_spans() if s.name.startswith("aiolock.")]
                out[url] = {"users": users, "problems": problems, "spans": spans}
        finally:
            stop.set()
            for th in cols:
                th.join(5)
        with watch.lock:
            out["started"] = {format(k, "016x"): v for k, v in watch.started.items()}
            out["ended"] = {format(k, "016x"): v for k, v in watch.ended.items()}
            out["bags"] = {format(k, "016x"): v for k, v in watch.bags.items()}
        out["collectors"] = collector_spans
        emit(**out)
    ''', redis_server.url)
    assert got["started"] == got["ended"], "a span started but not ended (or ended twice)"
    assert set(got["started"].values()) == {1}
    for url in (redis_server.url, "memory://"):
        r = got[url]
        assert r["problems"] == [], r["problems"][:8]
        spans = r["spans"]
        assert len(spans) >= 30 * 2, len(spans)
        assert len({s["id"][1] for s in spans}) == len(spans)
        for s in spans:
            parent = s["parent"][1] if s["parent"] else None
            assert parent not in got["collectors"], ("a collector's span became the parent", s)
            assert parent in r["users"], ("parent is not a calling task's span", s)
            assert got["bags"][s["id"][1]] == r["users"][parent], (
                "the SDK was not given the caller's context (baggage lost) at the span's start", s)
        outcomes = {s["attrs"].get("aiolock.outcome") for s in spans if s["name"] == "aiolock.acquire"}
        assert {"granted", "timeout", "cancelled"} <= outcomes, outcomes


def test_ratio_sampled_roots_exemplars_match_exported_spans_exactly() -> None:
    """``TraceIdRatioBased(0.5)`` roots (the sampling decision made when the SDK gets to
    start the span, off the path): the acquire.duration exemplars are exactly the exported
    acquire spans (granted, timeout and cancelled alike), the hold.duration exemplars
    exactly the exported release spans; every call still works and is counted."""
    got = run_child('''
        from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

        rd, exp, tp = setup(sampler=TraceIdRatioBased(0.5), exemplars=True)
        out = {}

        async def main():
            calls = 0
            async with aiolock.connect("memory://") as locks:
                async def one(i):
                    nonlocal calls
                    for k in range(5):
                        name = f"n{(i + k) % 2}"
                        calls += 1
                        if k == 4:
                            t = asyncio.create_task(locks.lock(name).acquire())
                            await asyncio.sleep(0)
                            t.cancel()
                            with contextlib.suppress(asyncio.CancelledError):
                                lease = await t
                                await lease.release()
                            continue
                        try:
                            lease = await locks.lock(name).acquire(timeout=0 if k == 3 else 10)
                        except aiolock.LockTimeout:
                            continue
                        await asyncio.sleep(0)
                        await lease.release()
                await asyncio.gather(*(one(i) for i in range(40)))
            return calls

        out["calls"] = asyncio.run(main())
        data = rd.get_metrics_data()
        counts = {}
        for rm in data.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if isinstance(m.data, HistogramData):
                        counts[m.name] = sum(dp.count for dp in m.data.data_points)
        out["counts"] = counts
        # the exemplars of that same collection
        out["exemplars"] = exemplars_of(data)
        out["spans"] = [desc(s) for s in exp.get_finished_spans()]
        emit(**out)
    ''')
    acquire = [s for s in got["spans"] if s["name"] == "aiolock.acquire"]
    release = [s for s in got["spans"] if s["name"] == "aiolock.release"]
    assert got["counts"]["aiolock.acquire.duration"] == got["calls"] == 200, got["counts"]
    assert 0 < len(acquire) < 200, len(acquire)
    ex = got["exemplars"]
    assert sorted(e[:2] for e in ex.get("aiolock.acquire.duration", [])) == sorted(s["id"] for s in acquire)
    assert sorted(e[:2] for e in ex.get("aiolock.hold.duration", [])) == sorted(s["id"] for s in release)
    by_id = {tuple(s["id"]): s["attrs"].get("aiolock.outcome") for s in acquire}
    for trace_id, span_id, outcome in ex.get("aiolock.acquire.duration", []):
        assert by_id[(trace_id, span_id)] == outcome


def test_never_yielding_task_spans_exported_inline_and_nothing_piles_up() -> None:
    """A task that never lets the loop turn (memory://, timeout=0 failures and cycles,
    each in a span of its own): every span is exported at its call's return; the memory
    held after 6000 cycles (no loop turn, no collection) is not growing with the cycles
    (measured against 1500), and after a loop turn and a collection it is back down."""
    got = run_child('''
        import gc, tracemalloc
        from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

        class Count(SpanExporter):
            def __init__(self):
                self.n = 0
            def export(self, spans):
                self.n += len(spans)
                return SpanExportResult.SUCCESS

        rd = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[rd]))
        tp = TracerProvider()
        cnt = Count()  # counts, keeps nothing: what stays in memory is not the exporter's
        tp.add_span_processor(SimpleSpanProcessor(cnt))
        trace.set_tracer_provider(tp)
        out = {"missing": 0}

        async def main():
            async with aiolock.connect("memory://") as locks:
                holder = await asyncio.create_task(locks.lock("busy").acquire())
                for i in range(300):
                    n = cnt.n
                    with user.start_as_current_span("u"):
                        try:
                            await locks.lock("busy").acquire(timeout=0)
                        except aiolock.LockTimeout:
                            pass
                    if cnt.n != n + 2:  # the acquire span, then the user span
                        out["missing"] += 1
                sizes = []
                for total in (1500, 6000):
                    gc.collect()
                    tracemalloc.start()
                    base = tracemalloc.take_snapshot()
                    for i in range(total):
                        lease = await locks.lock(f"c{i % 4}").acquire()
                        await lease.release()
                    gc.collect()
                    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(base, "filename"))
                    for _ in range(5):
                        await asyncio.sleep(0)
                    rd.get_metrics_data()
                    gc.collect()
                    after = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(base, "filename"))
                    tracemalloc.stop()
                    sizes.append([total, grown, after])
                await holder.release()
                out["sizes"] = sizes

        asyncio.run(main())
        out["exported"] = cnt.n
        emit(**out)
    ''', timeout=50)
    assert got["missing"] == 0, got
    (n1, grown1, _), (n2, grown2, after2) = got["sizes"]
    per_cycle_small = grown1 / n1
    per_cycle_big = grown2 / n2
    assert grown2 < 1_000_000 or per_cycle_big < 0.5 * per_cycle_small, got["sizes"]
    assert after2 < 1_000_000, got["sizes"]
