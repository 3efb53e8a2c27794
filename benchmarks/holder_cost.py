"""The cost of holder records (SPEC §7, issue 12): uncontended acquire+release cycles/s of
this tree vs the last release before them (the parent of commit c187a4d), per backend, in
the same run, on private servers.

    python benchmarks/holder_cost.py [--baseline TREE] [--backends memory,redis,...]
        [--runs 5] [--seconds 3] [--no-record-pass] [--no-commands] [--callgrind]

Without ``--baseline``, the baseline is ``git archive c187a4d^ aiolock`` exported to a temp
dir. Each pass is a subprocess with ``PYTHONPATH`` set to one tree: ``before`` (the
baseline, ``lock(name, ttl=10)``: it has no ``data=``), ``after`` (this tree,
``lock(name, ttl=10, data="x" * 40)``), ``after-nodata`` (this tree without ``data=``:
the record of host, pid and task is written anyway) and, with ``--no-record-pass``,
``after-norecord`` (this tree with the record left empty: ``encode_holder`` patched to
give ``""``; what this tree costs without the record, to tell the record's share from the
other changes since the release). The order of the passes is reversed every other run,
so that none always goes first on a machine whose load drifts. Each tree has its own lock
name, Redis database, ZooKeeper chroot and SQL database, so that neither meets the
other's server state.

Each pass warms up (50 cycles), then times cycles for ``--seconds``: cycles/s (wall) and
the client process's CPU time per cycle (``time.process_time``: less sensitive to the
other processes of a loaded machine; on ``memory://`` the server is the client). Prints
each pass, then per backend the median and range of each pass and each pass's cost vs
``before``: from the medians, and paired run by run (the passes of one run are seconds
apart: less drift), median and range.

MySQL and etcd are not measured by default: their backends came after holder records
(there is no "before"); ``--backends mysql --baseline TREE`` compares this tree with
another one that has MySQL.

Unless ``--no-commands``: the server commands per cycle on Redis and Redlock (``INFO
commandstats`` over 2000 cycles after the warm-up, per pass; commands called by scripts
are counted too). With ``--callgrind`` (slow: minutes): client CPU instructions per cycle
on ``memory://``, from ``valgrind --tool=callgrind`` runs of 200 and 2200 cycles (the
difference over 2000 cycles; deterministic, unlike the rates).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
#: the commit that added holder records; its parent is the release before them
HOLDERS_COMMIT = "c187a4d"
BACKENDS = ("memory", "redis", "zookeeper", "postgres", "memcached", "redlock")
DATA = "x" * 40

#: one pass: argv = url, seconds (0: count ``cycles`` instead), lock name, data ("-": none),
#: cycles, redis ports for INFO commandstats ("-": none). Prints a JSON object.
PASS = r"""
import asyncio, json, os, socket, sys, time
import aiolock
if os.environ.get("HOLDERCOST_NO_RECORD"):  # this tree, the record left empty
    import aiolock._lock
    aiolock._lock.encode_holder = lambda data, task: ""

def redis_call(port, *args):
    with socket.create_connection(("127.0.0.1", port), 5) as s:
        s.sendall(("*%d\r\n" % len(args) + "".join(
            "$%d\r\n%s\r\n" % (len(a), a) for a in args)).encode())
        buf = b""
        while b"\r\n" not in buf:
            buf += s.recv(65536)
        head, _, rest = buf.partition(b"\r\n")
        if head[:1] != b"$":
            return head.decode()
        size = int(head[1:])
        while len(rest) < size:
            rest += s.recv(65536)
        return rest[:size].decode()

def commandstats(ports):
    calls = {}
    for port in ports:
        for line in redis_call(port, "INFO", "commandstats").splitlines():
            if line.startswith("cmdstat_"):
                name, _, fields = line[8:].partition(":")
                n = int(fields.split(",")[0].split("=")[1])
                if name not in ("info", "config|resetstat", "config"):
                    calls[name] = calls.get(name, 0) + n
    return calls

async def main() -> None:
    url, seconds, name, data = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
    cycles = int(sys.argv[5])
    ports = [] if sys.argv[6] == "-" else [int(p) for p in sys.argv[6].split(",")]
    async with aiolock.connect(url) as locks:
        lock = locks.lock(name, ttl=10) if data == "-" else locks.lock(name, ttl=10, data=data)
        for _ in range(50):  # warm up: connections, scripts, prepared statements
            await (await lock.acquire()).release()
        for port in ports:
            redis_call(port, "CONFIG", "RESETSTAT")
        n, start, cpu = 0, time.perf_counter(), time.process_time()
        if seconds > 0:
            while time.perf_counter() - start < seconds:
                await (await lock.acquire()).release()
                n += 1
        else:
            for n in range(1, cycles + 1):
                await (await lock.acquire()).release()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        out = {"cycles": n, "rate": n / elapsed if elapsed else 0.0, "cpu_us": cpu / n * 1e6}
        if ports:
            out["commands"] = commandstats(ports)
        print(json.dumps(out))

asyncio.run(main())
"""


class Tree:
    """A pass: its tree, its side (``before`` / ``after``: which server state it uses),
    the ``data`` it gives ``lock()`` (None: no ``data=``) and whether the record is left
    empty (``no_record``: ``encode_holder`` patched to give ``""``)."""

    def __init__(self, label: str, path: str, side: str, data: str | None,
                 no_record: bool = False) -> None:
        self.label, self.path, self.side, self.data = label, path, side, data
        self.no_record = no_record

    def run(self, url: str, *, seconds: float = 0.0, cycles: int = 0,
            ports: list[int] | None = None, wrap: list[str] | None = None) -> dict[str, Any]:
        """One subprocess pass; its JSON output."""
        env = dict(os.environ, PYTHONPATH=self.path, PYTHONHASHSEED="0")
        env.pop("HOLDERCOST_NO_RECORD", None)
        if self.no_record:
            env["HOLDERCOST_NO_RECORD"] = "1"
        cmd = [*(wrap or []), sys.executable, "-c", PASS, url, str(seconds), f"bench-{self.side}",
               self.data if self.data is not None else "-", str(cycles),
               ",".join(map(str, ports)) if ports else "-"]
        out = subprocess.run(cmd, env=env, cwd=self.path, capture_output=True, text=True,
                             timeout=600)
        if out.returncode != 0:
            raise RuntimeError(f"{self.label} pass on {url.split(':')[0]} failed:\n{out.stderr[-2000:]}")
        result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
        return result


def export_baseline(rev: str, into: Path) -> str:
    """``git archive REV aiolock`` of this repository, extracted under ``into``."""
    archive = subprocess.run(["git", "-C", str(HERE), "archive", rev, "aiolock"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return str(into)


async def _make_databases(url: str, names: list[str]) -> None:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        for name in names:
            await conn.execute(f"CREATE DATABASE {name}")
    finally:
        await conn.close()


class Servers:
    """The private servers of the backends measured, and the URL of each backend per side
    (``before`` / ``after``), so that the two trees never share server state."""

    def __init__(self) -> None:
        self.started: list[Any] = []
        self.redis_ports: list[int] = []

    def _start(self, factory: Callable[[], Any]) -> Any:
        server = factory().start()
        self.started.append(server)
        return server

    def urls(self, backend: str) -> dict[str, str]:
        """The URL per side; ``redis_ports`` is set for Redis and Redlock."""
        self.redis_ports = []
        if backend == "memory":
            return {side: "memory://" for side in ("before", "after")}
        if backend == "redis":
            from tests.servers import RedisServer

            r = self._start(RedisServer)
            self.redis_ports = [r.port]
            return {"before": f"redis://127.0.0.1:{r.port}/1", "after": f"redis://127.0.0.1:{r.port}/2"}
        if backend == "redlock":
            from tests.servers import RedisServer

            rs = [self._start(RedisServer) for _ in range(3)]
            self.redis_ports = [r.port for r in rs]
            hosts = ",".join(f"127.0.0.1:{r.port}" for r in rs)
            return {side: f"redlock://{hosts}" for side in ("before", "after")}
        if backend == "zookeeper":
            from tests.zk_server import ZooKeeperServer

            zk = self._start(ZooKeeperServer)
            return {side: f"zookeeper://127.0.0.1:{zk.port}/bench-{side}" for side in ("before", "after")}
        if backend == "postgres":
            from tests.pg_server import PostgresServer

            pg = self._start(PostgresServer)
            asyncio.run(_make_databases(pg.url, ["bench_before", "bench_after"]))
            base = pg.url.rpartition("/")[0]
            return {side: f"{base}/bench_{side}" for side in ("before", "after")}
        if backend == "mysql":
            from tests.mysql_server import USER, MariaDBServer

            my = self._start(MariaDBServer)
            my.sql("".join(f"CREATE DATABASE bench_{side};"
                           f" GRANT ALL ON bench_{side}.* TO '{USER}'@'127.0.0.1';"
                           for side in ("before", "after")))
            base = my.url.rpartition("/")[0]
            return {side: f"{base}/bench_{side}" for side in ("before", "after")}
        if backend == "memcached":
            from tests.mc_server import MemcachedServer

            mc = self._start(MemcachedServer)
            return {side: mc.url for side in ("before", "after")}
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")

    def close(self) -> None:
        for server in self.started:
            server.close()
        self.started.clear()


def summary(results: dict[str, list[dict[str, float]]]) -> list[str]:
    """Table rows: each pass's median and range of cycles/s and of client CPU us/cycle, then
    each pass's cost vs ``before``: from the medians, and paired run by run (median, range)."""
    lines = []
    for label, got in results.items():
        rate = [r["rate"] for r in got]
        cpu = [r["cpu_us"] for r in got]
        lines.append(f"    {label:14} {statistics.median(rate):8.0f}/s ({min(rate):.0f}-{max(rate):.0f})"
                     f"   client CPU {statistics.median(cpu):6.1f} us/cycle ({min(cpu):.1f}-{max(cpu):.1f})")
    before = results["before"]
    for label, got in results.items():
        if label == "before":
            continue
        parts = []
        for key, what, sign in (("rate", "cycles/s", -1), ("cpu_us", "client CPU", 1)):
            a = [r[key] for r in got]
            b = [r[key] for r in before]
            of_medians = sign * (statistics.median(a) / statistics.median(b) - 1)
            paired = [sign * (x / y - 1) for x, y in zip(a, b, strict=True)]
            parts.append(f"{what} {of_medians:+.1%} (paired {statistics.median(paired):+.1%}, "
                         f"{min(paired):+.1%} to {max(paired):+.1%})")
        lines.append(f"    cost {label:14} " + "; ".join(parts))
    return lines


def callgrind_instructions(tree: Tree) -> float:
    """Client instructions per cycle on ``memory://``: (I at 2200 cycles - at 200) / 2000."""
    totals = []
    for cycles in (200, 2200):
        with tempfile.TemporaryDirectory(prefix="holdercost-cg-") as tmp:
            out = Path(tmp) / "callgrind.out"
            tree.run("memory://", cycles=cycles,
                     wrap=["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"])
            match = re.search(r"^(?:summary|totals): (\d+)", out.read_text(), re.M)
            if match is None:
                raise RuntimeError("no totals in the callgrind output")
            totals.append(int(match.group(1)))
    return (totals[1] - totals[0]) / 2000


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--baseline", help=f"the tree before holder records (default: "
                        f"{HOLDERS_COMMIT}^ exported to a temp dir)")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help="comma-separated, of: " + ", ".join(BACKENDS) + ", mysql (with --baseline)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--no-commands", action="store_true", help="skip the Redis command counts")
    parser.add_argument("--no-record-pass", action="store_true",
                        help="add a pass of this tree with the holder record left empty")
    parser.add_argument("--callgrind", action="store_true",
                        help="also count instructions per cycle on memory:// (valgrind)")
    args = parser.parse_args()
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in (*BACKENDS, "mysql"):
            parser.error(f"unknown backend {b!r}; expected some of {', '.join(BACKENDS)}, mysql")
        if b == "mysql" and not args.baseline:
            parser.error("the mysql backend came after holder records: give --baseline TREE")
    if args.runs < 1 or args.seconds <= 0:
        parser.error("--runs must be >= 1 and --seconds > 0")
    if args.callgrind and shutil.which("valgrind") is None:
        parser.error("--callgrind needs valgrind")
    sys.path.insert(0, str(HERE))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # close the servers on kill

    tmp = tempfile.TemporaryDirectory(prefix="holdercost-before-")
    try:
        baseline = args.baseline or export_baseline(f"{HOLDERS_COMMIT}^", Path(tmp.name))
        trees = [Tree("before", baseline, "before", None), Tree("after", str(HERE), "after", DATA),
                 Tree("after-nodata", str(HERE), "after", None)]
        if args.no_record_pass:
            trees.append(Tree("after-norecord", str(HERE), "after", None, no_record=True))
        report: list[str] = []
        for backend in backends:
            start = len(report)
            servers = Servers()
            try:
                urls = servers.urls(backend)
                results: dict[str, list[dict[str, float]]] = {t.label: [] for t in trees}
                for run in range(args.runs):
                    for tree in trees if run % 2 == 0 else trees[::-1]:  # no order bias
                        got = tree.run(urls[tree.side], seconds=args.seconds)
                        results[tree.label].append(got)
                        print(f"run {run + 1} {backend:9} {tree.label:14} {got['rate']:8.0f} cycles/s"
                              f"  client CPU {got['cpu_us']:6.1f} us/cycle", flush=True)
                report += [f"{backend} ({args.runs} runs x {args.seconds:g} s per pass; median (range)):",
                           *summary(results)]
                if servers.redis_ports and not args.no_commands:
                    for tree in trees:
                        got = tree.run(urls[tree.side], cycles=2000, ports=servers.redis_ports)
                        per = {k: v / got["cycles"] for k, v in sorted(got["commands"].items())}
                        report.append(f"    commands/cycle {tree.label:14} {sum(per.values()):5.2f}: "
                                      + ", ".join(f"{k} {v:g}" for k, v in per.items()))
            finally:
                servers.close()
            print("\n".join(report[start:]), flush=True)
        if args.callgrind:
            report.append("memory, client instructions per cycle (callgrind, 2000 cycles):")
            base = None
            for tree in trees:
                ins = callgrind_instructions(tree)
                base = base or ins
                report.append(f"    {tree.label:14} {ins:10.0f}  ({ins / base - 1:+.1%} vs before)")
        print("\nsummary:\n" + "\n".join(report))
    finally:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
