"""Several worker processes, one scheduler: leader election with ``locks.election()``.

What it shows
-------------
* Every worker process campaigns for the election ``scheduler``
  (``election.campaign(data=...)``); the one that wins runs the schedule: it prints a
  tick every ``--tick`` seconds, tagged with its **term** (``term.token``, a fencing token
  that only grows), and would pass that term to whatever it writes, so a deposed leader's
  late writes can be refused.
* Every worker also **observes** the election (``election.observe()``) and prints each
  change of leader: this is how the others know whom to ask.
* After ``--kill-after`` seconds the parent ``kill -9``'s the current leader (its pid comes
  from the leader's holder record, ``election.leader()``). A waiting candidate takes over
  with a higher term: at once on PostgreSQL (the server frees a dead session's locks), at
  most the ``ttl`` on backends whose leases expire. The parent reports the takeover and
  stops everyone; it exits 1 if no takeover happened in time.

It needs a lock server **shared across processes** that offers elections
(``Capability.ELECTION`` and ``Capability.DISTRIBUTED``), e.g. PostgreSQL or Redis;
``memory://`` is per process and is refused.

Run it
------
    AIOLOCK_URL=postgresql://user@127.0.0.1:5432/db python examples/leader_scheduler.py
    python examples/leader_scheduler.py     # the URL from DATABASE_URL, or from PGHOST,
                                            # PGPORT, PGUSER, PGDATABASE (libpq's variables)

Options: ``--workers`` (3), ``--ttl`` (2 s), ``--tick`` (0.3 s), ``--kill-after`` (2 s),
``--after`` (how long to keep running after the takeover, 1 s).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import signal
import sys
import time

import aiolock
from aiolock import Capability

ELECTION = "scheduler"


def default_url() -> str:
    """``AIOLOCK_URL``, else ``DATABASE_URL``, else a postgresql:// URL from libpq's
    environment variables (``PGHOST``, ``PGPORT``, ``PGUSER``, ``PGDATABASE``)."""
    url = os.environ.get("AIOLOCK_URL") or os.environ.get("DATABASE_URL")
    if url:
        return url
    user = os.environ.get("PGUSER", "postgres")
    host = os.environ.get("PGHOST", "127.0.0.1")
    port = os.environ.get("PGPORT", "5432")
    return f"postgresql://{user}@{host}:{port}/{os.environ.get('PGDATABASE', user)}"


def say(who: str, text: str) -> None:
    # one write per line: the processes share stdout, lines must not interleave
    sys.stdout.write(f"{time.strftime('%H:%M:%S')} [{who}] {text}\n")
    sys.stdout.flush()


# -- a worker process -------------------------------------------------------------------------


async def run_schedule(who: str, term: aiolock.Leadership, tick: float) -> None:
    """The leader's work: one tick per period, each tagged with the term."""
    n = 0
    while True:
        n += 1
        say(who, f"TICK {n} term={term.token}")  # a real job would write with term.token
        await asyncio.sleep(tick)


async def campaign_forever(locks: aiolock.Locks, who: str, ttl: float, tick: float) -> None:
    election = locks.election(ELECTION, ttl=ttl)
    while True:
        try:
            async with election.campaign(data=who) as term:
                say(who, f"LEADER term={term.token}: running the schedule")
                await run_schedule(who, term, tick)
        except aiolock.LockLost:
            say(who, "lost the leadership: schedule stopped; campaigning again")


async def observe(locks: aiolock.Locks, who: str, ttl: float) -> None:
    async for leader in locks.election(ELECTION, ttl=ttl).observe():
        if leader is None:
            say(who, "sees: nobody leads")
        else:
            say(who, f"sees leader {leader.data} (pid {leader.holder.pid}) term={leader.token}")


async def worker_main(url: str, who: str, ttl: float, tick: float) -> None:
    async with aiolock.connect(url) as locks:
        await asyncio.gather(campaign_forever(locks, who, ttl, tick), observe(locks, who, ttl))


def worker(url: str, who: str, ttl: float, tick: float) -> None:
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(worker_main(url, who, ttl, tick))


# -- the parent: start the workers, kill the leader, report the takeover --------------------


async def check_backend(url: str) -> str | None:
    """None if ``url`` offers elections shared by processes, else why not."""
    async with aiolock.connect(url) as locks:
        missing = {Capability.ELECTION, Capability.DISTRIBUTED} - set(locks.capabilities)
        if missing:
            return (f"{locks.url} does not offer {', '.join(sorted(c.value for c in missing))}: "
                    "this example needs a backend with Capability.ELECTION shared across "
                    "processes (e.g. postgresql:// or redis://)")
    return None


async def wait_for_leader(election: aiolock.Election, above: int, timeout: float) -> aiolock.Leader:
    """The first leader with a term above ``above`` that ``observe()`` reports."""
    async with asyncio.timeout(timeout):
        async for leader in election.observe():
            if leader is not None and leader.token > above:
                return leader
    raise AssertionError("unreachable")  # pragma: no cover -- observe() never ends


async def supervise(url: str, args: argparse.Namespace) -> int:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(url, f"worker-{i}", args.ttl, args.tick), daemon=True)
             for i in range(1, args.workers + 1)]
    for proc in procs:
        proc.start()
    try:
        async with aiolock.connect(url) as locks:
            say("parent", f"lock backend: {locks.url}; {args.workers} worker processes")
            election = locks.election(ELECTION, ttl=args.ttl)
            first = await wait_for_leader(election, 0, 30)
            say("parent", f"{first.data} leads, term={first.token}")
            await asyncio.sleep(args.kill_after)
            current = await election.leader()
            if current is None:
                say("parent", "FAIL: nobody leads")
                return 1
            say("parent", f"kill -9 {current.data} (pid {current.holder.pid}), term={current.token}")
            killed = time.monotonic()
            os.kill(current.holder.pid, signal.SIGKILL)
            try:
                nxt = await wait_for_leader(election, current.token, args.ttl * 2 + 10)
            except TimeoutError:
                say("parent", "FAIL: no new leader took over")
                return 1
            say("parent", f"takeover: {nxt.data} leads with term={nxt.token} > {current.token}, "
                          f"{time.monotonic() - killed:.2f} s after the kill")
            await asyncio.sleep(args.after)
            return 0
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--ttl", type=float, default=2.0)
    parser.add_argument("--tick", type=float, default=0.3)
    parser.add_argument("--kill-after", type=float, default=2.0)
    parser.add_argument("--after", type=float, default=1.0)
    args = parser.parse_args()
    if args.workers < 2:
        parser.error("--workers must be at least 2 (one to kill, one to take over)")
    url = default_url()
    problem = asyncio.run(check_backend(url))
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    return asyncio.run(supervise(url, args))


if __name__ == "__main__":
    sys.exit(main())
