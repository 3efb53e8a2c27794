"""Helpers shared by the benchmarks: timing loops, release adapters, table formatting."""

from __future__ import annotations

import argparse
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiolock

#: one acquire+release cycle of an implementation under test
Cycle = Callable[[], Awaitable[None]]
#: gives back what an acquire returned
Release = Callable[[Any], Awaitable[Any]]


async def repeat(cycle: Cycle, n: int) -> float:
    """Seconds taken by ``n`` awaited cycles."""
    start = time.perf_counter()
    for _ in range(n):
        await cycle()
    return time.perf_counter() - start


def repeat_sync(cycle: Callable[[], None], n: int) -> float:
    """Seconds taken by ``n`` blocking cycles."""
    start = time.perf_counter()
    for _ in range(n):
        cycle()
    return time.perf_counter() - start


async def release_lease(lease: aiolock.Lease) -> None:
    await lease.release()


def releaser(lock: Any) -> Release:
    """A release callable for a peer lock object whose ``release()`` takes no argument."""

    async def release(_: Any) -> None:
        await lock.release()

    return release


def fmt(value: float | None, spec: str = ",.0f", none: str = "-") -> str:
    return none if value is None or value != value else format(value, spec)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of ``values`` (q in 0..100)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, round(q / 100 * len(ordered) + 0.5))
    return ordered[min(rank, len(ordered)) - 1]


def tree_comparison_args(doc: str, backends: list[str] | None = None) -> argparse.Namespace:
    """The options of the benchmarks that compare this tree with another, pass by pass:
    ``--baseline TREE`` (required), ``--runs`` (3), ``--seconds`` per pass (3) and, where
    ``backends`` are given, ``--backend`` (the first by default)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--baseline", required=True, help="the other tree (a checkout of main)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    if backends:
        parser.add_argument("--backend", choices=backends, default=backends[0])
    return parser.parse_args()
