"""Fast encoding of the requests and decoding of the replies of a contended acquisition
(list, create, delete, read, renew): one struct call per field group instead of
``aiozk``'s generic part-by-part (de)serializer -- the largest client cost left per
acquisition. They are ``aiozk``'s own request and response classes (subclassed for the
requests), byte for byte the same on the wire (``tests/test_zk_reader.py``)."""

from __future__ import annotations

import struct
from typing import Any

from aiozk import protocol as zkproto
from aiozk.protocol.stat import Stat as _Stat

__all__ = ["FAST_REPLIES", "Children", "Create2", "Delete", "GetData", "SetData", "watch_event"]

_HEAD = struct.Struct("!ii")


def _head(xid: int | None, opcode: int) -> bytes:
    return _INT.pack(opcode) if xid is None else _HEAD.pack(xid, opcode)


def _text(value: str) -> bytes:
    raw = value.encode()
    return _INT.pack(len(raw)) + raw


def _buffer(value: bytes | None) -> bytes:
    return _INT.pack(-1) if value is None else _INT.pack(len(value)) + value


_ACLS: dict[tuple[tuple[int, str, str], ...], bytes] = {}


def _acl(acl: list[Any]) -> bytes:
    """An ACL vector (the same few lists every time: cached)."""
    key = tuple((a.perms, a.id.scheme, a.id.id) for a in acl)
    out = _ACLS.get(key)
    if out is None:
        out = _ACLS[key] = _INT.pack(len(key)) + b"".join(
            _INT.pack(perms) + _text(scheme) + _text(ident) for perms, scheme, ident in key)
    return out


class _Fast:
    """Made from keywords without aiozk's check of each part's name (callers are ours)."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


class Children(_Fast, zkproto.GetChildrenRequest):  # type: ignore[misc]
    def serialize(self, xid: int | None = None) -> bytes:
        return _head(xid, self.opcode) + _text(self.path) + (b"\1" if self.watch else b"\0")


class GetData(_Fast, zkproto.GetDataRequest):  # type: ignore[misc]
    def serialize(self, xid: int | None = None) -> bytes:
        return _head(xid, self.opcode) + _text(self.path) + (b"\1" if self.watch else b"\0")


class Delete(_Fast, zkproto.DeleteRequest):  # type: ignore[misc]
    def serialize(self, xid: int | None = None) -> bytes:
        return _head(xid, self.opcode) + _text(self.path) + _INT.pack(self.version)


class SetData(_Fast, zkproto.SetDataRequest):  # type: ignore[misc]
    def serialize(self, xid: int | None = None) -> bytes:
        return (_head(xid, self.opcode) + _text(self.path) + _buffer(self.data)
                + _INT.pack(self.version))


class Create2(_Fast, zkproto.Create2Request):  # type: ignore[misc]
    flags = 0

    def serialize(self, xid: int | None = None) -> bytes:
        return (_head(xid, self.opcode) + _text(self.path) + _buffer(self.data)
                + _acl(self.acl) + _INT.pack(self.flags))


# The replies of a contended acquisition (listings, creates, reads, renewals), parsed with
# one struct call per field group instead of aiozk's generic part-by-part parser (the
# largest client cost left per acquisition); they are the same aiozk response classes.
_INT = struct.Struct("!i")
_STAT = struct.Struct("!qqqqiiiqiiq")
_STAT_FIELDS = tuple(name for name, _ in _Stat.parts)


def _response(cls: Any, **fields: Any) -> Any:
    out = cls.__new__(cls)
    out.__dict__.update(fields)
    return out


def _stat(payload: bytes, offset: int) -> Any:
    return _response(_Stat, **dict(zip(_STAT_FIELDS, _STAT.unpack_from(payload, offset),
                                              strict=True)))


def _string(payload: bytes, offset: int) -> tuple[str, int]:
    (size,) = _INT.unpack_from(payload, offset)
    offset += 4
    return payload[offset : offset + size].decode(), offset + size


def _children_reply(payload: bytes) -> Any:
    unpack = _INT.unpack_from
    (count,) = unpack(payload, 0)
    offset, children = 4, []
    for _ in range(count):  # (inline: a listing has a name per contender)
        end = offset + 4 + unpack(payload, offset)[0]
        children.append(payload[offset + 4 : end].decode())
        offset = end
    return _response(zkproto.GetChildrenResponse, children=children)


def _create2_reply(payload: bytes) -> Any:
    path, offset = _string(payload, 0)
    return _response(zkproto.Create2Response, path=path, stat=_stat(payload, offset))


def _get_data_reply(payload: bytes) -> Any:
    (size,) = _INT.unpack_from(payload, 0)
    data = None if size < 0 else payload[4 : 4 + size]
    return _response(zkproto.GetDataResponse, data=data, stat=_stat(payload, 4 + max(size, 0)))


def _set_data_reply(payload: bytes) -> Any:
    return _response(zkproto.SetDataResponse, stat=_stat(payload, 0))


def _delete_reply(payload: bytes) -> Any:
    return _response(zkproto.DeleteResponse)


def watch_event(payload: bytes) -> Any:
    """A watch notification (aiozk's ``WatchEvent``)."""
    kind, state, size = _EVENT_HEAD.unpack_from(payload, 0)
    path = None if size == -1 else payload[12 : 12 + size].decode()
    return _response(zkproto.WatchEvent, type=kind, state=state, path=path)


_EVENT_HEAD = struct.Struct("!iii")

FAST_REPLIES = {
    zkproto.DeleteResponse.opcode: _delete_reply,
    zkproto.GetChildrenResponse.opcode: _children_reply,
    zkproto.Create2Response.opcode: _create2_reply,
    zkproto.GetDataResponse.opcode: _get_data_reply,
    zkproto.SetDataResponse.opcode: _set_data_reply,
}


