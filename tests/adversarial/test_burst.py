"""A burst of 50,000 concurrent acquires on one ``redis://`` connection against a
healthy server: no BackendUnavailable (issue 9 #12: the request timeout must measure the
server, not the client's queue)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

import aiolock

from ..servers import RedisServer

N = 50_000


@pytest.mark.slow
async def test_burst_of_50000_acquires(redis_server: RedisServer) -> None:
    base = uuid.uuid4().hex
    errors: list[BaseException] = []
    async with aiolock.connect(redis_server.url, request_timeout=2) as locks:

        async def one(i: int) -> None:
            try:
                lease = await locks.lock(f"{base}:{i}", ttl=30).acquire(timeout=0)
                await lease.release()
            except Exception as exc:
                errors.append(exc)

        t0 = time.monotonic()
        async with asyncio.timeout(120):
            await asyncio.gather(*(one(i) for i in range(N)))
        took = time.monotonic() - t0
    kinds = {type(e).__name__ for e in errors}
    assert not errors, f"{len(errors)} errors of {N} ({kinds}) in {took:.1f}s: {errors[:1]}"
    print(f"{N} acquire+release in {took:.1f}s: {N / took:.0f}/s")
