"""The etcd recipe as a pure function of a listing (no server): who holds, what a waiter
watches."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from aiolock.abc import Claim, Kind

pytest.importorskip("etcd3aio")

from aiolock.backends.etcd import _recipe as recipe

PREFIX = b"p/rw/n/"


def listing(*kinds: str, ttl: int = 1000, limit: int = 1) -> list[recipe.Entry]:
    kvs = [SimpleNamespace(key=PREFIX + f"{k}-o{i}".encode(), value=f"{ttl}:{limit}".encode(),
                           create_revision=10 + i, lease=100 + i)
           for i, k in enumerate(kinds)]
    return recipe.entries(kvs, PREFIX)


def owners(entries: list[recipe.Entry]) -> list[str]:
    return [e.owner for e in entries]


def test_entries_parse_and_skip_foreign_keys() -> None:
    kvs = [SimpleNamespace(key=PREFIX + b"lock-abc", value=b"500:3", create_revision=7, lease=9),
           SimpleNamespace(key=PREFIX + b"junk", value=b"", create_revision=8, lease=0),
           SimpleNamespace(key=PREFIX + b"read-x", value=b"bad", create_revision=9, lease=1)]
    got = recipe.entries(kvs, PREFIX)
    assert [(e.kind, e.owner, e.rev, e.ttl_ms, e.limit) for e in got] == [
        (Kind.LOCK, "abc", 7, 500, 3), (Kind.READ, "x", 9, 30_000, 1)]


def test_holders() -> None:
    assert owners(recipe.holders(listing("lock", "lock"), 1)) == ["o0"]
    assert owners(recipe.holders(listing("read", "read", "write", "read"), 1)) == ["o0", "o1"]
    assert owners(recipe.holders(listing("write", "read"), 1)) == ["o0"]
    assert owners(recipe.holders(listing("permit", "permit", "permit"), 2)) == ["o0", "o1"]
    assert recipe.holders([], 1) == []


def test_watch_targets_are_the_predecessors_only() -> None:
    def targets(kinds: tuple[str, ...], index: int, kind: Kind, limit: int = 1) -> list[str]:
        claim = Claim("n", kind, f"o{index}", 1000, limit=limit)
        return owners(recipe.watch_targets(listing(*kinds), index, claim))

    assert targets(("lock", "lock", "lock"), 2, Kind.LOCK) == ["o1"]  # no herd
    assert targets(("read", "write", "read", "read"), 3, Kind.READ) == ["o1"]  # the last writer
    assert targets(("read", "read", "write"), 2, Kind.WRITE) == ["o1"]
    assert targets(("permit",) * 5, 4, Kind.PERMIT, limit=2) == ["o2", "o3"]


def test_range_end_and_lease_seconds() -> None:
    assert recipe.range_end(b"a/b/") == b"a/b0"
    assert [recipe.lease_seconds(ms) for ms in (1, 999, 1000, 1001, 30_000)] == [1, 1, 1, 2, 30]
