"""ZooKeeper: the leaner reply reader of the clients aiolock makes (issue 10).

A reply is read in one piece after its size: at once when buffered, else under one
``read_timeout``. These tests feed a ``StreamReader`` by hand: a reply split across
segments, a reply that never completes (``UnfinishedRead``, as aiozk's own reader), and
a connection closed mid-reply.
"""

from __future__ import annotations

import asyncio
import struct

import pytest

aiozk = pytest.importorskip("aiozk")

from aiozk import exc as zkexc  # noqa: E402
from aiozk import protocol as zkproto  # noqa: E402

from aiolock.backends.zookeeper._session import Connection as _Connection  # noqa: E402


def _conn(reader: asyncio.StreamReader, read_timeout: float = 2.0) -> _Connection:
    conn = _Connection("127.0.0.1", 1, watch_handler=lambda event: None, read_timeout=read_timeout)
    conn.reader = reader
    return conn


def _watch_event(path: str) -> bytes:
    """A watch notification (xid -1, zxid 7) for a deleted node, with its size prefix:
    header (xid, zxid, error), then type, state and the path (length-prefixed)."""
    raw = path.encode()
    body = struct.pack(f"!iqiiii{len(raw)}s", zkproto.WATCH_XID, 7, 0, zkproto.WatchEvent.DELETED,
                       3, len(raw), raw)
    return struct.pack("!i", len(body)) + body


async def test_a_reply_split_across_segments_is_read_whole() -> None:
    reader = asyncio.StreamReader()
    data = _watch_event("/aiolock/a/lock-x-0000000001")
    reader.feed_data(data[:7])  # the size and part of the header
    task = asyncio.create_task(_conn(reader).read_response())
    await asyncio.sleep(0.01)
    assert not task.done()
    reader.feed_data(data[7:])
    xid, zxid, event = await asyncio.wait_for(task, 2)
    assert (xid, zxid) == (zkproto.WATCH_XID, 7)
    assert event.path == "/aiolock/a/lock-x-0000000001" and event.type == zkproto.WatchEvent.DELETED


async def test_buffered_replies_are_read_in_order() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(_watch_event("/a/1") + _watch_event("/a/2"))
    conn = _conn(reader)
    assert (await conn.read_response())[2].path == "/a/1"
    assert (await conn.read_response())[2].path == "/a/2"


async def test_a_reply_that_never_completes_is_an_unfinished_read() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(_watch_event("/a/1")[:10])
    with pytest.raises(zkexc.UnfinishedRead):
        await asyncio.wait_for(_conn(reader, read_timeout=0.1).read_response(), 2)


async def test_a_connection_closed_mid_reply_is_aborted() -> None:
    """As a close between replies: the read loop ends, and the backend's connection
    watch suspends the session at once (aiozk's own reader spins on empty reads for its
    whole read_timeout, then raises UnfinishedRead)."""
    reader = asyncio.StreamReader()
    reader.feed_data(_watch_event("/a/1")[:10])
    reader.feed_eof()
    with pytest.raises(ConnectionAbortedError):
        await asyncio.wait_for(_conn(reader).read_response(), 2)


def _serialized(reply: object) -> bytes:
    fmt, data = reply.render()  # type: ignore[attr-defined]
    return struct.pack("!" + fmt, *data)


def _stat(version: int) -> object:
    from aiozk.protocol.stat import Stat
    return Stat(created_zxid=1 << 40, last_modified_zxid=7, created=1_700_000_000_000,
                modified=1_700_000_000_500, version=version, child_version=3, acl_version=0,
                ephemeral_owner=0x1234, data_length=5, num_children=0, last_modified_children=9)


@pytest.mark.parametrize("reply", [
    zkproto.GetChildrenResponse(children=[]),
    zkproto.GetChildrenResponse(children=["lock-a-0000000001", "read-ü-0000000002"]),
    zkproto.Create2Response(path="/aiolock/x/lock-o-0000000003", stat=_stat(0)),
    zkproto.GetDataResponse(data=b'3000:1:{"d":"x"}', stat=_stat(4)),
    zkproto.GetDataResponse(data=b"", stat=_stat(0)),
    zkproto.SetDataResponse(stat=_stat(5)),
    zkproto.DeleteResponse(),
], ids=["children-empty", "children", "create2", "get-data", "get-empty-data", "set-data", "delete"])
def test_fast_replies_read_as_aiozk_reads_them(reply: object) -> None:
    from aiolock.backends.zookeeper._wire import FAST_REPLIES as _FAST_REPLIES

    payload = _serialized(reply)
    cls = type(reply)
    fast, slow = _FAST_REPLIES[cls.opcode](payload), cls.deserialize(payload)
    assert type(fast) is cls and fast == slow and vars(fast) == vars(slow)


@pytest.mark.parametrize("path", ["/aiolock/x/lock-o-0000000003", "/ü", None])
def test_watch_events_read_as_aiozk_reads_them(path: str | None) -> None:
    from aiolock.backends.zookeeper._wire import watch_event

    event = zkproto.WatchEvent(type=zkproto.WatchEvent.DELETED, state=3, path=path)
    payload = _serialized(event)
    fast, slow = watch_event(payload), zkproto.WatchEvent.deserialize(payload)
    assert type(fast) is zkproto.WatchEvent and vars(fast) == vars(slow)


def _requests() -> list[tuple[object, object]]:
    from aiolock.backends.zookeeper import _wire
    from aiolock.backends.zookeeper._options import node_acl
    from aiolock.backends.zookeeper._session import CountedDelete

    acl = node_acl("creator", type("D", (), {"ident": "u:h4sh=", "user": "u"})())  # type: ignore[arg-type]
    create, slow_create = (c(path="/a/lock-ü-", data=b"3000:1:{}", acl=acl) for c in (
        _wire.Create2, zkproto.Create2Request))
    create.set_flags(ephemeral=True, sequential=True)
    slow_create.set_flags(ephemeral=True, sequential=True)
    return [
        (create, slow_create),
        (_wire.Children(path="/a/b", watch=True), zkproto.GetChildrenRequest(path="/a/b", watch=True)),
        (_wire.Children(path="/a", watch=False), zkproto.GetChildrenRequest(path="/a", watch=False)),
        (_wire.GetData(path="/a/ö", watch=False), zkproto.GetDataRequest(path="/a/ö", watch=False)),
        (_wire.Delete(path="/a/x", version=-1), zkproto.DeleteRequest(path="/a/x", version=-1)),
        (CountedDelete(path="/a/x", version=3), zkproto.DeleteRequest(path="/a/x", version=3)),
        (_wire.SetData(path="/a/x", data=b"1:2:", version=-1),
         zkproto.SetDataRequest(path="/a/x", data=b"1:2:", version=-1)),
    ]


def test_fast_requests_are_aiozk_requests_byte_for_byte() -> None:
    for fast, slow in _requests():
        assert isinstance(fast, type(slow))
        for xid in (None, 7):
            assert fast.serialize(xid) == slow.serialize(xid)  # type: ignore[attr-defined]
