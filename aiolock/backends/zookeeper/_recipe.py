"""The ZooKeeper recipe, pure: znode names and data, and from a listing of a lock node's
children who holds and what a waiter watches (the generic part is
:mod:`aiolock.backends._queue`). No I/O here.

Layout: every claim is one ephemeral sequential znode
``<chroot>/<escaped name>/<kind>-<owner>-<sequence>`` (kind ``lock``, ``read``,
``write``, ``permit`` or ``leader``; ``owner`` is the claim's per-acquisition id, so a
node whose create reply was lost is found again by it). The parent is a container node,
removed by the server once empty. A node's data is ``ttl_ms:limit:info`` (``info`` the
holder record of :mod:`aiolock._holder`), written by the create and by every renewal.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import quote, unquote

from ...abc import Kind
from .. import _queue

SEQ_DIGITS = 10
KIND_PREFIX = {
    Kind.LOCK: "lock", Kind.READ: "read", Kind.WRITE: "write", Kind.PERMIT: "permit",
    Kind.LEADER: "leader",
}
_PREFIX_KIND = {v: k for k, v in KIND_PREFIX.items()}
_FAMILY_PREFIXES = {
    family: tuple(f"{KIND_PREFIX[k]}-" for k in Kind if k.family == family)
    for family in {k.family for k in Kind}
}
#: The family of each node-name prefix (``"lock-"`` -> ``"lock"``).
PREFIX_FAMILY = {f"{p}-": k.family for k, p in KIND_PREFIX.items()}


@dataclass(slots=True, frozen=True)
class Node:
    """One claim's znode, parsed from its name."""

    seq: int
    kind: Kind
    owner: str
    name: str  # the znode's own name


@functools.lru_cache(maxsize=1024)
def zk_name(name: str) -> str:
    """Escape a lock name (1..512 chars) into one valid znode name, reversibly.

    Everything but ASCII letters, digits and ``_.~-`` is percent-encoded (UTF-8), so
    ``/``, ``%``, control characters and unicode ranges ZooKeeper rejects never reach
    it; a leading ``.`` is encoded too, so ``.`` and ``..`` are never produced.
    """
    escaped = quote(name, safe="")
    if escaped.startswith("."):
        escaped = "%2E" + escaped[1:]
    return escaped


def lock_name(escaped: str) -> str:
    """The lock name of a container node's name (:func:`zk_name` reversed)."""
    return unquote(escaped)


@functools.lru_cache(maxsize=8192)  # every listing parses the same names again
def parse(child: str) -> Node | None:
    """A child of a lock node as a :class:`Node`; None for anything else."""
    prefix, sep, rest = child.partition("-")
    kind = _PREFIX_KIND.get(prefix)
    if kind is None or not sep or len(rest) < SEQ_DIGITS + 2 or rest[-SEQ_DIGITS - 1] != "-":
        return None
    seq = rest[-SEQ_DIGITS:]
    if not seq.isdigit():
        return None
    return Node(int(seq), kind, rest[: -SEQ_DIGITS - 1], child)


def family_nodes(children: Sequence[str], kind: Kind) -> list[Node]:
    """The nodes of ``kind``'s family among ``children``, oldest first."""
    prefixes = _FAMILY_PREFIXES[kind.family]
    nodes = [n for c in children if c.startswith(prefixes) and (n := parse(c)) is not None]
    nodes.sort(key=_SEQ)
    return nodes


def families(children: Sequence[str]) -> list[str]:
    """The families that have nodes among ``children`` (for a listing)."""
    found = {fam for c in children for p, fam in PREFIX_FAMILY.items() if c.startswith(p)}
    return sorted(found)


_SEQ = operator.attrgetter("seq")


holders = _queue.holders


def encode_data(ttl_ms: int, limit: int, info: str) -> bytes:
    """A claim node's data."""
    return f"{ttl_ms}:{limit}:{info}".encode()


def decode_data(data: bytes | None) -> tuple[int, int, str]:
    """``(ttl_ms, limit, info)`` of a claim node's data; defaults for foreign data."""
    try:
        ttl, _, rest = (data or b"").decode().partition(":")
        limit, _, info = rest.partition(":")
        return int(ttl), int(limit or 1), info
    except (UnicodeDecodeError, ValueError):
        return 30_000, 1, ""
