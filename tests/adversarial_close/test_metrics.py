"""docs/operations.md: ``aiolock.leases.lost`` counts a lease with the outcome ``closed``
"when the connection was closed (``aclose()``) while it was still held, which releases
it"; ``aiolock.leases.held`` counts leases held now (back to where it was after the
close); ``aiolock.waiters`` acquisitions waiting now (a closed waiter stops counting).
Written from README.md, SPEC.md and docs/ only; the process's global SDK providers are
the suites' shared ones (tests/_otel_global.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import aiolock
from aiolock import Capability

from .conftest import LONG, has

pytest.importorskip("opentelemetry.sdk")


def _points(reader: Any, metric: str) -> list[tuple[dict[str, Any], float]]:
    """(attributes, value) of every data point of ``metric`` the reader collects now."""
    data = reader.get_metrics_data()
    found = []
    for rm in getattr(data, "resource_metrics", None) or []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == metric:
                    found += [(dict(dp.attributes or {}), dp.value) for dp in m.data.data_points]
    return found


def _sum(points: list[tuple[dict[str, Any], float]], **attrs: str) -> float:
    want = {f"aiolock.{k}": v for k, v in attrs.items()}
    return sum(v for a, v in points if all(a.get(k) == x for k, x in want.items()))


async def test_close_counts_leases_held_as_lost_closed(
    backend_url: str, judge: aiolock.Locks, name: str
) -> None:
    """Two locks (and a read lease, where declared) held at the close, one released
    before it: ``aiolock.leases.lost`` gets exactly the leases held at the close with
    outcome ``closed`` (and no other outcome), ``aiolock.leases.held`` and
    ``aiolock.waiters`` come back to where they were."""
    from .._otel_global import providers

    shared = providers()
    delta, cumulative = shared.delta, shared.cumulative
    scheme = backend_url.split("://", 1)[0]
    kinds = ("lock", "read", "write", "permit", "leader")
    doomed = aiolock.connect(backend_url)
    await doomed.status(name)  # connected
    await asyncio.sleep(0.05)
    held_before = _points(cumulative, "aiolock.leases.held")
    waiting_before = _points(cumulative, "aiolock.waiters")
    blocker = await judge.lock(f"{name}-busy", ttl=LONG).acquire(timeout=5)
    _points(delta, "aiolock.leases.lost")  # drains the deltas so far

    # every lease held at the close stays referenced: a Lease garbage-collected
    # unreleased is released then (README), not by the close
    a = await doomed.lock(f"{name}-a", ttl=LONG).acquire(timeout=5)
    b = await doomed.lock(f"{name}-b", ttl=LONG).acquire(timeout=5)
    done = await doomed.lock(f"{name}-c", ttl=LONG).acquire(timeout=5)
    await done.release()
    expected = {"lock": 2}
    if has(doomed, Capability.RWLOCK):
        read = await doomed.rwlock(f"{name}-rw", ttl=LONG).read().acquire(timeout=5)
        expected["read"] = 1
    waiter = asyncio.create_task(doomed.lock(f"{name}-busy", ttl=LONG).acquire(timeout=20))
    await asyncio.sleep(0.3)
    await doomed.aclose()
    await asyncio.gather(waiter, return_exceptions=True)
    await blocker.release()
    await asyncio.sleep(0.05)
    assert a.released and not a.lost and b.released
    if has(doomed, Capability.RWLOCK):
        assert read.released

    lost = _points(delta, "aiolock.leases.lost")
    got = {k: _sum(lost, backend=scheme, kind=k, outcome="closed") for k in kinds}
    got = {k: v for k, v in got.items() if v}
    others = [(attrs, v) for attrs, v in lost if attrs.get("aiolock.outcome") != "closed" and v]
    assert got == expected and not others, (
        f"aiolock.leases.lost after closing with {expected} held: closed {got}, other points {others}"
    )
    for metric, before in (("aiolock.leases.held", held_before), ("aiolock.waiters", waiting_before)):
        now = _points(cumulative, metric)
        for k in kinds:
            assert _sum(now, backend=scheme, kind=k) == _sum(before, backend=scheme, kind=k), (
                f"{metric}[{scheme}, {k}]: {_sum(before, backend=scheme, kind=k)} before, "
                f"{_sum(now, backend=scheme, kind=k)} after the close"
            )
