"""A release wakes ONE waiting process, not all of them (README "Waiting": Redis, Cluster,
Sentinel, ZooKeeper, etcd, PostgreSQL, MySQL); ``fair=True`` -- and ZooKeeper and etcd,
always fair -- serve processes first come, first served; fencing tokens keep increasing
across the hand-offs.

Six processes wait on a lock the test holds, each arriving well after the previous one;
the test releases and each, granted in turn, holds briefly and releases. Meanwhile the
server is watched: a process that is not handed the lock must not be woken, so it makes
no request while it waits. A thundering herd shows as requests that grow with a
process's place in the line (each release wakes everyone still waiting).
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid

import pytest

import aiolock

from .conftest import Agents, Got, backend, go_in_order
from .probes import probe_for

pytestmark = pytest.mark.timeout(120)

N = 6  # waiting processes
HOLD = 0.15  # s each holds
TTL = 30.0  # no renewal, queue-place refresh or holder-ttl retry falls inside the test

#: requests one process may make from "every process waits" to its own release being
#: done: a woken waiter's look at the lock (if any) and its release, plus slack (a
#: ZooKeeper ping). The same for the first and the last in line: not woken, no request.
BUDGET = {"redis": 3, "redis-cluster": 3, "redis-sentinel": 3, "zookeeper": 5, "postgres": 3,
          "mysql": 3}
#: requests a process may make while ten of its tasks wait behind another's holder: the
#: head's attempt and registration (ZooKeeper: create, list, watch, the name's container;
#: plus session traffic seen now and then: 4 or 7 with 1 task as with 40)
LOCAL_BUDGET = {"redis": 3, "zookeeper": 8}
#: how many more requests the last in line may make than the first: a ZooKeeper ping, a
#: short SQL statement (a release) caught by the sampling or not
SPREAD = {"zookeeper": 2, "postgres": 2, "mysql": 2}
#: backends serving waiters in arrival order whatever ``fair`` says: ZooKeeper and etcd
#: (always fair), and Redis, whose release "hands the lock directly to the first live
#: waiter" of the lock's queue
IN_ORDER = {"zookeeper", "etcd", "redis", "redis-cluster", "redis-sentinel"}
HOLDER_TTL = 20.0  # the test's own lease: a hand-off gives "that waiter's ttl" (TTL)

CASES = [
    pytest.param("redis", False, id="redis-plain"),
    pytest.param("redis", True, id="redis-fair"),
    pytest.param("zookeeper", False, id="zookeeper"),
    pytest.param("postgres", True, id="postgres-fair"),
    pytest.param("postgres", False, id="postgres-plain"),
    pytest.param("redis-cluster", False, id="redis-cluster-plain"),
    pytest.param("redis-cluster", True, id="redis-cluster-fair"),
    pytest.param("redis-sentinel", False, id="redis-sentinel-plain"),
    pytest.param("redis-sentinel", True, id="redis-sentinel-fair"),
    pytest.param("etcd", False, id="etcd"),
    pytest.param("mysql", False, id="mysql"),
]


def connect_options(key: str) -> dict[str, object]:
    # ZooKeeper: pings every third of the session timeout; a long one keeps them out
    return {"session_timeout": 30} if key == "zookeeper" else {}


@pytest.mark.parametrize(("key", "fair"), CASES)
async def test_release_wakes_only_the_next_process(request: pytest.FixtureRequest,
                                                   agents: Agents, key: str, fair: bool) -> None:
    """Attacks "a release wakes one waiting process, not all of them" (and, with fair=True
    or on an always-fair backend, "first come, first served across processes"; on Redis
    the hand-off to "the first live waiter", with "that waiter's ttl"; and "tokens
    strictly increase"): each waiting process's requests while the line ahead of it is
    served must not grow with its place in the line."""
    b = backend(request, key)
    name = f"a10-wake-{uuid.uuid4().hex[:10]}"
    opts = connect_options(key)
    async with aiolock.connect(b.url, **opts) as locks:
        held = await locks.lock(name, ttl=HOLDER_TTL, fair=fair).acquire()
        line = await agents.start("once", b.url, name, N, ttl=TTL, fair=fair, hold=HOLD,
                                  connect=opts)
        await go_in_order(line, settle=0.3)
        probe = probe_for(b, [a.pid for a in line])
        await probe.start()
        released_at = time.monotonic()
        await held.release()
        gots: list[Got] = await asyncio.gather(*(a.got(N * HOLD + 30) for a in line))
        releases = await asyncio.gather(*(a.expect("RELEASING", 30) for a in line))
        await asyncio.gather(*(a.expect("RELEASED", 30) for a in line))
        await probe.stop()

    by_pid = {a.pid: float(r.split()[1]) for a, r in zip(line, releases, strict=True)}
    order = sorted(gots, key=lambda g: g.at)
    assert order[0].at >= released_at
    for prev, nxt in itertools.pairwise(order):
        assert nxt.at >= by_pid[prev.pid], "two processes held the lock at once"
    short = [round(g.expires_in, 2) for g in order if not HOLDER_TTL < g.expires_in <= TTL + 1]
    assert not short, f"a waiter was handed a lease not of its own ttl ({TTL}s): {short}"
    tokens = [held.token, *(g.token for g in order)]
    assert tokens == sorted(set(tokens)), f"tokens not strictly increasing in grant order: {tokens}"
    if fair or key in IN_ORDER:
        arrival = [a.pid for a in line]
        assert [g.pid for g in order] == arrival, (
            f"not first come, first served: arrival {arrival}, granted {[g.pid for g in order]}")

    requests = probe.requests()
    if requests is None:  # etcd: the server counts requests, not who sent them
        total = probe.total()
        assert total is not None
        # N + 1 releases and a look by each woken process (2N + 1; slack 2); a herd adds a
        # look by every waiter still in line at every release: N * (N - 1) / 2 more
        assert total <= 2 * N + 3, f"{total} KV requests for {N} hand-offs: {probe.detail()}"
        return
    in_line = [requests[g.pid] for g in order]
    assert max(in_line) <= BUDGET[key], (
        f"requests per process in grant order {in_line} (budget {BUDGET[key]}): {probe.detail()}")
    assert in_line[-1] <= in_line[0] + SPREAD.get(key, 1), (
        f"the last in line made more requests than the first: {in_line}: {probe.detail()}")
    if key == "zookeeper":
        watches = probe.total()
        assert watches is not None and watches <= N + 1, (
            f"{watches} watches fired for {N + 1} releases: {probe.detail()}")


@pytest.mark.parametrize("key", [
    pytest.param("redis", id="redis"),
    pytest.param("zookeeper", id="zookeeper"),
])
async def test_local_waiters_queue_and_only_the_head_asks(request: pytest.FixtureRequest,
                                                           agents: Agents, key: str) -> None:
    """Attacks "inside one process, waiters for one lock queue locally (FIFO) and only the
    head of that queue talks to the server": ten tasks of one process wait for a lock
    another connection holds; while they wait the process makes at most a couple of
    requests (not one per task), and they are served in the order they came."""
    b = backend(request, key)
    name = f"a10-local-{uuid.uuid4().hex[:10]}"
    tasks = 10
    opts = connect_options(key)
    async with aiolock.connect(b.url, **opts) as locks:
        held = await locks.lock(name, ttl=TTL).acquire()
        (agent,) = await agents.start("many", b.url, name, 1, ttl=TTL, tasks=tasks, hold=0.01,
                                      connect=opts)
        probe = probe_for(b, [agent.pid])
        await probe.start()
        await agent.say("GO")
        await agent.expect("WAITING", 20)
        await asyncio.sleep(0.5)
        await probe.stop()
        await held.release()
        order = [int(i) for i in (await agent.expect("ORDER", 30)).split()[1].split(",")]
        tokens = [int(t) for t in (await agent.expect("TOKENS", 5)).split()[1].split(",")]
    asked = probe.requests()
    assert asked is not None
    assert asked[agent.pid] <= LOCAL_BUDGET[key], (
        f"{tasks} local waiters made {asked[agent.pid]} requests while they waited: "
        f"{probe.detail()}")
    assert order == list(range(tasks)), f"local waiters not served in arrival order: {order}"
    assert tokens == sorted(set(tokens)) and tokens[0] > held.token


@pytest.mark.parametrize(("key", "fair"), [
    pytest.param("redis", False, id="redis"),
    pytest.param("redis", True, id="redis-fair"),
    pytest.param("redis-cluster", False, id="redis-cluster"),
])
async def test_hand_off_reaches_the_right_waiter_of_a_process(
        request: pytest.FixtureRequest, agents: Agents, key: str, fair: bool) -> None:
    """Attacks "tells only that waiter's process, in one message on the process's own
    pub/sub channel": one inbox per process carries the hand-offs of every lock its tasks
    wait for. Two processes each wait for three locks the test holds; releasing one lock
    must grant exactly that lock, to the process first in its line, and no other."""
    b = backend(request, key)
    names = [f"a10-inbox{i}-{uuid.uuid4().hex[:8]}" for i in range(3)]
    async with aiolock.connect(b.url) as locks:
        held = [await locks.lock(n, ttl=TTL, fair=fair).acquire() for n in names]
        first, second = await agents.start("multi", b.url, "-", 2, ttl=TTL, fair=fair, hold=0.2,
                                           names=names)
        await go_in_order([first, second], 0.4)
        for i in (2, 0, 1):
            others = [a.lines[:] for a in (first, second)]
            await held[i].release()
            await first.expect(f"GOT{i}", 10)
            await first.expect(f"RELEASED{i}", 10)
            await second.expect(f"GOT{i}", 10)
            stray = [ln for a, before in zip((first, second), others, strict=True)
                     for ln in a.lines[len(before):]
                     if ln.startswith("GOT") and not ln.startswith(f"GOT{i} ")]
            assert not stray, f"releasing lock {i} granted another lock: {stray}"
