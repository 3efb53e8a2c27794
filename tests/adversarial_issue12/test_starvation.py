"""Waiting across processes (README "Waiting"): "**No process starves:** a release hands
the lock straight to the next local waiter, but while another process waits on Redis at
most 4 times in a row and never later than 10 ms after the first; the next release goes
to the server's next waiter, so a waiting process with k processes ahead of it gets the
lock within k x 5 acquisitions" -- "On Redis (plain, Cluster, Sentinel)"."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

import pytest

import aiolock

from ..scenarios import params_of

ROUNDS = int(os.environ.get("ADV12_ROUNDS", "15"))


@pytest.mark.parametrize("hold", [0.001, 0.008], ids=["short", "long"])
@pytest.mark.parametrize("srow", params_of("redis", "redis-cluster", "redis-sentinel"))
async def test_lone_waiting_process_not_starved_by_busy_process(srow: Any, request: Any,
                                                                name: str, hold: float) -> None:
    """With holds of 1 ms: at most 5 local grants (4 hand-offs in a row) while the other
    process waits, plus up to 5 while its registration travels; with holds of 8 ms, the
    10 ms limit allows 2 local hand-offs after the first: at most 3, plus the same 5."""
    url = srow.url(request)
    grants: list[float] = []
    stop = asyncio.Event()
    async with aiolock.connect(url) as locks:
        lock = locks.lock(name, ttl=5)

        async def busy() -> None:
            while not stop.is_set():
                async with lock:
                    grants.append(time.monotonic())
                    await asyncio.sleep(hold)

        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.adversarial_issue12.procs.waiter", url, name,
            str(ROUNDS), "0.001", stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert proc.stdout is not None
        assert (await asyncio.wait_for(proc.stdout.readline(), 30)).split() == [b"READY"]
        tasks = [asyncio.create_task(busy()) for _ in range(8)]
        waits: list[tuple[float, float]] = []
        try:
            wait_at = 0.0
            async with asyncio.timeout(30):
                async for raw in proc.stdout:
                    words = raw.decode().split()
                    if words[0] == "WAIT":
                        wait_at = float(words[1])
                    elif words[0] == "GOT":
                        waits.append((wait_at, float(words[1])))
                    elif words[0] == "DONE":
                        break
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
    assert len(waits) == ROUNDS
    # grants of the busy process while the other waited; the first few of a wait may
    # fall before its registration reached the server: allow one extra burst (5)
    ahead = [sum(1 for g in grants if a < g < b) for a, b in waits]
    limit = (5 if hold < 0.002 else 3) + 5
    assert max(ahead) <= limit, f"the other process waited behind {ahead} local grants"
    # README: "a lost message costs at most one lease length" (ttl 5 s here). Without any
    # fault one wait of 5.01 s was seen once (Sentinel, 1 ms holds, loaded machine): the
    # hand-off message to the waiting process missed and the lock idle for its ttl; not
    # reproduced in 1,200 more waits, so only the documented bound is asserted.
    assert max(b - a for a, b in waits) < 5.0 + 1.0, waits
