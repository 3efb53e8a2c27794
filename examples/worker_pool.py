"""A pool of workers that claim jobs with ``timeout=0`` locks, so each job runs once.

What it shows
-------------
* Every worker walks the whole job list (each in its own random order) and tries
  ``locks.lock(f"job:{job_id}", timeout=0)``: one try, no waiting. If another worker holds
  the job, ``LockTimeout`` comes back at once and the worker moves on to the next job.
* The lock alone is not "exactly once": a worker that arrives *after* the job finished
  gets the (now free) lock too. So, inside the lock, the worker first checks the job's
  result record and skips jobs that are done. Lock + check-inside-the-lock is the pattern.
* Results are written with the lease's fencing token (``aiolock.RedisFencedResource`` on
  Redis, ``aiolock.MemoryFencedResource`` in-process): a worker whose lease expired while
  it was stalled cannot overwrite the result of the worker that took the job over.
* With ``--processes N`` the workers run in N separate OS processes (each with its own
  aiolock connection and several asyncio workers), which needs a shared backend: Redis.

Run it
------
    python examples/worker_pool.py                         # memory://: asyncio tasks
    AIOLOCK_URL=redis://127.0.0.1:6379/0 python examples/worker_pool.py
    AIOLOCK_URL=redis://127.0.0.1:6379/0 python examples/worker_pool.py --processes 3

Options: ``--jobs`` (default 40), ``--workers`` (per process, default 6). It ends by
checking that every job was processed exactly once and exits 1 if not.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import sys
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import aiolock

AIOLOCK_URL = os.environ.get("AIOLOCK_URL", "memory://")


def is_redis(url: str) -> bool:
    return url.startswith(("redis://", "rediss://", "unix://"))


@dataclass
class Report:
    """What one process's workers did."""

    processed: list[tuple[str, str, int]]  # (job id, worker, fencing token)
    busy: int = 0  # claims skipped: another worker held the job
    done: int = 0  # claims skipped: the job was already finished


class Results:
    """Per-job result records written with fencing tokens (Redis hashes or in-process)."""

    _memory: ClassVar[dict[str, aiolock.MemoryFencedResource]] = {}  # one per process

    def __init__(self, url: str, batch: str) -> None:
        self.prefix = f"example:results:{batch}"
        self._client: Any = None
        if is_redis(url):
            import redis.asyncio as aioredis

            self._client = aioredis.Redis.from_url(url)

    def record(self, job_id: str) -> aiolock.FencedResource:
        if self._client is not None:
            return aiolock.RedisFencedResource(self._client, f"{self.prefix}:{job_id}")
        return self._memory.setdefault(job_id, aiolock.MemoryFencedResource())

    async def cleanup(self, job_ids: list[str]) -> None:
        if self._client is not None:
            await self._client.delete(*(f"{self.prefix}:{job}" for job in job_ids))

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


async def process(job_id: str) -> str:
    """The actual work: here, a short sleep and a made-up result."""
    await asyncio.sleep(random.uniform(0.01, 0.04))
    return f"result-of-{job_id}"


async def run_workers(url: str, batch: str, job_ids: list[str], names: list[str]) -> Report:
    """Run one asyncio worker per name on one aiolock connection (one per process)."""
    report = Report(processed=[])
    results = Results(url, batch)
    try:
        async with aiolock.connect(url) as locks:

            async def worker(name: str) -> None:
                todo = list(job_ids)
                random.Random(name).shuffle(todo)
                for job_id in todo:
                    # timeout=0: one try. Taken by someone else -> LockTimeout at once.
                    lock = locks.lock(f"job:{job_id}", ttl=10, timeout=0)
                    try:
                        async with lock as lease:
                            record = results.record(job_id)
                            _, existing = await record.read()
                            if existing is not None:  # finished before we got here
                                report.done += 1
                                continue
                            result = await process(job_id)
                            if await record.write(lease.token, f"{result} by {name}"):
                                report.processed.append((job_id, name, lease.token))
                            # else: a newer lease took the job over; our result is dropped
                    except aiolock.LockTimeout:
                        report.busy += 1

            await asyncio.gather(*(worker(name) for name in names))
    finally:
        await results.aclose()
    return report


def process_main(
    url: str, batch: str, job_ids: list[str], names: list[str], start: Any, out: Any
) -> None:
    """Entry point of one worker process (``--processes``): its own loop and connection."""
    start.wait(30)  # all processes begin together, so they really contend for jobs
    out.put(asyncio.run(run_workers(url, batch, job_ids, names)))


async def verify(url: str, batch: str, job_ids: list[str], reports: list[Report]) -> bool:
    processed = [item for report in reports for item in report.processed]
    per_job = Counter(job for job, _, _ in processed)
    per_worker = Counter(worker for _, worker, _ in processed)
    results = Results(url, batch)
    try:
        missing = [job for job in job_ids if (await results.record(job).read())[1] is None]
        await results.cleanup(job_ids)
    finally:
        await results.aclose()
    print(f"claims skipped because another worker held the job: "
          f"{sum(r.busy for r in reports)}; because it was already done: "
          f"{sum(r.done for r in reports)}")
    print("jobs per worker: " + ", ".join(f"{w}={n}" for w, n in sorted(per_worker.items())))
    twice = sorted(job for job, n in per_job.items() if n > 1)
    never = sorted(set(job_ids) - set(per_job))
    if twice or never or missing:
        print(f"FAIL: processed twice {twice}, never {never}, without a result {missing}")
        return False
    print(f"all {len(job_ids)} jobs have a result; each job processed exactly once")
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--workers", type=int, default=6, help="asyncio workers per process")
    parser.add_argument("--processes", type=int, default=0,
                        help="run the workers in this many OS processes (needs a Redis URL)")
    args = parser.parse_args()
    url = AIOLOCK_URL
    if args.processes and not is_redis(url):
        print(f"--processes needs a lock server shared by processes; {url} lives inside one "
              "process. Set AIOLOCK_URL=redis://host:port/db.", file=sys.stderr)
        return 2
    batch = uuid.uuid4().hex[:8]
    job_ids = [f"{batch}-{n:03d}" for n in range(args.jobs)]
    print(f"lock backend: {url}")
    if args.processes:
        print(f"{args.jobs} jobs, {args.processes} processes x {args.workers} workers")
        ctx = multiprocessing.get_context("spawn")
        start, out = ctx.Barrier(args.processes), ctx.Queue()
        procs = [
            ctx.Process(target=process_main, args=(
                url, batch, job_ids, [f"p{p}w{w}" for w in range(args.workers)], start, out,
            ))
            for p in range(args.processes)
        ]
        for proc in procs:
            proc.start()
        reports = [out.get(timeout=60) for _ in procs]
        for proc in procs:
            proc.join()
    else:
        print(f"{args.jobs} jobs, {args.workers} asyncio workers")
        names = [f"w{w}" for w in range(args.workers)]
        reports = [asyncio.run(run_workers(url, batch, job_ids, names))]
    ok = asyncio.run(verify(url, batch, job_ids, reports))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
