"""Elections across OS processes, on every server backend declaring ELECTION (memory:// is
per process): at most one leader measured on CLOCK_MONOTONIC, kill -9 of the leader (a new
one within the backend's documented bound, tests/scenarios.py), SIGSTOP of the leader past
its ttl (cancelled on wake, its fenced write rejected)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import aiolock
from aiolock import Capability

from ..scenarios import Scenario
from ..servers import RedisServer

CANDIDATE = str(Path(__file__).parent / "procs" / "candidate.py")
ROOT = str(Path(__file__).parents[2])


class Proc:
    """A candidate process whose stdout lines are collected by a thread."""

    def __init__(self, url: str, name: str, ttl: float, data: str, tasks: int = 1,
                 hold: float = -1, duration: float = 0, fence: str | None = None) -> None:
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.p = subprocess.Popen(
            [sys.executable, CANDIDATE, url, name, str(ttl), data, str(tasks), str(hold),
             str(duration), *([fence] if fence else [])],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.append(line.strip())

    def wait_line(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if line.startswith(prefix):
                    return line
            time.sleep(0.01)
        raise AssertionError(f"no {prefix!r} line within {timeout} s: {self.lines[-5:]} "
                             f"rc={self.p.poll()}")

    def kill(self) -> None:
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGKILL)
        self.p.wait(10)
        self.t.join(5)


@contextlib.asynccontextmanager
async def observing(el: aiolock.Election) -> AsyncIterator[list[aiolock.Leader | None]]:
    """Every value ``el.observe()`` gives, appended to the list while the block runs."""
    seen: list[aiolock.Leader | None] = []

    async def watch() -> None:
        async for ldr in el.observe():
            seen.append(ldr)

    task = asyncio.create_task(watch())
    try:
        yield seen
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def one_leader_at_a_time(urls: list[str], name: str) -> list[tuple[float, float, int]]:
    """A candidate process per URL (two tasks each) campaigning for ``name`` for 2.5 s:
    no term lost nor cancelled, terms never overlap (CLOCK_MONOTONIC, shared by the
    processes), and each begins with a higher token. Returns the terms (start, end, token)."""
    procs = [Proc(url, name, 2.0, f"p{i}", tasks=2, hold=0.02, duration=2.5)
             for i, url in enumerate(urls)]
    try:
        for pr in procs:
            await asyncio.to_thread(pr.p.wait, 40)
    finally:
        for pr in procs:
            pr.kill()
    terms: list[tuple[float, float, int]] = []
    for pr in procs:
        assert pr.p.returncode == 0, (pr.lines[-5:], pr.p.stderr.read() if pr.p.stderr else "")
        starts: dict[int, float] = {}
        for line in pr.lines:
            kind, *rest = line.split()
            if kind == "LEAD":
                starts[int(rest[1])] = float(rest[0])
            elif kind == "END":
                terms.append((starts.pop(int(rest[1])), float(rest[0]), int(rest[1])))
            assert kind not in ("LOST", "CANCELLED"), line
    terms.sort()
    for (_s1, e1, t1), (s2, _e2, t2) in itertools.pairwise(terms):
        assert e1 <= s2, f"terms {t1} and {t2} overlap by {e1 - s2:.6f} s"
        assert t2 > t1, f"term {t2} began after term {t1}"
    return terms


async def test_at_most_one_leader_across_processes(shared_url: str) -> None:
    terms = await one_leader_at_a_time([shared_url] * 3, f"adv-el-{uuid.uuid4().hex[:8]}")
    assert len(terms) >= 6


async def test_killed_leader_replaced_quickly(shared_scenario: Scenario, shared_url: str) -> None:
    name = f"adv-el-{uuid.uuid4().hex[:8]}"
    a = Proc(shared_url, name, 2.0, "a")
    b = None
    try:
        lead_a = await asyncio.to_thread(a.wait_line, "LEAD", 20)
        b = Proc(shared_url, name, 2.0, "b")
        await asyncio.to_thread(b.wait_line, "READY", 20)
        await asyncio.sleep(0.5)
        assert not any(x.startswith("LEAD") for x in b.lines)
        async with aiolock.connect(shared_url) as locks:
            el = locks.election(name, ttl=2.0)
            ldr = await el.leader()
            assert ldr is not None and ldr.data == "a-0" and ldr.holder.pid == a.p.pid
            t0 = time.monotonic()
            a.kill()
            lead_b = await asyncio.to_thread(b.wait_line, "LEAD", 10)
            took = float(lead_b.split()[1]) - t0
            # the backend's documented bound (tests/scenarios.py): PostgreSQL / MySQL
            # replace a killed leader at once (its connection drops); etcd when its lease
            # expires
            bound = shared_scenario.kill_bound(2.0)
            assert took < bound, f"new leader after {took:.2f} s (bound {bound:.2f} s)"
            assert int(lead_b.split()[2]) > int(lead_a.split()[2])
            ldr = await el.leader()
            assert ldr is not None and ldr.data == "b-0" and ldr.holder.pid == b.p.pid
    finally:
        a.kill()
        if b is not None:
            b.kill()


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rpartition(")")[2].split()[0] in ("T", "t")


async def test_sigstopped_leader_loses_and_is_cancelled_on_wake(
    shared_scenario: Scenario, shared_url: str, redis_server: RedisServer
) -> None:
    """A leader paused past its ttl, between its check that it leads and a fenced write:
    replaced within the backend's dead-holder bound; on wake its term is lost, its body
    cancelled, and the write it had on its way is rejected by the fence."""
    ttl = 1.5
    name = f"adv-el-{uuid.uuid4().hex[:8]}"
    a = Proc(shared_url, name, ttl, "a", fence=redis_server.url)
    b = None
    try:
        lead_a = await asyncio.to_thread(a.wait_line, "LEAD", 20)
        await asyncio.to_thread(a.wait_line, "WRITE", 5)
        b = Proc(shared_url, name, ttl, "b", fence=redis_server.url)
        await asyncio.to_thread(b.wait_line, "READY", 20)
        await asyncio.sleep(0.3)
        os.kill(a.p.pid, signal.SIGUSR1)  # it stops itself between its check and its write
        async with asyncio.timeout(5):
            while not _stopped(a.p.pid):
                await asyncio.sleep(0.005)
        stopped = time.monotonic()
        try:
            lead_b = await asyncio.to_thread(b.wait_line, "LEAD", ttl * 2 + 3)
            await asyncio.to_thread(b.wait_line, "WRITE", 3)  # the new leader wrote
        finally:
            resumed = time.monotonic()
            os.kill(a.p.pid, signal.SIGCONT)
        took = float(lead_b.split()[1]) - stopped
        bound = shared_scenario.dead_holder(ttl)
        assert took < bound + 0.5, f"paused leader replaced after {took:.2f} s (bound {bound:.2f} s)"
        lost = await asyncio.to_thread(a.wait_line, "LOST", 3)
        assert "CANCELLED" in " ".join(a.lines), a.lines[-5:]
        assert float(lost.split()[1]) - resumed < 1.0
        # the write it had on its way when it stopped arrives now, with the old term: rejected
        stale = await asyncio.to_thread(_after, a, "WRITE", resumed, 3)
        assert stale and all(line.split()[3] == "0" for line in stale), stale
        assert all(line.split()[3] == "1" for line in b.lines if line.startswith("WRITE")), b.lines
        # after B leads, A never ticks believing it leads
        b_start = float(lead_b.split()[1])
        bad = [x for x in a.lines if x.startswith("TICK") and float(x.split()[1]) >= b_start
               and x.split()[3] == "0"]
        assert bad == [], bad
        assert int(lead_b.split()[2]) > int(lead_a.split()[2])
    finally:
        a.kill()
        if b is not None:
            b.kill()


def _after(proc: Proc, prefix: str, since: float, timeout: float) -> list[str]:
    """The lines ``proc`` printed with ``prefix`` stamped at or after ``since`` (waiting
    up to ``timeout`` for the first)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [x for x in list(proc.lines) if x.startswith(prefix) and float(x.split()[1]) >= since]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.01)


@pytest.mark.slow
async def test_many_processes_churn_and_observer_settles(shared_url: str,
                                                        shared_scenario: Scenario) -> None:
    """Observers in this process follow a churning multi-process election and settle on
    the truth after it stops."""
    name = f"adv-el-{uuid.uuid4().hex[:8]}"
    ttl = 1.0
    async with aiolock.connect(shared_url) as locks, \
            observing(locks.election(name, ttl=ttl)) as seen:
        procs = [Proc(shared_url, name, ttl, f"p{i}", tasks=3, hold=0.01, duration=3) for i in range(3)]
        try:
            for pr in procs:
                await asyncio.to_thread(pr.p.wait, 40)
            last = Proc(shared_url, name, ttl, "last")
            await asyncio.to_thread(last.wait_line, "LEAD", 10)
            deadline = time.monotonic() + ttl + 1
            while not (seen and seen[-1] is not None and seen[-1].data == "last-0"):
                assert time.monotonic() < deadline, seen[-3:]
                await asyncio.sleep(0.02)
            last.kill()
            # vacant once the killed leader's claim is gone (the backend's documented
            # bound: Memcached's whole-second expiries take longer) and observe() looked
            # again (at least every ttl/2)
            deadline = time.monotonic() + max(ttl + 1.5, shared_scenario.kill_bound(ttl) + ttl)
            while not (seen and seen[-1] is None):
                assert time.monotonic() < deadline, seen[-3:]
                await asyncio.sleep(0.02)
        finally:
            for pr in procs:
                pr.kill()
    assert len(seen) > 3


async def test_paused_lone_leader_is_seen_vacant(shared_url: str) -> None:
    """A leader SIGSTOPped with nobody else campaigning: leader() and observe() must show
    the election vacant within about a ttl (the backend's paused-holder bound)."""
    ttl = 1.5
    name = f"adv-el-{uuid.uuid4().hex[:8]}"
    a = Proc(shared_url, name, ttl, "a")
    try:
        await asyncio.to_thread(a.wait_line, "LEAD", 20)
        async with aiolock.connect(shared_url) as locks:
            el = locks.election(name, ttl=ttl)
            async with observing(el) as seen:
                os.kill(a.p.pid, signal.SIGSTOP)
                try:
                    t0 = time.monotonic()
                    while not (seen and seen[-1] is None):
                        assert time.monotonic() - t0 < ttl * 2 + 1.5, seen[-2:]
                        await asyncio.sleep(0.02)
                    assert await el.leader() is None
                finally:
                    os.kill(a.p.pid, signal.SIGCONT)
            await asyncio.to_thread(a.wait_line, "LOST", 5)
    finally:
        a.kill()


HOLDER = str(Path(__file__).parents[1] / "procs" / "holder.py")


async def test_killed_holders_record_does_not_come_back(shared_url: str) -> None:
    """kill -9 of a lock holder and of a leader: their records must vanish with their claim,
    and not reappear beside the next holder's (stale rows of a dead session)."""
    name = f"adv-k-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = await asyncio.create_subprocess_exec(sys.executable, HOLDER, shared_url, name, "2",
                                             stdout=asyncio.subprocess.PIPE, env=env)
    a = Proc(shared_url, name + "-el", 2, "dead")
    try:
        assert p.stdout is not None
        line = await asyncio.wait_for(p.stdout.readline(), 20)
        assert line.startswith(b"ACQUIRED"), line
        await asyncio.to_thread(a.wait_line, "LEAD", 20)
        p.kill()
        await p.wait()
        a.kill()
        async with aiolock.connect(shared_url) as locks:
            el = locks.election(name + "-el", ttl=2)
            deadline = time.monotonic() + 2 + 3  # a dead holder's bound is at most its ttl
            while (await locks.status(name)).held or await el.leader() is not None:
                assert time.monotonic() < deadline, "dead holders still listed"
                await asyncio.sleep(0.05)
            can_scan = Capability.SCAN in locks.capabilities
            if can_scan:
                assert [i.name async for i in locks.scan(name)] == []
            async with locks.lock(name, ttl=2, data="alive"), el.campaign(data="alive-l") as t:
                assert [h.data for h in (await locks.status(name)).held_by] == ["alive"]
                ldr = await el.leader()
                assert ldr is not None and (ldr.data, ldr.token) == ("alive-l", t.token), ldr
                if can_scan:
                    infos = {i.name: [h.data for h in i.held_by]
                             async for i in locks.scan(name)}
                    assert infos == {name: ["alive"], name + "-el": ["alive-l"]}, infos
    finally:
        if p.returncode is None:
            p.kill()
            await p.wait()
        a.kill()
