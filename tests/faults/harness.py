"""The orchestrator: per backend, start the server(s), the checker, the proxies and the
workers; inject faults; run the fault-free probes; collect and analyse.

Use :func:`run` (in-process) or ``python -m tests.faults`` (see ``__main__.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiolock import Capability

from .analysis import Figure, analyze
from .backends import BACKENDS, BackendSpec, ensemble_class
from .common import CheckerClient, mono
from .proxy import Proxies
from .records import Event, Record, parse

__all__ = ["Config", "Result", "run"]

ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger("tests.faults")


@dataclass
class Config:
    """What one run does. :meth:`quick` and :meth:`long` are the two presets."""

    backends: list[str]
    seed: int = 1
    mode: str = "quick"
    ttl: float = 1.0
    procs: int = 3
    tasks: int = 3
    locks: int = 2
    chaos: float = 0.05
    #: quick: every fault kind once (shuffled); long: random kinds until ``target`` writes
    target: int = 0
    max_seconds: float = 30.0
    gap: float = 0.4
    cancels: int = 300
    holds: int = 100
    hold_ttl: float = 1.0
    timeouts: int = 20
    stall_rounds: int = 1
    #: backends run at once (quick: 3; they mostly wait, the CPU stays idle)
    parallel: int = 3
    #: election mode: the workers campaign (``election(name).campaign()``) instead of
    #: locking; the fault-free probes (locks) are left out; a backend that does not
    #: declare ``Capability.ELECTION`` is skipped
    election: bool = False

    @classmethod
    def quick(cls, backends: list[str], seed: int) -> Config:
        return cls(backends=backends, seed=seed)

    @classmethod
    def long(cls, backends: list[str], seed: int) -> Config:
        return cls(backends=backends, seed=seed, mode="long", procs=4, tasks=4, locks=4, target=100_000,
                   max_seconds=7200.0, gap=2.0, cancels=10_000, holds=10_000, hold_ttl=2.0,
                   timeouts=300, stall_rounds=10, parallel=1)

    def holds_for(self, spec: BackendSpec) -> tuple[int, int]:
        """(total holds, held at once) in the fault-free probe of ``spec``: a backend
        holding one server connection per lease gets fewer (the test servers allow 200)."""
        total = self.holds
        if spec.connection_per_hold:
            total, at_once = min(total, 1000 if self.mode == "long" else 50), 100
        else:
            at_once = spec.holds_at_once or total
        return total, at_once


@dataclass
class Result:
    """The figures of one backend (or why it was skipped)."""

    backend: str
    figures: list[Figure] = field(default_factory=list)
    skipped: str = ""
    seconds: float = 0.0
    error: str = ""

    def failed(self) -> list[Figure]:
        return [f for f in self.figures if f.status == "FAIL"]


@dataclass
class Worker:
    proc: asyncio.subprocess.Process
    proxy: Proxies | None
    index: int
    replaced: bool = False


class BackendRun:
    """Everything for one backend column."""

    def __init__(self, spec: BackendSpec, cfg: Config, tmp: Path, say: Any) -> None:
        self.spec = spec
        self.cfg = cfg
        self.tmp = tmp
        self.say = say
        self.rng = random.Random(f"{cfg.seed}-{spec.key}")
        self.server: Any = None
        self.checker: asyncio.subprocess.Process | None = None
        self.ctl: CheckerClient | None = None
        self.sock = str(tmp / "checker.sock")
        self.workers: list[Worker] = []
        self.events: list[Event] = []
        self.spawned = 0
        self.names = [f"{spec.key}-lock{i}" for i in range(cfg.locks)]
        #: redis-cluster: each lock's master port (see actions.restart_slot_owner)
        self.owners: dict[str, int] = {}

    # -- processes ---------------------------------------------------------------------------

    async def start_checker(self) -> None:
        self.checker = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.faults.checker", self.sock, cwd=ROOT,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )
        assert self.checker.stdout is not None
        await asyncio.wait_for(self.checker.stdout.readline(), 30)
        self.ctl = await CheckerClient(self.sock).open()

    def direct_url(self) -> str:
        return self.spec.url(self.server, None)

    async def spawn_worker(self, index: int, proxy: Proxies | None) -> Worker:
        if proxy is None and self.spec.proxied:
            proxy = await Proxies(self.spec.ports(self.server)).start()
        url = self.spec.url(self.server, proxy.ports if proxy else None)
        self.spawned += 1
        err = open(self.tmp / f"worker-{self.spawned}.stderr", "wb")  # noqa: SIM115, ASYNC230
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tests.faults.worker", "--url", url, "--kind", self.spec.echo,
                "--locks", ",".join(self.names), "--tasks", str(self.cfg.tasks),
                "--ttl", str(self.cfg.ttl), "--checker", self.sock,
                "--seed", str(self.rng.randrange(1 << 30)), "--chaos", str(self.cfg.chaos),
                "--options", json.dumps(self.spec.options),
                *(["--election"] if self.cfg.election else []), cwd=ROOT,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=err,
            )
        finally:
            err.close()
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        if not line.startswith(b"READY"):
            raise RuntimeError(f"worker did not start: {line!r}; see {self.tmp}")
        return Worker(proc, proxy, index)

    def alive(self) -> list[Worker]:
        return [w for w in self.workers if w.proc.returncode is None]

    # -- faults -----------------------------------------------------------------------------

    async def pick(self) -> tuple[Worker, list[list[Any]]]:
        """A worker that holds a lock now (as the checker heard), and what it holds."""
        assert self.ctl is not None
        deadline = mono() + 2.0
        while True:
            holders, _ = await self.ctl.call("HOLD")
            alive = {w.proc.pid: w for w in self.alive()}
            pids = sorted({v[0] for v in holders.values() if v[0] in alive})
            if pids or mono() > deadline:
                break
            await asyncio.sleep(0.02)
        if not pids:
            w = self.rng.choice(list(alive.values()))
            return w, []
        pid = self.rng.choice(pids)
        return alive[pid], [[lock, v[1]] for lock, v in holders.items() if v[0] == pid]

    def event(self, kind: str, t0: float, t1: float, pid: int = 0,
              holdings: list[list[Any]] | None = None, **more: Any) -> None:
        self.events.append(Event(kind, t0, t1, pid, holdings or [], more))

    async def respawn_dead(self) -> None:
        """A worker that exited on its own (an exception escaped the library) is recorded
        as a ``crash`` event and replaced."""
        for w in list(self.workers):
            if w.proc.returncode is not None and not w.replaced:
                w.replaced = True
                if w.proc.returncode != -signal.SIGKILL:
                    t = mono()
                    self.event("crash", t, t, w.proc.pid, code=w.proc.returncode)
                    self.say(f"  {self.spec.key}: worker {w.proc.pid} exited {w.proc.returncode} "
                             f"(see {self.tmp})")
                    self.workers.append(await self.spawn_worker(w.index, w.proxy))

    async def inject(self, kind: str) -> None:
        await self.respawn_dead()
        try:
            await self._inject(kind)
        except ProcessLookupError:
            await self.respawn_dead()  # the target exited meanwhile: no fault this time

    async def _inject(self, kind: str) -> None:
        w, holdings = await self.pick()
        await self.spec.faults[kind](self, w, holdings)

    # -- phases -------------------------------------------------------------------------------

    async def workload(self) -> None:
        cfg = self.cfg
        self.workers = [await self.spawn_worker(i, None) for i in range(cfg.procs)]
        started = mono()
        assert self.ctl is not None
        if cfg.mode == "quick":
            schedule = list(self.spec.faults)
            self.rng.shuffle(schedule)
            await asyncio.sleep(0.5)
            for kind in schedule:
                await self.inject(kind)
                await asyncio.sleep(cfg.gap * self.rng.uniform(0.5, 1.5))
        else:
            next_report = mono() + 30
            while mono() - started < cfg.max_seconds:
                _, writes = await self.ctl.call("HOLD")
                if writes >= cfg.target:
                    break
                if mono() > next_report:
                    self.say(f"  {self.spec.key}: {writes:,} fenced writes, {len(self.events)} faults, "
                             f"{mono() - started:.0f}s")
                    next_report = mono() + 60
                await asyncio.sleep(cfg.gap * self.rng.uniform(0.5, 1.5))
                await self.inject(self.rng.choice(list(self.spec.faults)))
        await self.stop_workers()

    async def stop_workers(self) -> None:
        for w in self.alive():
            with contextlib.suppress(Exception):
                os.kill(w.proc.pid, signal.SIGCONT)
                assert w.proc.stdin is not None
                w.proc.stdin.write(b"STOP\n")
                w.proc.stdin.close()
        for w in self.workers:
            try:
                await asyncio.wait_for(w.proc.wait(), 30)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.kill()
                await w.proc.wait()
        for w in self.workers:
            if w.proxy is not None:
                await w.proxy.aclose()

    async def probes(self) -> tuple[dict[str, Any], dict[str, Any]]:
        cfg = self.cfg
        total, at_once = cfg.holds_for(self.spec)
        common = ["--url", self.direct_url(), "--kind", self.spec.echo, "--seed", str(cfg.seed)]
        options = json.dumps(self.spec.options)
        # a ZooKeeper lease is believed for at most the session timeout (keep ttl below 2.4x)
        lock_ttl = 2 * float(self.spec.options.get("session_timeout", 15.0))
        probe = self._probe(["probe", *common, "--options", options, "--ttl", str(cfg.ttl),
                             "--lock-ttl", str(lock_ttl), "--cancels", str(cfg.cancels),
                             "--timeouts", str(cfg.timeouts), "--stall-rounds", str(cfg.stall_rounds)])
        hold_options = dict(self.spec.options)
        if self.spec.connection_per_hold:
            hold_options["max_connections"] = at_once + 20
        holds = self._probe(["holds", *common, "--options", json.dumps(hold_options),
                             "--ttl", str(max(cfg.hold_ttl, self.spec.min_hold_ttl)), "--count", str(total),
                             "--concurrency", str(at_once), "--prefix", "holds",
                             "--burst", str(self.spec.burst)])
        a, b = await asyncio.gather(probe, holds)
        return a, b

    async def _probe(self, args: list[str]) -> dict[str, Any]:
        err = self.tmp / f"probe-{args[0]}.stderr"
        with err.open("wb") as fh:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tests.faults.probe", *args, cwd=ROOT,
                stdout=asyncio.subprocess.PIPE, stderr=fh,
            )
        out, _ = await asyncio.wait_for(proc.communicate(), 3600)
        for line in out.decode().splitlines():
            if line.startswith("RESULT "):
                result: dict[str, Any] = json.loads(line[7:])
                return result
        raise RuntimeError(f"probe {args[0]} failed: {err.read_text()[-2000:]}")

    def _start_server(self) -> Any:
        server = self.spec.server()
        server.start()
        return server

    async def run(self) -> Result:
        started = mono()
        result = Result(self.spec.key)
        if self.cfg.election and Capability.ELECTION not in self.spec.capabilities:
            result.skipped = "does not declare election"
            return result
        try:
            self.server = await asyncio.to_thread(self._start_server)
        except Exception as exc:
            result.skipped = f"server did not start: {exc}"
            return result
        try:
            await self.start_checker()
            await self.workload()
            assert self.ctl is not None
            path = str(self.tmp / "checker.jsonl")
            await self.ctl.call("DUMP", path)
            # parsing and analysis run in a thread: this event loop also runs the proxies
            # of the backends still in their workload (a stall here stalls their traffic)
            records = await asyncio.to_thread(_load, Path(path))
            probe: dict[str, Any] = {}
            holds: dict[str, Any] = {}
            extra: dict[str, Any] = {}
            if not self.cfg.election:  # the probes and extras are about locks
                probe, holds = await self.probes()
                if self.spec.extra is not None:
                    extra = await self.spec.extra(self)
            result.figures = await asyncio.to_thread(
                analyze, self.spec, self.cfg.ttl, records, self.events, probe, holds, extra)
            (self.tmp / "events.json").write_text(json.dumps([ev.json() for ev in self.events]))
            (self.tmp / "probe.json").write_text(json.dumps([probe, holds]))
        except Exception as exc:
            log.exception("backend %s failed", self.spec.key)
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            await self.close()
            result.seconds = mono() - started
        return result

    async def close(self) -> None:
        for w in self.workers:
            if w.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.proc.pid, signal.SIGCONT)
                    w.proc.kill()
                await w.proc.wait()
        if self.ctl is not None:
            await self.ctl.aclose()
        if self.checker is not None:
            if self.checker.stdin is not None:
                self.checker.stdin.close()
            try:
                await asyncio.wait_for(self.checker.wait(), 5)
            except TimeoutError:
                self.checker.kill()
                await self.checker.wait()
        if self.server is not None:
            await asyncio.to_thread(self.server.close)


def _load(path: Path) -> list[Record]:
    return [parse(json.loads(line)) for line in path.read_text().splitlines()]


async def run(cfg: Config, say: Any = print, keep: bool = False) -> list[Result]:
    """Run every backend of ``cfg`` (``cfg.parallel`` at a time); returns their results
    in the order of ``cfg.backends``."""
    slots = asyncio.Semaphore(max(1, cfg.parallel))

    async def one(key: str) -> Result:
        spec = BACKENDS[key]
        if key == "zookeeper-3" and ensemble_class() is None:
            say(f"{key}: skipped (no ZooKeeperEnsemble in tests/zk_server.py)")
            return Result(key, skipped="no ZooKeeperEnsemble in tests/zk_server.py")
        async with slots:
            tmp = Path(tempfile.mkdtemp(prefix=f"aiolock-faults-{key}-"))
            say(f"{key}: running ({cfg.mode}) ...")
            t0 = time.monotonic()
            result = await BackendRun(spec, cfg, tmp, say).run()
            bad = result.failed()
            state = result.skipped or result.error or (f"{len(bad)} figure(s) FAIL" if bad else "ok")
            say(f"{key}: done in {time.monotonic() - t0:.1f}s: {state} (logs: {tmp})")
            if not keep and not bad and not result.error:
                shutil.rmtree(tmp, ignore_errors=True)
            return result

    # the longest first (they start in this order, ``cfg.parallel`` at a time); the
    # results come back in the order of ``cfg.backends``
    order = sorted(cfg.backends, key=lambda k: -BACKENDS[k].weight)
    done = dict(zip(order, await asyncio.gather(*(one(key) for key in order)), strict=True))
    return [done[key] for key in cfg.backends]
