"""aiolock on etcd, against one private etcd member, in one run (a first, quick bench;
python-etcd3's ``Lock`` next to it is still to come).

    .venv/bin/python benchmarks/bench_etcd.py [--quick]

(a) Uncontended acquire+release cycles per second: a raw floor (one transaction
    put-if-absent with no lease, then a delete: two requests) and aiolock (watchdog on:
    a lease grant, the put-and-list transaction, the revoke). Rounds alternate; the
    median round is reported.
(b) Handoff: 16 contenders (16 ``aiolock.connect`` sessions) loop acquire -> release on
    one lock; handoffs per second and the latency from a holder's ``release()`` returning
    to the next holder's ``acquire()`` returning (p50 / p99), with a mutual-exclusion check.

Requests are counted on the server from its ``/metrics`` (``grpc_server_msg_received_total``:
unary requests and stream messages, keep-alives and watch requests included).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import aiolock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # for tests/etcd_server.py

from _common import fmt, percentile  # noqa: E402

from aiolock.backends.etcd._wire import CREATE, EQUAL, grpc, pb  # noqa: E402
from tests.etcd_server import EtcdServer  # noqa: E402

CONTENDERS = 16


def received(server: EtcdServer) -> int:
    text = urllib.request.urlopen(f"http://{server.endpoint}/metrics", timeout=5).read().decode()
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("grpc_server_msg_received_total"))


async def floor_cycles(server: EtcdServer, n: int) -> float:
    channel = grpc.aio.insecure_channel(server.endpoint)
    kv = pb.KVStub(channel)
    key = b"bench/floor/lock"
    txn = pb.TxnRequest(compare=[pb.Compare(key=key, target=CREATE, result=EQUAL, create_revision=0)],
                        success=[pb.RequestOp(request_put=pb.PutRequest(key=key, value=b"x"))])
    try:
        started = time.perf_counter()
        for _ in range(n):
            reply = await kv.Txn(txn)
            assert reply.succeeded
            await kv.DeleteRange(pb.DeleteRangeRequest(key=key))
        return time.perf_counter() - started
    finally:
        await channel.close()


async def aiolock_cycles(server: EtcdServer, n: int) -> float:
    async with aiolock.connect(f"{server.url}?prefix=bench-a") as locks:
        lock = locks.lock("a", ttl=30)
        for _ in range(20):
            await (await lock.acquire()).release()
        started = time.perf_counter()
        for _ in range(n):
            lease = await lock.acquire()
            await lease.release()
        return time.perf_counter() - started


async def handoffs(server: EtcdServer, seconds: float) -> tuple[int, list[float]]:
    conns = [aiolock.connect(f"{server.url}?prefix=bench-b") for _ in range(CONTENDERS)]
    for conn in conns:
        await conn.__aenter__()
    inside = 0
    count = 0
    released_at: float | None = None
    waits: list[float] = []
    deadline = time.monotonic() + seconds

    async def worker(locks: aiolock.Locks) -> None:
        nonlocal inside, count, released_at
        lock = locks.lock("b", ttl=30)
        while time.monotonic() < deadline:
            lease = await lock.acquire()
            now = time.monotonic()
            if released_at is not None:
                waits.append(now - released_at)
            inside += 1
            assert inside == 1, "mutual exclusion broken"
            count += 1
            inside -= 1
            await lease.release()
            released_at = time.monotonic()

    try:
        await asyncio.gather(*(worker(c) for c in conns))
    finally:
        for conn in conns:
            await conn.aclose()
    return count, waits


async def main(quick: bool) -> None:
    rounds, cycles, contend = (3, 200, 2.0) if quick else (5, 1000, 5.0)
    server = EtcdServer().start()
    try:
        floor: list[float] = []
        ours: list[float] = []
        req_floor = req_ours = 0.0
        for _ in range(rounds):
            before = received(server)
            floor.append(cycles / await floor_cycles(server, cycles))
            middle = received(server)
            ours.append(cycles / await aiolock_cycles(server, cycles))
            after = received(server)
            req_floor = (middle - before) / cycles
            req_ours = (after - middle) / cycles
        before = received(server)
        count, waits = await handoffs(server, contend)
        req_handoff = (received(server) - before) / max(count, 1)
        f, o = statistics.median(floor), statistics.median(ours)
        print(f"etcd {server.etcdctl('version').splitlines()[0]}; {rounds} rounds x {cycles} cycles")
        print("| | uncontended cycles/s | requests/cycle | handoffs/s (16 sessions) | handoff p50 / p99 |")
        print("| --- | ---: | ---: | ---: | ---: |")
        print(f"| raw floor (txn put-if-absent + delete) | {fmt(f)} | {req_floor:.2f} | | |")
        print(f"| aiolock | {fmt(o)} ({o / f:.2f}x) | {req_ours:.2f} | {fmt(count / contend)} | "
              f"{percentile(waits, 50) * 1000:.2f} / {percentile(waits, 99) * 1000:.2f} ms |")
        print(f"requests per contended acquisition: {req_handoff:.2f}")
    finally:
        server.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    asyncio.run(main(parser.parse_args().quick))
