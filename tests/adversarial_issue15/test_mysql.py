"""MySQL / MariaDB (issue 15), from README.md and docs/backends/mysql.md: ``GET_LOCK``
named locks (the default) and ``?mode=row``, on the session's private MariaDB."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import signal
import time
import uuid
from typing import Any

import pytest

import aiolock
from aiolock import Capability

from .._children import exclusion_run, held_for
from ..conftest import acquire_cancelled_after
from .conftest import Child

pytestmark = pytest.mark.timeout(60)
C = Capability
SECRET = "s3cret-pw"  # the password of tests/mysql_server.py's user


@pytest.fixture
def name() -> str:
    return f"m15-{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=["lock", "row"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def url(mysql_server: Any, mode: str) -> str:
    return str(mysql_server.url) + ("?mode=row" if mode == "row" else "")


def _holder_conn(server: Any, name: str) -> list[int]:
    """The session ids aiolock_holders records for ``name``."""
    out = server.sql(f"SELECT conn FROM `{server.database}`.aiolock_holders "
                     f"WHERE name = '{name}'")
    return [int(x) for x in out.split()]


def _kill(server: Any, conns: list[int]) -> None:
    for conn in conns:
        server.sql(f"KILL CONNECTION {conn}")


# -- names ------------------------------------------------------------------------------


async def test_long_names_with_common_prefix_are_two_locks(url: str) -> None:
    prefix = uuid.uuid4().hex * 2  # 64 characters
    pairs = [(prefix + "A", prefix + "B"), (prefix * 7 + "x" * 63 + "1", prefix * 7 + "x" * 63 + "2")]
    async with aiolock.connect(url) as a, aiolock.connect(url) as b:
        for one, two in pairs:
            assert len(one) <= 512
            la = await a.lock(one, ttl=5).acquire(timeout=0)
            lb = await b.lock(two, ttl=5).acquire(timeout=0)  # not the same lock
            with pytest.raises(aiolock.LockTimeout):
                await b.lock(one, ttl=5).acquire(timeout=0)  # but each one is a lock
            assert (await a.status(two)).token == lb.token
            await la.release()
            await lb.release()


@pytest.mark.parametrize("pair", [("Case", "case"), ("e", "\u00e9"), ("x", "x "), ("ss", "\u00df"),
                                  ("n", "n\x00"), ("\u00c5", "A\u030a")],
                         ids=["case", "accent", "trailing-space", "sharp-s", "nul", "normalization"])
async def test_names_collations_would_confuse_are_distinct(url: str, pair: tuple[str, str]) -> None:
    """Names a case/accent/pad-insensitive collation would equate are different locks,
    each with its own holder record."""
    tag = uuid.uuid4().hex[:8]
    one, two = (f"{tag}{p}" for p in pair)
    async with aiolock.connect(url) as a, aiolock.connect(url) as b:
        la = await a.lock(one, ttl=5, data="one").acquire(timeout=0)
        lb = await b.lock(two, ttl=5, data="two").acquire(timeout=0)
        sa, sb = await a.status(one), await a.status(two)
        assert [h.data for h in sa.held_by] == ["one"]
        assert [h.data for h in sb.held_by] == ["two"]
        assert (sa.token, sb.token) == (la.token, lb.token)
        await la.release()
        assert (await b.status(two)).held
        assert not (await b.status(one)).held
        await lb.release()


@pytest.mark.parametrize("shape", ["short", "max-4-byte"])
async def test_unicode_names(url: str, shape: str) -> None:
    tag = uuid.uuid4().hex[:6]
    name = f"{tag}-\U0001f512-\u540d\u524d-\u00f1" if shape == "short" else tag + "\U0001f512" * 506
    assert len(name) <= 512
    async with aiolock.connect(url) as a, aiolock.connect(url) as b:
        last = 0
        for locks in (a, b, a):
            async with locks.lock(name, ttl=5, data="\u00fc\U0001f600") as lease:
                assert lease.token > last
                last = lease.token
                info = await (b if locks is a else a).status(name)
                assert info.held and info.token == lease.token
                assert [h.data for h in info.held_by] == ["\u00fc\U0001f600"]
                with pytest.raises(aiolock.LockTimeout):
                    await (b if locks is a else a).lock(name, ttl=5).acquire(timeout=0)


async def test_two_modes_keep_their_own_holder_records(mysql_server: Any, name: str) -> None:
    """A name held in both modes at once (two mechanisms): each claim's record is kept."""
    async with aiolock.connect(mysql_server.url) as lk, \
            aiolock.connect(mysql_server.url + "?mode=row") as rw:
        a = await lk.lock(name, ttl=1, data="lock-mode").acquire(timeout=0)
        b = await rw.lock(name, ttl=1, data="row-mode").acquire(timeout=0)
        await asyncio.sleep(0.7)  # renewals of both
        assert not a.lost and not b.lost
        assert [h.data for h in (await lk.status(name)).held_by] == ["lock-mode"]
        assert [h.data for h in (await rw.status(name)).held_by] == ["row-mode"]
        await b.release()
        await asyncio.sleep(0.5)
        assert not a.lost
        assert [h.data for h in (await lk.status(name)).held_by] == ["lock-mode"]
        await a.release()


# -- tokens and mutual exclusion ---------------------------------------------------------


async def test_mutual_exclusion_and_tokens_many_tasks(url: str, name: str) -> None:
    async with aiolock.connect(url) as a, aiolock.connect(url) as b, aiolock.connect(url) as c:
        overlaps, order = await exclusion_run([a, b, c], name, tasks=12, ttl=5)
    assert overlaps == 0
    assert len(order) > 10
    assert all(x < y for x, y in itertools.pairwise(order)), order


async def test_mariadb_scheme_is_the_same_lock(mysql_server: Any, name: str) -> None:
    maria = mysql_server.url.replace("mysql://", "mariadb://", 1)
    async with aiolock.connect(mysql_server.url) as my, aiolock.connect(maria) as ma:
        lease = await ma.lock(name, ttl=5).acquire(timeout=0)
        with pytest.raises(aiolock.LockTimeout):
            await my.lock(name, ttl=5).acquire(timeout=0)
        await lease.release()
        got = await my.lock(name, ttl=5).acquire(timeout=0)
        assert got.token > lease.token
        await got.release()


async def test_tokens_survive_restart_and_leases_are_lost(own_mariadb: Any, mode: str,
                                                          name: str) -> None:
    url = own_mariadb.url + ("?mode=row" if mode == "row" else "")
    ttl = 1.5
    async with aiolock.connect(url) as locks:
        tokens = []
        for _ in range(3):
            async with locks.lock(name, ttl=ttl) as lease:
                tokens.append(lease.token)
        held = await locks.lock(name, ttl=ttl).acquire()
        own_mariadb.restart()
        restarted = time.monotonic()
        await asyncio.wait_for(held.wait_lost(), ttl + 2)
        assert held.lost
        assert time.monotonic() - restarted < ttl / 3 + 1.0
        async with locks.lock(name, ttl=ttl, timeout=5) as lease:
            assert lease.token > held.token > tokens[-1]
    # a new connection after the restart
    async with aiolock.connect(url) as fresh, fresh.lock(name, ttl=ttl, timeout=5) as lease2:
        assert lease2.token > lease.token


# -- losing a lease ----------------------------------------------------------------------


async def test_killed_connection_loses_lease_and_frees_lock(mysql_server: Any, url: str,
                                                            name: str) -> None:
    ttl = 3.0
    async with aiolock.connect(url) as holder, aiolock.connect(url) as other:
        cancelled = False
        with pytest.raises(aiolock.LockLost):
            async with holder.lock(name, ttl=ttl) as lease:
                conns = _holder_conn(mysql_server, name)
                assert conns, "no session id in aiolock_holders"
                _kill(mysql_server, conns)
                killed = time.monotonic()
                got = await other.lock(name, ttl=ttl).acquire(timeout=2)
                freed = time.monotonic() - killed
                try:
                    await asyncio.sleep(ttl * 2)
                except asyncio.CancelledError:
                    cancelled = True
                    raise
        noticed = time.monotonic() - killed
        assert cancelled
        assert freed < 1.0, f"freed {freed:.2f}s after KILL"
        assert noticed < ttl / 3 + 0.7, f"holder noticed after {noticed:.2f}s"
        assert got.token > lease.token
        with contextlib.suppress(aiolock.LockLost):
            await lease.release()  # a lost lease: must not free the new holder
        assert not got.lost
        with pytest.raises(aiolock.LockTimeout):
            await holder.lock(name, ttl=ttl).acquire(timeout=0)
        await got.release()


async def test_paused_holder_cut_off_and_stale_write_refused(mysql_server: Any, url: str,
                                                            children: list[Child],
                                                            name: str) -> None:
    """SIGSTOP a holder process (ttl 1) past its ttl: the server frees the lock within
    ceil(ttl) (+ slack) of the pause, the next holder's token is higher, and the resumed
    holder never writes believing in its lease."""
    ttl = 1.0
    child = await Child.start("worker", "hold", url, name, str(ttl))
    children.append(child)
    old = int((await child.expect("GOT")).split()[1])
    await child.expect("WRITE")
    await asyncio.sleep(0.5)
    child.signal(signal.SIGSTOP)
    paused = time.monotonic()
    fence = old  # the resource's highest token seen
    try:
        async with aiolock.connect(url) as locks:
            lease = await locks.lock(name, ttl=5).acquire(timeout=ttl + 5)
            took = time.monotonic() - paused
            assert lease.token > old
            fence = lease.token
            child.signal(signal.SIGCONT)  # paused > ttl by now: its lease is over
            resumed = time.monotonic()
            believed, stale_accepted = 0, 0
            while True:
                got = await child.line(10)
                if got.startswith("WRITE"):
                    _, tok, at = got.split()
                    if float(at) > resumed:
                        believed += 1
                        stale_accepted += int(tok) >= fence
                elif got.startswith(("LOST", "LOCKLOST")):
                    break
            assert not lease.lost
            await lease.release()
    finally:
        child.signal(signal.SIGCONT)
    assert took < math.ceil(ttl) + 0.6, f"paused holder's lock freed after {took:.2f}s"
    assert stale_accepted == 0
    assert believed == 0, f"{believed} writes after resuming, believing a lease past its ttl"


async def test_killed_holder_process_frees_at_once(url: str, children: list[Child],
                                                  name: str) -> None:
    """kill -9 of a holder process: its connection drops, the server frees the lock at
    once; a waiter already waiting gets it well before the 30 s ttl."""
    child = await Child.start("worker", "hold", url, name, "30")
    children.append(child)
    token = int((await child.expect("GOT")).split()[1])
    async with aiolock.connect(url) as locks:
        waiter = asyncio.create_task(locks.lock(name, ttl=5).acquire(timeout=10))
        await asyncio.sleep(0.3)
        assert not waiter.done()
        child.signal(signal.SIGKILL)
        killed = time.monotonic()
        lease = await waiter
        took = time.monotonic() - killed
        assert lease.token > token
        await lease.release()
    assert took < 1.5, f"taken over {took:.2f}s after kill -9"


async def test_watchdog_keeps_lease_several_ttls(url: str, name: str) -> None:
    async with aiolock.connect(url) as locks, aiolock.connect(url) as other:
        await held_for(locks, other, name, ttl=0.6, seconds=1.6, step=0.2)


# -- waiting, trying, cancelling ---------------------------------------------------------


async def test_try_lock_returns_promptly(url: str, name: str) -> None:
    async with aiolock.connect(url) as a, aiolock.connect(url) as b, aiolock.connect(url) as c:
        held = await a.lock(name, ttl=10).acquire()
        waiter = asyncio.create_task(b.lock(name, ttl=5).acquire(timeout=10))
        await asyncio.sleep(0.2)
        for locks in (b, c):
            for _ in range(3):
                start = time.monotonic()
                with pytest.raises(aiolock.LockTimeout):
                    await locks.lock(name, ttl=1).acquire(timeout=0)
                assert time.monotonic() - start < 0.5
        start = time.monotonic()
        with pytest.raises(aiolock.LockTimeout):
            await c.lock(name, ttl=1).acquire(timeout=0.3)
        assert time.monotonic() - start < 0.9
        await held.release()
        got = await asyncio.wait_for(waiter, 2)
        assert got.token > held.token
        await got.release()


async def test_cancelled_waiter_is_never_granted_later(url: str, name: str) -> None:
    async with aiolock.connect(url) as a, aiolock.connect(url) as b, aiolock.connect(url) as c:
        for delay in (0.0, 0.001, 0.01, 0.05, 0.2):
            held = await a.lock(name, ttl=10).acquire()
            task = asyncio.create_task(b.lock(name, ttl=10).acquire())
            await asyncio.sleep(delay)
            task.cancel()
            res = await asyncio.gather(task, return_exceptions=True)
            assert isinstance(res[0], asyncio.CancelledError), res
            await held.release()
            await asyncio.sleep(0.05)
            got = await c.lock(name, ttl=10).acquire(timeout=0.5)
            await got.release()


async def test_cancellation_at_random_points_never_leaks(url: str, name: str) -> None:
    async with aiolock.connect(url) as locks, aiolock.connect(url) as other:
        lock = locks.lock(name, ttl=30)
        for steps in range(0, 80, 4):
            await acquire_cancelled_after(lock, steps)
            got = await other.lock(name, ttl=30).acquire(timeout=0.5)
            await got.release()


async def test_release_cancelled_at_random_points(url: str, name: str) -> None:
    async with aiolock.connect(url) as locks, aiolock.connect(url) as other:
        for steps in range(0, 40, 3):
            lease = await locks.lock(name, ttl=30).acquire()
            task = asyncio.create_task(lease.release())
            for _ in range(steps):
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await lease.release()
            got = await other.lock(name, ttl=30).acquire(timeout=2)
            assert got.token > lease.token
            await got.release()


# -- what each mode offers, options, errors -------------------------------------------


async def test_capabilities_honest(url: str, mode: str, name: str) -> None:
    async with aiolock.connect(url) as locks:
        caps = locks.capabilities
        assert C.FAIR not in caps and C.RWLOCK not in caps
        with pytest.raises(ValueError):
            locks.lock(name, fair=True)
        with pytest.raises(ValueError):
            locks.rwlock(name)
        if mode == "row":
            assert C.SEMAPHORE not in caps
            with pytest.raises(ValueError):
                locks.semaphore(name, limit=2)
        else:
            sem = locks.semaphore(name, limit=2)
            async with aiolock.connect(url) as other:
                one = await sem.acquire(timeout=0)
                two = await other.semaphore(name, limit=2).acquire(timeout=0)
                with pytest.raises(aiolock.LockTimeout):
                    await other.semaphore(name, limit=2).acquire(timeout=0)
                assert one.token != two.token
                await one.release()
                await two.release()


@pytest.mark.parametrize("query", [
    "mode=rows", "mode=", "mode=lock&mode=row", "max_connections=0",
    "max_connections=-1", "max_connections=abc", "max_connections=1.5", "connect_timeout=-1",
    "connect_timeout=0", "connect_timeout=nan", "request_timeout=abc", "request_timeout=inf",
    "pool_timeout=-2", "poll_interval=0", "poll_interval=-1", "bogus=1", "Mode=row",
    "mode=row&bogus=", "bogus=",
])
async def test_bad_options_refused(mysql_server: Any, query: str) -> None:
    with pytest.raises(ValueError) as err:
        async with aiolock.connect(f"{mysql_server.url}?{query}") as locks:
            await locks.lock("x", ttl=1).acquire(timeout=0)
    assert SECRET not in str(err.value)


@pytest.mark.parametrize("kwargs", [
    {"mode": "rows"}, {"mode": None}, {"max_connections": 0}, {"connect_timeout": -1},
    {"poll_interval": 0}, {"bogus": 1}, {"max_connections": True},
], ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
async def test_bad_keyword_options_refused(mysql_server: Any, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError) as err:
        async with aiolock.connect(mysql_server.url, **kwargs) as locks:
            await locks.lock("x", ttl=1).acquire(timeout=0)
    assert SECRET not in str(err.value)


async def test_mode_error_names_accepted_values(mysql_server: Any) -> None:
    with pytest.raises(ValueError) as err:
        async with aiolock.connect(mysql_server.url + "?mode=table"):
            pass
    assert "lock" in str(err.value) and "row" in str(err.value)


async def test_wrong_password_access_denied(mysql_server: Any, caplog: Any) -> None:
    caplog.set_level("DEBUG")
    url = mysql_server.url.replace(SECRET, SECRET + "x")
    with pytest.raises(aiolock.AccessDenied) as err:
        async with aiolock.connect(url) as locks:
            await locks.lock("x", ttl=1).acquire(timeout=0)
    assert SECRET not in str(err.value) and SECRET not in caplog.text


@pytest.mark.parametrize("size", [1, 2])
async def test_max_connections_n_holds_n_leases(mysql_server: Any, mode: str, size: int,
                                                name: str) -> None:
    """"every held lease keeps one connection": a pool of n holds n leases; the next
    acquire fails within pool_timeout (not later), and works once they are released."""
    url = mysql_server.url + f"?max_connections={size}&pool_timeout=0.3&mode={mode}"
    async with aiolock.connect(url) as locks:
        held = [await locks.lock(f"{name}-{i}", ttl=5).acquire(timeout=0) for i in range(size)]
        start = time.monotonic()
        with pytest.raises((aiolock.BackendUnavailable, aiolock.LockTimeout)):
            await locks.lock(f"{name}-x", ttl=5).acquire(timeout=3)
        assert time.monotonic() - start < 2.0
        for lease in held:
            await lease.release()
        async with locks.lock(f"{name}-x", ttl=5, timeout=1):
            pass


@pytest.mark.parametrize("ttl", [0.001, 2_000_000])
async def test_ttl_extremes(url: str, ttl: float, name: str) -> None:
    async with aiolock.connect(url) as locks, aiolock.connect(url) as other:
        lease = await locks.lock(name, ttl=ttl, watchdog=False).acquire(timeout=0)
        if ttl >= 1:
            with pytest.raises(aiolock.LockTimeout):
                await other.lock(name, ttl=1).acquire(timeout=0)
            assert not lease.lost
        else:
            await asyncio.sleep(0.05)
            assert lease.lost
        await lease.release()
        async with other.lock(name, ttl=1, timeout=2.5):
            pass


# -- more: server-side kills of waiters, races on first use, a frozen server -------------


def _sessions(server: Any, like: str) -> list[int]:
    out = server.sql("SELECT ID FROM information_schema.PROCESSLIST WHERE USER = 'aiolock' "
                     f"AND INFO LIKE '{like}'")
    return [int(x) for x in out.split()]


@pytest.mark.parametrize("what", ["CONNECTION", "QUERY"])
async def test_waiter_whose_connection_is_killed_does_not_hang(mysql_server: Any, url: str,
                                                              mode: str, what: str,
                                                              name: str) -> None:
    """KILL the waiting claim's connection (or its statement) on the server: once the
    lock frees, the waiter gets it (or fails at once); it never sits out its timeout with
    the lock free."""
    async with aiolock.connect(url) as a, aiolock.connect(url) as b:
        held = await a.lock(name, ttl=10).acquire()
        task = asyncio.create_task(b.lock(name, ttl=10).acquire(timeout=8))
        like = "%GET_LOCK%" if mode == "lock" else "%FOR UPDATE%"
        for _ in range(50):
            waiting = _sessions(mysql_server, like)
            if waiting:
                break
            await asyncio.sleep(0.05)
        assert waiting, "no waiting statement on the server"
        for conn in waiting:
            mysql_server.sql(f"KILL {what} {conn}")
        await asyncio.sleep(0.3)
        await held.release()
        released = time.monotonic()
        try:
            got = await task
        except aiolock.LockTimeout:
            raise AssertionError(f"waiter hung {time.monotonic() - released:.1f}s "
                                 "with the lock free") from None
        except aiolock.LockError as exc:  # an error, at once, is acceptable
            assert not isinstance(exc, aiolock.LockTimeout)
            got = None
        assert time.monotonic() - released < 1.5
        if got is not None:
            assert got.token > held.token
            await got.release()
        async with a.lock(name, ttl=1, timeout=1):
            pass


async def test_status_after_holder_session_killed(mysql_server: Any, url: str, name: str) -> None:
    async with aiolock.connect(url) as a, aiolock.connect(url) as b:
        lease = await a.lock(name, ttl=10).acquire()
        assert (await b.status(name)).held
        _kill(mysql_server, _holder_conn(mysql_server, name))
        await asyncio.sleep(0.2)
        info = await b.status(name)
        assert not info.held, info
        with contextlib.suppress(aiolock.LockLost):
            await lease.release()


async def test_timed_out_waiter_never_granted_later(url: str, name: str) -> None:
    async with aiolock.connect(url) as a, aiolock.connect(url) as b, aiolock.connect(url) as c:
        for wait in (0.05, 0.4):
            held = await a.lock(name, ttl=10).acquire()
            start = time.monotonic()
            with pytest.raises(aiolock.LockTimeout):
                await b.lock(name, ttl=10).acquire(timeout=wait)
            assert time.monotonic() - start < wait + 0.5
            await held.release()
            got = await c.lock(name, ttl=10).acquire(timeout=0.5)
            await got.release()


async def test_first_use_race_one_winner(url: str, name: str) -> None:
    """Many connections try a never-used name at once: exactly one wins, the others are
    busy (no duplicate-key LockError from creating the name's rows)."""
    conns = [aiolock.connect(url) for _ in range(8)]
    try:
        for locks in conns:
            await locks.__aenter__()
        for round_ in range(3):
            fresh = f"{name}-{round_}"
            results = await asyncio.gather(
                *(c.lock(fresh, ttl=5).acquire(timeout=0) for c in conns), return_exceptions=True)
            leases = [r for r in results if isinstance(r, aiolock.Lease)]
            others = [r for r in results if not isinstance(r, aiolock.Lease)]
            assert len(leases) == 1, results
            assert all(isinstance(r, aiolock.LockTimeout) for r in others), others
            await leases[0].release()
            waited = await asyncio.gather(
                *(c.lock(f"{fresh}-w", ttl=5).acquire(timeout=5) for c in conns[:1]))
            await waited[0].release()
    finally:
        for locks in conns:
            await locks.__aexit__(None, None, None)


async def test_first_use_race_waiting(url: str, name: str) -> None:
    """Many connections wait for a never-used name at once: all get it, one at a time."""
    inside = 0
    tokens: list[int] = []

    async def one(locks: aiolock.Locks) -> None:
        nonlocal inside
        async with locks.lock(name, ttl=5, timeout=10) as lease:
            inside += 1
            assert inside == 1
            tokens.append(lease.token)
            await asyncio.sleep(0.01)
            inside -= 1

    conns = [aiolock.connect(url) for _ in range(6)]
    try:
        await asyncio.gather(*(one(c) for c in conns))
    finally:
        for locks in conns:
            await locks.aclose()
    assert len(tokens) == 6 and tokens == sorted(set(tokens))


async def test_frozen_server_bounded(own_mariadb: Any, mode: str, name: str) -> None:
    """SIGSTOP the server: a held lease is lost by its last confirmed expiry, a new acquire
    fails within request_timeout (+ slack); after SIGCONT it works again."""
    url = own_mariadb.url + f"?mode={mode}&request_timeout=1&connect_timeout=1"
    ttl = 1.2
    async with aiolock.connect(url) as locks:
        lease = await locks.lock(name, ttl=ttl).acquire()
        own_mariadb.pause()
        paused = time.monotonic()

        async def lost_after() -> float:
            await lease.wait_lost()
            return time.monotonic() - paused

        try:
            watch = asyncio.create_task(asyncio.wait_for(lost_after(), ttl + 1.5))
            start = time.monotonic()
            with pytest.raises(aiolock.BackendUnavailable):
                await locks.lock(f"{name}-x", ttl=ttl).acquire(timeout=0)
            assert time.monotonic() - start < 2.5
            assert await watch < ttl + 0.3
        finally:
            own_mariadb.resume()
        async with locks.lock(name, ttl=ttl, timeout=5) as again:
            assert again.token > lease.token
