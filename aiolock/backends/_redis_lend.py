"""Connections lent one transaction at a time, for Redis without scripting.

``WATCH`` is a state of one connection, so each ``WATCH``/``MULTI``/``EXEC`` transaction
of :mod:`aiolock.backends._redis_txn` borrows a connection of its own for its few round
trips (:class:`Lent`), and gives it back clean -- or closes it if it was left watching,
inside ``MULTI`` or with replies unread (an error, a cancellation, a timeout).

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

    async def borrow(self) -> Any:
        if self._template is None:
            return await self._client.connection_pool.get_connection()
        conn = self._idle.pop() if self._idle else _fresh(self._template)
        self._lent.add(conn)
        return conn

    async def send(self, conn: Any, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Write ``commands`` at once on ``conn``; their replies, an error in its place."""
        if self._template is None:
            await conn.send_packed_command(_pack(conn, commands), check_health=False)
            return [await _read(conn) for _ in commands]
        data = b"".join(hiredis.pack_command(c) for c in commands)
        if len(commands) == 1:  # one command: an error reply raises
            try:
                return [await conn.send(data, retry=False)]  # (a retry would lose WATCH)
            except ResponseError as exc:
                return [exc]
        replies: list[Any] = await conn.send(data, len(commands), retry=False)
        return replies

    async def give_back(self, conn: Any, clean: bool) -> None:
        if self._template is None:
            try:
                if not clean:
                    await conn.disconnect(nowait=True)
            finally:
                await self._client.connection_pool.release(conn)
            return
        self._lent.discard(conn)
        if clean and self._template is not None:
            self._idle.append(conn)
        else:
            await conn.aclose()

    async def aclose(self) -> None:
        """Close the connections of our own (the pool's are the client's to close)."""
        conns, self._idle = [*self._idle, *self._lent], []
        self._lent.clear()
        for conn in conns:
            await conn.aclose()


class Lent:
    """One borrowed connection for one transaction: commands go out in batches, one
    round trip each."""

    def __init__(self, connections: Connections) -> None:
        self._connections = connections
        self._conn: Any = None
        self._clean = True

    async def __aenter__(self) -> Lent:
        self._conn = await self._connections.borrow()
        return self

    async def run(self, *commands: tuple[Any, ...]) -> list[Any]:
        """Send ``commands`` at once, return their replies; an aborted EXEC's is ABORTED.
        An error reply raises (after every reply of the batch was read)."""
        self._clean = False
        replies = await self._connections.send(self._conn, commands)
        errors = [r for r in replies if isinstance(r, _ERROR_REPLIES)]
        last = commands[-1][0]
        self._clean = not errors and last in ("EXEC", "UNWATCH")
        if not errors and last == "EXEC":
            if replies[-1] is None:
                replies[-1] = ABORTED
            else:
                errors = [r for r in replies[-1] if isinstance(r, _ERROR_REPLIES)]
        if errors:
            error = errors[0]
            raise ResponseError(str(error)) if isinstance(error, hiredis.ReplyError) else error
        return replies

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.shield(self._connections.give_back(self._conn, self._clean))


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
