"""Leader elections across processes: failover after ``kill -9`` and observe latency, per
backend, next to kazoo's ``Election`` (and aiozk's ``LeaderElection``) on the same
ZooKeeper, in one run, against private servers this script starts itself.

    .venv/bin/python benchmarks/bench_election.py --quick          # ~7 min: ttl 1 s
    .venv/bin/python benchmarks/bench_election.py                  # ~30 min: ttl 3 s
    .venv/bin/python benchmarks/bench_election.py --only redis,zookeeper,kazoo

(1) Failover: N candidate processes (3) campaign on one election
    (``locks.election(name, ttl=TTL).campaign(data)``); once a leader is known and every
    candidate has been campaigning for a while (``--settle``, plus a random part of the
    renewal period ttl/3, so that the kill lands at any phase of it), the leader process is sent
    SIGKILL, and the time from the kill to the moment another process's ``campaign``
    returns is taken on CLOCK_MONOTONIC (shared by the processes of one host); then a
    replacement candidate is started. K kills per run (``--kills``), 3 runs (``--runs``), the runs
    alternating between backends. kazoo: ``zk.Election(path, id).run(func)`` in each
    process, failover = kill -9 of the process whose ``func`` runs until another's runs;
    its session timeout (``KazooClient(timeout=...)``) is set to the ttl. aiozk:
    ``client.recipes.LeaderElection(path)``, ``volunteer()`` then
    ``wait_for_leadership()``, session timeout = the ttl.
(2) Observe latency: an observer process iterating ``election.observe()``; a changer
    process repeats: campaign (a new leader), ``proclaim(data)`` (new data), resign
    (vacant), ``--gap`` seconds apart (ttl/2 + gap + 0.25 s where the server sends no
    events: MySQL's and Memcached's ``observe()`` polls every ttl/2). Latency: from the
    change call (monotonic, in the changer) to the observer yielding the new state
    (monotonic, in the observer).
    kazoo's ``Election`` has no observe: its row is a ``ChildrenWatch`` on the election
    path calling ``contenders()`` (the first is the leader), the changes ``run(func)``
    and ``func`` returning (no proclaim). aiozk's ``LeaderElection`` has no way to
    read the leader: not measured.

A violation is a candidate's campaign returning while another live candidate leads (two
leaders at once) or a term (fencing token) not above the previous one; the exit status is
1 on any violation or error (a hang, a worker that fails). Tables go to stdout, progress
to stderr. The servers are the tests' own (``tests/servers.py``, ``tests/zk_server.py``,
``tests/pg_server.py``, ``tests/etcd_server.py``, ``tests/mc_server.py``,
``tests/mysql_server.py``) on free loopback ports: never the machine's own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import statistics
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(Path(__file__).resolve())
sys.path.insert(0, str(ROOT))  # aiolock from this tree, tests/*_server.py

import aiolock  # noqa: E402
from benchmarks._common import fmt, percentile  # noqa: E402

ALL = ["redis", "zookeeper", "zookeeper-st", "kazoo", "aiozk", "postgres", "etcd", "mysql",
       "memcached", "redlock"]


def mono() -> float:
    return time.monotonic()


def connect(address: str) -> aiolock.Locks:
    """``aiolock.connect`` of ``URL`` or ``URL##option=number``: an option that is a keyword
    of ``connect()`` only (ZooKeeper's ``session_timeout``)."""
    url, _, option = address.partition("##")
    if not option:
        return aiolock.connect(url)
    key, _, value = option.partition("=")
    return aiolock.connect(url, **{key: float(value)})


def say(*words: object) -> None:
    print(*words, flush=True)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- workers
# Run as ``bench_election.py --worker KIND ARGS...``; they talk to the parent on stdout:
# ``READY pid``, ``LEAD pid mono token``, ``LOST pid mono``, ``OBS mono data token``,
# ``CHANGE kind data t_call t_done``, ``DONE``.


async def cand_aiolock(url: str, name: str, ttl: float) -> None:
    pid = os.getpid()
    async with connect(url) as locks:
        election = locks.election(name, ttl=ttl)
        say("READY", pid)
        try:
            async with election.campaign(data=str(pid)) as term:
                say("LEAD", pid, mono(), term.token)
                await asyncio.sleep(3600)
        except aiolock.LockLost:
            say("LOST", pid, mono())
            await asyncio.sleep(3600)


def cand_kazoo(hosts: str, path: str, timeout: float) -> None:
    pid = os.getpid()
    zk = kazoo_client(hosts, timeout)

    def lead() -> None:
        say("LEAD", pid, mono(), "-")
        time.sleep(3600)

    say("READY", pid)
    zk.Election(path, str(pid)).run(lead)


async def cand_aiozk(hosts: str, path: str, timeout: float) -> None:
    import aiozk

    pid = os.getpid()
    zk = aiozk.ZKClient(hosts, session_timeout=timeout)
    await zk.start()
    election = zk.recipes.LeaderElection(path)
    say("READY", pid)
    await election.volunteer()
    await election.wait_for_leadership()
    say("LEAD", pid, mono(), "-")
    await asyncio.sleep(3600)


async def observer(url: str, name: str, ttl: float) -> None:
    async with connect(url) as locks:
        async for leader in locks.election(name, ttl=ttl).observe():
            now = mono()
            if leader is None:
                say("OBS", now, "-", "-")
            else:
                say("OBS", now, leader.data, leader.token)


async def changer(url: str, name: str, ttl: float, gap: float, cycles: int) -> None:
    loop = asyncio.get_running_loop()
    async with connect(url) as locks:
        election = locks.election(name, ttl=ttl)
        say("READY", os.getpid())
        await loop.run_in_executor(None, sys.stdin.readline)  # GO
        for i in range(cycles):
            data = f"c{i}"
            t = mono()
            term = await election.campaign(data=data).acquire()
            say("CHANGE", "campaign", data, t, mono())
            await asyncio.sleep(gap)
            data = f"p{i}"
            t = mono()
            await term.proclaim(data)
            say("CHANGE", "proclaim", data, t, mono())
            await asyncio.sleep(gap)
            t = mono()
            await term.release()
            say("CHANGE", "resign", "-", t, mono())
            await asyncio.sleep(gap)
        say("DONE")


def kazoo_client(hosts: str, timeout: float) -> Any:
    from kazoo.client import KazooClient  # type: ignore[import-untyped]

    zk = KazooClient(hosts=hosts, timeout=timeout)
    zk.start()
    return zk


def observer_kazoo(hosts: str, path: str, timeout: float) -> None:
    """kazoo has no observe: a ``ChildrenWatch`` on the election path, then
    ``Election.contenders()`` (the first is the leader), as a kazoo user would."""
    zk = kazoo_client(hosts, timeout)
    zk.ensure_path(path)
    election = zk.Election(path)
    last: list[object] = [object()]

    def changed(_children: list[str]) -> None:
        names = election.contenders()
        now = mono()
        data = names[0] if names else "-"
        if data != last[0]:
            last[0] = data
            say("OBS", now, data, "-")

    zk.ChildrenWatch(path)(changed)
    time.sleep(3600)


def changer_kazoo(hosts: str, path: str, timeout: float, gap: float, cycles: int) -> None:
    """kazoo's changes: ``Election(path, data).run(func)`` (a new leader), ``func``
    returning (resign); kazoo has no proclaim."""
    zk = kazoo_client(hosts, timeout)
    zk.ensure_path(path)
    say("READY", os.getpid())
    sys.stdin.readline()  # GO

    def lead(data: str, called: float, resigned: list[float]) -> None:
        say("CHANGE", "campaign", data, called, mono())
        time.sleep(gap)
        resigned.append(mono())

    for i in range(cycles):
        resigned: list[float] = []
        zk.Election(path, f"c{i}").run(lead, f"c{i}", mono(), resigned)
        say("CHANGE", "resign", "-", resigned[0], mono())
        time.sleep(gap)
    say("DONE")


def worker_main(argv: list[str]) -> None:
    kind, *args = argv
    if kind == "aiolock":
        asyncio.run(cand_aiolock(args[0], args[1], float(args[2])))
    elif kind == "kazoo":
        cand_kazoo(args[0], args[1], float(args[2]))
    elif kind == "aiozk":
        asyncio.run(cand_aiozk(args[0], args[1], float(args[2])))
    elif kind == "observer":
        asyncio.run(observer(args[0], args[1], float(args[2])))
    elif kind == "changer":
        asyncio.run(changer(args[0], args[1], float(args[2]), float(args[3]), int(args[4])))
    elif kind == "observer-kazoo":
        observer_kazoo(args[0], args[1], float(args[2]))
    elif kind == "changer-kazoo":
        changer_kazoo(args[0], args[1], float(args[2]), float(args[3]), int(args[4]))
    else:
        raise SystemExit(f"unknown worker {kind!r}")


# --------------------------------------------------------------------------- parent


@dataclass
class Target:
    """One row: an implementation on one server."""

    name: str
    impl: str  # "aiolock", "kazoo" or "aiozk"
    #: a fresh URL (aiolock) or ``hosts/path`` pair (kazoo, aiozk) per run
    address: Callable[[], str]
    #: ``observe()`` is woken by the server (False: it polls every ttl/2)
    events: bool = True
    bound: str = ""


@dataclass
class FailoverRun:
    samples: list[float] = field(default_factory=list)
    lost: int = 0
    violations: int = 0


@dataclass
class ObserveRun:
    latencies: dict[str, list[float]] = field(default_factory=dict)
    changes: int = 0
    missed: int = 0


class BenchError(Exception):
    """A run failed: a hang or a worker that died."""


class Workers:
    """Worker processes of one run; their stdout lines go to one queue."""

    def __init__(self) -> None:
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.queue: asyncio.Queue[list[str]] = asyncio.Queue()
        self.readers: list[asyncio.Task[None]] = []

    async def spawn(self, *args: str, stdin: bool = False) -> asyncio.subprocess.Process:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, SCRIPT, "--worker", *args,
            stdout=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL, env=env)
        self.procs[proc.pid] = proc
        self.readers.append(asyncio.create_task(self._read(proc)))
        return proc

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            words = raw.decode().split()
            if words:
                await self.queue.put(words)
        await proc.wait()
        await self.queue.put(["EXIT", str(proc.pid), str(proc.returncode)])

    async def next(self, deadline: float) -> list[str] | None:
        """The next line, or None at ``deadline`` (monotonic)."""
        try:
            return await asyncio.wait_for(self.queue.get(), max(0.0, deadline - mono()))
        except TimeoutError:
            return None

    def kill(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    async def close(self) -> None:
        for pid, proc in self.procs.items():
            if proc.returncode is None:
                self.kill(pid)
        for proc in self.procs.values():
            await proc.wait()
        for task in self.readers:
            task.cancel()
        await asyncio.gather(*self.readers, return_exceptions=True)


def worker_args(target: Target, ttl: float) -> list[str]:
    address = target.address()
    if target.impl == "aiolock":
        return ["aiolock", address, f"bench-election-{uuid.uuid4().hex[:8]}", str(ttl)]
    hosts, path = address.split("/", 1)
    return [target.impl, hosts, "/" + path, str(ttl)]


async def failover_run(target: Target, ttl: float, candidates: int, kills: int,
                       settle: float) -> FailoverRun:
    """One run: ``kills`` leaders killed one after another, each time a failover sample."""
    run = FailoverRun()
    args = worker_args(target, ttl)
    workers = Workers()
    alive: set[int] = set()
    ready: set[int] = set()
    leader: int | None = None
    killed_at: float | None = None
    last_token: int | None = None
    limit = 4 * ttl + 20  # a hang, far past any documented bound

    def handle(words: list[str]) -> None:
        nonlocal leader, killed_at, last_token
        what = words[0]
        if what == "READY":
            ready.add(int(words[1]))
        elif what == "LEAD":
            pid, at = int(words[1]), float(words[2])
            if leader is not None:
                run.violations += 1
                log(f"  VIOLATION: {pid} leads while {leader} (alive, not killed) leads")
            if words[3] != "-":
                token = int(words[3])
                if last_token is not None and token <= last_token:
                    run.violations += 1
                    log(f"  VIOLATION: term {token} after term {last_token}")
                last_token = token
            leader = pid
            if killed_at is not None:
                run.samples.append(at - killed_at)
                killed_at = None
        elif what == "LOST":
            run.lost += 1
            log(f"  leader {words[1]} lost its leadership (not killed)")
            if leader == int(words[1]):
                leader = None
        elif what == "EXIT":
            pid = int(words[1])
            if pid in alive:
                raise BenchError(f"candidate {pid} exited with {words[2]}")
        else:
            raise BenchError(f"unexpected line {' '.join(words)!r}")

    async def until(done: Callable[[], bool], within: float, what: str) -> None:
        deadline = mono() + within
        while not done():
            words = await workers.next(deadline)
            if words is None:
                raise BenchError(f"{target.name}: no {what} within {within:.0f} s")
            handle(words)

    async def drain(seconds: float) -> None:
        deadline = mono() + seconds
        while (words := await workers.next(deadline)) is not None:
            handle(words)

    async def start_one() -> None:
        proc = await workers.spawn(*args)
        alive.add(proc.pid)

    def settled() -> bool:
        return leader is not None and alive <= ready

    def taken_over() -> bool:
        return killed_at is None

    try:
        for _ in range(candidates):
            await start_one()
        for _ in range(kills):
            await until(settled, limit, "leader")
            # the others queue up (a second leader would show here); the kill lands at a
            # random phase of the leader's renewal period (ttl/3)
            await drain(settle + random.uniform(0, ttl / 3))
            if leader is None:
                continue  # lost during the settle: counted, wait for the next one
            victim = leader
            killed_at = mono()
            workers.kill(victim)
            alive.discard(victim)
            leader = None
            await until(taken_over, limit, "new leader after the kill")
            await start_one()  # after the failover: a process start takes CPU
        await drain(0.2)
    finally:
        await workers.close()
    return run


async def observe_run(target: Target, ttl: float, gap: float, cycles: int) -> ObserveRun:
    """One run: an observer process, a changer process making ``3 * cycles`` changes."""
    run = ObserveRun()
    if target.impl == "aiolock":
        where = [target.address(), f"bench-observe-{uuid.uuid4().hex[:8]}"]
        kinds = ("observer", "changer")
    else:  # kazoo
        hosts, path = target.address().split("/", 1)
        where = [hosts, "/" + path]
        kinds = ("observer-kazoo", "changer-kazoo")
    workers = Workers()
    seen: list[tuple[float, str]] = []
    changes: list[tuple[str, str, float]] = []
    try:
        await workers.spawn(kinds[0], *where, str(ttl))
        limit = mono() + 30
        while not seen:
            words = await workers.next(limit)
            if words is None or words[0] == "EXIT":
                raise BenchError(f"{target.name}: the observer did not start")
            if words[0] == "OBS":
                seen.append((float(words[1]), words[2]))
        proc = await workers.spawn(kinds[1], *where, str(ttl), str(gap), str(cycles),
                                   stdin=True)
        limit = mono() + 30 + cycles * 3 * (gap + ttl + 5)
        started = False
        while True:
            words = await workers.next(limit)
            if words is None:
                raise BenchError(f"{target.name}: the changer did not finish")
            what = words[0]
            if what == "OBS":
                seen.append((float(words[1]), words[2]))
            elif what == "READY" and not started:
                assert proc.stdin is not None
                proc.stdin.write(b"GO\n")
                await proc.stdin.drain()
                started = True
            elif what == "CHANGE":
                changes.append((words[1], words[2], float(words[3])))
            elif what == "DONE":
                break
            elif what == "EXIT":
                raise BenchError(f"{target.name}: worker {words[1]} exited with {words[2]}")
        deadline = mono() + max(gap, ttl)  # the observer's last lines
        while (words := await workers.next(deadline)) is not None:
            if words[0] == "OBS":
                seen.append((float(words[1]), words[2]))
    finally:
        await workers.close()
    for i, (kind, data, t_call) in enumerate(changes):
        t_next = changes[i + 1][2] if i + 1 < len(changes) else float("inf")
        run.changes += 1
        match = next((t for t, d in seen if d == data and t_call <= t < t_next), None)
        if match is None:
            run.missed += 1
        else:
            run.latencies.setdefault(kind, []).append(match - t_call)
    return run


# --------------------------------------------------------------------------- report


def med_range(values: list[float], scale: float = 1000.0, spec: str = ",.0f") -> str:
    values = [v for v in values if v == v]
    if not values:
        return "-"
    values = [v * scale for v in values]
    mid = statistics.median(values)
    if len(values) == 1:
        return fmt(mid, spec)
    return f"{fmt(mid, spec)} ({fmt(min(values), spec)}-{fmt(max(values), spec)})"


def failover_table(targets: list[Target], results: dict[str, list[FailoverRun]], ttl: float) -> None:
    print(f"\n### Failover after kill -9 of the leader process (ttl {ttl:g} s)\n")
    print("Per run: p50 and p99 (nearest rank) of the kill -> next leader's campaign return; each "
          "cell: the median of the runs (min-max).\n")
    print("| backend | documented dead-leader bound | failover p50 ms | failover p99 ms "
          "| kills | lost (not killed) | two leaders / term order |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for target in targets:
        runs = results.get(target.name, [])
        if not runs:
            continue
        p50 = [percentile(r.samples, 50) for r in runs]
        p99 = [percentile(r.samples, 99) for r in runs]
        print(f"| {target.name} | {target.bound} | {med_range(p50)} | {med_range(p99)} "
              f"| {sum(len(r.samples) for r in runs)} | {sum(r.lost for r in runs)} "
              f"| {sum(r.violations for r in runs)} |")


def observe_table(targets: list[Target], results: dict[str, list[ObserveRun]],
                  gaps: dict[str, float]) -> None:
    print("\n### Observe latency: change call -> the observer process yields the new state\n")
    print("Per run: p50 / p99 over all changes, and p50 per kind of change; each cell: the "
          "median of the runs (min-max), ms.\n")
    print("| backend | all p50 | all p99 | new leader p50 | proclaim p50 | resign (vacant) p50 "
          "| changes | missed | gap s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for target in targets:
        runs = results.get(target.name, [])
        if not runs:
            continue
        every = [[x for v in r.latencies.values() for x in v] for r in runs]
        cells = [med_range([percentile(v, 50) for v in every], spec=",.1f"),
                 med_range([percentile(v, 99) for v in every], spec=",.1f")]
        for kind in ("campaign", "proclaim", "resign"):
            cells.append(med_range([percentile(r.latencies.get(kind, []), 50) for r in runs],
                                   spec=",.1f"))
        print(f"| {target.name} | {' | '.join(cells)} | {sum(r.changes for r in runs)} "
              f"| {sum(r.missed for r in runs)} | {gaps[target.name]:g} |")


# --------------------------------------------------------------------------- servers


@contextlib.contextmanager
def servers(wanted: set[str], ttl: float) -> Iterator[list[Target]]:
    """Start the servers the wanted rows need; yield the rows, in table order."""
    started: list[Any] = []

    def start(server: Any) -> Any:
        log(f"starting {type(server).__name__}")
        started.append(server)
        return server.start()

    def fresh() -> str:
        return uuid.uuid4().hex[:8]

    def ceil(x: float) -> int:
        return -int(-x // 1)

    targets: list[Target] = []
    try:
        if "redis" in wanted:
            from tests.servers import RedisServer

            redis = start(RedisServer())
            targets.append(Target("redis", "aiolock", lambda: str(redis.url),
                                  bound="ttl after the last renewal"))
        if wanted & {"zookeeper", "zookeeper-st", "kazoo", "aiozk"}:
            from tests.zk_server import ZooKeeperServer

            zk = start(ZooKeeperServer())
            if "zookeeper" in wanted:
                targets.append(Target(
                    "zookeeper", "aiolock", lambda: f"zookeeper://{zk.hosts}/bench-{fresh()}",
                    bound="min(ttl, session 20 s) + ttl/3"))
            if "zookeeper-st" in wanted:
                targets.append(Target(
                    "zookeeper, session_timeout=ttl", "aiolock",
                    lambda: f"zookeeper://{zk.hosts}/bench-{fresh()}##session_timeout={ttl:g}",
                    bound="min(ttl, session) + ttl/3"))
            if "kazoo" in wanted:
                targets.append(Target("kazoo `Election`, session timeout = ttl", "kazoo",
                                      lambda: f"{zk.hosts}/bench-kazoo-{fresh()}/election",
                                      bound="session timeout"))
            if "aiozk" in wanted:
                targets.append(Target("aiozk `LeaderElection`, session timeout = ttl", "aiozk",
                                      lambda: f"{zk.hosts}/bench-aiozk-{fresh()}/election",
                                      bound="session timeout"))
        if "postgres" in wanted:
            from tests.pg_server import PostgresServer

            pg = start(PostgresServer())
            targets.append(Target("postgres", "aiolock", lambda: str(pg.url),
                                  bound="at once (its connection drops)"))
        if "etcd" in wanted:
            from tests.etcd_server import EtcdServer

            etcd = start(EtcdServer())
            targets.append(Target("etcd", "aiolock", lambda: f"{etcd.url}?prefix=bench-{fresh()}",
                                  bound="ceil(ttl) (whole-second lease) + the server's 0.5 s "
                                  "expiry sweep"))
        if "mysql" in wanted:
            from tests.mysql_server import MariaDBServer

            mysql = start(MariaDBServer())
            targets.append(Target("mysql (MariaDB)", "aiolock", lambda: str(mysql.url),
                                  events=False, bound="at once (its connection drops)"))
        if "memcached" in wanted:
            from tests.mc_server import MemcachedServer

            mc = start(MemcachedServer())
            targets.append(Target("memcached", "aiolock", lambda: str(mc.url), events=False,
                                  bound=f"ceil(ttl)+1 to +2 s = {ceil(ttl) + 1}-{ceil(ttl) + 2} s "
                                  "after the last renewal"))
        if "redlock" in wanted:
            from tests.servers import RedisServer

            nodes = [start(RedisServer()) for _ in range(3)]
            address = "redlock://" + ",".join(f"127.0.0.1:{n.port}" for n in nodes)
            targets.append(Target("redlock (3 nodes)", "aiolock", lambda: address,
                                  bound="ttl after the last renewal"))
        yield targets
    finally:
        for server in reversed(started):
            with contextlib.suppress(Exception):
                server.close()


# --------------------------------------------------------------------------- main


async def bench(args: argparse.Namespace) -> int:
    wanted = set(args.only.split(",")) if args.only else set(ALL)
    unknown = wanted - set(ALL)
    if unknown:
        raise ValueError(f"unknown backends {sorted(unknown)}; known: {', '.join(ALL)}")
    failures = 0
    with servers(wanted, args.ttl) as targets:
        fail: dict[str, list[FailoverRun]] = {}
        obs: dict[str, list[ObserveRun]] = {}
        gaps = {t.name: args.gap if t.events else round(args.ttl / 2 + args.gap + 0.25, 2)
                for t in targets}
        for rnd in range(args.runs):
            ordered = targets if rnd % 2 == 0 else targets[::-1]
            for target in ordered:
                log(f"run {rnd + 1}/{args.runs}: failover, {target.name}")
                try:
                    run = await failover_run(target, args.ttl, args.candidates, args.kills,
                                             args.settle)
                except Exception:
                    failures += 1
                    traceback.print_exc()
                    continue
                fail.setdefault(target.name, []).append(run)
                failures += run.violations
                log(f"  failover ms: {', '.join(f'{s * 1000:.0f}' for s in run.samples)}")
            for target in ordered:
                if target.impl == "aiozk" or args.no_observe:
                    continue
                log(f"run {rnd + 1}/{args.runs}: observe, {target.name}")
                try:
                    orun = await observe_run(target, args.ttl, gaps[target.name], args.cycles)
                except Exception:
                    failures += 1
                    traceback.print_exc()
                    continue
                obs.setdefault(target.name, []).append(orun)
                every = [x for v in orun.latencies.values() for x in v]
                log(f"  observe p50 {percentile(every, 50) * 1000:.1f} ms, "
                    f"max {max(every, default=float('nan')) * 1000:.1f} ms, "
                    f"missed {orun.missed}/{orun.changes}")
    print(f"\n## Elections: {args.candidates} candidate processes, ttl {args.ttl:g} s, "
          f"{args.kills} kills x {args.runs} runs; {time.strftime('%Y-%m-%d %H:%M %Z')}, "
          f"load average at the end {os.getloadavg()[0]:.1f}")
    failover_table(targets, fail, args.ttl)
    if not args.no_observe:
        observe_table([t for t in targets if t.impl != "aiozk"], obs, gaps)
    if failures:
        log(f"{failures} error(s) or violation(s): see above")
        return 1
    return 0


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="ttl 1 s, 4 kills and 4 observe cycles per run (~7 min)")
    parser.add_argument("--only", default="", help=f"comma-separated rows: {','.join(ALL)}")
    parser.add_argument("--ttl", type=float, help="election ttl, s (3; 1 with --quick)")
    parser.add_argument("--kills", type=int, help="kills per run (10; 4 with --quick)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--candidates", type=int, default=3)
    parser.add_argument("--settle", type=float, default=0.5,
                        help="s between a new leader (and every candidate campaigning) and the kill")
    parser.add_argument("--cycles", type=int, help="observe: campaign/proclaim/resign cycles per "
                        "run (10; 4 with --quick)")
    parser.add_argument("--gap", type=float, default=0.3, help="observe: s between changes")
    parser.add_argument("--no-observe", action="store_true")
    args = parser.parse_args()
    args.ttl = args.ttl or (1.0 if args.quick else 3.0)
    args.kills = args.kills or (4 if args.quick else 10)
    args.cycles = args.cycles or (4 if args.quick else 10)
    if args.ttl <= 0 or args.kills < 1 or args.runs < 1 or args.candidates < 2:
        raise ValueError("--ttl must be > 0, --kills and --runs >= 1, --candidates >= 2")
    sys.exit(asyncio.run(bench(args)))


if __name__ == "__main__":
    main()
