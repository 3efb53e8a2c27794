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
