"""aiolock on MySQL/MariaDB next to PostgreSQL, each on a private server, in one run.

    .venv/bin/python benchmarks/bench_sql.py [--quick]

(a) Uncontended: one task acquires and releases one lock in a loop (``ttl=30``,
    watchdog on); rounds alternate between the backends, the median round is reported
    (cycles per second). Both the default mode (``GET_LOCK`` / advisory locks) and
    ``?mode=row`` (``SELECT ... FOR UPDATE``).
(b) Handoff: 32 contenders (32 ``aiolock.connect`` sessions, so each waits on the server,
    not in the local queue) loop acquire -> release on one lock for a fixed time;
    reported: handoffs per second and a mutual-exclusion check.

The servers are the tests' own: ``tests/pg_server.py`` (``initdb`` on a free loopback
port, ``fsync=off``) and ``tests/mysql_server.py`` (``mariadb-install-db``,
``innodb_flush_log_at_trx_commit=2``): both durable across a crash of the server process,
neither across a crash of the machine, so the comparison is even.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiolock
from benchmarks._common import fmt


async def cycles(url: str, n: int) -> float:
    """Uncontended acquire+release cycles per second over ``n`` cycles."""
    async with aiolock.connect(url) as locks:
        lock = locks.lock("bench-uncontended", ttl=30)
        for _ in range(20):  # warm-up: connections, schema
            lease = await lock.acquire()
            await lease.release()
        start = time.perf_counter()
        for _ in range(n):
            lease = await lock.acquire()
            await lease.release()
        return n / (time.perf_counter() - start)


async def handoffs(url: str, contenders: int, seconds: float) -> tuple[float, int]:
    """(handoffs per second, peak holders at once) with ``contenders`` sessions."""
    sessions = [aiolock.connect(url) for _ in range(contenders)]
    for s in sessions:
        await s.__aenter__()
    inside = peak = count = 0
    stop = time.monotonic() + seconds

    async def worker(locks: aiolock.Locks) -> None:
        nonlocal inside, peak, count
        lock = locks.lock("bench-handoff", ttl=30)
        while time.monotonic() < stop:
            try:
                lease = await lock.acquire(timeout=max(stop - time.monotonic(), 0.0) + 1)
            except aiolock.LockTimeout:
                return
            inside += 1
            peak = max(peak, inside)
            count += 1
            inside -= 1
            await lease.release()

    start = time.monotonic()
    try:
        await asyncio.gather(*(worker(s) for s in sessions))
    finally:
        for s in sessions:
            await s.__aexit__(None, None, None)
    return count / (time.monotonic() - start), peak


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from tests.mysql_server import MariaDBServer
    from tests.pg_server import PostgresServer

    n, rounds, seconds = (200, 3, 3.0) if args.quick else (1000, 5, 10.0)
    pg, my = PostgresServer().start(), MariaDBServer().start()
    urls = {"postgres": pg.url, "postgres ?mode=row": pg.url + "?mode=row",
            "mysql": my.url, "mysql ?mode=row": my.url + "?mode=row"}
    bad = 0
    try:
        rates: dict[str, list[float]] = {k: [] for k in urls}
        for r in range(rounds):
            order = list(urls) if r % 2 == 0 else list(reversed(urls))
            for key in order:
                rates[key].append(await cycles(urls[key], n))
                print(f"round {r + 1}: {key} {rates[key][-1]:,.0f}/s", file=sys.stderr)
        print("\n(a) uncontended acquire+release, cycles/s (median of "
              f"{rounds} rounds of {n}; min-max)")
        print("| backend | cycles/s | range |\n| --- | ---: | --- |")
        for key, values in rates.items():
            print(f"| {key} | {fmt(statistics.median(values))} | "
                  f"{fmt(min(values))}-{fmt(max(values))} |")
        print(f"\n(b) 32 contenders in 32 sessions, {seconds:g} s")
        print("| backend | handoffs/s | peak holders |\n| --- | ---: | ---: |")
        for key in ("postgres", "mysql"):
            rate, peak = await handoffs(urls[key], 32, seconds)
            bad += peak != 1
            print(f"| {key} | {fmt(rate)} | {peak} |")
    finally:
        pg.close()
        my.close()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
