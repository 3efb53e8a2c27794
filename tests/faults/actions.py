"""The fault actions: each injects one fault kind into a running backend column and
records it as an event. A :class:`~tests.faults.backends.BackendSpec` names the actions
its backend takes (``faults``: kind -> action), so the orchestrator only looks one up.

An action gets the run (its server, workers, random source, config), the worker the
fault is aimed at (one that holds a lock now, as the checker heard) and what it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiolock

from .common import mono

if TYPE_CHECKING:
    from .harness import BackendRun, Worker

__all__ = ["Fault", "failover", "kill", "killmaster", "leader", "proxy", "restart", "restart_no_aof",
           "restart_node", "restart_slot_owner", "session_expiry", "stall", "stop"]

#: ``action(run, worker, holdings)``; holdings are ``[lock, token]`` pairs
Fault = Callable[["BackendRun", "Worker", list[list[Any]]], Awaitable[None]]


def _stopped(pid: int) -> bool:
    """Is ``pid`` in the stopped state (``T`` in /proc/pid/stat)?"""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] in ("T", "t")
    except OSError:
        return False


def _tell(w: Worker, line: str) -> None:
    assert w.proc.stdin is not None
    w.proc.stdin.write(line.encode() + b"\n")


# -- the worker process ------------------------------------------------------------------


async def stop(run: BackendRun, w: Worker, holdings: list[list[Any]]) -> None:
    """SIGSTOP for 1.5 x ttl: half the time the worker stops itself between a lease check
    and its write (``in-gap``), else at a random point."""
    pid, t0 = w.proc.pid, mono()
    how = "random"
    if run.rng.random() < 0.5:
        _tell(w, "STOP-IN-GAP")
        how = "in-gap"
        while mono() - t0 < 1.5 and not _stopped(pid):
            await asyncio.sleep(0.002)
    if not _stopped(pid):
        os.kill(pid, signal.SIGSTOP)
        how = "random"
    t0 = mono()
    await asyncio.sleep(1.5 * run.cfg.ttl)
    os.kill(pid, signal.SIGCONT)
    run.event("stop", t0, mono(), pid, holdings, how=how)


async def kill(run: BackendRun, w: Worker, holdings: list[list[Any]]) -> None:
    """kill -9, a fresh worker in its place; wait out the backend's takeover bound."""
    t0 = mono()
    os.kill(w.proc.pid, signal.SIGKILL)
    run.event("kill", t0, t0, w.proc.pid, holdings)
    await w.proc.wait()
    w.replaced = True
    run.workers.append(await run.spawn_worker(w.index, w.proxy))
    bound, _ = run.spec.kill_bound(run.cfg.ttl)
    await asyncio.sleep(max(0.0, t0 + bound + 0.3 - mono()))


async def stall(run: BackendRun, w: Worker, holdings: list[list[Any]]) -> None:
    """Block the worker's event loop for 1.5 x ttl (between a lease check and a write)."""
    t0, ttl = mono(), run.cfg.ttl
    _tell(w, f"STALL {1.5 * ttl}")
    await asyncio.sleep(1.5 * ttl + 0.3)
    run.event("stall", t0, mono(), w.proc.pid, holdings)


async def session_expiry(run: BackendRun, w: Worker, holdings: list[list[Any]]) -> None:
    """ZooKeeper: the worker's session expired from the server side."""
    t0 = mono()
    _tell(w, "EXPIRE")
    await asyncio.sleep(2.0)
    run.event("expire", t0, mono(), w.proc.pid, holdings)
    await asyncio.sleep(run.cfg.ttl)


async def proxy(run: BackendRun, w: Worker, holdings: list[list[Any]]) -> None:
    """The worker's own TCP proxies: blackhole, one direction dropped, delay or reset;
    with several nodes (redlock), on all of them or on one (a minority)."""
    px, rng, ttl, t0 = w.proxy, run.rng, run.cfg.ttl, mono()
    assert px is not None
    mode = rng.choice(["blackhole", "drop-up", "drop-down", "delay", "reset"])
    which: list[int] | None = None
    if len(px.proxies) > 1 and rng.random() < 0.5:
        which = [rng.randrange(len(px.proxies))]
    if mode == "reset":
        px.reset(which)
    elif mode == "delay":
        px.set_faults(delay=rng.uniform(0.05, 0.3), which=which)
        await asyncio.sleep(2 * ttl)
    else:
        px.set_faults(up=mode in ("blackhole", "drop-up"), down=mode in ("blackhole", "drop-down"),
                      which=which)
        await asyncio.sleep(1.5 * ttl)
        if rng.random() < 0.5:
            px.reset(which)
            mode += "+reset"
    px.heal()
    run.event(f"proxy:{mode}", t0, mono(), w.proc.pid, holdings, nodes=which)
    await asyncio.sleep(0.3)


# -- the server(s) -----------------------------------------------------------------------


async def restart(run: BackendRun, w: Worker, holdings: list[list[Any]]) -> None:
    """kill -9 of the server and a start on the same data."""
    t0 = mono()
    await asyncio.to_thread(run.server.restart)
    run.event("restart", t0, mono())
    await asyncio.sleep(run.cfg.ttl)


async def restart_node(run: BackendRun, w: Worker, holdings: list[list[Any]]) -> None:
    """Redlock: one node of three (a minority) killed and started again empty (no AOF),
    down for the ttl first so that its leases expired before it rejoins (the "delayed
    restart" of docs/redlock.md)."""
    t0, ttl = mono(), run.cfg.ttl
    index = run.rng.randrange(len(run.server.nodes))
    await asyncio.to_thread(run.server.nodes[index].restart, down_for=ttl)
    run.event("restart", t0, mono(), w.proc.pid, holdings, index=index)
    await asyncio.sleep(ttl)


async def restart_slot_owner(run: BackendRun, w: Worker, holdings: list[list[Any]]) -> None:
    """Redis Cluster: the master of a held lock's slot (no replicas: its slots are down
    meanwhile)."""
    t0 = mono()
    owners = await _slot_owners(run)
    names = [lock for lock, _tok in holdings] or run.names
    port = owners[run.rng.choice(names)]
    node = next(n for n in run.server.nodes if n.port == port)
    await asyncio.to_thread(node.restart)
    await asyncio.to_thread(run.server.wait_ok)
    run.event("restart", t0, mono(), w.proc.pid, holdings, port=port,
              slots=[lock for lock in run.names if owners[lock] == port])
    await asyncio.sleep(run.cfg.ttl)


async def _slot_owners(run: BackendRun) -> dict[str, int]:
    """Each lock's master port (found once, at the first restart: restarts keep them)."""
    if not run.owners:
        from aiolock.backends.redis_cluster import RedisClusterBackend

        backend = RedisClusterBackend.from_url(run.direct_url())
        try:
            slots = {name: backend.slot(name) for name in run.names}
        finally:
            with contextlib.suppress(Exception):
                await backend.aclose()
        for name, slot in slots.items():
            run.owners[name] = await asyncio.to_thread(run.server.owner_of, slot)
    return run.owners


async def _sentinel(run: BackendRun, w: Worker, holdings: list[list[Any]], kind: str) -> None:
    t0 = mono()
    old, new = await asyncio.to_thread(getattr(run.server, kind.replace("killmaster", "kill_master")))
    run.event(kind, t0, mono(), w.proc.pid, holdings, old=old, new=new)
    await asyncio.sleep(run.cfg.ttl)


async def failover(run: BackendRun, w: Worker, holdings: list[list[Any]]) -> None:
    """Sentinel: ``SENTINEL FAILOVER`` (the old master comes back as a replica)."""
    await _sentinel(run, w, holdings, "failover")


async def killmaster(run: BackendRun, w: Worker, holdings: list[list[Any]]) -> None:
    """Sentinel: kill -9 of the master; the sentinel promotes the replica."""
    await _sentinel(run, w, holdings, "killmaster")


async def leader(run: BackendRun, w: Worker, holdings: list[list[Any]]) -> None:
    """An ensemble's leader killed, down for 2 x ttl, started again."""
    t0, ttl = mono(), run.cfg.ttl
    index = await asyncio.to_thread(run.server.leader_index)
    await asyncio.to_thread(run.server.kill, index)
    await asyncio.sleep(2 * ttl)
    await asyncio.to_thread(run.server.restart, index)
    run.event("leader", t0, mono(), index=index)
    await asyncio.sleep(ttl)


# -- extra scenarios (after the workload) --------------------------------------------------


async def restart_no_aof(run: BackendRun) -> dict[str, Any]:
    """Redis without AOF: restart under a held lease; the token counter goes back."""
    ttl = run.cfg.ttl
    async with aiolock.connect(run.direct_url()) as locks:
        name = "no-aof"
        for _ in range(5):
            await (await locks.lock(name, ttl=ttl).acquire(timeout=2)).release()
        lease = await locks.lock(name, ttl=ttl).acquire(timeout=2)
        before = lease.token
        t0 = mono()
        await asyncio.to_thread(run.server.restart)
        while not lease.lost and mono() - t0 < ttl + 2:
            await asyncio.sleep(0.01)
        noticed = mono() - t0
        again = await locks.lock(name, ttl=ttl).acquire(timeout=5)
        after = again.token
        await again.release()
    went_back = after <= before
    text = f"n/a: no AOF, token {before}->{after}" if went_back else f"token {before}->{after}"
    return dict(key="restart_no_aof", value=after, text=text, status="n/a" if went_back else "ok",
                before=before, after=after, lost_noticed=noticed)
