"""Faults on etcd (SPEC §2, §4; docs/backends/etcd.md "Guarantees and limits"): a holder
killed with -9, a holder paused past its ttl, dead and silent ports, quorum loss, and
1,000 leases on one connection kept alive over several ttls."""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import socket
import time
from collections.abc import Iterator

import pytest

import aiolock

from ..etcd_server import EtcdCluster
from ..servers import free_port
from .conftest import Child, Target, claim_keys, since

HOLD = """
import asyncio, sys, aiolock
async def main():
    async with aiolock.connect(sys.argv[1]) as locks:
        lease = await locks.lock("victim", ttl=float(sys.argv[2])).acquire()
        print("held", lease.token, flush=True)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while True:
            line = await reader.readline()
            if not line:
                return
            print("lost", lease.lost, flush=True)
asyncio.run(main())
"""


async def _start_holder(children: list[Child], url: str, ttl: float) -> tuple[Child, int]:
    import asyncio.subprocess as sp
    import os
    import sys

    from .conftest import ROOT

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLD, url, str(ttl), env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=sp.PIPE, stdout=sp.PIPE, stderr=sp.PIPE)
    child = Child(proc)
    children.append(child)
    token = int((await child.expect("held")).split()[1])
    return child, token


async def test_killed_holder_freed_within_documented_bound(etcd: Target, children: list[Child]) -> None:
    """kill -9 the holder: a waiter gets the lock within max(ceil(ttl), 1) + 0.5 s (+ slack),
    not sooner than the lease allows, with a higher token; no claim key is left."""
    ttl = 2.0
    child, token = await _start_holder(children, etcd.url, ttl)
    async with aiolock.connect(etcd.url) as locks:
        waiter = asyncio.create_task(locks.lock("victim", ttl=ttl).acquire())
        await asyncio.sleep(ttl)  # the holder renews meanwhile: still held
        assert not waiter.done()
        child.signal(signal.SIGKILL)
        t0 = time.monotonic()
        lease = await asyncio.wait_for(waiter, 10)
        took = since(t0)
        assert lease.token > token
        assert took <= max(math.ceil(ttl), 1) + 0.5 + 0.8, took
        await lease.release()
    assert claim_keys(etcd.server, etcd.prefix) == []


async def test_paused_holder_loses_and_its_fenced_write_is_refused(
        etcd: Target, children: list[Child]) -> None:
    """SIGSTOP the holder past its ttl: another client gets the lock (higher token); on
    SIGCONT the old holder's lease says lost at once, and the fence refuses its token."""
    ttl = 1.0
    child, token = await _start_holder(children, etcd.url, ttl)
    fence = aiolock.MemoryFencedResource()
    assert await fence.write(token, "old")
    child.signal(signal.SIGSTOP)
    async with aiolock.connect(etcd.url) as locks:
        t0 = time.monotonic()
        lease = await locks.lock("victim", ttl=5).acquire(timeout=10)
        assert since(t0) <= max(math.ceil(ttl), 1) + 1.3 + 0.5
        assert lease.token > token
        assert await fence.write(lease.token, "new")
        child.signal(signal.SIGCONT)
        assert child.proc.stdin is not None
        child.proc.stdin.write(b"check\n")
        assert await child.expect("lost", within=5) == "lost True"
        assert not await fence.write(token, "stale")
        await lease.release()


@contextlib.contextmanager
def silent_port() -> Iterator[int]:
    """A port that accepts TCP connections (kernel backlog) and never says a word."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


@pytest.mark.parametrize("kind", ["refused", "silent"])
@pytest.mark.parametrize("opts", [pytest.param("default", marks=pytest.mark.slow), "connect_timeout=1"])
async def test_unreachable_is_backend_unavailable_in_bounded_time(kind: str, opts: str) -> None:
    """A dead or silent port: BackendUnavailable (never a hang, never a raw grpc error)
    within the connect timeout (+ slack), with the password nowhere in it."""
    with silent_port() as quiet:
        port = quiet if kind == "silent" else free_port()
        query = "" if opts == "default" else f"?{opts}"
        url = f"etcd://app:pw-Adv14-hidden@127.0.0.1:{port}{query}"
        bound = 5.0 + 2.0 if opts == "default" else 1.0 + 1.5
        t0 = time.monotonic()
        locks = aiolock.connect(url)
        try:
            with pytest.raises(aiolock.BackendUnavailable) as err:
                await asyncio.wait_for(locks.lock("x", ttl=5).acquire(timeout=0), 30)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(locks.aclose(), 10)
        took = since(t0)
        assert took <= bound, took
        assert "pw-Adv14-hidden" not in f"{err.value!r} {err.value} {err.value.__cause__!r}"


@pytest.fixture
def own_cluster() -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(3).start()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.mark.slow
async def test_quorum_loss_bounded_and_leases_lost_at_expiry(own_cluster: EtcdCluster) -> None:
    """Kill two members of three: a held lease is lost no later than its last confirmed
    expiry (ttl after a renewal was sent, + slack); a new acquire raises BackendUnavailable
    within request_timeout (+ slack)."""
    ttl = 3.0
    url = f"{own_cluster.url}?request_timeout=2"
    async with aiolock.connect(url) as locks:
        lease = await locks.lock("q", ttl=ttl).acquire()
        await asyncio.sleep(0.2)
        leader = own_cluster.leader_index()
        others = [i for i in range(3) if i != leader]
        own_cluster.kill(leader)
        own_cluster.kill(others[0])
        t0 = time.monotonic()
        await asyncio.wait_for(lease.wait_lost(), ttl + 1.0)
        assert since(t0) <= ttl + 0.5
        t1 = time.monotonic()
        with pytest.raises(aiolock.BackendUnavailable):
            await asyncio.wait_for(locks.lock("q2", ttl=ttl).acquire(), 20)
        assert since(t1) <= 2.0 + 1.5


@pytest.mark.parametrize("n", [1000])
async def test_many_leases_one_connection_kept_several_ttls(etcd: Target, n: int) -> None:
    """1,000 leases (ttl 2 s) on one connection for 3 ttls: none lost, every key still
    there, every etcd lease still alive."""
    ttl = 2.0
    async with aiolock.connect(etcd.url) as locks:
        leases: list[aiolock.Lease] = []
        for start in range(0, n, 100):
            leases += await asyncio.gather(*(locks.lock(f"many-{i}", ttl=ttl).acquire(timeout=10)
                                             for i in range(start, start + 100)))
        assert not any(lease.lost for lease in leases)
        await asyncio.sleep(ttl * 3)
        lost = [lease.name for lease in leases if lease.lost]
        assert lost == [], f"{len(lost)} leases lapsed"
        assert len(claim_keys(etcd.server, etcd.prefix)) == n
        for lease in leases:
            await lease.release()
    assert claim_keys(etcd.server, etcd.prefix) == []
