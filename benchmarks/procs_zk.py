"""P processes x T tasks on ONE ZooKeeper lock: how a lock hands off across processes.

The ZooKeeper twin of ``bench_procs.py`` (same columns, same layout). Every
implementation runs in the same run, against one private standalone ZooKeeper started
here (``tests/zk_server.py``'s ``ZooKeeperServer``: a child process on a free loopback
port, never a server that is already running), in P worker processes of T tasks each.
Each task loops: acquire -> ``await asyncio.sleep(0)`` -> release (kazoo is synchronous:
T threads on one ``KazooClient`` per process). In each round, each
implementation's workers start and open their sessions, warm up, then do one timed run;
the rounds alternate the order of the implementations (the load of a shared machine
drifts), and the tables give the median of 3 runs and their range (min-max).
``--grouped`` keeps one set of workers (sessions kept across runs) for 3 runs in a row
instead, as ``bench_procs.py`` does.

Columns (times on CLOCK_MONOTONIC, shared by all processes of the host):

- acq/s: acquisitions per second, all processes together.
- xproc/s: cross-process hand-offs per second: acquisitions whose previous holder was
  another process.
- handoff p50/p99 (ms): for cross-process hand-offs, from the moment the previous holder
  called release() until the next holder's acquire() returned.
- max handoff (ms): the longest hand-off of all, cross-process or in-process (another
  task of the same process), measured the same way; ``in-proc`` the longest in-process one.
- wait p99 (ms): from calling acquire() until it returned.
- req/acq: requests the server received per acquisition (``mntr`` ``zk_packets_received``
  deltas over the run, pings included; the server is standalone and
  private, so nothing else counts); watches/acq: watchers triggered (``mntr``
  ``zk_sum_node_*_watch_count``).
- CPU us/acq: client CPU (user + system of the worker processes, ``time.process_time``)
  per acquisition.
- min/max: the fewest and the most acquisitions of one process (and their ratio).

Usage::

    .venv/bin/python benchmarks/procs_zk.py [--quick] [--only NAME,...] [--scenarios 16x1,8x4]
                                            [--profile DIR] [--before REV] [--grouped]

``--profile DIR`` runs the asyncio workers (aiolock, aiozk) under ``cProfile`` and
writes one ``<scenario>-<impl>-<pid>.prof`` per worker process into DIR (timed runs
only). ``--before REV`` adds rows for aiolock as of git revision REV (``git archive`` of
its ``aiolock/`` put first on the workers' PYTHONPATH), for an A/B in the same run.
Tables go to stdout, progress to stderr. Needs ``java`` and Debian's ``zookeeper``
package; kazoo's rows need ``kazoo``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from _common import (  # noqa: E402
    Record,
    Run,
    Workers,
    checkout,
    fmt,
    go_commands,
    lead_cells,
    median_range,
    parse_go,
    peer_acquirer,
    procs_args,
    release_lease,
    release_peer,
    report,
    run_threads,
    spread,
    timed_loop,
    timed_runs,
)

TTL = 30


# -- the worker side ---------------------------------------------------------------------------
# A worker opens its session(s) once and keeps them across runs: a run measures the steady
# state, not session set-up (ZooKeeper's handshake and aiolock's chroot check).

async def _serve_async(impl: str, hosts: str, name: str, tasks: int, prof: Any) -> None:
    records: list[Record] = []
    async with contextlib.AsyncExitStack() as stack:
        if impl == "aiolock":
            import aiolock

            # (a connect timeout as long as kazoo's start timeout: a shared machine's load)
            locks = await stack.enter_async_context(
                aiolock.connect(f"zookeeper://{hosts}/bench-procs", connect_timeout=15))
            lock = locks.lock(name, ttl=TTL)
            loops = [timed_loop(records, i, lock.acquire, release_lease) for i in range(tasks)]
        else:  # aiozk: one client, one recipe object per task (one may not serve two tasks)
            import aiozk

            client = aiozk.ZKClient(hosts)
            await client.start()
            stack.push_async_callback(client.close)
            peers = [client.recipes.Lock(f"/bench-procs-aiozk/{name}") for _ in range(tasks)]
            loops = [timed_loop(records, i, peer_acquirer(p), release_peer)
                     for i, p in enumerate(peers)]
        loop = asyncio.get_running_loop()
        print("READY", flush=True)
        for go in itertools.count():
            command = parse_go(await loop.run_in_executor(None, sys.stdin.readline))
            if command is None:
                return
            stop, path = command
            records.clear()
            cpu = time.process_time()
            if prof is not None and go:  # not the warm-up
                prof.enable()
            await asyncio.gather(*(run(stop) for run in loops))
            if prof is not None:
                prof.disable()
            report(path, records, time.process_time() - cpu)


def _serve_threads(hosts: str, name: str, tasks: int) -> None:
    from kazoo.client import KazooClient

    client = KazooClient(hosts=hosts)
    client.start(timeout=15)
    records: list[Record] = []
    pid = os.getpid()
    locks = [client.Lock(f"/bench-procs-kazoo/{name}", f"{pid}-{i}") for i in range(tasks)]
    print("READY", flush=True)
    for stop, path in go_commands():
        records.clear()
        cpu = time.process_time()
        run_threads(records, locks, stop)
        report(path, records, time.process_time() - cpu)
    client.stop()
    client.close()


def worker(impl: str, hosts: str, name: str, tasks: int, profile: str) -> None:
    """Prints ``READY`` once its session is open, then reads ``GO <stop> <file>`` lines:
    runs until ``stop``, writes the records and the CPU time used to ``file`` (JSON),
    prints ``DONE``; ``QUIT`` ends it."""
    if impl == "kazoo":
        _serve_threads(hosts, name, tasks)
        return
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
    asyncio.run(_serve_async(impl, hosts, name, tasks, prof))
    if prof is not None:
        prof.dump_stats(f"{profile}-{os.getpid()}.prof")


# -- the driver ----------------------------------------------------------------------------------

def server_counts(port: int) -> dict[str, float]:
    from tests.zk_server import packets_and_watches  # (the driver puts the repository on the path)

    reqs, watches = packets_and_watches(port)
    return {"reqs": reqs, "watches": watches}


def bench(impl: str, hosts: str, port: int, nprocs: int, tasks: int, seconds: float,
          runs: int, tmp: Path, profile: str, path: str | None = None) -> list[Run]:
    name = f"procs-{impl.replace('@', '-')}-{nprocs}x{tasks}-{uuid.uuid4().hex[:6]}"
    prof = f"{profile}-{impl}" if profile and impl != "kazoo" else ""
    workers = Workers(__file__, [impl.split("@")[0], hosts, name, str(tasks), prof], nprocs, path)
    return timed_runs(workers, nprocs, seconds, runs, tmp, lambda: server_counts(port))


def row(label: str, runs: list[Run]) -> str:
    med = functools.partial(median_range, runs)
    return (f"{lead_cells(label, runs)} {fmt(max(r.max_handoff for r in runs), '.1f')}"
            f" / {fmt(max(r.max_local for r in runs), '.1f')} | {med('wait_p99', '.1f')} | "
            f"{med('reqs', '.2f')} | {med('watches', '.2f')} | {med('cpu_us', ',.0f')} | "
            f"{spread(runs)} | {med('handoffs_s', ',.0f')} |")


HEADER = ("| implementation | acq/s | xproc/s | handoff p50 / p99 ms | max handoff / in-proc ms "
          "| wait p99 ms | req/acq | watches/acq | CPU us/acq | min / max per process (ratio) "
          "| handoffs/s |\n|---|---|---|---|---|---|---|---|---|---|---|")

IMPLS = ["aiolock", "aiozk", "kazoo"]


def main() -> int:
    # not at import: a worker must import aiolock from its PYTHONPATH (see --before)
    sys.path.insert(0, str(ROOT))
    from tests.zk_server import ZooKeeperServer, four_letter

    ap = procs_args(__doc__, "16x1,8x4")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profile", help="cProfile the asyncio workers into this directory")
    ap.add_argument("--grouped", action="store_true",
                    help="all runs of one implementation, then the next (as bench_procs.py)")
    args = ap.parse_args()
    seconds = 1.5 if args.quick else 3.0
    impls = args.only.split(",") if args.only else list(IMPLS)
    tmp = Path(tempfile.mkdtemp(prefix="aiolock-procs-zk-"))
    paths: dict[str, str | None] = {}
    if args.before and "aiolock" in impls:
        label = f"aiolock@{args.before[:9]}"
        impls.insert(impls.index("aiolock") + 1, label)
        paths[label] = checkout(ROOT, args.before, tmp)
    if "kazoo" in impls:
        try:
            import kazoo  # noqa: F401
        except ImportError:
            print("kazoo is not installed (pip install kazoo): its rows are skipped", file=sys.stderr)
            impls.remove("kazoo")
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    print(f"# P processes x T tasks on one ZooKeeper lock ({seconds} s runs, median of "
          f"{args.runs} (range); {os.cpu_count()} CPUs, shared; load "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())})\n")
    server = ZooKeeperServer().start()
    try:
        version = four_letter(server.port, "srvr").splitlines()[0].split(":", 1)[1].split(",")[0]
        print(f"ZooKeeper {version.strip()}, private standalone server on a loopback port\n")
        for scenario in args.scenarios.split(","):
            nprocs, tasks = map(int, scenario.split("x"))
            print(f"## {nprocs} processes x {tasks} task(s)\n\n{HEADER}", flush=True)
            results: dict[str, list[Run]] = {impl: [] for impl in impls}
            failed: dict[str, str] = {}
            # one timed run per implementation per round, the order alternating between
            # rounds: on a shared machine the load drifts, and no implementation should
            # always run first or last (--grouped: all runs of one, then the next)
            rounds = [impls] if args.grouped else [
                impls if r % 2 == 0 else impls[::-1] for r in range(args.runs)]
            for order in rounds:
                for impl in order:
                    if impl in failed:
                        continue
                    print(f"{scenario} {impl} ...", file=sys.stderr, flush=True)
                    profile = str(Path(args.profile) / scenario) if args.profile else ""
                    try:
                        results[impl] += bench(impl, server.hosts, server.port, nprocs, tasks,
                                               seconds, args.runs if args.grouped else 1, tmp,
                                               profile, paths.get(impl))
                    except Exception as exc:
                        failed[impl] = f"{type(exc).__name__}: {exc}"
            for impl in impls:
                if impl in failed:
                    print(f"| {impl} | error: {failed[impl]} |", flush=True)
                else:
                    print(row(impl, results[impl]), flush=True)
            print(flush=True)
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6])
        sys.exit(0)
    sys.exit(main())
