"""aiolock on etcd next to python-etcd3's ``Lock``, against one private etcd member, in
one run.

    .venv/bin/python benchmarks/bench_etcd.py [--quick] [--etcd3-python PATH]

python-etcd3 (``etcd3`` 0.12, synchronous) needs protobuf < 4, which cannot share a venv
with current grpcio/protobuf users: give ``--etcd3-python`` the interpreter of a venv
with ``pip install etcd3 'protobuf<3.21' 'tenacity<7'`` (its ``Lock`` breaks under
contention with newer tenacity); its runs go in a subprocess, once per run (not
alternated). Without it, its rows are left out.

(a) Uncontended acquire+release cycles per second: a raw floor (one transaction
    put-if-absent with no lease, then a delete: two requests) and aiolock (watchdog on:
    a lease grant, the put-and-list transaction, the revoke). Rounds alternate; the
    median round is reported.
    python-etcd3's ``Lock`` (lease grant + put-if-absent transaction; release: a
    transaction delete) runs the same cycles in its own process.
(b) Handoff: 16 contenders (16 ``aiolock.connect`` sessions; python-etcd3: 16 threads,
    16 clients) loop acquire -> release on one lock; handoffs per second and the latency
    from a holder's ``release()`` returning to the next holder's ``acquire()`` returning
    (p50 / p99), with a mutual-exclusion check.

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

#: run by --etcd3-python: python-etcd3's Lock, uncontended cycles then threaded handoffs;
#: prints "cycles/s", then "count p50 p99" (seconds)
ETCD3_SCRIPT = """
import sys, threading, time
import etcd3
port, cycles, seconds, threads = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
client = etcd3.client(host="127.0.0.1", port=port)
lock = client.lock("bench-etcd3-a", ttl=30)
for _ in range(20):
    lock.acquire(); lock.release()
started = time.perf_counter()
for _ in range(cycles):
    lock.acquire(); lock.release()
print(cycles / (time.perf_counter() - started), flush=True)
sys.stdin.readline()  # the parent reads the server's counters here
state = {"inside": 0, "count": 0, "released": None}
waits = []
guard = threading.Lock()
deadline = time.monotonic() + seconds
def worker():
    c = etcd3.client(host="127.0.0.1", port=port)
    lk = c.lock("bench-etcd3-b", ttl=30)
    while time.monotonic() < deadline:
        lk.acquire()
        now = time.monotonic()
        with guard:
            if state["released"] is not None:
                waits.append(now - state["released"])
            state["inside"] += 1
            assert state["inside"] == 1
            state["count"] += 1
            state["inside"] -= 1
        lk.release()
        with guard:
            state["released"] = time.monotonic()
ts = [threading.Thread(target=worker) for _ in range(threads)]
for t in ts: t.start()
for t in ts: t.join()
waits.sort()
def p(q):
    return waits[min(len(waits) - 1, max(0, round(q / 100 * len(waits) + 0.5) - 1))] if waits else -1
print(state["count"], p(50), p(99), flush=True)
"""


def run_etcd3(
    python: str, server: EtcdServer, cycles: int, seconds: float,
) -> tuple[float, float, int, float, float, float]:
    """python-etcd3: (cycles/s, requests/cycle, handoffs, p50, p99, requests/acquisition)."""
    import subprocess

    proc = subprocess.Popen([python, "-c", ETCD3_SCRIPT, str(server.port), str(cycles), str(seconds),
                             str(CONTENDERS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    before = received(server)
    rate = float(proc.stdout.readline())
    middle = received(server)
    proc.stdin.write("\n")
    proc.stdin.flush()
    count, p50, p99 = proc.stdout.readline().split()
    after = received(server)
    proc.wait(30)
    per_cycle = (middle - before) / (cycles + 20)
    return rate, per_cycle, int(count), float(p50), float(p99), (after - middle) / max(int(count), 1)


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


async def main(quick: bool, etcd3_python: str | None) -> None:
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
        print(f"requests per contended acquisition: aiolock {req_handoff:.2f}")
        if etcd3_python:
            rate, per_cycle, n, p50, p99, per_acq = await asyncio.to_thread(
                run_etcd3, etcd3_python, server, cycles, contend)
            print(f"| python-etcd3 `Lock` (sync; 16 threads) | {fmt(rate)} ({rate / f:.2f}x) "
                  f"| {per_cycle:.2f} | {fmt(n / contend)} | {p50 * 1000:.2f} / {p99 * 1000:.2f} ms |")
            print(f"requests per contended acquisition: python-etcd3 {per_acq:.2f}")
    finally:
        server.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--etcd3-python", help="a python with python-etcd3 installed")
    args = parser.parse_args()
    asyncio.run(main(args.quick, args.etcd3_python))
