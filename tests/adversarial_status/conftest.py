"""Fixtures of the status / leader / scan / fencing adversarial tests, written from
README.md, SPEC.md (sections 7 and 8) and docs/ only -- never from the implementation.

The promise under attack: what ``locks.status()``, ``locks.scan()`` and
``election.leader()`` report is the state some granted lease actually set -- right after
a grant, the token and holder record of exactly that lease, from any connection; under
churn, never a token no lease was granted, never a token older than one already seen,
never a holder record that belongs to another lease -- and fencing tokens strictly
increase across holders, across ``force_release()`` too.

Backends are the rows of ``tests/scenarios.py`` (one topology each), run on the servers
the session fixtures of ``tests/conftest.py`` start; a test needing a capability the row
does not declare skips itself. Every grant is recorded (token, data) -- by child
processes in a file -- so that each observation can be judged afterwards.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

import aiolock

from ..scenarios import SCENARIOS, rows  # noqa: F401 -- rows: for the tests

#: connections a test opens to one backend (the monitor uses the last)
NCONN = 3




@pytest.fixture
async def conns(backend_url: str) -> AsyncIterator[list[aiolock.Locks]]:
    """``NCONN`` independent connections to the row's server (same data)."""
    opened: list[aiolock.Locks] = []
    try:
        for _ in range(NCONN):
            conn = aiolock.connect(backend_url)
            await conn.__aenter__()
            opened.append(conn)
        yield opened
    finally:
        for conn in reversed(opened):
            with contextlib.suppress(Exception):
                await conn.__aexit__(None, None, None)


@dataclass
class Seen:
    """One observation of the monitor: what it read and when it started/returned."""

    t0: float
    t1: float
    how: str  # "status", "scan", "leader"
    held: bool
    token: int | None
    last_token: int | None
    datas: tuple[str, ...]

    def brief(self) -> str:
        return (f"held={self.held} token={self.token} last_token={self.last_token} "
                f"data={list(self.datas)} at +{self.t0 % 1000:.4f}s")


@dataclass
class Ledger:
    """Every grant (token -> the data values its lease set) and every observation."""

    grants: dict[int, set[str]] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)

    def grant(self, token: int, *datas: str) -> None:
        self.grants.setdefault(token, set()).update(datas)


def from_info(info: aiolock.LockInfo | None, how: str, t0: float) -> Seen:
    t1 = time.monotonic()
    if info is None:
        return Seen(t0, t1, how, False, None, None, ())
    return Seen(t0, t1, how, bool(info.held), info.token, info.last_token,
                tuple(h.data for h in info.held_by))


def from_leader(leader: aiolock.Leader | None, t0: float) -> Seen:
    t1 = time.monotonic()
    if leader is None:
        return Seen(t0, t1, "leader", False, None, None, ())
    return Seen(t0, t1, "leader", True, leader.token, None, (leader.data, leader.holder.data))


def judge(ledger: Ledger, holders_promised: bool, last_monotonic: bool = True) -> list[str]:
    """The defects in ``ledger.seen``: a held token never granted, a held token lower than
    one seen held before (per monitor, observations are sequential), held without a holder
    record, a record whose data is not that token's lease's, last_token going back (unless
    not ``last_monotonic``: Redlock's is the highest count of the majority that answered,
    docs/redlock.md, and two reads may hear different majorities)."""
    bad: list[str] = []
    high = -1
    high_at: Seen | None = None
    last_high = -1
    for s in ledger.seen:
        if s.held:
            if s.token is None:
                bad.append(f"{s.how}: held with no token ({s.brief()})")
            elif s.token not in ledger.grants:
                owners = sorted(t for t, ds in ledger.grants.items() if set(s.datas) & ds)
                bad.append(f"{s.how}: held with token {s.token}, never granted (granted near it: "
                           f"{_near(ledger, s.token)}; seen {s.brief()}; that data's lease has "
                           f"token {owners})")
            else:
                wrong = [d for d in s.datas if d not in ledger.grants[s.token]]
                if wrong:
                    owners = sorted(t for t, ds in ledger.grants.items() if set(wrong) & ds)
                    bad.append(f"{s.how}: token {s.token} shown with data {wrong} (the data of "
                               f"token {owners}), its lease set {sorted(ledger.grants[s.token])}")
            if holders_promised and not s.datas:
                bad.append(f"{s.how}: held (token {s.token}) with no holder record ({s.brief()})")
            if s.token is not None:
                if s.token < high:
                    bad.append(f"{s.how}: token {s.token} seen held after token {high} "
                               f"({high_at.how if high_at else '?'}) was seen held")
                elif s.token > high:
                    high, high_at = s.token, s
        if s.last_token is not None:
            if s.last_token < last_high and last_monotonic:
                bad.append(f"{s.how}: last_token went back {last_high} -> {s.last_token} ({s.brief()})")
            last_high = max(last_high, s.last_token)
            if s.held and s.token is not None and s.last_token < s.token:
                bad.append(f"{s.how}: last_token {s.last_token} < held token {s.token}")
    return bad


def _near(ledger: Ledger, token: int | None) -> list[int]:
    if token is None:
        return []
    return sorted(t for t in ledger.grants if abs(t - token) <= 3)
