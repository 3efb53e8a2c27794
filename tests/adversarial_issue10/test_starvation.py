"""No process starves (README "Waiting"): a release hands the lock straight to the next
local waiter, "but while another process waits on Redis at most 4 times in a row and
never later than 10 ms after the first; the next release goes to the server's next
waiter, so a waiting process with k processes ahead of it gets the lock within k x 5
acquisitions".

Processes with several tasks each loop on one lock; every grant is recorded (token,
monotonic times, pid) and the grants are put in token order.
"""

from __future__ import annotations

import itertools
import time
import uuid

import pytest

from .conftest import Agents, backend

pytestmark = pytest.mark.timeout(120)

REDIS = [pytest.param("redis", id="redis"),
         pytest.param("redis-cluster", id="redis-cluster"),
         pytest.param("redis-sentinel", id="redis-sentinel")]

Rec = tuple[int, float, float, int]


async def run_loops(agents: Agents, url: str, name: str, procs: list[dict[str, float]],
                    seconds: float) -> tuple[float, float, list[Rec], list[int]]:
    """One ``loop`` agent per entry of ``procs`` (its options), all started together for
    ``seconds``: (start, end, every grant in token order, the pids), checked for overlaps and for
    tokens that follow the grants' times."""
    line = await agents.start_each("loop", url, name, [{"ttl": 10.0, **o} for o in procs])
    start = time.monotonic() + 0.2
    end = start + seconds
    for a in line:
        await a.say(f"GO {end}")
    per_agent = [await a.records(seconds + 60) for a in line]
    recs = sorted(r for mine in per_agent for r in mine)
    by_time = sorted(recs, key=lambda r: r[1])
    assert by_time == recs, "tokens do not follow the order of the grants"
    for prev, nxt in itertools.pairwise(recs):
        assert nxt[1] >= prev[2], f"two holders at once: {prev} and {nxt}"
    assert len({r[0] for r in recs}) == len(recs), "a token was given twice"
    return start, end, recs, [a.pid for a in line]


def runs_and_gaps(recs: list[Rec], lo: float, hi: float) -> tuple[dict[int, int], dict[int, int]]:
    """Of the grants made in [lo, hi]: per pid, the longest run of its grants in a row, and
    the most grants to others between two of its own."""
    steady = [r[3] for r in recs if lo <= r[1] <= hi]
    runs: dict[int, int] = {}
    gaps: dict[int, int] = {}
    since: dict[int, int] = {}
    run = 0
    for i, pid in enumerate(steady):
        run = run + 1 if i and steady[i - 1] == pid else 1
        runs[pid] = max(runs.get(pid, 0), run)
        if pid in since:
            gaps[pid] = max(gaps.get(pid, 0), i - since[pid] - 1)
        since[pid] = i
    return runs, gaps


@pytest.mark.parametrize("key", REDIS)
async def test_no_process_starves_under_local_churn(request: pytest.FixtureRequest,
                                                    agents: Agents, key: str) -> None:
    """Attacks "at most 4 local hand-offs in a row while another process waits" and "a
    waiting process with k processes ahead gets the lock within k x 5 acquisitions": three
    processes of four tasks each re-take the lock at once after each release (each
    process always has a waiter), holding it up to 2 ms."""
    b = backend(request, key)
    name = f"a10-starve-{uuid.uuid4().hex[:10]}"
    procs = 3
    start, end, recs, _ = await run_loops(agents, b.url, name,
                                       [{"tasks": 4, "hold": 0.002}] * procs, 2.0)
    runs, gaps = runs_and_gaps(recs, start + 0.3, end - 0.15)
    assert len(runs) == procs, f"a process never got the lock: {runs}"
    assert max(runs.values()) <= 5, (
        f"a process took the lock more than 5 times in a row while others waited: {runs}")
    assert max(gaps.values()) <= 5 * (procs - 1), (
        f"a process waited through more than {5 * (procs - 1)} grants to others: {gaps}")


@pytest.mark.parametrize("key", REDIS)
async def test_local_handoffs_stop_10ms_after_the_first(request: pytest.FixtureRequest,
                                                        agents: Agents, key: str) -> None:
    """Attacks "never later than 10 ms after the first" (local hand-off): four tasks of
    one process hold the lock 30 ms each while one task of another process waits; every
    local hand-off after the first is more than 10 ms later, so the busy process never
    gets more than 2 grants in a row (on any reading of "the first")."""
    b = backend(request, key)
    name = f"a10-10ms-{uuid.uuid4().hex[:10]}"
    start, end, recs, pids = await run_loops(
        agents, b.url, name,
        [{"tasks": 4, "hold_min": 0.03, "hold": 0.035}, {"tasks": 1, "hold_min": 0.03, "hold": 0.035}],
        1.5)
    busy = pids[0]
    runs, gaps = runs_and_gaps(recs, start + 0.2, end - 0.1)
    assert len(runs) == 2, f"a process never got the lock: {runs}"
    assert runs[busy] <= 2, (
        f"the 4-task process kept the lock {runs[busy]} times in a row (30 ms holds) "
        f"while the other waited: runs {runs}, gaps {gaps}")
