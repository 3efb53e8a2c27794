"""A churn worker for the load tests (tests/adversarial_load_redis).

``python worker.py MODE URL NAME OUT [options]``: connects (``--conns`` connections),
prints ``READY``, waits for a line ``GO <end>`` on stdin (``end`` on the monotonic clock,
system-wide on Linux), then ``--tasks`` tasks churn the primitive ``MODE`` until ``end``
and it prints ``DONE <holds> <errors>``; it stays connected (holding nothing) until a
line ``QUIT`` (or the end of stdin), then closes and prints ``CLOSED``.

Every hold appends to OUT (this process's own file, line-buffered) an enter record as
soon as the body runs and an exit record in the body's ``finally``::

    E <id> <t> <token> <kind> <asked>  kind: l(ock) r(ead) w(rite) p(ermit) e(lection);
                                       asked: when its acquire was called
    X <id> <t> <token> <lost 0|1>
    T <t> <wanted timeout> <elapsed>   an acquire(timeout=...) that timed out
    R <t> <type> <message>             any other error (then the task goes on)

The recorded interval lies inside the real hold (it starts after the grant and ends
before the release), so two recorded intervals that overlap are a real overlap.

Modes: ``lock``, ``fair``, ``reentrant`` (the body re-enters twice; the inner tokens must
equal the outer one, else ``R`` records), ``sem`` (``--limit``), ``rw`` (one task in
``--writers`` writes, the others read), ``elect`` (campaign), ``cancel`` (``lock`` whose
acquires are at random cancelled after a few ms, or given a short timeout; ``--cancel``
does the same to any mode).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from typing import Any, TextIO

import aiolock

#: (chance, seconds): a body stalls its event loop for 0.5-1.5 x seconds
SPIN = [0.02, 0.03]


class Log:
    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.holds = 0
        self.errors = 0

    def line(self, *parts: object) -> None:
        self.out.write(" ".join(map(str, parts)) + "\n")

    def error(self, exc: BaseException) -> None:
        self.errors += 1
        text = str(exc).replace("\n", " ")[:300]
        self.line("R", time.monotonic(), type(exc).__name__, text)


def spin(seconds: float) -> None:
    """Burn CPU in the event loop (a stalled loop while holding)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


async def body(log: Log, hid: str, lease: Any, kind: str, hold: float,
               rng: random.Random, asked: float) -> None:
    log.line("E", hid, time.monotonic(), lease.token, kind, asked)
    log.holds += 1
    try:
        if rng.random() < SPIN[0]:
            spin(SPIN[1] * (0.5 + rng.random()))
        await asyncio.sleep(rng.random() * hold)
    finally:
        log.line("X", hid, time.monotonic(), lease.token, int(bool(lease.lost)))


def primitive(locks: aiolock.Locks, args: argparse.Namespace, task: int) -> tuple[Any, str]:
    mode = args.mode
    if mode in ("lock", "cancel"):
        return locks.lock(args.name, ttl=args.ttl), "l"
    if mode == "fair":
        return locks.lock(args.name, ttl=args.ttl, fair=True), "l"
    if mode == "reentrant":
        return locks.lock(args.name, ttl=args.ttl, reentrant=True), "l"
    if mode == "sem":
        return locks.semaphore(args.name, limit=args.limit, ttl=args.ttl), "p"
    if mode == "rw":
        rw = locks.rwlock(args.name, ttl=args.ttl)
        if task < args.writers:
            return rw.write(), "w"
        return rw.read(), "r"
    if mode == "elect":
        return locks.election(args.name, ttl=args.ttl).campaign(data=f"{os.getpid()}-{task}"), "e"
    raise SystemExit(f"unknown mode {mode}")


async def churn(log: Log, locks: aiolock.Locks, args: argparse.Namespace, task: int,
                end: float) -> None:
    rng = random.Random(os.getpid() * 1000 + task)
    prim, kind = primitive(locks, args, task)
    seq = 0
    while time.monotonic() < end:
        seq += 1
        hid = f"{os.getpid()}:{task}:{seq}"
        asked = time.monotonic()
        try:
            if args.mode == "cancel" or args.cancel:
                await cancel_round(log, prim, kind, hid, args, rng, asked)
            elif args.mode == "reentrant":
                async with prim as lease, prim as inner, prim as inner2:
                    if not inner.token == inner2.token == lease.token:
                        log.line("R", time.monotonic(), "TokenMismatch",
                                 f"{lease.token} {inner.token} {inner2.token}")
                        log.errors += 1
                    await body(log, hid, lease, kind, args.hold, rng, asked)
            else:
                async with prim as lease:
                    await body(log, hid, lease, kind, args.hold, rng, asked)
        except aiolock.LockLost as exc:
            log.line("R", time.monotonic(), "LockLost", hid, str(exc).replace("\n", " ")[:200])
        except Exception as exc:  # recorded; the test fails on it
            log.error(exc)
            await asyncio.sleep(0.05)
        if args.gap:
            await asyncio.sleep(rng.random() * args.gap)


async def cancel_round(log: Log, lock: Any, kind: str, hid: str, args: argparse.Namespace,
                       rng: random.Random, asked: float) -> None:
    how = rng.random()
    if how < 0.35:  # cancelled at a random point
        task = asyncio.ensure_future(lock.acquire())
        if rng.random() < 0.5:
            for _ in range(rng.randrange(8)):
                await asyncio.sleep(0)
        else:
            await asyncio.sleep(rng.random() * 0.01)
        task.cancel()
        try:
            lease = await task
        except asyncio.CancelledError:
            return
    elif how < 0.7:  # a short timeout
        wanted = rng.random() * 0.02
        start = time.monotonic()
        try:
            lease = await lock.acquire(timeout=wanted)
        except aiolock.LockTimeout:
            log.line("T", time.monotonic(), wanted, time.monotonic() - start)
            return
    else:
        async with lock as lease:
            await body(log, hid, lease, kind, args.hold, rng, asked)
        return
    try:  # granted after all (cancelled too late), or within the timeout
        await body(log, hid, lease, kind, args.hold, rng, asked)
    finally:
        await lease.release()


async def main(args: argparse.Namespace) -> None:
    SPIN[:] = [args.spin_chance, args.spin]
    out = open(args.out, "a", buffering=1)  # noqa: SIM115, ASYNC230 -- kept open for the run
    log = Log(out)
    conns = [aiolock.connect(args.url) for _ in range(args.conns)]
    for c in conns:
        await c.__aenter__()
    print("READY", os.getpid(), flush=True)
    loop = asyncio.get_running_loop()
    go = await loop.run_in_executor(None, sys.stdin.readline)
    end = float(go.split()[1])
    await asyncio.gather(*(churn(log, conns[i % len(conns)], args, i, end)
                           for i in range(args.tasks)))
    print("DONE", log.holds, log.errors, flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)
    for c in conns:
        await c.__aexit__(None, None, None)
    out.close()
    print("CLOSED", flush=True)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("mode")
    p.add_argument("url")
    p.add_argument("name")
    p.add_argument("out")
    p.add_argument("--tasks", type=int, default=4)
    p.add_argument("--conns", type=int, default=2)
    p.add_argument("--ttl", type=float, default=5.0)
    p.add_argument("--hold", type=float, default=0.004)
    p.add_argument("--gap", type=float, default=0.0)
    p.add_argument("--limit", type=int, default=2)
    p.add_argument("--writers", type=int, default=1)
    p.add_argument("--spin-chance", type=float, default=0.02)
    p.add_argument("--spin", type=float, default=0.03)
    p.add_argument("--cancel", action="store_true",
                   help="acquires cancelled or timed out at random, as mode cancel")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse(sys.argv[1:])))
