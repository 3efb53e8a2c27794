"""Fault-free probes of one backend, run as a process after the faulty workload.

    python -m tests.faults.probe probe --url URL --kind KIND [--cancels N] ...
    python -m tests.faults.probe holds --url URL --count N --concurrency C --ttl S

``probe``: (1) a cancellation storm: ``--cancels`` acquires cancelled after a random
delay in [0, 2 x RTT] (half of those that won the race also get their ``release()``
cancelled the same way), each followed by a nonce echo through the backend connection;
then every name is checked with ``inspect()`` and by acquiring it with a short timeout
from a fresh connection: still held by a token whose release was cancelled counts as
"held but not owned", otherwise as leaked; (2) ``acquire(timeout=t)`` against a held
lock, overshoot measured; (3) event-loop stalls of 1.5 x TTL with leases held in
``async with`` bodies: ``lease.lost`` must say so on wake and the bodies must end with
``LockLost``. ``holds``: ``--count`` leases held ``10 x ttl`` without faults, in rounds
of ``--concurrency``; every lapse (a lease lost) is counted.

The last stdout line is ``RESULT <json>``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import statistics
import sys
import time
from typing import Any

import aiolock

from .common import echo, mono, pause


async def connect(args: argparse.Namespace) -> aiolock.Locks:
    locks = aiolock.connect(args.url, **json.loads(args.options))
    await locks.__aenter__()
    return locks


async def storm(args: argparse.Namespace, locks: aiolock.Locks, fresh: aiolock.Locks,
                rng: random.Random) -> dict[str, Any]:
    samples = []
    for _ in range(15):
        t0 = mono()
        await echo(locks, args.kind)
        samples.append(mono() - t0)
    rtt = statistics.median(samples)
    names = [f"{args.prefix}-c{i}" for i in range(args.names)]
    stats = dict(attempts=0, cancelled=0, won=0, release_cancelled=0, echoes=0, desyncs=0,
                 echo_errors=0)
    cancelled_tokens: dict[str, set[int]] = {n: set() for n in names}
    kept: list[aiolock.Lease] = []

    async def check_echo() -> None:
        try:
            async with asyncio.timeout(10):
                ok = await echo(locks, args.kind)
        except Exception:
            stats["echo_errors"] += 1
            return
        stats["echoes"] += 1
        if not ok:
            stats["desyncs"] += 1

    async def loop() -> None:
        while stats["attempts"] < args.cancels:
            stats["attempts"] += 1
            name = rng.choice(names)
            task = asyncio.create_task(locks.lock(name, ttl=args.lock_ttl).acquire())
            await pause(rng, rtt)
            task.cancel()
            try:
                lease = await task
            except asyncio.CancelledError:
                stats["cancelled"] += 1
                await check_echo()
                continue
            except aiolock.LockError:
                continue
            stats["won"] += 1
            kept.append(lease)
            await asyncio.sleep(0)
            if rng.random() < 0.5:
                rel = asyncio.create_task(lease.release())
                await pause(rng, rtt, min_steps=1)
                rel.cancel()
                try:
                    await rel
                except asyncio.CancelledError:
                    stats["release_cancelled"] += 1
                    cancelled_tokens[name].add(lease.token)
                    await check_echo()
            else:
                await lease.release()

    started = mono()
    await asyncio.gather(*(loop() for _ in range(args.concurrency)))
    took = mono() - started
    await asyncio.sleep(1.0)  # cancelled releases finish in the background
    leaked, not_owned, examples = 0, 0, []
    for name in names:
        info = await fresh.status(name)
        if info.held:
            if info.token in cancelled_tokens[name]:
                not_owned += 1
            else:
                leaked += 1
            examples.append(f"{name}: {info}")
            continue
        try:
            lease = await fresh.lock(name, ttl=args.lock_ttl).acquire(timeout=0.5)
        except aiolock.LockTimeout:
            leaked += 1
            examples.append(f"{name}: not acquirable in 0.5 s")
        else:
            await lease.release()
    return dict(stats, rtt=rtt, leaked=leaked, held_not_owned=not_owned, storm_s=took,
                examples=examples[:5])


async def timeouts(args: argparse.Namespace, locks: aiolock.Locks, fresh: aiolock.Locks,
                   rng: random.Random) -> dict[str, Any]:
    name = f"{args.prefix}-t"
    holder = await fresh.lock(name, ttl=args.lock_ttl).acquire(timeout=5)
    overs: list[float] = []
    unexpected = 0
    try:
        done = 0
        while done < args.timeouts:
            batch = min(10, args.timeouts - done)
            done += batch

            async def one() -> None:
                nonlocal unexpected
                limit = rng.uniform(0.02, 0.3)
                t0 = mono()
                try:
                    lease = await locks.lock(name, ttl=args.lock_ttl).acquire(timeout=limit)
                except aiolock.LockTimeout:
                    overs.append(mono() - t0 - limit)
                else:
                    unexpected += 1
                    await lease.release()

            await asyncio.gather(*(one() for _ in range(batch)))
    finally:
        await holder.release()
    return dict(timeout_probes=len(overs), overshoot_max=max(overs, default=0.0),
                overshoot_min=min(overs, default=0.0), over_50ms=sum(1 for o in overs if o > 0.05),
                timeout_unexpected=unexpected)


async def stalls(args: argparse.Namespace, locks: aiolock.Locks) -> dict[str, Any]:
    expired = detected = bodies = bodies_ok = 0
    for r in range(args.stall_rounds):
        leases: list[aiolock.Lease] = []
        started = asyncio.Event()
        outcome: list[str] = []

        async def body(i: int, r: int = r, leases: list[aiolock.Lease] = leases,
                       started: asyncio.Event = started, outcome: list[str] = outcome) -> None:
            try:
                async with locks.lock(f"{args.prefix}-s{r}-{i}", ttl=args.ttl) as lease:
                    leases.append(lease)
                    if len(leases) == 3:
                        started.set()
                    await asyncio.sleep(60)
                outcome.append("ended")
            except aiolock.LockLost:
                outcome.append("lost")

        tasks = [asyncio.create_task(body(i)) for i in range(3)]
        await asyncio.wait_for(started.wait(), 10)
        await asyncio.sleep(args.ttl / 2)
        before = [(lease, mono() + lease.expires_in) for lease in leases]
        time.sleep(1.5 * args.ttl)
        now = mono()
        for lease, until in before:
            if until <= now:
                expired += 1
                detected += lease.lost
        _done, pending = await asyncio.wait(tasks, timeout=2)
        for t in pending:
            t.cancel()
        bodies += len(tasks)
        bodies_ok += outcome.count("lost")
    return dict(stall_expired=expired, stall_detected=detected, stall_bodies=bodies,
                stall_bodies_lost=bodies_ok)


async def probe(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    locks = await connect(args)
    fresh = await connect(args)
    try:
        result = await storm(args, locks, fresh, rng)
        result.update(await timeouts(args, locks, fresh, rng))
        result.update(await stalls(args, locks))
    finally:
        for session in (locks, fresh):
            with contextlib.suppress(Exception):
                async with asyncio.timeout(10):
                    await session.aclose()
    return result


async def holds(args: argparse.Namespace) -> dict[str, Any]:
    locks = await connect(args)
    total = lost = 0
    try:
        r = 0
        while total < args.count:
            n = min(args.concurrency, args.count - total)
            # acquired 500 at a time: a burst of thousands of acquires on one connection
            # would measure that burst (renewals queue behind it), not the holds
            leases: list[aiolock.Lease] = []
            for j in range(0, n, args.burst):
                leases += await asyncio.gather(*(
                    locks.lock(f"{args.prefix}-h{r}-{i}", ttl=args.ttl).acquire(timeout=60)
                    for i in range(j, min(n, j + args.burst))
                ))
            await asyncio.sleep(10 * args.ttl)
            lost += sum(1 for lease in leases if lease.lost)
            total += n
            await asyncio.gather(*(lease.release() for lease in leases), return_exceptions=True)
            r += 1
    finally:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(10):
                await locks.aclose()
    return dict(holds=total, lapses=lost, hold_ttl=args.ttl)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults.probe")
    parser.add_argument("mode", choices=["probe", "holds"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--kind", required=True)
    parser.add_argument("--options", default="{}")
    parser.add_argument("--prefix", default="probe")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ttl", type=float, default=1.0)
    parser.add_argument("--lock-ttl", type=float, default=30.0,
                        help="ttl of the storm's and the timeout probes' locks (outlives the checks)")
    parser.add_argument("--cancels", type=int, default=300)
    parser.add_argument("--names", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--timeouts", type=int, default=20)
    parser.add_argument("--stall-rounds", type=int, default=2)
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--burst", type=int, default=500, help="holds: acquires at once")
    args = parser.parse_args()
    logging.basicConfig(level=logging.CRITICAL)
    result = asyncio.run(probe(args) if args.mode == "probe" else holds(args))
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
