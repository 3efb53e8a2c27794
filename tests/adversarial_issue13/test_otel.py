"""OpenTelemetry metrics and spans (SPEC §9, docs/operations.md), with the real SDK."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid

import pytest

import aiolock

from ..scenarios import SCENARIOS
from .conftest import ROOT, Telemetry, cli_env

#: the metric attribute aiolock.backend of every row (the URL scheme)
SCHEMES = {s.bad_url.partition("://")[0] for s in SCENARIOS if s.bad_url} | {"memory", "postgres"}

METRIC_ATTRS = {"aiolock.backend", "aiolock.kind", "aiolock.outcome"}
UNITS = {
    "aiolock.acquire.duration": ("histogram", "s"),
    "aiolock.hold.duration": ("histogram", "s"),
    "aiolock.renewal.duration": ("histogram", "s"),
    "aiolock.leases.held": ("updown", "{lease}"),
    "aiolock.waiters": ("updown", "{waiter}"),
    "aiolock.leases.lost": ("counter", "{lease}"),
}



def scheme(url: str) -> str:
    return url.split("://", 1)[0]


def fresh() -> str:
    return f"adv13-{uuid.uuid4().hex}"


async def until(check, within: float = 3.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


# ------------------------------------------------------------------ instruments


async def test_instruments_names_units_types_scope(telemetry: Telemetry, locks: aiolock.Locks,
                                                   url: str) -> None:
    """One cycle held across renewals: every §9 instrument that shows up has its type and
    unit, under the scope ``aiolock``; acquire, hold and renewal durations do show up."""
    name = fresh()
    async with locks.lock(name, ttl=0.3):
        await asyncio.sleep(0.4)  # renewals every 0.1 s
    got = telemetry.collect()
    assert "aiolock" in got.scopes
    seen = {p.metric for p in got.points}
    for must in ("aiolock.acquire.duration", "aiolock.hold.duration", "aiolock.renewal.duration"):
        assert must in seen, f"{must} not recorded; got {sorted(seen)}"
    unknown = {m for m in seen if m not in UNITS}
    assert not unknown, f"instruments not named in §9: {unknown}"
    for p in got.points:
        assert (p.kind, p.unit) == UNITS[p.metric], (p.metric, p.kind, p.unit)


async def test_metric_attributes_never_name(telemetry: Telemetry, locks: aiolock.Locks,
                                            url: str) -> None:
    """Only backend, kind, outcome as metric attributes; the lock name nowhere in them;
    backend is the URL scheme."""
    name = fresh()
    async with locks.lock(name, ttl=0.3):
        waiter = asyncio.create_task(locks.lock(name).acquire(timeout=0.25))
        await asyncio.sleep(0.15)
        mid = telemetry.collect()
        with pytest.raises(aiolock.LockTimeout):
            await waiter
        await asyncio.sleep(0.2)
    got = telemetry.collect()
    points = mid.points + got.points
    assert points
    for p in points:
        assert set(p.attrs) <= METRIC_ATTRS, (p.metric, p.attrs)
        assert "aiolock.backend" in p.attrs, (p.metric, p.attrs)
        if p.kind != "updown":  # cumulative: earlier tests' backends stay listed
            assert p.attrs["aiolock.backend"] == scheme(url), (p.metric, p.attrs)
        else:
            # (the process's shared providers: any row's scheme an earlier test used)
            assert p.attrs["aiolock.backend"] in SCHEMES, (p.metric, p.attrs)
        for v in p.attrs.values():
            assert name not in str(v)


async def test_each_cycle_recorded_once(telemetry: Telemetry, locks: aiolock.Locks,
                                        url: str) -> None:
    """N cycles: N granted acquire points, N hold points, N acquire spans carrying the
    granted token and the name, N release spans: nothing recorded twice."""
    name = fresh()
    tokens = []
    for _ in range(5):
        async with locks.lock(name, ttl=5) as lease:
            tokens.append(lease.token)
        await asyncio.sleep(0)
    got = telemetry.collect()
    assert got.count("aiolock.acquire.duration", outcome="granted") == 5
    assert got.count("aiolock.acquire.duration") == 5
    assert got.count("aiolock.hold.duration") == 5
    acq = [s for s in telemetry.spans("aiolock.acquire") if s.attributes.get("aiolock.name") == name]
    rel = telemetry.spans("aiolock.release")
    assert len(acq) == 5
    assert len(rel) == 5
    assert sorted(s.attributes["aiolock.token"] for s in acq) == sorted(tokens)
    for s in acq:
        assert s.instrumentation_scope.name == "aiolock"
        assert s.attributes["aiolock.backend"] == scheme(url)
        assert s.attributes["aiolock.kind"] == "lock"
        assert s.attributes.get("aiolock.outcome") == "granted"


async def test_wait_time_measured(telemetry: Telemetry, locks: aiolock.Locks) -> None:
    """A waiter blocked 0.4 s records an acquire duration of at least that; the holder's
    hold duration is at least its hold."""
    name = fresh()
    lock = locks.lock(name, ttl=5)
    lease = await lock.acquire()
    telemetry.reset()
    waiter = asyncio.create_task(locks.lock(name, ttl=5).acquire())
    await asyncio.sleep(0.4)
    await lease.release()
    lease2 = await asyncio.wait_for(waiter, 5)
    await lease2.release()
    got = telemetry.collect()
    pts = got.of("aiolock.acquire.duration", outcome="granted")
    assert sum(p.count for p in pts) == 1
    assert max(p.max for p in pts) >= 0.35
    holds = got.of("aiolock.hold.duration")
    assert sum(p.count for p in holds) == 2
    assert max(p.max for p in holds) >= 0.35
    span = [s for s in telemetry.spans("aiolock.acquire") if s.attributes.get("aiolock.name") == name]
    assert len(span) == 1
    assert (span[0].end_time - span[0].start_time) / 1e9 >= 0.35


async def test_timeout_outcome(telemetry: Telemetry, locks: aiolock.Locks) -> None:
    name = fresh()
    async with locks.lock(name, ttl=5):
        telemetry.reset()
        with pytest.raises(aiolock.LockTimeout):
            await asyncio.create_task(locks.lock(name).acquire(timeout=0.2))
    got = telemetry.collect()
    pts = got.of("aiolock.acquire.duration", outcome="timeout")
    assert sum(p.count for p in pts) == 1
    assert pts[0].sum >= 0.18
    assert got.count("aiolock.acquire.duration", outcome="granted") == 0
    spans = [s for s in telemetry.spans("aiolock.acquire") if s.attributes.get("aiolock.name") == name]
    assert len(spans) == 1
    assert spans[0].attributes.get("aiolock.outcome") == "timeout"
    assert "aiolock.token" not in spans[0].attributes
    from opentelemetry.trace import StatusCode

    assert spans[0].status.status_code != StatusCode.ERROR


async def test_cancelled_outcome(telemetry: Telemetry, locks: aiolock.Locks) -> None:
    name = fresh()
    async with locks.lock(name, ttl=5):
        telemetry.reset()
        waiter = asyncio.create_task(locks.lock(name).acquire())
        await asyncio.sleep(0.1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
    got = telemetry.collect()
    assert got.count("aiolock.acquire.duration", outcome="cancelled") == 1
    assert got.count("aiolock.acquire.duration", outcome="granted") == 0


async def test_held_and_waiters_now(telemetry: Telemetry, locks: aiolock.Locks) -> None:
    """leases.held and waiters are what is held / waiting now, back to 0 after."""
    name = fresh()
    base = telemetry.collect()
    held0 = base.value("aiolock.leases.held", kind="lock")
    wait0 = base.value("aiolock.waiters", kind="lock")
    async with locks.lock(name, ttl=5):
        waiters = [asyncio.create_task(locks.lock(name).acquire(timeout=5)) for _ in range(2)]
        await asyncio.sleep(0.2)
        mid = telemetry.collect()
        assert mid.value("aiolock.leases.held", kind="lock") - held0 == 1
        assert mid.value("aiolock.waiters", kind="lock") - wait0 == 2
    for w in waiters:
        lease = await asyncio.wait_for(w, 5)
        await lease.release()
    end = telemetry.collect()
    assert end.value("aiolock.leases.held", kind="lock") - held0 == 0
    assert end.value("aiolock.waiters", kind="lock") - wait0 == 0


async def test_try_once_is_no_waiter(telemetry: Telemetry, locks: aiolock.Locks) -> None:
    """``acquire(timeout=0)`` on a busy lock never leaves the waiters count moved."""
    name = fresh()
    base = telemetry.collect().value("aiolock.waiters", kind="lock")
    async with locks.lock(name, ttl=5):
        for _ in range(3):
            with pytest.raises(aiolock.LockTimeout):
                await asyncio.create_task(locks.lock(name).acquire(timeout=0))
        assert telemetry.collect().value("aiolock.waiters", kind="lock") == base


async def test_double_release_recorded_once(telemetry: Telemetry, locks: aiolock.Locks) -> None:
    name = fresh()
    held0 = telemetry.collect().value("aiolock.leases.held", kind="lock")
    lease = await locks.lock(name, ttl=5).acquire()
    await lease.release()
    await lease.release()
    got = telemetry.collect()
    assert got.count("aiolock.hold.duration") == 1
    assert got.value("aiolock.leases.held", kind="lock") == held0


# ------------------------------------------------------------------ losses


async def test_revoked_loss_counted_once(telemetry: Telemetry, locks: aiolock.Locks) -> None:
    """A revoked lease: one loss `revoked`, one hold point, held back to where it was
    (not below), even though the `async with` exit then releases."""
    name = fresh()
    held0 = telemetry.collect().value("aiolock.leases.held", kind="lock")
    with pytest.raises(aiolock.LockLost):
        async with locks.lock(name, ttl=0.6) as lease:
            assert await locks.lock(name).force_release()
            # inside `async with` the body's cancellation comes before wait_lost() returns
            await lease.wait_lost()
            pytest.fail("the body went on after its lease was lost")
    assert lease.lost
    got = telemetry.collect()
    lost = got.of("aiolock.leases.lost")
    assert [(p.attrs.get("aiolock.outcome"), p.value) for p in lost if p.value] == [("revoked", 1)]
    assert lost[0].attrs.get("aiolock.kind") == "lock"
    assert got.count("aiolock.hold.duration") == 1
    assert got.value("aiolock.leases.held", kind="lock") == held0


async def test_expired_loss(telemetry: Telemetry, locks: aiolock.Locks) -> None:
    name = fresh()
    lease = await locks.lock(name, ttl=0.2, watchdog=False, on_lost="raise").acquire()
    await asyncio.wait_for(lease.wait_lost(), 3)
    await lease.release()
    got = telemetry.collect()
    assert got.count("aiolock.leases.lost", outcome="expired") == 1
    assert got.count("aiolock.leases.lost") == 1
    assert got.count("aiolock.hold.duration") == 1


async def test_closed_loss(telemetry: Telemetry, url: str) -> None:
    """aclose() while a lease is held: one loss `closed`; held back to its value."""
    base = telemetry.collect().value("aiolock.leases.held", kind="lock")
    conn = aiolock.connect(url)
    lease = await conn.lock(fresh(), ttl=5).acquire()
    assert telemetry.collect().value("aiolock.leases.held", kind="lock") == base + 1
    await conn.aclose()
    got = telemetry.collect()
    assert got.count("aiolock.leases.lost", outcome="closed") == 1
    assert got.count("aiolock.leases.lost") == 1
    assert got.value("aiolock.leases.held", kind="lock") == base
    del lease


async def test_gone_loss_redis(telemetry: Telemetry, redis_server) -> None:  # type: ignore[no-untyped-def]
    """The server forgets the lease (FLUSHDB): one loss `gone`."""
    import redis.asyncio as aioredis

    async with aiolock.connect(redis_server.url) as conn:
        lease = await conn.lock(fresh(), ttl=0.6, on_lost="raise").acquire()
        raw = aioredis.Redis(host="127.0.0.1", port=redis_server.port)
        try:
            for key in [k async for k in raw.scan_iter(match=f"*{lease.name}*")]:
                await raw.delete(key)
        finally:
            await raw.aclose()
        await asyncio.wait_for(lease.wait_lost(), 3)
        await lease.release()
    got = telemetry.collect()
    assert got.count("aiolock.leases.lost", outcome="gone") == 1
    assert got.count("aiolock.leases.lost") == 1


# ------------------------------------------------------------------ kinds


async def test_kinds(telemetry: Telemetry, locks: aiolock.Locks) -> None:
    """read, write, permit, leader: each acquisition points and spans with its kind."""
    async with locks.rwlock(fresh()).read():
        pass
    async with locks.rwlock(fresh()).write():
        pass
    async with locks.semaphore(fresh(), limit=2):
        pass
    if aiolock.Capability.ELECTION in locks.capabilities:
        async with locks.election(fresh(), ttl=5).campaign(data="x"):
            pass
        kinds = ["read", "write", "permit", "leader"]
    else:
        kinds = ["read", "write", "permit"]
    got = telemetry.collect()
    for kind in kinds:
        assert got.count("aiolock.acquire.duration", kind=kind, outcome="granted") == 1, kind
        assert got.count("aiolock.hold.duration", kind=kind) == 1, kind
    span_kinds = sorted(s.attributes.get("aiolock.kind") for s in telemetry.spans("aiolock.acquire"))
    assert span_kinds == sorted(kinds)


# ------------------------------------------------------------------ no SDK


NO_SDK = """
import asyncio, sys
import aiolock

async def main():
    async with aiolock.connect("memory://") as locks:
        for _ in range(3):
            async with locks.lock("x", ttl=1) as lease:
                assert lease.token
    print("OK", "opentelemetry.sdk" in sys.modules)

asyncio.run(main())
"""


def test_no_sdk_works_and_imports_no_sdk() -> None:
    done = subprocess.run([sys.executable, "-c", NO_SDK], env=cli_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["OK", "False"], done.stdout


def test_without_opentelemetry_api() -> None:
    """With ``opentelemetry`` not importable at all, aiolock still works."""
    code = "import sys; sys.modules['opentelemetry'] = None\n" + NO_SDK
    done = subprocess.run([sys.executable, "-c", code], env=cli_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == "OK"


# ------------------------------------------------------------------ found on the way


async def test_body_cancelled_while_in_wait_for(url: str) -> None:
    """on_lost="cancel": the body is cancelled when the lease is lost, even while it sits
    in ``asyncio.wait_for(lease.wait_lost(), ...)`` (Python 3.11: wait_for swallows a
    cancellation that arrives as its inner task finishes, so the lost event must not
    complete before the cancellation is delivered). Seen while writing the revoke test:
    the body ran on for its whole sleep after the loss."""
    async with aiolock.connect(url) as locks:
        name = fresh()
        ran_on = False
        with pytest.raises(aiolock.LockLost):
            async with locks.lock(name, ttl=0.6) as lease:
                assert await locks.lock(name).force_release()
                await asyncio.wait_for(lease.wait_lost(), 3)
                await asyncio.sleep(1.5)
                ran_on = True
        assert not ran_on, "the body ran on after its lease was lost"
