"""Runs a churn of worker processes (procs/worker.py) and judges their records."""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from .conftest import Worker


@dataclass
class Hold:
    hid: str
    pid: int
    start: float
    end: float  # math.inf: never left (its process was killed)
    token: int
    kind: str
    lost: bool
    asked: float  # when its acquire was called

    def __str__(self) -> str:
        return (f"{self.kind}#{self.token} pid {self.pid} [{self.start:.4f}, {self.end:.4f}]"
                f"{' lost' if self.lost else ''}")


@dataclass
class Run:
    holds: list[Hold] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    #: (wanted timeout, elapsed) of each acquire that timed out
    timeouts: list[tuple[float, float]] = field(default_factory=list)
    #: pid -> monotonic time it was killed
    killed: dict[int, float] = field(default_factory=dict)
    stderr: dict[int, str] = field(default_factory=dict)
    start: float = 0.0
    end: float = 0.0

    @property
    def lost(self) -> list[Hold]:
        return [h for h in self.holds if h.lost]


def read(paths: list[Path], killed: dict[int, float]) -> Run:
    run = Run(killed=dict(killed))
    for path in paths:
        if not path.exists():
            continue
        opened: dict[str, Hold] = {}
        for line in path.read_text().splitlines():
            parts = line.split(" ")
            if parts[0] == "E" and len(parts) == 6:
                pid = int(parts[1].split(":")[0])
                hold = Hold(parts[1], pid, float(parts[2]), math.inf, int(parts[3]), parts[4],
                            False, float(parts[5]))
                opened[hold.hid] = hold
                run.holds.append(hold)
            elif parts[0] == "X" and len(parts) == 5:
                hold = opened.pop(parts[1])
                hold.end = float(parts[2])
                hold.lost = parts[4] == "1"
            elif parts[0] == "T" and len(parts) == 4:
                run.timeouts.append((float(parts[2]), float(parts[3])))
            elif parts[0] == "R":
                run.errors.append(f"{path.name}: {line}")
            # a torn last line of a killed process is ignored
        for hold in opened.values():  # never left: it lasted until its process was killed
            hold.end = killed.get(hold.pid, math.inf)
    run.holds.sort(key=lambda h: h.start)
    return run


def violations(run: Run, *, limit: int = 1) -> tuple[list[str], list[str]]:
    """Instants where more were inside than allowed (``limit`` permits; a writer must be
    alone): (violations, those excused by lost leases).

    A hold whose lease was lost by its end may have lost it before the newest one came
    in: it is excused. One that was not lost was valid throughout, and the newest was
    just granted: if those are more than allowed, it is a violation."""
    events: list[tuple[float, int, int]] = []
    for i, h in enumerate(run.holds):
        events.append((h.start, 1, i))
        events.append((h.end, 0, i))
    events.sort()
    inside: set[int] = set()
    bad: list[str] = []
    excused: list[str] = []
    for _t, what, i in events:
        if what == 0:
            inside.discard(i)
            continue
        inside.add(i)
        members = [run.holds[j] for j in inside]
        writer = any(m.kind == "w" for m in members)
        if not (len(members) > limit or (writer and len(members) > 1)):
            continue
        valid = [run.holds[i]] + [m for m in members if m is not run.holds[i] and not m.lost]
        strict = len(valid) > limit or (any(m.kind == "w" for m in valid) and len(valid) > 1)
        text = " | ".join(map(str, sorted(members, key=lambda m: m.start)))
        (bad if strict else excused).append(text)
    return bad, excused


def token_faults(run: Run, *, exclusive: bool = False) -> list[str]:
    """Tokens given twice, and acquisitions asked for after another hold ended but
    carrying a token not greater than its (every token must exceed every earlier
    acquisition's; the grant of one asked for after another's body ended is later)."""
    faults: list[str] = []
    seen: dict[int, Hold] = {}
    for h in run.holds:
        if h.token in seen:
            faults.append(f"token given twice: {seen[h.token]} and {h}")
        seen[h.token] = h
    by_end = sorted(run.holds, key=lambda h: h.end)
    if exclusive:  # one holder at a time: each grant follows the previous hold's end
        top_token = None
        for h in run.holds:  # sorted by start
            if top_token is not None and h.token <= top_token[0]:
                faults.append(f"token not increasing: {h} after {top_token[1]}")
            if top_token is None or h.token > top_token[0]:
                top_token = (h.token, h)
    k = 0
    top: Hold | None = None
    for h in sorted(run.holds, key=lambda h: h.asked):
        while k < len(by_end) and by_end[k].end < h.asked:
            if top is None or by_end[k].token > top.token:
                top = by_end[k]
            k += 1
        if top is not None and h.token <= top.token:
            faults.append(f"token not increasing: {h} asked at {h.asked:.4f}, after {top} ended")
    return faults


def longest_idle(run: Run, since: float, until: float) -> float:
    """The longest time within [since, until] when nobody held (intervals merged)."""
    spans = sorted((h.start, h.end) for h in run.holds)
    idle = 0.0
    reach = since
    for start, end in spans:
        if start > reach:
            idle = max(idle, min(start, until) - reach)
        reach = max(reach, end)
        if reach >= until:
            break
    return max(idle, until - reach) if reach < until else idle


async def churn(workers: list[Worker], tmp: Path, urls: list[str], mode: str, name: str, *,
                procs: int, seconds: float, opts: tuple[str, ...] = (),
                per_proc: Callable[[int], tuple[str, ...]] | None = None,
                during: Callable[[list[Worker], float], Awaitable[None]] | None = None,
                idle: Callable[[], Awaitable[None]] | None = None) -> Run:
    """``procs`` workers (URLs in turn) churn ``mode`` on ``name`` for ``seconds``;
    ``during(workers, end)`` runs alongside (faults); ``idle()`` runs once every live
    worker is done but still connected (a leak check). Killed workers are those
    ``during`` sent SIGKILL (their ``killed_at`` attribute)."""
    mine: list[Worker] = []
    for i in range(procs):
        extra = per_proc(i) if per_proc is not None else ()
        w = await Worker.launch(mode, urls[i % len(urls)], name, str(tmp / f"w{i}.log"),
                                *opts, *extra)
        mine.append(w)
        workers.append(w)
    for w in mine:
        await w.expect("READY", within=60)
    start = time.monotonic()
    end = start + seconds
    for w in mine:
        w.say(f"GO {end}")
    killed: dict[int, float] = {}
    if during is not None:
        await during(mine, end)
    for w in mine:
        if w.killed_at is not None:
            killed[w.pid] = w.killed_at
    errors: list[str] = []
    for w in mine:
        if w.pid in killed:
            continue
        try:
            got = await w.expect("DONE", within=seconds + 60)
        except AssertionError as exc:
            errors.append(f"worker {w.pid}: {exc}")
            continue
        if got.split()[2] != "0":
            errors.append(f"worker {w.pid} reported errors: {got}")
    if idle is not None:
        await idle()
    stderr: dict[int, str] = {}
    for w in mine:
        if w.pid in killed:
            continue
        w.say("QUIT")
        out, err = await w.finish(within=60)
        stderr[w.pid] = err
        if "CLOSED" not in out:
            errors.append(f"worker {w.pid} did not close: {err[-2000:]}")
    for pid, err in stderr.items():  # an error nobody saw is an error too
        errors += [f"worker {pid} stderr: {line}" for line in err.splitlines()
                   if any(mark in line for mark in NOISE)][:5]
    run = read([tmp / f"w{i}.log" for i in range(procs)], killed)
    run.errors = errors + run.errors
    run.stderr = stderr
    run.start, run.end = start, end
    return run


#: what a worker's stderr must not show: an exception or a task nobody awaited
NOISE = ("Traceback", "never retrieved", "was destroyed but it is pending", "Warning",
         "Error", "Exception")


def kill9(worker: Worker) -> None:
    worker.signal(signal.SIGKILL)
    worker.killed_at = time.monotonic()


def judged(run: Run, *, limit: int = 1, note: str = "") -> tuple[str, list[str]]:
    """Assert ``run``'s exclusion (at most ``limit`` inside) and its tokens (strictly
    increasing across holds where ``limit`` is 1); its report (plus ``note``) and the
    overlaps a lost lease excuses."""
    bad, excused = violations(run, limit=limit)
    tokens = token_faults(run, exclusive=limit == 1)
    text = report(run, bad, tokens) + note
    assert not bad, text
    assert not tokens, text
    return text, excused


def report(run: Run, bad: list[str], tokens: list[str]) -> str:
    lines = [f"{len(run.holds)} holds, {len(run.lost)} lost, {len(run.errors)} errors"]
    lines += [f"OVERLAP {v}" for v in bad[:10]]
    lines += tokens[:10]
    lines += run.errors[:10]
    lines += [f"LOST {h}" for h in run.lost[:10]]
    return "\n".join(lines)
