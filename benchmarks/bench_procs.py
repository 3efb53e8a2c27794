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

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt, percentile
from _redis import RedisServer, command_stats

ROOT = Path(__file__).resolve().parent.parent
TTL = 30
Record = tuple[float, float, float, int, int]  # call, acquired, release called, pid, task


# -- the worker side ---------------------------------------------------------------------------

async def _async_tasks(impl: str, url: str, name: str, tasks: int, stop: float) -> list[Record]:
    import redis.asyncio as aioredis

    import aiolock

    records: list[Record] = []
    pid = os.getpid()

    async def loop(task: int, acquire: Any, release: Any) -> None:
        while time.monotonic() < stop:
            t0 = time.monotonic()
            held = await acquire()
            t1 = time.monotonic()
            await asyncio.sleep(0)
            t2 = time.monotonic()
            await release(held)
            records.append((t0, t1, t2, pid, task))

    if impl.startswith("aiolock"):
        async with aiolock.connect(url) as locks:
            lock = locks.lock(name, ttl=TTL, fair=impl.endswith("fair"))

            async def release_lease(lease: Any) -> None:
                await lease.release()

            await asyncio.gather(*(loop(i, lock.acquire, release_lease) for i in range(tasks)))
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

        def acquirer(peer: Any) -> Any:
            async def acquire() -> Any:
                await peer.acquire()
                return peer
            return acquire

        async def release_peer(peer: Any) -> None:
            await peer.release()

        await asyncio.gather(*(loop(i, acquirer(p), release_peer) for i, p in enumerate(handles)))
    finally:
        await client.aclose()
    return records


def _thread_tasks(url: str, name: str, tasks: int, stop: float) -> list[Record]:
    import redis
    import redis_lock

    client = redis.Redis.from_url(url)
    records: list[Record] = []
    pid = os.getpid()

    def loop(task: int) -> None:
        lock = redis_lock.Lock(client, name, expire=TTL, auto_renewal=True)
        while time.monotonic() < stop:
            t0 = time.monotonic()
            lock.acquire()
            t1 = time.monotonic()
            t2 = time.monotonic()
            lock.release()
            records.append((t0, t1, t2, pid, task))

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(tasks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    client.close()
    return records


def worker(impl: str, url: str, name: str, tasks: int) -> None:
    """Reads ``GO <stop> <file>`` lines: runs until ``stop``, writes the records to
    ``file`` (one JSON list), prints ``DONE``; ``QUIT`` ends it."""
    print("READY", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "QUIT":
            return
        stop, path = float(words[1]), words[2]
        if impl == "python-redis-lock":
            records = _thread_tasks(url, name, tasks, stop)
        else:
            records = asyncio.run(_async_tasks(impl, url, name, tasks, stop))
        Path(path).write_text(json.dumps(records))
        print("DONE", flush=True)


# -- the driver ----------------------------------------------------------------------------------

@dataclass
class Run:
    acq_s: float
    xproc_s: float
    p50: float
    p99: float
    wait_p99: float
    cmds: float
    lo: int
    hi: int
    handoffs_s: float


def measure(records: list[Record], seconds: float, nprocs: int, commands: float) -> Run:
    records.sort(key=lambda r: r[1])
    cross: list[float] = []
    handoffs = 0
    for a, b in itertools.pairwise(records):
        if (a[3], a[4]) != (b[3], b[4]):
            handoffs += 1
        if a[3] != b[3]:
            cross.append((b[1] - a[2]) * 1000)
    per: dict[int, int] = {}
    for r in records:
        per[r[3]] = per.get(r[3], 0) + 1
    counts = list(per.values()) + [0] * (nprocs - len(per))
    waits = [(r[1] - r[0]) * 1000 for r in records]
    return Run(
        acq_s=len(records) / seconds, xproc_s=len(cross) / seconds,
        p50=percentile(cross, 50), p99=percentile(cross, 99), wait_p99=percentile(waits, 99),
        cmds=commands, lo=min(counts), hi=max(counts), handoffs_s=handoffs / seconds,
    )


class Workers:
    def __init__(self, impl: str, url: str, name: str, nprocs: int, tasks: int, path: str | None) -> None:
        env = dict(os.environ)
        impl_name = impl.split("@")[0]
        if path:
            env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
        self.procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", impl_name, url, name, str(tasks)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
            )
            for _ in range(nprocs)
        ]
        for p in self.procs:
            self._expect(p, "READY")

    def _expect(self, p: subprocess.Popen[str], word: str) -> None:
        assert p.stdout is not None
        line = p.stdout.readline()
        if not line.startswith(word):
            raise RuntimeError(f"worker said {line!r}, expected {word}")

    def run(self, seconds: float, tmp: Path) -> tuple[list[Record], int]:
        """The records of the last ``seconds`` of a run, and how many acquisitions the
        whole run made (the server's counters cover the whole run)."""
        stop = time.monotonic() + 0.3 + seconds  # a moment for every process to read GO
        files = [tmp / f"{uuid.uuid4().hex}.json" for _ in self.procs]
        for p, f in zip(self.procs, files, strict=True):
            assert p.stdin is not None
            p.stdin.write(f"GO {stop} {f}\n")
            p.stdin.flush()
        for p in self.procs:
            self._expect(p, "DONE")
        records: list[Record] = []
        for f in files:
            records += [tuple(r) for r in json.loads(f.read_text())]  # type: ignore[misc]
            f.unlink()
        return [r for r in records if r[1] >= stop - seconds], len(records)

    def close(self) -> None:
        for p in self.procs:
            assert p.stdin is not None
            try:
                p.stdin.write("QUIT\n")
                p.stdin.flush()
            except BrokenPipeError:
                pass
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


async def server_commands(client: Any) -> int:
    stats = await command_stats(client)
    return sum(v for k, v in stats.items() if k not in ("info", "config", "config|resetstat"))


def bench(impl: str, path: str | None, url: str, nprocs: int, tasks: int, seconds: float,
          runs: int, tmp: Path) -> list[Run]:
    import redis.asyncio as aioredis

    name = f"bench:procs:{impl}:{nprocs}x{tasks}:{uuid.uuid4().hex[:6]}"
    workers = Workers(impl, url, name, nprocs, tasks, path)
    out: list[Run] = []
    try:
        workers.run(min(0.5, seconds), tmp)  # warm-up: connections, scripts, subscriptions
        for _ in range(runs):
            async def count() -> int:
                client = aioredis.Redis.from_url(url)
                try:
                    return await server_commands(client)
                finally:
                    await client.aclose()

            before = asyncio.run(count())
            records, total = workers.run(seconds, tmp)
            after = asyncio.run(count())
            out.append(measure(records, seconds, nprocs, (after - before) / max(total, 1)))
    finally:
        workers.close()
    return out


def row(label: str, runs: list[Run]) -> str:
    def med(attr: str, spec: str) -> str:
        values = [getattr(r, attr) for r in runs]
        return (f"{fmt(statistics.median(values), spec)} "
                f"({fmt(min(values), spec)}-{fmt(max(values), spec)})")

    ratio = [r.lo / r.hi if r.hi else 0.0 for r in runs]
    mid = sorted(runs, key=lambda r: r.acq_s)[len(runs) // 2]
    return (f"| {label} | {med('acq_s', ',.0f')} | {med('xproc_s', ',.0f')} | "
            f"{med('p50', '.2f')} / {med('p99', '.2f')} | {med('wait_p99', '.1f')} | "
            f"{med('cmds', '.1f')} | {mid.lo:,} / {mid.hi:,} ({fmt(statistics.median(ratio), '.2f')}) | "
            f"{med('handoffs_s', ',.0f')} |")


HEADER = ("| implementation | acq/s | xproc/s | handoff p50 / p99 ms | wait p99 ms | cmds/acq "
          "| min / max per process (ratio) | handoffs/s |\n|---|---|---|---|---|---|---|---|")

IMPLS = ["aiolock", "aiolock-fair", "python-redis-lock", "redis-py", "pottery"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1.5 s runs instead of 3 s")
    ap.add_argument("--before", help="also run aiolock as of this git revision")
    ap.add_argument("--only", help="comma-separated implementations (default: all)")
    ap.add_argument("--scenarios", default="16x1,8x4,1x32")
    args = ap.parse_args()
    seconds = 1.5 if args.quick else 3.0
    impls = args.only.split(",") if args.only else list(IMPLS)
    paths: dict[str, str | None] = {i: str(ROOT) for i in impls}
    tmp = Path(tempfile.mkdtemp(prefix="aiolock-bench-procs-"))
    if args.before:
        before = tmp / "before"
        before.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.before, "aiolock"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
        for i in [i for i in impls if i.startswith("aiolock")]:
            label = f"{i}@{args.before[:7]}"
            impls.insert(impls.index(i) + 1, label)
            paths[label] = str(before)
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
