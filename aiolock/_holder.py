"""Who holds a lease: the record every lease leaves on the server beside its claim.

The core encodes it once per acquisition (:func:`encode_holder`: host, pid, task name
and the user's ``data``, as compact JSON) into :attr:`aiolock.abc.Claim.info`; a
backend stores that string verbatim next to the claim and gives it back, with how long
the claim has been held, through :func:`decode_holder`. Backends never parse it.

While a lease is held, the tasks of its own process that queue behind it for the same
name never reach the server (a release here wakes them directly), so no server can
count them: the core writes their number into the record as well (``"w"``, see
``_Engine.waiting_changed``), and ``status()``/``scan()`` add it to the waiters the
server sees.

On a backend whose claim is on the server from its first request, before it is granted
(a ZooKeeper node, an etcd key: they queue), the server's time for the record is when it
queued: a claim granted after a wait of :data:`QUEUED_RECORDED` seconds or more writes
how long it queued into its record too (``"q"``, see ``Lock._record_queued``), and
:func:`decode_holder` takes it off ``since``, so ``since`` counts from the grant.
"""

from __future__ import annotations

import functools
import json
import os
import socket
from dataclasses import dataclass, field

__all__ = [
    "MAX_DATA_LENGTH", "QUEUED_RECORDED", "Holder", "check_data", "decode_holder", "encode_holder",
    "with_data", "with_queued", "with_waiting",
]

#: The longest user ``data`` string a lease may carry.
MAX_DATA_LENGTH = 1024
#: Seconds of queueing from which a granted claim records them (see the module doc): a
#: shorter wait leaves ``since`` that much long, which no operator would notice.
QUEUED_RECORDED = 0.25

_HOST = socket.gethostname()


@dataclass(frozen=True, slots=True)
class Holder:
    """One holder of a lock, read lock, permit or leadership, as recorded on the server.

    ``host`` (``socket.gethostname()`` of the holding process), ``pid``, ``task`` (the
    name of the task that acquired it, or None), ``data`` (the user's string, ``""`` by
    default), ``since`` (seconds it has been held, from the server's view where the
    backend has one; None where unknown), ``waiting`` (tasks of the holder's own process
    queued behind it for the same name, as last written to the record; they are counted
    in :attr:`aiolock.LockInfo.waiters`; not compared).
    """

    host: str
    pid: int
    task: str | None
    data: str
    since: float | None = None
    waiting: int = field(default=0, compare=False)


def check_data(data: object) -> str:
    """A holder's ``data``: a str of at most :data:`MAX_DATA_LENGTH` characters, UTF-8."""
    if not isinstance(data, str):
        raise ValueError(
            f"data must be a str of at most {MAX_DATA_LENGTH} characters, got {type(data).__name__}"
        )
    if len(data) > MAX_DATA_LENGTH:
        raise ValueError(f"data must be at most {MAX_DATA_LENGTH} characters long, got {len(data)}")
    try:
        data.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"data must be encodable as UTF-8 (no lone surrogates), got {data!r}") from None
    return data


def encode_holder(data: str, task: str | None, waiting: int = 0, queued: float = 0.0) -> str:
    """The record of a holder in this process (what backends store as ``Claim.info``);
    ``waiting``: the local tasks queued behind it, ``queued``: the seconds its claim
    queued on the server before its grant (each omitted when 0)."""
    if queued:
        return _encode_queued(os.getpid(), data, task, waiting, round(queued, 3))
    return _encode(os.getpid(), data, task, waiting)


@functools.lru_cache(maxsize=256)
def _encode(pid: int, data: str, task: str | None, waiting: int) -> str:
    # cached: a worker acquiring in a loop sends the same record each time, and the JSON
    # encoding was most of the record's cost (pid in the key: a forked child differs)
    return _encode_queued(pid, data, task, waiting, 0.0)


def _encode_queued(pid: int, data: str, task: str | None, waiting: int, queued: float) -> str:
    record: dict[str, object] = {"h": _HOST, "p": pid, "t": task, "d": data}
    if waiting:
        record["w"] = waiting
    if queued:
        record["q"] = queued
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False)


def with_waiting(info: str, waiting: int) -> str:
    """``info`` (a record made here) with ``waiting`` local tasks queued behind it."""
    holder, queued = _decode(info, None)
    return encode_holder(holder.data, holder.task, waiting, queued)


def with_data(info: str, data: str) -> str:
    """``info`` (a record made here) with the user's ``data`` replaced (a proclaim)."""
    holder, queued = _decode(info, None)
    return encode_holder(data, holder.task, holder.waiting, queued)


def with_queued(info: str, queued: float) -> str:
    """``info`` (a record made here) saying its claim queued ``queued`` seconds."""
    holder, _ = _decode(info, None)
    return encode_holder(holder.data, holder.task, holder.waiting, queued)


def decode_holder(info: str | bytes | None, since: float | None = None) -> Holder:
    """A stored record back as a :class:`Holder`; a missing or foreign record (a claim
    made by an older aiolock, or by hand) reads as an unknown holder. ``since``: the
    server's time for the record (less the seconds the record says it queued)."""
    return _decode(info, since)[0]


def _decode(info: str | bytes | None, since: float | None) -> tuple[Holder, float]:
    """The :class:`Holder` and the seconds its record says it queued."""
    try:
        raw = json.loads(info) if info else {}
        if not isinstance(raw, dict):
            raise TypeError
        task = raw.get("t")
        queued = max(0.0, float(raw.get("q", 0.0)))
        if since is not None:
            since -= queued
        return Holder(str(raw.get("h", "")), int(raw.get("p", 0)),
                      None if task is None else str(task), str(raw.get("d", "")),
                      None if since is None else max(0.0, since),
                      max(0, int(raw.get("w", 0)))), queued
    except (TypeError, ValueError, OverflowError):
        return Holder("", 0, None, "", None if since is None else max(0.0, since)), 0.0
