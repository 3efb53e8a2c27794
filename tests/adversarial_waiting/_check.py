"""Checks on the grant records of tests/adversarial_waiting: ``[token, t_call, t_grant,
t_release, pid, task]`` (CLOCK_MONOTONIC, t_release taken just before release())."""

from __future__ import annotations

import itertools
from typing import Any


def exclusion_and_tokens(records: list[list[Any]]) -> None:
    """Tokens unique and strictly increasing in grant order; no two grants overlap (the
    next grant comes after the previous holder began its release)."""
    by_token = sorted(records, key=lambda r: r[0])
    tokens = [r[0] for r in by_token]
    assert len(set(tokens)) == len(tokens), f"a token given twice: {len(tokens) - len(set(tokens))}"
    for a, b in itertools.pairwise(by_token):
        assert b[2] >= a[3], (f"overlap: token {b[0]} (pid {b[4]}) granted at {b[2]:.6f}, "
                              f"{(a[3] - b[2]) * 1e3:.2f} ms before token {a[0]} (pid {a[4]}) "
                              f"began its release")


def others_during_wait(records: list[list[Any]], mine: list[Any]) -> int:
    """Grants of other processes while ``mine`` waited (between its call and its grant)."""
    return sum(1 for r in records if r[4] != mine[4] and mine[1] < r[2] < mine[2])


def process_runs(records: list[list[Any]]) -> dict[int, int]:
    """Per process: the most grants of other processes in a row while that process had
    an acquire pending (some record of it called before and granted after them)."""
    grants = sorted(records, key=lambda r: r[2])
    pids = {r[4] for r in records}
    worst = {p: 0 for p in pids}
    for p in pids:
        mine = [r for r in records if r[4] == p]
        run = 0
        for g in grants:
            if g[4] == p:
                run = 0
                continue
            pending = any(m[1] < g[2] < m[2] for m in mine)
            run = run + 1 if pending else 0
            worst[p] = max(worst[p], run)
    return worst
