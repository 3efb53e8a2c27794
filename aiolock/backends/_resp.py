"""The Redis protocol (RESP, parsed by hiredis) on one pipelined connection.

The connection machinery -- ordering, cancellation, timeouts, one retry on a fresh
connection -- is :mod:`aiolock.backends._pipeline`; this module adds the parser and the
handshake (AUTH, CLIENT SETNAME, SELECT); a refused handshake raises its
:class:`ResponseError`.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable, Mapping
from typing import Any

import hiredis

from ._pipeline import PipelinedClient, PipelinedProtocol

__all__ = ["RespClient", "ResponseError"]


class ResponseError(Exception):
    """Redis answered with an error reply (``-ERR ...``)."""


class _Protocol(PipelinedProtocol):
    peer = "Redis"

    def __init__(self, timeout: float) -> None:
        super().__init__(timeout)
        self._reader = hiredis.Reader()

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        while True:
            try:
                reply = reader.gets()
                if reply is False:
                    return
                if isinstance(reply, hiredis.ReplyError):
                    reply = ResponseError(str(reply))  # fails its request, not the connection
                self.deliver(reply)
            except (hiredis.ProtocolError, ValueError) as exc:
                self.abort(ConnectionError(f"protocol error from Redis: {exc}"))
                return


class RespClient(PipelinedClient[_Protocol]):
    """Runs Redis commands on one lazily (re)connected, pipelined connection."""

    def __init__(
        self, *, host: str = "localhost", port: int = 6379, path: str | None = None,
        db: int = 0, username: str | None = None, password: str | None = None,
        ssl_context: ssl.SSLContext | None = None, connect_timeout: float = 5.0,
        request_timeout: float = 5.0, client_name: str | None = None, keepalive: bool = False,
        keepalive_options: Mapping[int, int | bytes] | None = None,
    ) -> None:
        super().__init__(connect_timeout=connect_timeout, request_timeout=request_timeout)
        self._host, self._port, self._path = host, port, path
        self._db, self._username, self._password = db, username, password
        self._ssl = ssl_context
        self._client_name = client_name
        self._keepalive = keepalive
        self._keepalive_options = dict(keepalive_options or {})

    async def _open(self, loop: asyncio.AbstractEventLoop) -> _Protocol:
        proto = _Protocol(self._request_timeout)
        if self._path is not None:
            await loop.create_unix_connection(lambda: proto, self._path)
        else:
            transport, _ = await loop.create_connection(
                lambda: proto, self._host, self._port, ssl=self._ssl)
            if self._keepalive:  # as redis-py's socket_keepalive(_options)
                sock = transport.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                for option, value in self._keepalive_options.items():
                    sock.setsockopt(socket.SOL_TCP, option, value)
        setup: list[asyncio.Future[list[Any]]] = []
        if self._password is not None:
            auth = ["AUTH", self._password]
            if self._username:
                auth.insert(1, self._username)
            setup.append(proto.send(_pack(*auth), loop))
        if self._client_name:
            setup.append(proto.send(_pack("CLIENT", "SETNAME", self._client_name), loop))
        if self._db:
            setup.append(proto.send(_pack("SELECT", self._db), loop))
        try:
            for fut in setup:
                await fut
        except BaseException as exc:  # a refusal (NOAUTH, WRONGPASS...) is the caller's to map
            proto.abort(exc)
            for fut in setup:  # the others failed with it: nobody else will look
                if fut.done() and not fut.cancelled():
                    fut.exception()
            raise
        return proto

    async def call(self, *args: Any, on_retry: Callable[[], object] | None = None) -> Any:
        """Run one command (retried once on a fresh connection if the first one died,
        calling ``on_retry`` first; aiolock's scripts are safe to repeat)."""
        return (await self.send(_pack(*args), on_retry=on_retry))[0]


def _pack(*args: Any) -> bytes:
    packed: bytes = hiredis.pack_command(args)
    return packed
