"""status() / scan() / leader() against the leases actually granted (SPEC 7, 8;
README "Coordination"). Written from README.md, SPEC.md and docs/ only."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import pytest

import aiolock
from aiolock import Capability

from ..conftest import need
from ..scenarios import Scenario
from .conftest import Ledger, from_info, from_leader, judge, rows

C = Capability
CHILD = Path(__file__).parent / "_churn_child.py"
ROOT = Path(__file__).parents[2]


def _ttl_bound(ttl: float) -> float:
    """The longest ``ttl_left`` a fresh lease may show: whole-second expiries
    (Memcached, etcd) round up, plus slack."""
    return max(math.ceil(ttl), 1) + 2.0


# ---------------------------------------------------------------------------- right after a grant


@rows(C.HOLDERS, default=("redlock",))  # pin: the race class found on Redlock's leader()
async def test_status_right_after_grant_is_that_lease(
        scenario: Scenario, conns: list[aiolock.Locks], name: str) -> None:
    """acquire() returned: status() from the granting and from another connection shows
    that lease's token and holder record (data, pid, task), and after release() the name
    is free with last_token >= the released token (ZooKeeper's page promises no
    last_token once the name is free: None is accepted there)."""
    me = asyncio.current_task()
    assert me is not None
    previous = -1
    for i in range(12):
        mine, other = conns[i % 2], conns[(i + 1) % 2]
        data = f"grant-{i}"
        lease = await mine.lock(name, ttl=5, data=data).acquire(timeout=10)
        try:
            assert lease.token > previous, f"token {lease.token} after {previous}"
            previous = lease.token
            assert lease.holder.data == data
            for who, conn in (("same", mine), ("other", other)):
                info = await conn.status(name)
                assert info.held, f"round {i}, {who} connection: not held right after a grant: {info}"
                assert info.token == lease.token, (
                    f"round {i}, {who} connection: status().token {info.token}, lease.token {lease.token}")
                assert len(info.held_by) == 1, f"round {i}, {who}: held_by {info.held_by}"
                h = info.held_by[0]
                assert (h.data, h.pid, h.task) == (data, os.getpid(), me.get_name()), (
                    f"round {i}, {who}: holder {h}, expected data {data!r} pid {os.getpid()} "
                    f"task {me.get_name()!r}")
                assert info.last_token is None or info.last_token >= lease.token, (
                    f"round {i}, {who}: last_token {info.last_token} < held token {lease.token}")
                assert info.ttl_left is not None and 0 < info.ttl_left <= _ttl_bound(5), (
                    f"round {i}, {who}: ttl_left {info.ttl_left} right after a grant of ttl 5")
        finally:
            await lease.release()
        for who, conn in (("same", mine), ("other", other)):
            info = await conn.status(name)
            assert not info.held and not info.held_by, f"round {i}, {who}: held after release: {info}"
            if info.last_token is None and scenario.id == "zookeeper":
                continue
            assert info.last_token is not None and info.last_token >= lease.token, (
                f"round {i}, {who}: last_token {info.last_token} after releasing token {lease.token}")


@rows(C.ELECTION, default=("redlock",))  # pin: leader().token right after a grant on Redlock
async def test_leader_right_after_campaign_is_that_term(conns: list[aiolock.Locks], name: str) -> None:
    """campaign granted: leader() from the same and another connection shows that term's
    token and data; proclaim() returned: another connection's leader() shows the new data,
    same token; resigned: nobody leads."""
    previous = -1
    for i in range(10):
        mine, other = conns[i % 2], conns[(i + 1) % 2]
        data = f"cand-{i}"
        term = await mine.election(name, ttl=5).campaign(data=data).acquire(timeout=10)
        try:
            assert term.token > previous, f"term {term.token} after {previous}"
            previous = term.token
            for who, conn in (("same", mine), ("other", other)):
                leader = await conn.election(name, ttl=5).leader()
                assert leader is not None, f"round {i}, {who}: no leader right after a granted campaign"
                assert leader.token == term.token, (
                    f"round {i}, {who}: leader().token {leader.token}, term.token {term.token}")
                assert (leader.data, leader.holder.data) == (data, data), (
                    f"round {i}, {who}: leader data {leader.data!r} / holder {leader.holder.data!r}, "
                    f"campaigned with {data!r}")
                assert leader.holder.pid == os.getpid()
            await term.proclaim(data + "/p")
            for who, conn in (("same", mine), ("other", other)):
                leader = await conn.election(name, ttl=5).leader()
                assert leader is not None and leader.token == term.token, (
                    f"round {i}, {who}: after proclaim leader {leader}, term {term.token}")
                assert (leader.data, leader.holder.data) == (data + "/p", data + "/p"), (
                    f"round {i}, {who}: after proclaim({data + '/p'!r}) leader data {leader.data!r} "
                    f"/ holder {leader.holder.data!r}")
        finally:
            await term.release()
        for who, conn in (("same", mine), ("other", other)):
            leader = await conn.election(name, ttl=5).leader()
            assert leader is None, f"round {i}, {who}: leader {leader} after the only leader resigned"


@rows(C.SCAN)
async def test_scan_right_after_grant_lists_that_lease(conns: list[aiolock.Locks], name: str) -> None:
    """A held lock and a led election, each listed by scan() from another connection with
    its lease's token and data; gone from the listing once released."""
    lease = await conns[0].lock(name + ":l", ttl=5, data="scan-lock").acquire(timeout=10)
    term = await conns[1].election(name + ":e", ttl=5).campaign(data="scan-elect").acquire(timeout=10)
    try:
        listed = {(info.name, info.family): info async for info in conns[2].scan(prefix=name)}
        mine = {key: info for key, info in listed.items() if key[0] == name + ":l"}
        theirs = {key: info for key, info in listed.items() if key[0] == name + ":e"}
        assert len(mine) == 1 and len(theirs) == 1, f"scan listed {sorted(listed)}"
        (li,), (ei,) = mine.values(), theirs.values()
        assert li.held and li.token == lease.token and [h.data for h in li.held_by] == ["scan-lock"], (
            f"lock listed as {li}, lease token {lease.token}")
        assert ei.held and ei.token == term.token and [h.data for h in ei.held_by] == ["scan-elect"], (
            f"election listed as {ei}, term token {term.token}")
    finally:
        await lease.release()
        await term.release()
    left = [info async for info in conns[2].scan(prefix=name)]
    assert not left, f"still listed after release: {left}"


# ---------------------------------------------------------------------------- churn, one process


async def _monitor(ledger: Ledger, conn: aiolock.Locks, name: str, election: bool, stop: asyncio.Event,
                   scan: bool) -> None:
    i = 0
    while not stop.is_set():
        i += 1
        t0 = time.monotonic()
        if election:
            ledger.seen.append(from_leader(await conn.election(name, ttl=5).leader(), t0))
        else:
            ledger.seen.append(from_info(await conn.status(name), "status", t0))
        if scan and i % 3 == 0:
            t0 = time.monotonic()
            found = [info async for info in conn.scan(prefix=name) if info.name == name]
            assert len(found) <= 1, f"scan listed {name} {len(found)} times: {found}"
            ledger.seen.append(from_info(found[0] if found else None, "scan", t0))
        await asyncio.sleep(0)


async def _churn_lock(ledger: Ledger, conn: aiolock.Locks, name: str, tag: str, end: float) -> None:
    i = 0
    while time.monotonic() < end:
        i += 1
        data = f"{tag}-{i}"
        lease = await conn.lock(name, ttl=5, data=data).acquire(timeout=30)
        ledger.grant(lease.token, data)
        await asyncio.sleep(0.002)
        await lease.release()


async def _churn_election(ledger: Ledger, conn: aiolock.Locks, name: str, tag: str, end: float) -> None:
    i = 0
    while time.monotonic() < end:
        i += 1
        data = f"{tag}-{i}"
        term = await conn.election(name, ttl=5).campaign(data=data).acquire(timeout=30)
        ledger.grant(term.token, data, data + "/p")
        await asyncio.sleep(0.001)
        await term.proclaim(data + "/p")
        await asyncio.sleep(0.001)
        await term.release()


async def _churn_one_process(scenario: Scenario, conns: list[aiolock.Locks], name: str,
                             election: bool) -> None:
    """2 connections x 2 tasks hand the name around for 2.5 s; a monitor on a third
    connection polls status()/leader() (and scan()): every observation is judged."""
    ledger = Ledger()
    stop = asyncio.Event()
    end = time.monotonic() + 2.5
    churn = _churn_election if election else _churn_lock
    scan = C.SCAN in conns[2].capabilities
    monitor = asyncio.create_task(_monitor(ledger, conns[2], name, election, stop, scan))
    try:
        await asyncio.gather(*(churn(ledger, conns[c], name, f"c{c}t{t}", end)
                               for c in range(2) for t in range(2)))
    finally:
        stop.set()
        await monitor
    _report(scenario, ledger)


def _report(scenario: Scenario, ledger: Ledger) -> None:
    assert len(ledger.grants) >= 5, f"too few grants to judge: {len(ledger.grants)}"
    bad = judge(ledger, holders_promised=True, last_monotonic=not scenario.id.startswith("redlock"))
    held = sum(s.held for s in ledger.seen)
    kinds = sorted({re.sub(r"\d+", "N", re.sub(r" \(.*", "", b)) for b in bad})
    assert not bad, (f"{scenario.id}: {len(bad)} bad of {len(ledger.seen)} observations "
                     f"({held} held, {len(ledger.grants)} grants); kinds {kinds}; first: "
                     + "\n".join(bad[:8]))


#: FOUND (2026-11-27, 2 connections x 2 tasks, 2.5 s; runs: 4 full-folder on 2 xdist
#: workers + 7 default on 1 worker; every row below failed 11 of 11, redlock 10 of 11):
#: - redlock: status()/scan() show a held token that no lease was granted, with the data
#:   of the lease whose acquire returned the next token (e.g. "held token 633, data
#:   c1t0-315", that acquire returned 634) or the previous one (token 6 shown, its lease
#:   got 5); held tokens and last_token go back between two successive calls of one
#:   monitor (last_token 26 -> 25; held 78 then 75). 1 to 97 bad observations a run;
#: - postgres, postgres-row, mysql, mysql-row: held=True with token None and no holder
#:   record (held_by empty), hundreds of observations a run, while a grant is in flight;
#:   mysql-row also held=True with the coming lease's token but no holder record;
#: - memcached: held=True with token None (the coming lease's record is shown).
#: Fixed: reads that show a grant half made are made again (aiolock/_settle.py); Redlock's
#: last_token is documented as the highest count of the majority that answered.
@rows(C.HOLDERS, default=("redlock", "postgres", "postgres-row", "mysql", "mysql-row", "memcached"))
async def test_churn_lock_monitor_sees_only_granted_leases(
        scenario: Scenario, conns: list[aiolock.Locks], name: str) -> None:
    await _churn_one_process(scenario, conns, name, election=False)


#: FOUND (same runs): redlock 10 of 11; mysql-row 10 of 10 (one run errored: MariaDB's
#: install-db failed in the session fixture); mysql 6 of 6 (4 full + 2 default runs):
#: - redlock: leader() shows a term no campaign was granted, with the data of the term
#:   granted next (leader token 86, data "c1t1-13", whose campaign returned 87), and a
#:   term lower than one already seen (leader token 15 after 16);
#: - mysql-row: leader() shows the coming term's token with data "" (its campaign set
#:   "c0t0-1"): a record that is not that lease's; also held with no token in status();
#: - mysql: scan() lists the election held with no token and no holder record.
#: Fixed as above.
@rows(C.HOLDERS, C.ELECTION, default=("redlock", "mysql", "mysql-row"))
async def test_churn_election_monitor_sees_only_granted_terms(
        scenario: Scenario, conns: list[aiolock.Locks], name: str) -> None:
    await _churn_one_process(scenario, conns, name, election=True)


# ---------------------------------------------------------------------------- churn, two processes


#: slow tier: the same defects as the one-process churn above, across processes (4 of 4
#: full runs: lock on redlock, postgres, postgres-row, memcached, mysql, mysql-row;
#: election on redlock, mysql, mysql-row); passes on the other rows
@rows(C.HOLDERS, C.DISTRIBUTED)
@pytest.mark.parametrize("kind", ["lock", "election"])
async def test_churn_two_processes_monitor_sees_only_granted_leases(
        scenario: Scenario, backend_url: str, conns: list[aiolock.Locks], name: str, kind: str,
        tmp_path: Path) -> None:
    """2 processes x 2 tasks hand the name around for 3 s, recording every grant in a
    file; the monitor here polls status()/leader() (and scan()) meanwhile."""
    election = kind == "election"
    if election:
        need(conns[0], C.ELECTION)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    files = [tmp_path / f"grants-{p}.jsonl" for p in range(2)]
    children = []
    try:
        for p, f in enumerate(files):
            children.append(await asyncio.create_subprocess_exec(
                sys.executable, str(CHILD), backend_url, name, kind, "2", "3", str(f), f"p{p}",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env))
        for child in children:
            assert child.stdout is not None
            line = await asyncio.wait_for(child.stdout.readline(), 30)
            assert line.startswith(b"READY"), line
        ledger = Ledger()
        stop = asyncio.Event()
        scan = C.SCAN in conns[2].capabilities
        monitor = asyncio.create_task(_monitor(ledger, conns[2], name, election, stop, scan))
        for child in children:
            assert child.stdin is not None
            child.stdin.write(b"GO\n")
            await child.stdin.drain()
        try:
            for child in children:
                _out, err = await asyncio.wait_for(child.communicate(), 60)
                assert child.returncode == 0, err.decode(errors="replace")[-3000:]
        finally:
            stop.set()
            await monitor
    finally:
        for child in children:
            if child.returncode is None:
                child.kill()
                await child.wait()
    for f in files:
        for row in map(json.loads, f.read_text().splitlines()):
            assert row[0] not in ledger.grants, (
                f"token {row[0]} granted twice: {row} and {ledger.grants[row[0]]}")
            ledger.grant(row[0], *row[1:])
    _report(scenario, ledger)


# ---------------------------------------------------------------------------- revocation


@rows(C.REVOKE, default=("redis",))  # pin
async def test_force_release_revoked_holder_learns_and_next_token_is_higher(
        scenario: Scenario, conns: list[aiolock.Locks], name: str) -> None:
    """force_release() while held: True; the holder's body is cancelled and its block
    raises LockLost within ttl/3 (+ slack); status() no longer shows its token; the next
    holder gets a higher token, shown by status() from another connection."""
    ttl = 3.0
    granted = asyncio.Event()
    token: list[int] = []

    async def hold() -> str:
        try:
            async with conns[0].lock(name, ttl=ttl, data="victim") as lease:
                token.append(lease.token)
                granted.set()
                await asyncio.sleep(60)
        except aiolock.LockLost:
            return "lost"
        return "ended"

    holder = asyncio.create_task(hold())
    await asyncio.wait_for(granted.wait(), 10)
    revoked_at = time.monotonic()
    assert await conns[2].lock(name).force_release() is True
    # the revoked holder may keep the server-side claim until its next renewal (MySQL,
    # PostgreSQL pages), but its record is gone
    info = await conns[2].status(name)
    assert "victim" not in [h.data for h in info.held_by], f"revoked holder still listed: {info}"
    assert info.token is None or info.token >= token[0], f"status after revoking {token[0]}: {info}"
    if not (info.last_token is None and scenario.id == "zookeeper"):  # no last_token promised there
        assert info.last_token is not None and info.last_token >= token[0], (
            f"last_token {info.last_token} after revoking token {token[0]}")
    # the documented bound: the next renewal, within ttl/3; Memcached/etcd round to seconds
    bound = ttl / 3 + (2.5 if scenario.id in ("memcached", "etcd", "etcd-cluster") else 1.0)
    outcome = await asyncio.wait_for(holder, bound + 5)
    took = time.monotonic() - revoked_at
    assert outcome == "lost", f"the revoked holder's block {outcome}"
    assert took <= bound, f"revoked holder learnt it after {took:.2f} s, bound {bound:.2f} s"
    nxt = await conns[1].lock(name, ttl=ttl, data="next").acquire(timeout=10)
    try:
        assert nxt.token > token[0], f"next holder's token {nxt.token} after revoked {token[0]}"
        info = await conns[2].status(name)
        assert info.held and info.token == nxt.token and [h.data for h in info.held_by] == ["next"], (
            f"status after the next grant: {info}, next token {nxt.token}")
    finally:
        await nxt.release()


@rows(C.REVOKE)
async def test_force_release_with_a_waiter_hands_over_with_a_higher_token(
        conns: list[aiolock.Locks], name: str) -> None:
    """force_release() with a waiter queued: the waiter gets the name with a higher token
    and status() from a third connection shows exactly the waiter's lease."""
    first = await conns[0].lock(name, ttl=3, data="first", on_lost="raise").acquire(timeout=10)
    waiter = asyncio.create_task(conns[1].lock(name, ttl=3, data="waiter").acquire(timeout=20))
    await asyncio.sleep(0.3)
    assert await conns[2].lock(name).force_release() is True
    nxt = await waiter
    try:
        assert nxt.token > first.token, f"waiter's token {nxt.token} after revoked {first.token}"
        for conn in (conns[1], conns[2]):
            info = await conn.status(name)
            assert info.held and info.token == nxt.token, f"status {info}, waiter's token {nxt.token}"
            assert [h.data for h in info.held_by] == ["waiter"], f"held_by {info.held_by}"
        await asyncio.wait_for(first.wait_lost(), 3)
        assert first.lost
    finally:
        await nxt.release()
        await first.release()
