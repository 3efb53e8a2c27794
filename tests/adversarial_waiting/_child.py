"""A child process of tests/adversarial_waiting (written from README, SPEC and docs only).

    python -m tests.adversarial_waiting._child URL NAME CONFIG_JSON

Connects, takes one lease of a warm-up name (so every server connection is open), prints
``READY``, then waits for ``GO`` on stdin. Every time is CLOCK_MONOTONIC (shared by the
processes of one host). Modes (``cfg["mode"]``):

- ``wait``: one task: prints ``WAITING <t>`` then acquires (``timeout``), prints
  ``GOT <token> <t_grant>``, holds ``hold`` s, prints ``REL <t_before_release>``, releases,
  prints ``DONE``.
- ``loop``: ``tasks`` tasks loop ``acquire``/hold random(``hold``)/release until
  ``seconds`` passed, each with a random think time (``think``); a record per grant
  ``[token, t_call, t_grant, t_release, pid, task]``.
- ``probe``: one task: ``count`` times: sleep random(``gap``), acquire, release at once;
  records as ``loop``.
- ``cancel``: ``tasks`` tasks loop until ``seconds`` passed: acquire with a random
  timeout in ``timeout_range`` or cancelled after a random delay; a grant (if any) is
  recorded and released at once; counts of timeouts and cancels.

At the end: ``RECORDS <json>`` and ``END``. Errors: ``ERROR <type>: <msg>`` and exit 4.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from typing import Any

import aiolock


def out(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def main() -> int:
    url, name, cfg = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    rng = random.Random(cfg.get("seed", 0))
    pid = os.getpid()
    ttl = float(cfg.get("ttl", 5.0))
    fair = bool(cfg.get("fair", False))
    records: list[list[Any]] = []
    counts = {"timeout": 0, "cancelled": 0, "granted": 0}
    mode = cfg["mode"]
    try:
        async with aiolock.connect(url) as locks:
            async with locks.lock(f"{name}-warm-{pid}", ttl=ttl):
                pass
            lock = locks.lock(name, ttl=ttl, fair=fair)
            out("READY")
            if mode == "rounds":
                while True:
                    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
                    if not line.startswith("GO "):
                        break
                    rlock = locks.lock(line.split()[1], ttl=ttl, fair=fair)
                    out(f"WAITING {time.monotonic():.6f}")
                    try:
                        lease = await rlock.acquire(timeout=cfg.get("timeout", 15))
                    except aiolock.LockTimeout:
                        out(f"TIMEOUT {time.monotonic():.6f}")
                        continue
                    out(f"GOT {lease.token} {time.monotonic():.6f}")
                    await asyncio.sleep(float(cfg.get("hold", 0)))
                    out(f"REL {time.monotonic():.6f}")
                    await lease.release()
                    out(f"DONE {time.monotonic():.6f}")
                out("COUNTS {}")
                out("RECORDS []")
                out("END")
                return 0
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            if mode == "wait":
                out(f"WAITING {time.monotonic():.6f}")
                lease = await lock.acquire(timeout=cfg.get("timeout", 15))
                out(f"GOT {lease.token} {time.monotonic():.6f}")
                await asyncio.sleep(float(cfg.get("hold", 0)))
                out(f"REL {time.monotonic():.6f}")
                await lease.release()
                out("DONE")
            elif mode in ("loop", "probe"):
                end = time.monotonic() + float(cfg.get("seconds", 2))
                lo, hi = cfg.get("hold", [0.0, 0.003])
                tlo, thi = cfg.get("think", [0.0, 0.0])
                glo, ghi = cfg.get("gap", [0.05, 0.15])

                async def task(i: int) -> None:
                    n = 0
                    while True:
                        if mode == "probe":
                            if n >= int(cfg["count"]):
                                return
                            await asyncio.sleep(rng.uniform(glo, ghi))
                        elif time.monotonic() >= end:
                            return
                        n += 1
                        t_call = time.monotonic()
                        lease = await lock.acquire(timeout=cfg.get("timeout", 15))
                        t_grant = time.monotonic()
                        if mode == "loop":
                            await asyncio.sleep(rng.uniform(lo, hi))
                        assert not lease.lost
                        t_rel = time.monotonic()
                        records.append([lease.token, t_call, t_grant, t_rel, pid, i])
                        await lease.release()
                        if mode == "loop" and thi > 0:
                            await asyncio.sleep(rng.uniform(tlo, thi))

                ntasks = 1 if mode == "probe" else int(cfg.get("tasks", 1))
                await asyncio.gather(*(task(i) for i in range(ntasks)))
            elif mode == "cancel":
                end = time.monotonic() + float(cfg.get("seconds", 2))
                tlo, thi = cfg.get("timeout_range", [0.005, 0.2])

                async def canceller(i: int) -> None:
                    while time.monotonic() < end:
                        t_call = time.monotonic()
                        if rng.random() < 0.5:
                            try:
                                lease = await lock.acquire(timeout=rng.uniform(tlo, thi))
                            except aiolock.LockTimeout:
                                counts["timeout"] += 1
                                continue
                        else:
                            job = asyncio.ensure_future(lock.acquire(timeout=None))
                            await asyncio.sleep(rng.uniform(tlo, thi))
                            job.cancel()
                            try:
                                lease = await job
                            except asyncio.CancelledError:
                                counts["cancelled"] += 1
                                continue
                        t_grant = time.monotonic()
                        counts["granted"] += 1
                        t_rel = time.monotonic()
                        records.append([lease.token, t_call, t_grant, t_rel, pid, i])
                        await lease.release()

                await asyncio.gather(*(canceller(i) for i in range(int(cfg.get("tasks", 4)))))
            else:
                raise ValueError(mode)
    except Exception as exc:
        out(f"ERROR {type(exc).__name__}: {exc}")
        return 4
    out(f"COUNTS {json.dumps(counts)}")
    out(f"RECORDS {json.dumps(records)}")
    out("END")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
