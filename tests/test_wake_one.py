"""Across processes, a release wakes ONE waiting process, and no process starves (issue 10).

Structure, not speed: several OS processes (``tests/procs/``) wait on one lock on a real,
private redis-server, and the server itself counts what they ask (``INFO commandstats``).
"""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

import aiolock
from aiolock.backends import redis as redis_backend

from ._workers import Procs, longest_waits, procs, run_workers  # noqa: F401 -- fixture
from .servers import RedisServer
from .test_faults_redis import own_server  # noqa: F401 -- fixture

pytestmark = pytest.mark.timeout(90)

LOCAL_HANDOFFS: int = getattr(redis_backend, "LOCAL_HANDOFFS", 4)


async def _evalsha_calls(client: aioredis.Redis) -> int:
    stats = await client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


@pytest.mark.parametrize("fair", [False, True], ids=["default", "fair"])
async def test_each_release_wakes_one_waiting_process(
    own_server: RedisServer, procs: Procs, fair: bool  # noqa: F811
) -> None:
    """P processes wait on a lock; it is released and each of them then takes it once.
    Every release may cost its own RELEASE script and at most one acquire attempt; the
    old broadcast made every waiting process retry at every release (about P*P/2)."""
    nprocs = 6
    name = f"wake-one-{fair}"
    admin = aioredis.Redis.from_url(own_server.url)
    async with aiolock.connect(own_server.url) as locks:
        lease = await locks.lock(name, ttl=5, fair=fair).acquire()
        workers = [
            await procs.spawn("waiter.py", own_server.url, name, "20", "1" if fair else "0")
            for _ in range(nprocs)
        ]
        for w in workers:
            await w.expect("WAITING", 20)
        await asyncio.sleep(0.5)  # they ask, find it held, and wait
        await admin.config_resetstat()
        before = await _evalsha_calls(admin)
        await lease.release()
        tokens = []
        for w in workers:
            tokens.append(int((await w.expect("ACQUIRED", 20)).split()[1]))
            await w.expect("DONE", 20)
        for w in workers:
            assert await w.finish(10) == 0, w.output()
        calls = await _evalsha_calls(admin) - before
    await admin.aclose()
    releases = nprocs + 1
    attempts = calls - releases
    print(f"{calls} scripts for {releases} releases: {attempts} acquire attempts")
    assert sorted(tokens) == list(range(2, nprocs + 2))  # one hand-off each, none lost
    assert attempts <= releases, f"{attempts} acquire attempts for {releases} releases"


async def test_every_process_gets_in_within_a_bounded_number_of_handoffs(
    own_server: RedisServer, procs: Procs  # noqa: F811
) -> None:
    """P processes x T tasks loop on one lock. In the order of acquisitions (tokens), a
    process never goes more than a bounded number of acquisitions without one of its own:
    a process hands the lock to its own tasks at most LOCAL_HANDOFFS times in a row while
    another waits, so each other process waits at most (P - 1) turns of LOCAL_HANDOFFS + 1.
    Before, one process could keep it for hundreds of acquisitions in a row."""
    nprocs, ntasks, duration, warmup = 4, 3, 2.5, 0.5
    start, records = await run_workers(procs, own_server.url, "fair-share", nprocs, ntasks, duration)
    per_proc, worst = longest_waits(records, start + warmup, nprocs)
    bound = 2 * (nprocs - 1) * (LOCAL_HANDOFFS + 1)  # x2: barging newcomers, timing
    longest = max(worst.values())
    assert longest <= bound, f"a process waited {longest} acquisitions (bound {bound})"
    assert min(per_proc.values()) >= 0.3 * max(per_proc.values()), per_proc


async def test_a_killed_waiting_process_does_not_hold_up_the_lock(
    own_server: RedisServer, procs: Procs  # noqa: F811
) -> None:
    """A waiting process is killed (SIGKILL: no abandon): its queue entry stays, but the
    release that reaches it hears nobody on its inbox (the PUBLISH count) and hands the
    lock to the next waiter at once -- not after the dead one's 5 s lease."""
    import signal
    import time

    name = "killed-waiter"
    admin = aioredis.Redis.from_url(own_server.url)
    async with aiolock.connect(own_server.url) as locks:
        lease = await locks.lock(name, ttl=5).acquire()
        dead = await procs.spawn("waiter.py", own_server.url, name, "0", "0")
        await dead.expect("WAITING", 20)
        await asyncio.sleep(0.5)  # it registered (first in the queue)
        live = await procs.spawn("waiter.py", own_server.url, name, "0", "0")
        await live.expect("WAITING", 20)
        await asyncio.sleep(0.5)
        assert await admin.llen(f"aiolock:lock:{{{name}}}:q") == 2
        dead.signal(signal.SIGKILL)
        await dead.finish(10)
        await asyncio.sleep(0.2)  # the server notices its pub/sub connection closed
        began = time.monotonic()
        await lease.release()
        await live.expect("ACQUIRED", 20)
        assert time.monotonic() - began < 2.0
        assert await live.finish(10) == 0, live.output()
    await admin.aclose()


async def test_a_claim_whose_abandon_failed_hands_on_a_lock_it_is_handed(
    own_server: RedisServer,  # noqa: F811
) -> None:
    """A waiting claim's abandon fails (the server away for that request): its queue entry
    stays, its process lives on. When a release hands it the lock, the process abandons it
    again, which hands the lock on to the next waiter, at once."""
    from aiolock._waiter import LocalWaiter
    from aiolock.abc import Busy, Claim, Kind

    async with aiolock.connect(own_server.url) as locks, \
            aiolock.connect(own_server.url) as other, aiolock.connect(own_server.url) as third:
        backend = locks.backend
        assert isinstance(backend, redis_backend.RedisBackend)
        lease = await other.lock("orphan", ttl=5).acquire()
        claim = Claim("orphan", Kind.LOCK, "orphan-claim", 5_000, waits=True)
        waiter = LocalWaiter(claim)
        await backend.listen("orphan", Kind.LOCK, waiter)
        assert isinstance(await backend.try_acquire(claim), Busy)  # registered
        backend.unlisten("orphan", Kind.LOCK, waiter)
        real = backend._release

        async def unreachable(*args: object, **kwargs: object) -> object:
            raise aiolock.BackendUnavailable("away")

        backend._release = unreachable  # type: ignore[method-assign]
        with pytest.raises(aiolock.BackendUnavailable):
            await backend.abandon(claim)
        backend._release = real  # type: ignore[method-assign]
        nxt = asyncio.ensure_future(third.lock("orphan", ttl=5).acquire(timeout=3))
        await asyncio.sleep(0.3)  # it waits behind the orphan
        await lease.release()  # -> the orphan -> abandoned again -> the next waiter
        second = await nxt
        await second.release()


async def test_a_hand_off_costs_one_script_of_nine_commands(
    own_server: RedisServer,  # noqa: F811
) -> None:
    """A release that hands the lock to a waiter of another process costs the RELEASE
    script and 8 commands in it (HGET, LPOP, GET of the waiter's key: its place lapses
    with it; DEL of that key: its place is used up; INCR, HSET, PEXPIRE, PUBLISH: its
    count tells the process is live), and the
    waiter takes the grant from the message, without a request."""
    admin = aioredis.Redis.from_url(own_server.url)

    async def calls() -> dict[str, int]:
        stats = await admin.info("commandstats")
        return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}

    async with aiolock.connect(own_server.url) as one, aiolock.connect(own_server.url) as two:
        lease = await one.lock("hand-off-cost", ttl=5).acquire()
        waiting = asyncio.ensure_future(two.lock("hand-off-cost", ttl=5).acquire(timeout=5))
        await asyncio.sleep(0.3)  # registered, and listening on its inbox
        before = await calls()
        await lease.release()
        second = await waiting
        after = await calls()
        await second.release()
    await admin.aclose()
    spent = {k: n - before.get(k, 0) for k, n in after.items() if n - before.get(k, 0)}
    spent.pop("info", None)
    assert spent == {"evalsha": 1, "hget": 1, "lpop": 1, "get": 1, "del": 1, "incr": 1,
                     "hset": 1, "pexpire": 1, "publish": 1}, spent
