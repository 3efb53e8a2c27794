"""Connections lent one transaction at a time, for Redis without scripting.

``WATCH`` is a state of one connection, so each ``WATCH``/``MULTI``/``EXEC`` transaction
of :mod:`aiolock.backends._redis_txn` borrows a connection of its own for its few round
trips (:class:`Lent`), and gives it back clean, or in a state the next transaction can
clean up: a transaction's ``MULTI`` and ``EXEC`` always go out in one batch, so a
transaction cancelled or failed half-way leaves at most a ``WATCH`` behind. On aiolock's
own connection the next transaction starts with ``UNWATCH`` then (and the protocol drops
the unread replies in order); a redis-py connection is closed instead (its pool refuses
one with replies unread).

:class:`Connections` keeps them: where the URL's options allow aiolock's own lean
connection (:mod:`aiolock.backends._resp`: hiredis parses a whole batch of replies at
once), new ones with the same settings, kept open between transactions; otherwise (an
option only redis-py honours, or a client you passed in) the connections of the
``redis.asyncio`` client's pool.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Sequence
from typing import Any

import hiredis
from redis import exceptions as rexc

from ._resp import RespClient, ResponseError

__all__ = ["ABORTED", "Connections", "Lent"]

#: The reply of an ``EXEC`` that another client's write aborted (a watched key changed).
ABORTED = object()
#: How a transaction leaves its connection: clean; perhaps still watching keys (cleared
#: by the next one's UNWATCH); in a state not known (closed).
CLEAN, WATCHING, BROKEN = "clean", "watching", "broken"
#: An error reply, as each transport gives it (a batch returns it in its place).
_ERROR_REPLIES = (rexc.ResponseError, ResponseError, hiredis.ReplyError)


class Connections:
    """The connections transactions borrow: clones of ``template`` (a lean connection,
    never used itself), or, without one, the pool of the ``redis.asyncio`` ``client``."""

    def __init__(self, client: Any, template: RespClient | None) -> None:
        self._client = client
        self._template = template
        self._idle: list[Any] = []
        self._lent: set[Any] = set()
        self._watching: set[Any] = set()  # may still WATCH keys: send UNWATCH first

    @property
    def lean(self) -> bool:
        """True for aiolock's own connections (False: the redis.asyncio client's pool)."""
        return self._template is not None

    async def borrow(self) -> tuple[Any, bool]:
        """A connection, and whether it may still WATCH keys (send UNWATCH first)."""
        if self._template is None:
            return await self._client.connection_pool.get_connection(), False
        conn = self._idle.pop() if self._idle else _fresh(self._template)
        self._lent.add(conn)
        watching = conn in self._watching
        self._watching.discard(conn)
        return conn, watching

    async def send(self, conn: Any, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Write ``commands`` at once on ``conn``; their replies, an error in its place."""
        if self._template is None:
            await conn.send_packed_command(_pack(conn, commands), check_health=False)
            return [await _read(conn) for _ in commands]
        data = b"".join(hiredis.pack_command(c) for c in commands)
        if len(commands) == 1:  # one command: an error reply raises
            try:
                replies: list[Any] = await conn.send(data, retry=False)  # (a retry would lose WATCH)
                return replies
            except ResponseError as exc:
                return [exc]
        replies = await conn.send(data, len(commands), retry=False)
        return replies

    async def give_back(self, conn: Any, left: str) -> None:
        """``conn`` back, as the transaction ``left`` it (CLEAN, WATCHING or BROKEN)."""
        if self._template is None:
            try:
                if left != CLEAN:
                    await conn.disconnect(nowait=True)
            finally:
                await self._client.connection_pool.release(conn)
            return
        self._lent.discard(conn)
        if left == BROKEN:
            await conn.aclose()
            return
        if left == WATCHING:
            self._watching.add(conn)
        self._idle.append(conn)

    async def aclose(self) -> None:
        """Close the connections of our own (the pool's are the client's to close)."""
        conns, self._idle = [*self._idle, *self._lent], []
        self._lent.clear()
        self._watching.clear()
        for conn in conns:
            await conn.aclose()


class Lent:
    """One borrowed connection for one transaction: commands go out in batches, one
    round trip each."""

    def __init__(self, connections: Connections) -> None:
        self._connections = connections
        self._conn: Any = None
        self._left = CLEAN
        self._stale = False  # the connection may still WATCH keys of an earlier transaction

    async def __aenter__(self) -> Lent:
        self._conn, self._stale = await self._connections.borrow()
        return self

    async def run(self, *commands: tuple[Any, ...]) -> list[Any]:
        """Send ``commands`` at once, return their replies; an aborted EXEC's is ABORTED.
        An error reply raises (after every reply of the batch was read)."""
        self._left = WATCHING  # until every reply is in (a cancellation, a timeout)
        if self._stale:
            replies = (await self._connections.send(self._conn, [("UNWATCH",), *commands]))[1:]
            self._stale = False
        else:
            replies = await self._connections.send(self._conn, commands)
        errors = [r for r in replies if isinstance(r, _ERROR_REPLIES)]
        last = commands[-1][0]
        if errors and any(c[0] == "MULTI" for c in commands):
            self._left = BROKEN  # a refused MULTI or EXEC: the state is not known
        elif not errors and last in ("EXEC", "UNWATCH"):
            self._left = CLEAN
        if not errors and last == "EXEC":
            if replies[-1] is None:
                replies[-1] = ABORTED
            else:
                errors = [r for r in replies[-1] if isinstance(r, _ERROR_REPLIES)]
        if errors:
            error = errors[0]
            raise ResponseError(str(error)) if isinstance(error, hiredis.ReplyError) else error
        return replies

    async def unwatch(self) -> None:
        """Drop the WATCH: on aiolock's own connection with the next transaction's first
        batch (no round trip now), on a redis-py one now."""
        if self._connections.lean:
            self._left, self._stale = WATCHING, True
        else:
            await self.run(("UNWATCH",))

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.shield(self._connections.give_back(self._conn, self._left))


def _fresh(template: RespClient) -> RespClient:
    """A new, unconnected RespClient with ``template``'s settings (address, credentials,
    TLS context, timeouts...): a copy, without its connection state."""
    clone = copy.copy(template)
    clone._proto, clone._connecting, clone._closed = None, None, False
    return clone


async def _read(conn: Any) -> Any:
    try:
        return await conn.read_response()
    except rexc.ResponseError as exc:
        return exc


def _pack(conn: Any, commands: Sequence[tuple[Any, ...]]) -> Any:
    """``commands`` in the protocol, as ``conn`` would pack them (hiredis's packer, much
    cheaper, where the connection encodes text as strict UTF-8)."""
    encoder = conn.encoder
    if encoder.encoding.lower().replace("_", "-") in ("utf-8", "utf8") and (
            encoder.encoding_errors == "strict"):
        return b"".join(hiredis.pack_command(c) for c in commands)
    return conn.pack_commands(commands)
