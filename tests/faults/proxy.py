"""An asyncio TCP proxy of our own between a worker and its server, with faults.

Each direction of each connection is a reader task that queues chunks with their arrival
time and a writer task that forwards them in order once ``delay`` has passed and its
direction is open. Faults (all connections of the proxy at once):

* ``blackhole``: nothing moves either way (bytes are kept, as TCP retransmission
  would), new connections hang too; afterwards everything flows again, or the
  connections are reset (``heal="reset"``);
* ``drop-up`` / ``drop-down``: one direction only (client->server or server->client);
* ``delay``: every chunk is held ``seconds`` before it is forwarded;
* ``reset``: every connection is aborted with a TCP RST (``SO_LINGER`` 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections import deque

__all__ = ["Proxies", "Proxy"]


class _Pipe:
    """One direction of one connection."""

    def __init__(self, proxy: Proxy, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 up: bool) -> None:
        self.proxy = proxy
        self.reader = reader
        self.writer = writer
        self.up = up
        self.queue: deque[tuple[float, bytes]] = deque()
        self.ready = asyncio.Event()

    async def read(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                data = await self.reader.read(65536)
                if not data:
                    break
                self.queue.append((loop.time(), data))
                self.ready.set()
        except (ConnectionError, OSError):
            pass
        self.queue.append((0.0, b""))
        self.ready.set()

    async def write(self) -> None:
        loop = asyncio.get_running_loop()
        proxy = self.proxy
        try:
            while True:
                while not self.queue:
                    self.ready.clear()
                    await self.ready.wait()
                await proxy.wait_open(self.up)
                arrived, data = self.queue[0]
                if not data:
                    with contextlib.suppress(Exception):
                        if self.writer.can_write_eof():
                            self.writer.write_eof()
                    return
                due = arrived + proxy.delay
                if due > loop.time():
                    await asyncio.sleep(due - loop.time())
                    continue  # re-check: the direction may have closed meanwhile
                self.queue.popleft()
                self.writer.write(data)
                await self.writer.drain()
        except (ConnectionError, OSError):
            pass


class Proxy:
    """Listens on a free loopback port and forwards to ``target``."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.delay = 0.0
        self.closed_up = False
        self.closed_down = False
        self._opened = asyncio.Event()
        self._opened.set()
        self._server: asyncio.Server | None = None
        self._conns: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> Proxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def wait_open(self, up: bool) -> None:
        while self.closed_up if up else self.closed_down:
            self._opened.clear()
            await self._opened.wait()

    def set_faults(self, *, up: bool | None = None, down: bool | None = None,
                   delay: float | None = None) -> None:
        """Close or open a direction (``up`` is client->server), set the delay."""
        if up is not None:
            self.closed_up = up
        if down is not None:
            self.closed_down = down
        if delay is not None:
            self.delay = delay
        self._opened.set()

    def heal(self) -> None:
        self.set_faults(up=False, down=False, delay=0.0)

    def reset(self) -> int:
        """Abort every connection with a RST; returns how many."""
        conns = list(self._conns)
        for client, upstream in conns:
            for w in (client, upstream):
                sock = w.get_extra_info("socket")
                with contextlib.suppress(OSError):
                    if sock is not None:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                with contextlib.suppress(Exception):
                    w.transport.abort()
        self._conns.clear()
        return len(conns)

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        try:
            await self.wait_open(True)
            sreader, swriter = await asyncio.open_connection(*self.target)
        except (ConnectionError, OSError):
            cwriter.transport.abort()
            return
        pair = (cwriter, swriter)
        self._conns.add(pair)
        pipes = [_Pipe(self, creader, swriter, True), _Pipe(self, sreader, cwriter, False)]
        tasks = [asyncio.create_task(p.read()) for p in pipes] + [
            asyncio.create_task(p.write()) for p in pipes
        ]
        for t in tasks:
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
        try:
            # a connection ends when both writers finished (EOF forwarded) or it was reset
            await asyncio.gather(tasks[2], tasks[3], return_exceptions=True)
        except asyncio.CancelledError:
            pass  # shutting down
        finally:
            self._conns.discard(pair)
            for t in tasks:
                t.cancel()
            for w in pair:
                with contextlib.suppress(Exception):
                    w.close()

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        self.reset()
        for t in list(self._tasks):
            t.cancel()


class Proxies:
    """One worker's proxies, one per server node (``redlock``: one per Redis master); a
    fault applies to the nodes chosen (``which``: indices, default all)."""

    def __init__(self, target_ports: list[int]) -> None:
        self.proxies = [Proxy(p) for p in target_ports]

    async def start(self) -> Proxies:
        for proxy in self.proxies:
            await proxy.start()
        return self

    @property
    def ports(self) -> list[int]:
        return [p.port for p in self.proxies]

    @property
    def port(self) -> int:
        return self.proxies[0].port

    def _chosen(self, which: list[int] | None) -> list[Proxy]:
        return self.proxies if which is None else [self.proxies[i] for i in which]

    def set_faults(self, *, up: bool | None = None, down: bool | None = None,
                   delay: float | None = None, which: list[int] | None = None) -> None:
        for proxy in self._chosen(which):
            proxy.set_faults(up=up, down=down, delay=delay)

    def heal(self) -> None:
        for proxy in self.proxies:
            proxy.heal()

    def reset(self, which: list[int] | None = None) -> int:
        return sum(proxy.reset() for proxy in self._chosen(which))

    async def aclose(self) -> None:
        for proxy in self.proxies:
            await proxy.aclose()
