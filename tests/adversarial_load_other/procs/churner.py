"""A churning worker process of the load tests (tests/adversarial_load_other).

``churner.py CONFIG_JSON``: connect (``conns`` connections), print ``READY``, wait for the
go file (it holds the end of the run on CLOCK_MONOTONIC), then ``tasks`` tasks acquire and
release one primitive until then. Every event is a JSON line appended to this process's
OWN file ``out`` (line-buffered: one write per record, so a ``kill -9`` loses nothing
written): ``start`` before an acquire, ``enter`` right after it returned, ``chk`` in the
body, ``exit`` at the end of the body, ``lockost`` when the block raised LockLost,
``miss`` (LockTimeout), ``cancel`` (the acquire was cancelled), ``error``
(``async with`` raised BackendUnavailable, though the server is up). Each ``enter``/``chk``/
``exit`` has ``t`` (monotonic, read BEFORE ``lease.lost``) and ``lost``: when ``lost`` is
false, the lease was believed at ``t``.

``stall``: a task blocks the event loop for up to that many seconds now and then.

kinds: ``lock``, ``fair`` (lock(fair=True)), ``sem`` (semaphore of ``limit``), ``rw``
(readers and writers, ``wfrac`` of them writers), ``elect`` (campaign; the term is the
lease).
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import json
import os
import random
import signal
import sys
import time
from typing import Any

import aiolock


class Log:
    def __init__(self, path: str) -> None:
        self.f = open(path, "a", buffering=1)  # noqa: SIM115 -- line-buffered, kept open
        self.pid = os.getpid()

    def rec(self, **kw: Any) -> None:
        kw["pid"] = self.pid
        self.f.write(json.dumps(kw) + "\n")


def primitive(locks: aiolock.Locks, cfg: dict[str, Any], role: str) -> Any:
    kind, name, ttl = cfg["kind"], cfg["name"], cfg["ttl"]
    if kind == "lock":
        return locks.lock(name, ttl=ttl)
    if kind == "fair":
        return locks.lock(name, ttl=ttl, fair=True)
    if kind == "sem":
        return locks.semaphore(name, cfg["limit"], ttl=ttl)
    if kind == "rw":
        rw = locks.rwlock(name, ttl=ttl)
        return rw.write() if role == "w" else rw.read()
    if kind == "elect":
        return locks.election(name, ttl=ttl).campaign(data=f"pid-{os.getpid()}")
    raise SystemExit(f"unknown kind {kind}")


async def body(log: Log, lease: Any, key: str, hold: float) -> None:
    t = time.monotonic()
    log.rec(ev="enter", key=key, t=t, lost=lease.lost, tok=lease.token)
    steps = random.randint(1, 3)
    for _ in range(steps):
        await asyncio.sleep(random.random() * hold / steps)
        t = time.monotonic()
        log.rec(ev="chk", key=key, t=t, lost=lease.lost)
    t = time.monotonic()
    log.rec(ev="exit", key=key, t=t, lost=lease.lost)


async def release(log: Log, lease: Any, key: str, cancel_p: float) -> None:
    """Release; with probability ``cancel_p`` cancel the release at a random point (it
    finishes in the background, SPEC §2), then release again (a no-op) half the time."""
    if random.random() >= cancel_p:
        await lease.release()
        return
    try:
        async with asyncio.timeout(random.random() * 0.01):
            await lease.release()
    except TimeoutError:
        log.rec(ev="relcancel", key=key, t=time.monotonic())
        if random.random() < 0.5:
            await lease.release()


async def task(log: Log, locks: aiolock.Locks, cfg: dict[str, Any], i: int, end: float) -> None:
    seq = 0
    hold = cfg.get("hold", 0.004)
    cancel_p = cfg.get("cancel", 0.0)
    try_p = cfg.get("try", 0.0)
    timeout_p = cfg.get("timeouts", 0.0)
    while time.monotonic() < end:
        seq += 1
        key = f"{log.pid}:{i}:{seq}"
        role = "w" if random.random() < cfg.get("wfrac", 1.0) else "r"
        prim = primitive(locks, cfg, role)
        r = random.random()
        t0 = time.monotonic()
        log.rec(ev="start", key=key, t=t0, task=i, role=role)
        if r < cancel_p + try_p + timeout_p:
            # the explicit form: a try, a bounded wait, or a wait cancelled at a random point
            lease = None
            try:
                if r < try_p:
                    lease = await prim.acquire(timeout=0)
                elif r < try_p + timeout_p:
                    lease = await prim.acquire(timeout=random.random() * 0.05)
                else:
                    async with asyncio.timeout(random.random() * 0.03):
                        lease = await prim.acquire()
            except aiolock.LockTimeout:
                log.rec(ev="miss", key=key, t=time.monotonic(), took=time.monotonic() - t0,
                        mode="try" if r < try_p else "timeout")
                continue
            except TimeoutError:
                log.rec(ev="cancel", key=key, t=time.monotonic(), took=time.monotonic() - t0)
                continue
            try:
                await body(log, lease, key, hold)
            finally:
                await release(log, lease, key, cfg.get("relcancel", 0.0))
            continue
        try:
            async with prim as lease:
                await body(log, lease, key, hold)
        except aiolock.LockLost:
            log.rec(ev="lockost", key=key, t=time.monotonic())
        except aiolock.BackendUnavailable as e:  # the servers here stay up: a finding
            log.rec(ev="error", key=key, t=time.monotonic(), took=time.monotonic() - t0,
                    err=f"{type(e).__name__}: {e}")


async def stalls(log: Log, most: float, end: float, gap: float = 0.8, least: float = 0.0) -> None:
    """Block the event loop (a synchronous sleep, as CPU-bound code would) for up to
    ``most`` seconds, now and then, until ``end``."""
    while time.monotonic() < end:
        await asyncio.sleep(gap / 4 + random.random() * gap * 3 / 4)
        took = least + random.random() * (most - least)
        log.rec(ev="stall", t=time.monotonic(), took=took)
        time.sleep(took)  # the point: the loop stalls


async def report_hang(after: float) -> None:
    """If closing the connections takes longer than ``after`` s, print every task's stack."""
    await asyncio.sleep(after)
    print(f"HUNG closing for {after}s; tasks:", file=sys.stderr, flush=True)
    for t in asyncio.all_tasks():
        if t is not asyncio.current_task():
            print(repr(t)[:300], file=sys.stderr)
            t.print_stack(limit=12, file=sys.stderr)
    sys.stderr.flush()


def exists(path: str) -> bool:
    return os.path.exists(path)


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


async def main(cfg: dict[str, Any]) -> None:
    log = Log(cfg["out"])
    async with contextlib.AsyncExitStack() as stack:
        conns = [await stack.enter_async_context(aiolock.connect(cfg["url"]))
                 for _ in range(cfg.get("conns", 2))]
        print("READY", flush=True)
        while not exists(cfg["go"]):
            await asyncio.sleep(0.01)
        end = float(read(cfg["go"]))
        jobs = [task(log, conns[i % len(conns)], cfg, i, end) for i in range(cfg["tasks"])]
        if cfg.get("stall"):
            jobs.append(stalls(log, cfg["stall"], end, cfg.get("stall_gap", 0.8),
                               cfg.get("stall_min", 0.0)))
        await asyncio.gather(*jobs)
        # no claim leaked: with every process still connected, one more acquire succeeds
        t0 = time.monotonic()
        try:
            lease = await primitive(conns[0], cfg, "w").acquire(timeout=cfg.get("final", 12.0))
        except aiolock.LockTimeout:
            log.rec(ev="final", ok=False, t=time.monotonic(), took=time.monotonic() - t0)
            print("FINAL timeout", flush=True)
        else:
            log.rec(ev="final", ok=True, t=time.monotonic(), took=time.monotonic() - t0,
                    tok=lease.token)
            await lease.release()
            print("FINAL ok", flush=True)
        while not exists(cfg["go"] + ".close"):
            await asyncio.sleep(0.01)
        print("CLOSING", flush=True)
        hang = asyncio.create_task(report_hang(10.0))
    hang.cancel()
    log.rec(ev="done", t=time.monotonic())
    # every connection is closed: whatever task still runs was left behind by it
    left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()
            and "report_hang" not in repr(t)]
    for t in left:
        print("LEFT", repr(t)[:300], file=sys.stderr, flush=True)
    print("DONE", len(left), flush=True)


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1)  # the harness asks for stacks of a hung worker
    asyncio.run(main(json.loads(sys.argv[1])))
