"""P processes x T tasks on ONE Redis lock: how a lock hands off across processes.

Every implementation runs in the same run, against one private ``redis-server`` (started
here, never port 6379), in P worker processes of T tasks each. Each task loops: acquire
-> ``await asyncio.sleep(0)`` -> release (python-redis-lock is synchronous: T threads).
Per scenario and implementation the workers start once, warm up, then do 3 timed runs;
the tables give the median run and the range (min-max) of the 3.

Columns (times on CLOCK_MONOTONIC, shared by all processes of the host):

- acq/s: acquisitions per second, all processes together.
- xproc/s: cross-process hand-offs per second: acquisitions whose previous holder was
  another process.
- handoff p50/p99 (ms): for cross-process hand-offs, from the moment the previous holder
  called release() until the next holder's acquire() returned.
- wait p99 (ms): from calling acquire() until it returned.
- cmds/acq: server commands per acquisition (``INFO commandstats`` deltas over the run,
  commands run inside Lua scripts included, the benchmark's own INFO left out).
- min/max: the fewest and the most acquisitions of one process (and their ratio).

Usage::

    .venv/bin/python benchmarks/bench_procs.py [--quick] [--before REV] [--only NAME,...]

``--before REV`` adds rows for aiolock as of git revision REV (``git archive`` of its
``aiolock/`` into a temporary directory, put first on the workers' PYTHONPATH), for an
A/B in the same run. Tables go to stdout, progress to stderr.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    Record,
    Run,
    Workers,
    checkout,
    go_commands,
    lead_cells,
    median_range,
    peer_acquirer,
    procs_args,
    release_lease,
    release_peer,
    report,
    run_threads,
    spread,
    timed_loop,
    timed_runs,
)
from _redis import RedisServer, command_stats

ROOT = Path(__file__).resolve().parent.parent
TTL = 30


# -- the worker side ---------------------------------------------------------------------------

async def _async_tasks(impl: str, url: str, name: str, tasks: int, stop: float) -> list[Record]:
    import redis.asyncio as aioredis

    import aiolock

    records: list[Record] = []
    if impl.startswith("aiolock"):
        async with aiolock.connect(url) as locks:
            lock = locks.lock(name, ttl=TTL, fair=impl.endswith("fair"))
            await asyncio.gather(*(timed_loop(records, i, lock.acquire, release_lease)(stop)
                                   for i in range(tasks)))
        return records
    client = aioredis.Redis.from_url(url)
    try:
        handles = []
        for _ in range(tasks):
            if impl == "redis-py":
                peer = client.lock(name, timeout=TTL, sleep=0.001)
            else:  # pottery
                from pottery import AIORedlock

                peer = AIORedlock(key=name, masters={client}, auto_release_time=TTL)
            handles.append(peer)
        await asyncio.gather(*(timed_loop(records, i, peer_acquirer(p), release_peer)(stop)
                               for i, p in enumerate(handles)))
    finally:
        await client.aclose()
    return records


def _thread_tasks(url: str, name: str, tasks: int, stop: float) -> list[Record]:
    import redis
    import redis_lock

    client = redis.Redis.from_url(url)
    records: list[Record] = []
    locks = [redis_lock.Lock(client, name, expire=TTL, auto_renewal=True) for _ in range(tasks)]
    run_threads(records, locks, stop)
    client.close()
    return records


def worker(impl: str, url: str, name: str, tasks: int) -> None:
    """Reads ``GO <stop> <file>`` lines: runs until ``stop``, writes the records to
    ``file`` (``_common.report``), prints ``DONE``; ``QUIT`` ends it."""
    print("READY", flush=True)
    for stop, path in go_commands():
        cpu = time.process_time()
        if impl == "python-redis-lock":
            records = _thread_tasks(url, name, tasks, stop)
        else:
            records = asyncio.run(_async_tasks(impl, url, name, tasks, stop))
        report(path, records, time.process_time() - cpu)


# -- the driver ----------------------------------------------------------------------------------

async def server_commands(client: Any) -> int:
    stats = await command_stats(client)
    return sum(v for k, v in stats.items() if k not in ("info", "config", "config|resetstat"))


def bench(impl: str, path: str | None, url: str, nprocs: int, tasks: int, seconds: float,
          runs: int, tmp: Path) -> list[Run]:
    import redis.asyncio as aioredis

    async def count() -> int:
        client = aioredis.Redis.from_url(url)
        try:
            return await server_commands(client)
        finally:
            await client.aclose()

    name = f"bench:procs:{impl}:{nprocs}x{tasks}:{uuid.uuid4().hex[:6]}"
    workers = Workers(__file__, [impl.split("@")[0], url, name, str(tasks)], nprocs, path)
    return timed_runs(workers, nprocs, seconds, runs, tmp,
                      lambda: {"cmds": float(asyncio.run(count()))})


def row(label: str, runs: list[Run]) -> str:
    med = functools.partial(median_range, runs)
    return (f"{lead_cells(label, runs)} {med('wait_p99', '.1f')} | {med('cmds', '.1f')} | "
            f"{spread(runs)} | {med('handoffs_s', ',.0f')} |")


HEADER = ("| implementation | acq/s | xproc/s | handoff p50 / p99 ms | wait p99 ms | cmds/acq "
          "| min / max per process (ratio) | handoffs/s |\n|---|---|---|---|---|---|---|---|")

IMPLS = ["aiolock", "aiolock-fair", "python-redis-lock", "redis-py", "pottery"]


def main() -> int:
    args = procs_args(__doc__, "16x1,8x4,1x32").parse_args()
    seconds = 1.5 if args.quick else 3.0
    impls = args.only.split(",") if args.only else list(IMPLS)
    paths: dict[str, str | None] = {i: str(ROOT) for i in impls}
    tmp = Path(tempfile.mkdtemp(prefix="aiolock-bench-procs-"))
    if args.before:
        before = checkout(ROOT, args.before, tmp)
        for i in [i for i in impls if i.startswith("aiolock")]:
            label = f"{i}@{args.before[:7]}"
            impls.insert(impls.index(i) + 1, label)
            paths[label] = before
    print(f"# P processes x T tasks on one Redis lock ({seconds} s runs, median of 3 "
          f"(range); {os.cpu_count()} CPUs, shared)\n")
    with RedisServer() as server:
        print(f"redis-server {server.version()} on a private loopback port\n")
        for scenario in args.scenarios.split(","):
            nprocs, tasks = map(int, scenario.split("x"))
            print(f"## {nprocs} processes x {tasks} task(s)\n\n{HEADER}", flush=True)
            for impl in impls:
                if scenario == "1x32" and not impl.startswith("aiolock"):
                    continue
                print(f"{scenario} {impl} ...", file=sys.stderr, flush=True)
                try:
                    runs = bench(impl, paths[impl], server.url, nprocs, tasks, seconds, 3, tmp)
                except Exception as exc:
                    print(f"| {impl} | error: {type(exc).__name__}: {exc} |", flush=True)
                    continue
                print(row(impl, runs), flush=True)
            print(flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
        sys.exit(0)
    sys.exit(main())
