"""Elections, holder records, listing and revocation on PostgreSQL, under faults, on a real
server started here (see tests/pg_server.py).

The coordination contract (tests/test_contract_coordination.py) runs on PostgreSQL too;
these tests cover what needs several processes or connections: a leader killed with
``kill -9`` (PostgreSQL frees its advisory lock the moment its connection drops), a
leader paused past its ttl (``idle_session_timeout`` ends its session), observers in
another connection woken by ``NOTIFY`` rather than by their ``ttl/2`` poll, a revocation
from another connection, and ``scan`` with names holding ``LIKE`` wildcards.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator

import pytest

pytest.importorskip("asyncpg")

import asyncpg

import aiolock
from aiolock.backends.postgres import PostgresBackend

from .pg_server import PostgresServer, find_pg_bin
from .sql_children import start_candidate, stop

pytestmark = pytest.mark.skipif(find_pg_bin() is None, reason="PostgreSQL is not installed")

@pytest.fixture
def url(postgres_server: PostgresServer) -> str:
    """The tests' own PostgreSQL (``tests/conftest.py`` starts it for the session)."""
    return postgres_server.url


class Observer:
    """``observe()`` in a task: every value seen, with when it was seen."""

    def __init__(self, election: aiolock.Election) -> None:
        self.seen: list[tuple[float, aiolock.Leader | None]] = []
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._run(election))

    async def _run(self, election: aiolock.Election) -> None:
        async for leader in election.observe():
            self.seen.append((time.monotonic(), leader))
            self._changed.set()

    async def until(self, check: object, timeout: float) -> float:
        """Wait until the last value seen passes ``check``; when it was seen."""
        deadline = time.monotonic() + timeout
        while True:
            if self.seen and check(self.seen[-1][1]):  # type: ignore[operator]
                return self.seen[-1][0]
            self._changed.clear()
            left = deadline - time.monotonic()
            assert left > 0, f"observe() did not get there in {timeout} s: {self.seen}"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    async def aclose(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


@contextlib.asynccontextmanager
async def observing(election: aiolock.Election) -> AsyncIterator[Observer]:
    observer = Observer(election)
    try:
        yield observer
    finally:
        await observer.aclose()


# -- the leader dies or stalls ---------------------------------------------------------------


async def test_killed_leader_is_replaced_at_once(url: str, name: str) -> None:
    """kill -9: the server frees the leadership as the socket closes (the documented
    dead-holder bound is "at once"), the waiting candidate leads with a higher term, and
    an observer on a third connection sees the change without waiting for its poll."""
    proc, term = start_candidate(url, name, ttl=30, data="doomed")
    try:
        async with aiolock.connect(url) as candidate, aiolock.connect(url) as watcher, \
                observing(watcher.election(name, ttl=30)) as observer:
            await observer.until(lambda s: s is not None and s.data == "doomed", 5)
            waiting = asyncio.create_task(
                candidate.election(name, ttl=30).campaign(data="next").acquire(timeout=10))
            await asyncio.sleep(0.3)
            assert not waiting.done()  # at most one leader
            killed = time.monotonic()
            proc.send_signal(signal.SIGKILL)
            lead = await asyncio.wait_for(waiting, 5)
            assert time.monotonic() - killed < 1.0  # not the 30 s ttl
            assert lead.token > term
            seen = await observer.until(lambda s: s is not None and s.data == "next", 5)
            assert seen - killed < 1.5  # NOTIFY, not the ttl/2 = 15 s poll
            await lead.release()
            await observer.until(lambda s: s is None, 5)
    finally:
        stop(proc)


async def test_paused_leader_loses_leadership_after_its_ttl(url: str, name: str) -> None:
    """SIGSTOP keeps the leader's TCP connection open: idle_session_timeout (= ttl) ends
    its session, the next candidate leads with a higher term, observers see it, and the
    old leader, woken, finds its leadership lost and its body cancelled."""
    ttl = 1.0
    proc, term = start_candidate(url, name, ttl=ttl, data="sleepy")
    try:
        async with aiolock.connect(url) as candidate, aiolock.connect(url) as watcher, \
                observing(watcher.election(name, ttl=ttl)) as observer:
            await observer.until(lambda s: s is not None and s.data == "sleepy", 5)
            os.kill(proc.pid, signal.SIGSTOP)
            paused = time.monotonic()
            lead = await candidate.election(name, ttl=ttl).campaign(data="awake").acquire(
                timeout=5)
            assert time.monotonic() - paused < ttl + 0.6
            assert lead.token > term
            await observer.until(lambda s: s is not None and s.token == lead.token, 2)
            os.kill(proc.pid, signal.SIGCONT)
            assert proc.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 5)
            assert line.strip() == "LOST"  # its body was cancelled, the block raised LockLost
            leader = await watcher.election(name).leader()
            assert leader is not None and leader.data == "awake"  # the old one did not return
            await lead.release()
    finally:
        stop(proc)


async def test_observe_is_woken_by_notify(url: str, name: str) -> None:
    """With ttl=20 the poll is every 10 s: grants, proclaims, releases and revocations
    from other connections reach the observer in well under a second."""
    async with aiolock.connect(url) as a, aiolock.connect(url) as watcher:
        election = a.election(name, ttl=20)
        async with observing(watcher.election(name, ttl=20)) as observer:
            await observer.until(lambda s: s is None, 5)
            started = time.monotonic()
            term = await election.campaign(data="one").acquire()
            await observer.until(lambda s: s is not None and s.data == "one", 1.0)
            await term.proclaim("two")
            await observer.until(lambda s: s is not None and s.data == "two", 1.0)
            await term.release()
            await observer.until(lambda s: s is None, 1.0)
            again = await election.campaign(data="three").acquire()
            await observer.until(lambda s: s is not None and s.data == "three", 1.0)
            assert await watcher.election(name).campaign().force_release()
            await observer.until(lambda s: s is None, 1.0)  # revoked: nobody leads
            assert time.monotonic() - started < 5
            await again.release()


async def test_observer_resumes_after_its_listen_connection_drops(
    url: str, name: str
) -> None:
    """The LISTEN connection is re-opened by itself (an observer never calls listen()
    again): with ttl=20 (a 10 s poll) changes after the drop still arrive at once."""
    async with aiolock.connect(url) as a, aiolock.connect(url, poll_interval=0.1) as watcher, \
            observing(watcher.election(name, ttl=20)) as observer:
        await observer.until(lambda s: s is None, 5)
        backend = watcher.backend
        assert isinstance(backend, PostgresBackend)
        listener = backend._notifier._conn
        assert listener is not None
        conn = await asyncpg.connect(url)
        try:
            await conn.fetchval("SELECT pg_terminate_backend($1)", listener.get_server_pid())
        finally:
            await conn.close()
        for _ in range(100):  # re-opened in the background
            await asyncio.sleep(0.05)
            if backend._notifier._conn is not None and backend._notifier._conn is not listener:
                break
        async with a.election(name, ttl=20).campaign(data="after"):
            await observer.until(lambda s: s is not None and s.data == "after", 1.5)


# -- revocation across connections -----------------------------------------------------------


async def test_revoked_holder_unlocks_and_the_next_acquires_without_ttl_wait(
    url: str, name: str
) -> None:
    """force_release from another connection: the holder learns it at its next renewal
    (ttl/3), its abandon unlocks the advisory lock on its connection, and a waiter gets
    the lock then -- long before the holder's ttl would have ended its session."""
    ttl = 3.0
    async with aiolock.connect(url) as a, aiolock.connect(url) as b:
        lease = await a.lock(name, ttl=ttl, data="victim").acquire()
        waiting = asyncio.create_task(b.lock(name, ttl=ttl).acquire(timeout=10))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        revoked = time.monotonic()
        assert await b.lock(name).force_release() is True
        nxt = await asyncio.wait_for(waiting, 5)
        assert time.monotonic() - revoked < ttl / 3 + 0.5
        assert nxt.token > lease.token
        await asyncio.wait_for(lease.wait_lost(), 1)
        assert "revoked" in repr(lease._hold.lost_reason)
        info = await b.status(name)
        assert [h.data for h in info.held_by] == [""] and info.token == nxt.token
        await nxt.release()
        await lease.release()
        assert await b.lock(name).force_release() is False


async def test_force_release_revokes_every_reader_and_permit(url: str, name: str) -> None:
    async with aiolock.connect(url) as a, aiolock.connect(url) as b:
        readers = [await asyncio.create_task(a.rwlock(name, ttl=1.5).read().acquire())
                   for _ in range(2)]
        permits = [await a.semaphore(name, 3, ttl=1.5).acquire() for _ in range(2)]
        assert await b.rwlock(name).force_release() is True
        assert await b.semaphore(name, 3).force_release() is True
        for lease in readers + permits:
            await asyncio.wait_for(lease.wait_lost(), 1.5)
        assert (await b.status(name, aiolock.Kind.READ)).held_by == ()
        async with b.rwlock(name, ttl=2).write():  # the readers unlocked
            pass
        for lease in readers + permits:
            await lease.release()


# -- listing --------------------------------------------------------------------------------


async def test_scan_escapes_like_wildcards_and_skips_dead_rows(url: str, name: str) -> None:
    async with aiolock.connect(url) as locks:
        names = [f"{name}%a", f"{name}_b", f"{name}!c", f"{name}xd", f"{name}\\e"]
        held = [await locks.lock(n, ttl=5).acquire() for n in names]
        try:
            for prefix, expected in [(f"{name}%", names[:1]), (f"{name}_", names[1:2]),
                                     (f"{name}!", names[2:3]), (f"{name}\\", names[4:]),
                                     (name, sorted(names))]:
                found = [i.name async for i in locks.scan(prefix)]
                assert found == expected, prefix
            # a holder row whose session no longer holds the lock is not listed
            conn = await asyncpg.connect(url)
            try:
                await conn.execute(
                    "INSERT INTO aiolock_holders (family, name, owner, kind, token, pid,"
                    " expires_at, info, since, key) VALUES ('lock', $1, 'ghost', 'lock', 1,"
                    " pg_backend_pid(), now() + interval '1 hour', '', now(), 42)", f"{name}ghost")
            finally:
                await conn.close()
            assert [i.name async for i in locks.scan(f"{name}ghost")] == []
            [info] = [i async for i in locks.scan(f"{name}x")]
            assert info.held and info.family == "lock" and info.token == held[3].token
            assert info.held_by[0].pid == os.getpid() and info.held_by[0].since is not None
        finally:
            for lease in held:
                await lease.release()
        assert [i async for i in locks.scan(name)] == []


async def test_holder_since_is_on_the_server_clock(url: str, name: str) -> None:
    async with aiolock.connect(url) as locks, locks.lock(name, ttl=5, data="d"):
        await asyncio.sleep(0.3)
        [holder] = (await locks.status(name)).held_by
        assert holder.data == "d" and holder.since is not None and 0.25 < holder.since < 3
