"""Races on both new backends: a waiter cancelled, or timing out, just as the holder
releases (the grant may be on its way); afterwards the lock must be free, never held by
nobody. And a stress of short leases renewed while other processes contend."""

from __future__ import annotations

import asyncio
import random
import uuid
from typing import Any

import pytest

import aiolock

from .conftest import Child, user_url

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(params=["redis-tx", "mysql", "mysql-row"])
def race_url(request: pytest.FixtureRequest) -> str:
    if request.param == "redis-tx":
        return user_url(request.getfixturevalue("tx_redis"), "noscript")
    server = request.getfixturevalue("mysql_server")
    return str(server.url) + ("?mode=row" if request.param == "mysql-row" else "")


@pytest.mark.parametrize("how", ["cancel", "timeout"])
async def test_waiter_interrupted_as_holder_releases_never_leaks(race_url: str, how: str) -> None:
    name = f"r15-{uuid.uuid4().hex[:10]}"
    rng = random.Random(15)
    leaks = []
    async with aiolock.connect(race_url) as a, aiolock.connect(race_url) as b, \
            aiolock.connect(race_url) as c:
        for i in range(10):
            held = await a.lock(name, ttl=30).acquire()
            when = 0.05 + rng.random() * 0.01
            if how == "cancel":
                task = asyncio.create_task(b.lock(name, ttl=30).acquire())
            else:
                task = asyncio.create_task(b.lock(name, ttl=30).acquire(timeout=when))
            await asyncio.sleep(when - 0.004 + rng.random() * 0.008)
            release = asyncio.create_task(held.release())
            if how == "cancel":
                for _ in range(rng.randrange(4)):
                    await asyncio.sleep(0)
                task.cancel()
            await release
            outcome = (await asyncio.gather(task, return_exceptions=True))[0]
            if isinstance(outcome, aiolock.Lease):
                assert outcome.token > held.token
                await outcome.release()
            else:
                assert isinstance(outcome, (asyncio.CancelledError, aiolock.LockTimeout)), outcome
            try:
                got = await c.lock(name, ttl=30).acquire(timeout=1.0)
            except aiolock.LockTimeout:
                leaks.append((i, type(outcome).__name__))
                info = await c.status(name)
                raise AssertionError(f"round {i}: held by nobody after {outcome!r}: {info}") from None
            await got.release()
    assert not leaks


@pytest.mark.slow
async def test_short_leases_renewed_under_contention_across_processes(
        tx_redis: Any, children: list[Child]) -> None:
    await _stress(tx_redis, children, seconds=8.0)


async def _stress(tx_redis: Any, children: list[Child], seconds: float) -> None:
    name = f"s15-{uuid.uuid4().hex[:10]}"
    counter = user_url(tx_redis, "default")
    urls = [user_url(tx_redis, "noscript"), user_url(tx_redis, "noscript"),
            user_url(tx_redis, "default", "?scripting=off"), user_url(tx_redis, "default")]
    for url in urls:
        children.append(await Child.start("worker", "churn", url, name, str(seconds), "6",
                                          counter, "0.5", "0.3"))
    tokens: list[int] = []
    for child in children:
        out, err = await child.finish(seconds + 60)
        lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
        assert "OVERLAPS" in lines, err[-3000:]
        assert lines["OVERLAPS"] == "0", err[-3000:]
        mine = [int(t) for t in lines["TOKENS"].split(",") if t]
        tokens += mine
    assert len(set(tokens)) == len(tokens), "a token was given twice"
    assert len(tokens) > 10

