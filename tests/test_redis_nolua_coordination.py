"""Redis without scripting (SPEC §6): elections, listing and revocation (SPEC §7, §8) as
WATCH/MULTI/EXEC transactions, against the Lua path on the same keys.

The server and users of ``tests/test_redis_nolua.py`` (its fixtures ``server``, ``nolua``
and ``lua``): ``nolua`` is the ACL user without ``@scripting`` (it falls back by itself),
``txn`` the default user with ``?scripting=off``, ``lua`` the default user on the Lua
scripts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import aiolock
from aiolock.backends._redis_txn import RedisTxnBackend

from .adversarial.conftest import acl_redis  # noqa: F401 -- a fixture
from .adversarial.servers import PasswordRedis
from .adversarial_coordination.helpers import eventually
from .adversarial_coordination.test_election_procs import observing, one_leader_at_a_time
from .test_redis_nolua import acl_server, lua_url, nolua_url  # noqa: F401 -- fixtures


@pytest.fixture
def txn(server: PasswordRedis) -> str:
    """The default user with scripting=off, on aiolock's own connections."""
    return f"redis://127.0.0.1:{server.port}/0?scripting=off"


async def _hold(lock: aiolock.Lock, entered: asyncio.Event, tokens: list[int]) -> None:
    """Hold ``lock`` (a lock or a campaign) until the block ends (a loss ends it)."""
    async with lock as lease:
        tokens.append(lease.token)
        entered.set()
        await asyncio.sleep(30)


async def test_user_without_scripting_campaigns_scans_and_revokes(nolua: str, name: str) -> None:
    """The ACL user without @scripting (the automatic fallback): campaign, leader, proclaim,
    scan and force_release, each seen by another connection; the revoked leader and lock
    holder learn it at their next renewal (ttl/3) as a revocation."""
    async with asyncio.timeout(20), aiolock.connect(nolua) as locks, \
            aiolock.connect(nolua) as other:
        assert type(locks.backend) is type(other.backend) is RedisTxnBackend
        election, lock = locks.election(name, ttl=0.6), locks.lock(name + ":x", ttl=0.6)
        entered, tokens = asyncio.Event(), []
        term = await election.campaign(data="a").acquire()
        leader = await other.election(name).leader()
        assert leader is not None and (leader.data, leader.token) == ("a", term.token)
        await term.proclaim("b")
        leader = await other.election(name).leader()
        assert leader is not None and leader.data == "b"
        holder = asyncio.create_task(_hold(lock, entered, tokens))
        await entered.wait()
        found = {i.name: i async for i in other.scan(name)}
        assert {k: (i.family, i.held_by[0].data) for k, i in found.items()} == {
            name: ("elect", "b"), name + ":x": ("lock", "")}
        assert await other.lock(name + ":x").force_release() is True
        assert await other.election(name).campaign().force_release() is True
        with pytest.raises(aiolock.LockLost, match="revoked"):
            await asyncio.wait_for(holder, 2)
        await asyncio.wait_for(term.wait_lost(), 2)
        with pytest.raises(aiolock.LockLost):
            await term.proclaim("c")
        assert [i async for i in other.scan(name)] == []
        async with election.campaign(data="next") as again:  # terms keep increasing
            assert again.token > term.token
        assert await other.lock(name + ":x").force_release() is False


@pytest.mark.parametrize(("revoker", "waiter_path"),
                         [("txn", "txn"), ("txn", "lua"), ("lua", "lua"), ("lua", "txn")])
async def test_revocation_is_seen_across_paths(
    txn: str, lua: str, name: str, revoker: str, waiter_path: str,
) -> None:
    """A holder (a lock, then a leader) of one path revoked through the other: lost as
    revoked within ttl/3 (+ slack); a waiter gets it at once, its token higher (a
    registered waiter of the Lua path is handed it, by either path's revocation; the
    transaction path's waiters are woken on the channel): without that it would wait
    for the holder's lease, at least 1.2 s of its 1.8 s ttl: 0.9 s leaves room for the
    rest of the suite running beside it."""
    async with asyncio.timeout(20), aiolock.connect(txn) as tx, aiolock.connect(lua) as ls:
        holding, revoking = (ls, tx) if revoker == "txn" else (tx, ls)
        waiting = tx if waiter_path == "txn" else ls
        for make in (lambda c: c.lock(name, ttl=1.8),
                     lambda c: c.election(name, ttl=1.8).campaign(data="d")):
            entered, tokens = asyncio.Event(), []
            holder = asyncio.create_task(_hold(make(holding), entered, tokens))
            await entered.wait()
            waiter = asyncio.create_task(make(waiting).acquire(timeout=5))
            await asyncio.sleep(0.1)  # waiting (subscribed, or registered)
            revoked = time.monotonic()
            assert await make(revoking).force_release() is True
            second = await asyncio.wait_for(waiter, 3)
            assert time.monotonic() - revoked < 0.9
            assert second.token > tokens[0]
            with pytest.raises(aiolock.LockLost, match="revoked"):
                await asyncio.wait_for(holder, 3)
            assert time.monotonic() - revoked < 1.8 / 3 + 0.5
            await second.release()


async def test_proclaim_seen_by_an_observer_of_the_other_path(
    txn: str, lua: str, name: str,
) -> None:
    """ttl 30 s: observe() reads again at least every 15 s, so what it sees within a
    second came by the name's signal -- a grant, a proclaim, a resignation -- sent by the
    other path."""
    async with asyncio.timeout(20), aiolock.connect(txn) as tx, aiolock.connect(lua) as ls:
        for leading, watching in ((tx, ls), (ls, tx)):
            async with observing(watching.election(name, ttl=30)) as seen:
                await eventually(_last_seen(seen, None), 1.0)
                term = await leading.election(name, ttl=30).campaign(data="one").acquire()
                await eventually(_last_seen(seen, "one"), 1.0)
                await term.proclaim("two")
                await eventually(_last_seen(seen, "two"), 1.0)
                await term.release()
                await eventually(_last_seen(seen, None), 1.0)


def _last_seen(
    seen: list[aiolock.Leader | None], data: str | None,
) -> Callable[[], Awaitable[bool]]:
    """Whether ``observe()``'s last value (in ``seen``) is a leader with ``data``, or
    vacant (``data`` None)."""

    async def check() -> bool:
        if not seen:
            return False
        last = seen[-1]
        return last is None if data is None else last is not None and last.data == data

    return check


def _listed(infos: list[aiolock.LockInfo]) -> dict[str, Any]:
    """What scan says, without the times (which move between two reads)."""
    return {i.name: (i.family, i.held, i.holders, i.token, i.last_token, i.waiters,
                     sorted((h.host, h.pid, h.task, h.data) for h in i.held_by))
            for i in infos}


async def test_scan_agrees_with_the_lua_path(txn: str, lua: str, name: str) -> None:
    """The same data -- held through both paths, every kind the Lua path has, a waiter
    registered -- listed by both paths alike (times within a second)."""
    async with asyncio.timeout(20), aiolock.connect(txn) as tx, aiolock.connect(lua) as ls:
        held = [await ls.lock(f"{name}:a", data="A").acquire(),
                await tx.lock(f"{name}:b", data="B").acquire(),
                await ls.rwlock(f"{name}:c").read().acquire(),
                await ls.rwlock(f"{name}:d").write().acquire(),
                *[await ls.semaphore(f"{name}:e", 3, data=f"P{i}").acquire() for i in range(2)],
                await tx.election(f"{name}:f").campaign(data="F").acquire(),
                await ls.election(f"{name}:g").campaign(data="G").acquire()]
        waiting = asyncio.create_task(ls.lock(f"{name}:b").acquire(timeout=5))
        await asyncio.sleep(0.2)  # registered in the queue of {name}:b
        found = {path: [i async for i in locks.scan(name)] for path, locks in (("txn", tx),
                                                                              ("lua", ls))}
        assert _listed(found["txn"]) == _listed(found["lua"])
        assert len(found["txn"]) == 7 and _listed(found["txn"])[f"{name}:b"][5] == 1
        for a, b in zip(sorted(found["txn"], key=lambda i: i.name),
                        sorted(found["lua"], key=lambda i: i.name), strict=True):
            assert a.ttl_left is not None and b.ttl_left is not None
            assert abs(a.ttl_left - b.ttl_left) < 1
            for x, y in zip(a.held_by, b.held_by, strict=True):
                assert x.since is not None and y.since is not None and abs(x.since - y.since) < 1
        for lease in held:
            await lease.release()
        await (await waiting).release()
        assert [i async for i in tx.scan(name)] == []


async def test_one_leader_at_a_time_across_processes_and_paths(
    nolua: str, lua: str, name: str,
) -> None:
    """Three candidate processes of two tasks each on one election: two on transactions
    (the user without @scripting), one on the Lua path (fair, registered waiters)."""
    terms = await one_leader_at_a_time([nolua, nolua, lua], name)
    assert len(terms) >= 6
