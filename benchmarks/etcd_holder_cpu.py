"""Client CPU of holding many etcd leases on one connection: this tree vs another (e.g.
the commit before shared leases), in the same run, alternating (and which goes first),
on a private one-member etcd (tests/etcd_server.py).

    python benchmarks/etcd_holder_cpu.py --baseline /tmp/etcd-base [--runs 3]
        [--claims 1000] [--ttl 2] [--seconds 60]

Each pass is a subprocess with ``PYTHONPATH`` set to one tree: it acquires ``--claims``
locks (``ttl``, watchdog on) on one connection, lets the watchdog run for 5 s, then
measures the process's CPU time (user + system, all threads: grpc's included) over
``--seconds``, and counts the leases lost meanwhile. Prints each pass (CPU seconds per
minute of holding, leases lost, etcd leases alive on the server at the end) and the median
and range per tree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

PASS = """
import asyncio, json, sys, time
import aiolock

async def main() -> None:
    url, claims, ttl, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    async with aiolock.connect(url) as locks:
        leases = []
        for i in range(0, claims, 100):
            leases += await asyncio.gather(*(locks.lock(f"h{j}", ttl=ttl).acquire()
                                            for j in range(i, min(claims, i + 100))))
        await asyncio.sleep(5)
        lost_before = sum(lease.lost for lease in leases)
        cpu, wall = time.process_time(), time.monotonic()
        await asyncio.sleep(seconds)
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
        lost = sum(lease.lost for lease in leases) - lost_before
        from aiolock.backends.etcd._wire import pb
        backend = locks.backend
        reply = await backend._unary("Lease", "LeaseLeases", pb.LeaseLeasesRequest(), "leases")
        print(json.dumps({"cpu_per_min": cpu / wall * 60, "lost": lost,
                          "server_leases": len(reply.leases)}))
        for lease in leases:
            if not lease.lost:
                await lease.release()

asyncio.run(main())
"""


def one_pass(tree: str, url: str, claims: int, ttl: float, seconds: float) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, "-c", PASS, url, str(claims), str(ttl), str(seconds)],
                         env=env, cwd=tree, capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="another tree (with an aiolock/ dir)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--claims", type=int, default=1000)
    parser.add_argument("--ttl", type=float, default=2.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from tests.etcd_server import EtcdServer

    trees = {"this tree": str(HERE), "baseline": str(Path(args.baseline).resolve())}
    results: dict[str, list[dict[str, float]]] = {k: [] for k in trees}
    server = EtcdServer().start()
    try:
        for run in range(args.runs):
            order = list(trees) if run % 2 == 0 else list(reversed(trees))
            for label in order:
                url = f"{server.url}?prefix=cpu-{uuid.uuid4().hex[:8]}"
                r = one_pass(trees[label], url, args.claims, args.ttl, args.seconds)
                results[label].append(r)
                print(f"run {run + 1} {label:9}: {r['cpu_per_min']:.2f} CPU s/min, "
                      f"{r['lost']} lost, {r['server_leases']} etcd leases", flush=True)
    finally:
        server.close()
    for label, rs in results.items():
        cpu = [r["cpu_per_min"] for r in rs]
        lost = [r["lost"] for r in rs]
        print(f"{label:9}: CPU s/min median {statistics.median(cpu):.2f} "
              f"(range {min(cpu):.2f}-{max(cpu):.2f}); lost median {statistics.median(lost):.0f} "
              f"(range {min(lost)}-{max(lost)}), {args.claims} claims, ttl {args.ttl} s, "
              f"{args.seconds:.0f} s each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
