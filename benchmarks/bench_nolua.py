"""Redis without scripting (``?scripting=off``: WATCH/MULTI/EXEC) next to the Lua path.

    .venv/bin/python benchmarks/bench_nolua.py [--runs 3] [--seconds 3] [--cycles 2000]

One private redis-server, both paths in the same run, rounds alternating between them;
each figure is the median of ``--runs`` rounds with its range [min-max]:

(a) uncontended acquire+release cycles per second on one connection (watchdog on);
(b) requests per acquire+release cycle, in a separate shorter pass: round trips (the
    Lua path sends one EVALSHA per acquire and per release; the transaction path's
    batches are counted where they are sent) and commands the server saw (``MONITOR``,
    top-level only: the commands a script runs inside an EVALSHA are not requests);
(c) 32 waiters contending for one lock, looping acquire -> ``sleep(0)`` -> release:
    handoffs per second (an acquisition by another waiter than the last holder), the
    aborted ``EXEC`` per acquisition (conflicts; transaction path only), round trips per
    acquisition (its release included; busy retries count) and a mutual-exclusion
    check. Two shapes: 32 tasks on one connection (they queue locally: one asks the
    server at a time) and 4 connections x 8 tasks (4 clients ask at once, as 4
    processes would).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from _common import fmt
from _redis import RedisServer, RequestCounter, command_stats, stats_delta

import aiolock
from aiolock.backends import _redis_lend

TTL = 30.0
WAITERS = 32


@dataclass
class Rounds:
    """One figure measured once per round."""

    values: list[float] = field(default_factory=list)

    def __str__(self) -> str:
        if not self.values:
            return "-"
        med = statistics.median(self.values)
        spec = ",.0f" if med >= 100 else ".2f"
        return (f"{fmt(med, spec)} [{fmt(min(self.values), spec)}-"
                f"{fmt(max(self.values), spec)}]")


async def cycles_per_second(url: str, cycles: int) -> float:
    async with aiolock.connect(url) as locks:
        lock = locks.lock("bench:nolua:a", ttl=TTL)
        for _ in range(100):  # warm-up
            await (await lock.acquire()).release()
        start = time.perf_counter()
        for _ in range(cycles):
            await (await lock.acquire()).release()
        return cycles / (time.perf_counter() - start)


@contextlib.contextmanager
def counting_batches() -> Iterator[list[int]]:
    """Counts the batches (round trips) transactions send meanwhile: ``[count]``."""
    count = [0]
    run = _redis_lend.Lent.run

    async def counted(self: Any, *commands: tuple[Any, ...]) -> list[Any]:
        count[0] += 1
        return await run(self, *commands)

    _redis_lend.Lent.run = counted  # type: ignore[method-assign]
    try:
        yield count
    finally:
        _redis_lend.Lent.run = run  # type: ignore[method-assign]


async def requests_per_cycle(server: RedisServer, admin: Any, url: str,
                             cycles: int) -> tuple[float, float]:
    """(round trips, server commands) per acquire+release cycle."""
    async with aiolock.connect(url) as locks:
        lock = locks.lock("bench:nolua:b", ttl=TTL)
        await (await lock.acquire()).release()
        with counting_batches() as batches:
            async with RequestCounter(server, admin) as counter:
                for _ in range(cycles):
                    await (await lock.acquire()).release()
    commands = sum(counter.requests.values()) / cycles
    trips = batches[0] / cycles if batches[0] else commands  # Lua: one EVALSHA each
    return trips, commands


@dataclass
class Contention:
    handoffs: float
    conflicts: float  # aborted EXEC per acquisition
    requests: float  # round trips per acquisition (its release included)
    violations: int
    acquisitions: int


async def contend(url: str, connections: int, seconds: float, admin: Any) -> Contention:
    holders = violations = acquisitions = handoffs = 0
    last: int | None = None
    sessions = [aiolock.connect(url) for _ in range(connections)]
    for s in sessions:
        await s.__aenter__()
    counting = counting_batches()
    batches = counting.__enter__()
    before = await command_stats(admin)
    deadline = time.perf_counter() + seconds

    async def waiter(who: int, locks: aiolock.Locks) -> None:
        nonlocal holders, violations, acquisitions, handoffs, last
        lock = locks.lock("bench:nolua:c", ttl=TTL)
        while time.perf_counter() < deadline:
            lease = await lock.acquire()
            holders += 1
            violations += holders > 1
            acquisitions += 1
            handoffs += last is not None and last != who
            last = who
            await asyncio.sleep(0)
            holders -= 1
            await lease.release()

    try:
        per = WAITERS // connections
        await asyncio.gather(*(waiter(i * per + j, s) for i, s in enumerate(sessions)
                               for j in range(per)))
    finally:
        counting.__exit__(None, None, None)
        evalsha = stats_delta(before, await command_stats(admin))["evalsha"]
        conflicts = sum(getattr(s.backend, "conflicts", 0) for s in sessions)
        for s in sessions:
            await s.aclose()
    n = max(acquisitions, 1)
    return Contention(handoffs / seconds, conflicts / n, (batches[0] or evalsha) / n,
                      violations, acquisitions)


Measure = Callable[[str], Awaitable[Any]]


async def main(runs: int, seconds: float, cycles: int) -> int:
    with RedisServer() as server:
        admin = aioredis.Redis.from_url(server.url)
        paths = {"Lua scripts (EVALSHA)": server.url,
                 "WATCH/MULTI/EXEC (scripting=off)": server.url + "?scripting=off"}
        rows: dict[str, dict[str, Rounds]] = {p: {} for p in paths}
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"# redis-server {server.version()}, {os.cpu_count()} CPUs, load {load}; "
              f"{runs} rounds, {seconds:g} s contention, {cycles} cycles", flush=True)
        bad = 0
        try:
            for r in range(runs):
                for path, url in paths.items():
                    row = rows[path]
                    row.setdefault("cycles/s", Rounds()).values.append(
                        await cycles_per_second(url, cycles))
                    trips, cmds = await requests_per_cycle(server, admin, url, 200)
                    row.setdefault("round trips/cycle", Rounds()).values.append(trips)
                    row.setdefault("commands/cycle", Rounds()).values.append(cmds)
                    for conns in (1, 4):
                        c = await contend(url, conns, seconds, admin)
                        bad += c.violations
                        shape = f"{conns}x{WAITERS // conns}"
                        row.setdefault(f"handoffs/s {shape}", Rounds()).values.append(c.handoffs)
                        row.setdefault(f"conflicts/acq {shape}", Rounds()).values.append(
                            c.conflicts)
                        row.setdefault(f"round trips/acq {shape}", Rounds()).values.append(
                            c.requests)
                    print(f"# round {r + 1}/{runs} {path} done", flush=True)
        finally:
            await admin.aclose()
    columns = list(next(iter(rows.values())))
    width = max(len(p) for p in rows)
    print("\n" + " | ".join([f"{'path':{width}}", *columns]))
    for path, row in rows.items():
        print(" | ".join([f"{path:{width}}", *(str(row[c]) for c in columns)]))
    print("\nmedian [min-max] of the rounds; conflicts/acq = aborted EXEC per acquisition; "
          "round trips/acq: per acquisition under contention, its release included (Lua: "
          "EVALSHA calls; transactions: batches sent);\n1x32 = one connection, 32 tasks; "
          "4x8 = 4 connections x 8 tasks")
    if bad:
        print(f"MUTUAL EXCLUSION VIOLATED {bad} times")
    return 1 if bad else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--cycles", type=int, default=2000)
    args = parser.parse_args()
    raise SystemExit(asyncio.run(main(args.runs, args.seconds, args.cycles)))
