"""Mutual exclusion and fencing order on ``redlock://`` across processes while one node
answers late. Written from README.md, SPEC.md, docs/redlock.md and
docs/backends/index.md only.

README: "need exactly one of them at a time to touch a resource"; "Every successful
acquisition gets a token strictly greater than every earlier acquisition of the same
name"; docs/redlock.md: "A minority of nodes down, stopped or slow changes nothing for
the user."
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from itertools import pairwise

import pytest

from .._workers import Procs, procs, run_workers  # noqa: F401 -- procs: a fixture
from ..faults.proxy import Proxy
from ..servers import RedisServer
from .conftest import url_of

# found nothing when written (README+SPEC-only pass on Redlock): slow tier
pytestmark = [pytest.mark.timeout(60), pytest.mark.slow]

async def test_mutual_exclusion_across_processes_with_one_node_slow(
    servers: list[RedisServer], proxies: Callable[[RedisServer], Awaitable[Proxy]], name: str,
    procs: Procs,  # noqa: F811
) -> None:
    """Three processes of three tasks each contend for 3 s; node 0 (a proxy in this
    process, shared by all) answers 30 ms late: no two critical sections overlap, tokens
    increase in hold order, and more than one process gets the lock."""
    nprocs, ntasks, ttl, duration = 3, 3, 0.9, 3.0
    slow = await proxies(servers[0])
    url = url_of([slow.port, servers[1].port, servers[2].port])
    _, per_worker = await run_workers(procs, url, name, nprocs, ntasks, duration, ttl=ttl,
                                      ready=lambda: slow.set_faults(delay=0.015))  # each way
    records = sorted((r for mine in per_worker for r in mine), key=lambda r: r[1])
    overlaps = [(x, y) for x, y in pairwise(records) if y[1] < x[2]]
    assert not overlaps, f"{len(overlaps)} overlapping critical sections, e.g. {overlaps[:3]}"
    tokens = [r[0] for r in records]
    bad = [(x, y) for x, y in pairwise(tokens) if not x < y]
    assert not bad, f"tokens not strictly increasing in hold order: {bad[:5]}"
    assert len(records) >= 30 and len({r[3] for r in records}) >= 2, len(records)
