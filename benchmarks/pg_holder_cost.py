"""Uncontended acquisitions/s on PostgreSQL (or MySQL/MariaDB): this tree vs another (e.g.
main before a change), in the same run, alternating (and which goes first), on a private
server (tests/pg_server.py, tests/mysql_server.py).

    python benchmarks/pg_holder_cost.py --baseline /work/main [--runs 3] [--seconds 3]
        [--backend postgres|mysql]

Each pass is a subprocess with ``PYTHONPATH`` set to one tree, timing ``acquire`` +
``release`` of one lock (with a 40-character ``data`` record) on its own database, so
both trees start from the same table state. Prints each pass and the median and range.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent

PASS = """
import asyncio, sys, time
import aiolock

async def main() -> None:
    url, seconds = sys.argv[1], float(sys.argv[2])
    async with aiolock.connect(url) as locks:
        lock = locks.lock("bench", ttl=10, data="x" * 40)
        for _ in range(50):  # warm up: connections, prepared statements
            await (await lock.acquire()).release()
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            await (await lock.acquire()).release()
            n += 1
        print(n / (time.perf_counter() - start))

asyncio.run(main())
"""


def one_pass(tree: str, url: str, seconds: float) -> float:
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, "-c", PASS, url, str(seconds)], env=env, cwd=tree,
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


async def make_databases(url: str, names: list[str]) -> None:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        for name in names:
            await conn.execute(f"CREATE DATABASE {name}")
    finally:
        await conn.close()


def start_server(backend: str) -> tuple[Any, dict[str, str]]:
    """The server and a fresh database URL per tree, so both start from the same tables."""
    if backend == "mysql":
        from tests.mysql_server import USER, MariaDBServer

        my = MariaDBServer().start()
        my.sql("CREATE DATABASE bench_base; CREATE DATABASE bench_this;"
               f" GRANT ALL ON bench_base.* TO '{USER}'@'127.0.0.1';"
               f" GRANT ALL ON bench_this.* TO '{USER}'@'127.0.0.1';")
        base = my.url.rpartition("/")[0]
        return my, {"baseline": f"{base}/bench_base", "this": f"{base}/bench_this"}
    from tests.pg_server import PostgresServer

    pg = PostgresServer().start()
    asyncio.run(make_databases(pg.url, ["bench_base", "bench_this"]))
    base = pg.url.rpartition("/")[0]
    return pg, {"baseline": f"{base}/bench_base", "this": f"{base}/bench_this"}


def main() -> int:
    sys.path.insert(0, str(HERE))
    from benchmarks._common import tree_comparison_args

    args = tree_comparison_args(__doc__ or "", ["postgres", "mysql"])
    server, urls = start_server(args.backend)
    try:
        trees = {"baseline": (args.baseline, urls["baseline"]), "this": (str(HERE), urls["this"])}
        results: dict[str, list[float]] = {k: [] for k in trees}
        for i in range(args.runs):
            order = list(trees.items())
            for label, (tree, url) in order if i % 2 == 0 else order[::-1]:  # no order bias
                rate = one_pass(tree, url, args.seconds)
                results[label].append(rate)
                print(f"run {i + 1} {label:8} {rate:8.0f} acquisitions/s", flush=True)
        for label, rates in results.items():
            print(f"{label:8} median {statistics.median(rates):.0f}/s, "
                  f"range {min(rates):.0f}-{max(rates):.0f}")
        cost = 1 - statistics.median(results["this"]) / statistics.median(results["baseline"])
        print(f"cost of this tree vs baseline (medians): {cost:+.1%}")
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
