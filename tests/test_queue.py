"""The queue recipe (aiolock.backends._queue) and ZooKeeper's node names and data, without
a server: who holds, what a waiter watches, for every kind."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from aiolock.abc import Kind
from aiolock.backends import _queue

pytest.importorskip("aiozk")

from aiolock.backends.zookeeper import _recipe as zk

_KINDS = {"L": Kind.LOCK, "R": Kind.READ, "W": Kind.WRITE, "P": Kind.PERMIT, "E": Kind.LEADER}


@dataclass(frozen=True)
class E:
    kind: Kind
    i: int


def q(spec: str) -> list[E]:
    return [E(_KINDS[c], i) for i, c in enumerate(spec)]


def ids(entries: list[E]) -> list[int]:
    return [e.i for e in entries]


@pytest.mark.parametrize(("spec", "limit", "held"), [
    ("", 1, []), ("LLL", 1, [0]), ("EE", 1, [0]), ("WRR", 1, [0]), ("RRWR", 1, [0, 1]),
    ("RRR", 1, [0, 1, 2]), ("PPPP", 2, [0, 1]), ("PP", 5, [0, 1]),
])
def test_holders(spec: str, limit: int, held: list[int]) -> None:
    assert ids(_queue.holders(q(spec), limit)) == held


@pytest.mark.parametrize(("spec", "index", "limit", "holds", "watch"), [
    ("LLL", 0, 1, True, []), ("LLL", 2, 1, False, [1]), ("EEE", 1, 1, False, [0]),
    ("WW", 1, 1, False, [0]), ("RWR", 1, 1, False, [0]), ("RWRR", 3, 1, False, [1]),
    ("RRR", 2, 1, True, []), ("WRWR", 3, 1, False, [2]), ("PPPPP", 1, 3, True, []),
    ("PPPPP", 4, 3, False, [1, 2, 3]), ("PPPP", 3, 2, False, [1, 2]),
])
def test_verdict(spec: str, index: int, limit: int, holds: bool, watch: list[int]) -> None:
    entries = q(spec)
    got = _queue.verdict(entries, index, limit)
    assert (got.holds, ids(got.watch)) == (holds, watch)
    # the verdict agrees with the holders' list, and the watch list with watch_targets
    assert holds == (entries[index] in _queue.holders(entries, limit))
    if not holds:
        assert got.watch == _queue.watch_targets(entries, index, entries[index].kind, limit)


def test_zk_node_names_round_trip() -> None:
    node = zk.parse("write-abc-def-0000000042")
    assert node == zk.Node(42, Kind.WRITE, "abc-def", "write-abc-def-0000000042")
    assert zk.parse("leader-o-0000000001") == zk.Node(1, Kind.LEADER, "o", "leader-o-0000000001")
    for junk in ("lock-0000000001", "lock-o-00000x0001", "other-o-0000000001", "lock"):
        assert zk.parse(junk) is None
    children = ["read-b-0000000003", "write-a-0000000002", "lock-c-0000000001", "permit-d-0000000004"]
    assert [n.name for n in zk.family_nodes(children, Kind.READ)] == [
        "write-a-0000000002", "read-b-0000000003"]
    assert zk.families(children) == ["lock", "rw", "sem"]
    assert zk.families(["leader-x-0000000001"]) == ["elect"]


@pytest.mark.parametrize("name", ["orders:42", "a/b", ".", "..", "zookeeper", "ünï%cøde", "x" * 512])
def test_zk_names_escape_reversibly(name: str) -> None:
    escaped = zk.zk_name(name)
    assert "/" not in escaped and escaped not in (".", "..")
    assert zk.lock_name(escaped) == name


def test_zk_node_data_carries_the_holder_record() -> None:
    info = '{"h":"host","p":1,"t":null,"d":"a:b"}'
    assert zk.decode_data(zk.encode_data(3000, 2, info)) == (3000, 2, info)
    assert zk.decode_data(b"3000:1") == (3000, 1, "")  # written by an older aiolock
    assert zk.decode_data(b"\xff") == (30_000, 1, "")
    assert zk.decode_data(None) == (30_000, 1, "")
