"""A worker process of the fault harness.

    python -m tests.faults.worker --url URL --kind KIND --locks a,b --tasks N --ttl S \
        --checker SOCKET --seed N [--chaos P] [--sleep S] [--options JSON] [--election]

``--tasks`` tasks loop: pick a lock, ``async with lock`` (watchdog on,
``on_lost="cancel"``; with ``--election``, ``async with election.campaign()``: the term is
the lease, its number the token) -> report the acquisition to the checker -> fenced read -> random
sleep -> fenced write of the value + 1 (sent after a random "travel" delay of up to
``--gap``: the hop to a real resource, where a pause lets a stale write through to the
fence) -> release, and report how the hold ended. Each
fenced access is made only if ``lease.lost`` is False, and carries the time taken just
*before* that check, so the orchestrator can tell whether the lease was believed after
someone else had been granted the lock.

With probability ``--chaos`` an iteration instead cancels its ``acquire()`` (and, when
the acquire won the race, half the time its ``release()``) after a random delay in
[0, 2 x RTT], then sends a nonce echo through the backend's connection and reports
whether the reply was its own.

Commands on stdin (one per line): ``STALL seconds`` blocks the event loop with
``time.sleep`` (taken by the next task that passed its lease check and is about to send
its write, so the write arrives after the lease expired; at a random point if no task
gets there within a second) and reports, for every lease whose confirmed expiry passed meanwhile,
whether ``lease.lost`` said so on wake; ``STOP-IN-GAP`` makes the process
SIGSTOP itself at that same point (the orchestrator resumes it); ``EXPIRE`` expires the
ZooKeeper session from
the server side; ``STOP`` finishes the current iterations and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import statistics
import sys
import time
from typing import Any

import aiolock

from .common import CheckerClient, echo, expire_zk_session, mono, pause


class Worker:
    """One process: several tasks contending for a few locks."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.pid = os.getpid()
        self.names: list[str] = args.locks.split(",")
        self.ttl: float = args.ttl
        self.kind: str = args.kind
        self.stopping = asyncio.Event()
        self.live: dict[int, aiolock.Lease] = {}
        self.rtt = 0.001
        self.locks: aiolock.Locks | None = None
        self.count = 0
        self.notes: CheckerClient | None = None
        #: a fault to take inside the next fenced write's travel gap ("STALL"/"STOP", seconds)
        self.armed: tuple[str, float] | None = None
        self.background: set[asyncio.Task[None]] = set()

    # -- setup ------------------------------------------------------------------------------

    async def connect(self) -> aiolock.Locks:
        options: dict[str, Any] = json.loads(self.args.options)
        deadline = mono() + 30
        while True:
            locks = aiolock.connect(self.args.url, **options)
            try:
                await locks.__aenter__()
                return locks
            except aiolock.BackendUnavailable:
                await locks.aclose()
                if mono() > deadline:
                    raise
                await asyncio.sleep(0.2)

    async def measure_rtt(self, locks: aiolock.Locks) -> float:
        samples = []
        for _ in range(7):
            t0 = mono()
            with contextlib.suppress(Exception):
                await echo(locks, self.kind)
                samples.append(mono() - t0)
        return statistics.median(samples) if samples else 0.001

    async def run(self) -> int:
        self.locks = locks = await self.connect()
        try:
            self.rtt = await self.measure_rtt(locks)
            self.notes = await CheckerClient(self.args.checker).open()
            commands = asyncio.create_task(self.commands())
            tasks = [asyncio.create_task(self.loop(i)) for i in range(self.args.tasks)]
            print(f"READY {self.pid} rtt={self.rtt * 1000:.3f}ms", flush=True)
            await asyncio.gather(*tasks)
            commands.cancel()
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(10):
                    await locks.aclose()
        print(f"DONE {self.count}", flush=True)
        return 0

    # -- commands ---------------------------------------------------------------------------

    async def commands(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                self.stopping.set()
                return
            words = line.split()
            if not words:
                continue
            if words[0] == "STOP":
                self.stopping.set()
            elif words[0] in ("STALL", "STOP-IN-GAP"):
                # taken by the next task between its lease check and its write (a GC
                # pause at the worst moment); at a random point if none gets there in 1 s
                self.armed = (words[0], float(words[1]) if len(words) > 1 else 0.0)
                loop.call_later(1.0, self.fallback)
            elif words[0] == "EXPIRE" and self.locks is not None:
                self.background.add(task := asyncio.create_task(self.expire()))
                task.add_done_callback(self.background.discard)

    def fallback(self) -> None:
        if self.armed is not None:
            self.take_armed()

    def take_armed(self) -> None:
        assert self.armed is not None
        what, seconds = self.armed
        self.armed = None
        if what == "STALL":
            self.stall(seconds)
        else:
            os.kill(self.pid, signal.SIGSTOP)  # the orchestrator sends SIGCONT

    def stall(self, seconds: float) -> None:
        """Block the event loop; on wake, check every lease whose expiry passed."""
        before = [(lease, mono() + lease.expires_in) for lease in self.live.values() if not lease.lost]
        time.sleep(seconds)
        now = mono()
        expired = [lease for lease, until in before if until <= now]
        detected = sum(1 for lease in expired if lease.lost)
        assert self.notes is not None
        self.notes.report("S", self.pid, len(expired), detected)

    async def expire(self) -> None:
        assert self.locks is not None and self.notes is not None
        try:
            ok = await expire_zk_session(self.locks)
            self.notes.report("N", self.pid, f"session expiry: {'confirmed' if ok else 'sent'}")
        except Exception as exc:
            self.notes.report("N", self.pid, f"session expiry failed: {exc!r}")

    # -- the loop ---------------------------------------------------------------------------

    async def loop(self, index: int) -> None:
        assert self.locks is not None
        chk = await CheckerClient(self.args.checker).open()
        try:
            while not self.stopping.is_set():
                name = self.rng.choice(self.names)
                lock = self.primitive(self.locks, name, index)
                try:
                    if self.rng.random() < self.args.chaos:
                        await self.chaos(lock, name, chk)
                    else:
                        await self.normal(lock, name, chk)
                except (aiolock.LockError, OSError, TimeoutError, ConnectionError) as exc:
                    chk.report("N", self.pid, f"{type(exc).__name__}: {str(exc)[:200]}")
                    await asyncio.sleep(0.05 + self.rng.random() * 0.1)
        finally:
            await chk.aclose()

    def primitive(self, locks: aiolock.Locks, name: str, index: int) -> aiolock.Lock:
        """What the tasks contend for: a lock, or (``--election``) a campaign for the
        election ``name`` (its terms are leases with fencing tokens, like a lock's)."""
        if self.args.election:
            return locks.election(name, ttl=self.ttl).campaign(data=f"{self.pid}/{index}")
        return locks.lock(name, ttl=self.ttl)

    async def access(self, lease: aiolock.Lease, name: str, chk: CheckerClient) -> None:
        """Fenced read, random sleep, fenced write of read + 1: each only if not lost."""
        token = lease.token
        tc = mono()
        if lease.lost:
            return
        ok, value = await chk.reply(chk.send_now("R", name, token, self.pid, tc))
        if not ok:
            return
        await asyncio.sleep(self.rng.random() * self.args.sleep)
        tc = mono()
        if lease.lost:
            return
        if self.armed is not None:
            self.take_armed()
        # The write is on its way to the resource (a network hop of up to --gap): it is
        # sent by a task of its own, so cancelling the body (lease lost) cannot recall it,
        # and a pause above makes it arrive late: what fencing is for.
        msg = ("W", name, token, self.pid, tc, value + 1, value)
        await asyncio.shield(asyncio.ensure_future(self.travel(chk, msg)))
        self.count += 1

    async def travel(self, chk: CheckerClient, msg: tuple[Any, ...]) -> Any:
        await asyncio.sleep(self.rng.random() * self.args.gap)
        return await chk.reply(chk.send_now(*msg))

    async def normal(self, lock: aiolock.Lock, name: str, chk: CheckerClient) -> None:
        t_req = mono()
        got: aiolock.Lease | None = None
        t_exit = 0.0
        how = "released"
        try:
            async with lock as lease:
                got = lease
                chk.report("A", name, lease.token, self.pid, t_req, mono())
                self.live[id(lease)] = lease
                await self.access(lease, name, chk)
                t_exit = mono()
        except aiolock.LockLost:
            how = "lost"
        except BaseException:
            how = "error"
            raise
        finally:
            if got is not None:
                self.live.pop(id(got), None)
                chk.report("E", name, got.token, self.pid, t_exit or mono(), mono(), how)

    async def pause(self, min_steps: int = 0) -> None:
        await pause(self.rng, self.rtt, min_steps)

    async def check_echo(self, what: str, chk: CheckerClient) -> None:
        assert self.locks is not None
        try:
            async with asyncio.timeout(10):
                ok: bool | None = await echo(self.locks, self.kind)
        except Exception:
            ok = None  # the server did not answer (a fault): not a desync
        chk.report("C", self.pid, what, ok)

    async def chaos(self, lock: aiolock.Lock, name: str, chk: CheckerClient) -> None:
        t_req = mono()
        task = asyncio.create_task(lock.acquire())
        await self.pause()
        task.cancel()
        try:
            lease = await task
        except asyncio.CancelledError:
            await self.check_echo("acquire", chk)
            return
        chk.report("A", name, lease.token, self.pid, t_req, mono())
        self.live[id(lease)] = lease
        t_exit = mono()
        try:
            await self.access(lease, name, chk)
            t_exit = mono()
        finally:
            self.live.pop(id(lease), None)
            how = "released"
            if self.rng.random() < 0.5:
                release = asyncio.create_task(lease.release())
                await self.pause(min_steps=1)
                release.cancel()
                try:
                    await release
                except asyncio.CancelledError:
                    await self.check_echo("release", chk)
                    await lease.release()  # again: waits for the one finishing in the background
            else:
                await lease.release()
            if lease.lost:
                how = "lost"
            chk.report("E", name, lease.token, self.pid, t_exit, mono(), how)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults.worker")
    parser.add_argument("--url", required=True)
    parser.add_argument("--kind", required=True)
    parser.add_argument("--locks", required=True)
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--ttl", type=float, default=1.0)
    parser.add_argument("--checker", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chaos", type=float, default=0.05)
    parser.add_argument("--sleep", type=float, default=0.003)
    parser.add_argument("--gap", type=float, default=0.004)
    parser.add_argument("--options", default="{}")
    parser.add_argument("--election", action="store_true", help="campaign instead of lock")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    return asyncio.run(Worker(args).run())


if __name__ == "__main__":
    sys.exit(main())
