"""The checker's log records and the orchestrator's fault events, as named tuples.

On the wire and in ``checker.jsonl`` a record is a JSON list whose first item is its
kind and whose second is the checker's arrival time (``time.monotonic()``, as every time
here); :func:`parse` turns one into the tuple of its kind.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["Access", "Acquired", "Echo", "Ended", "Event", "Note", "Record", "Stall", "parse"]


class Acquired(NamedTuple):
    """``A``: a worker was granted ``lock`` (asked at ``t_req``, granted by ``t_acq``)."""

    kind: str
    t: float
    lock: str
    token: int
    pid: int
    t_req: float
    t_acq: float


class Access(NamedTuple):
    """``R`` (fenced read) or ``W`` (fenced write), checked as not lost at ``t_check``.
    ``read``: for R the value returned, for W the value the writer had read; ``before``
    (W only): the counter's value when the write arrived."""

    kind: str
    t: float
    lock: str
    token: int
    pid: int
    t_check: float
    ok: bool
    read: int
    before: int | None = None


class Ended(NamedTuple):
    """``E``: a hold ended (``how``: released, lost, cancelled, error)."""

    kind: str
    t: float
    lock: str
    token: int
    pid: int
    t_exit: float
    t_done: float
    how: str


class Echo(NamedTuple):
    """``C``: a cancellation (``what``) and its nonce echo (``ok`` None: no answer)."""

    kind: str
    t: float
    pid: int
    what: str
    ok: bool | None


class Stall(NamedTuple):
    """``S``: an event-loop stall: leases whose expiry passed, and how many knew."""

    kind: str
    t: float
    pid: int
    expired: int
    detected: int


class Note(NamedTuple):
    """``N``: a line of text from a worker."""

    kind: str
    t: float
    pid: int
    text: str


Record = Acquired | Access | Ended | Echo | Stall | Note

_KINDS: dict[str, Any] = {"A": Acquired, "R": Access, "W": Access, "E": Ended, "C": Echo,
                          "S": Stall, "N": Note}


def parse(raw: list[Any]) -> Record:
    """The named tuple of one logged list."""
    record: Record = _KINDS[raw[0]](*raw)
    return record


class Event(NamedTuple):
    """A fault the orchestrator injected, from ``t0`` to ``t1``; ``pid`` and ``holdings``
    (``[lock, token]`` pairs) name the worker it hit, when it hit one."""

    kind: str
    t0: float
    t1: float
    pid: int
    holdings: list[list[Any]]
    more: dict[str, Any]

    def json(self) -> dict[str, Any]:
        return {**self._asdict(), **self.more}
