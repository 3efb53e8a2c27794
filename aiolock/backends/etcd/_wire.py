"""The wire: etcd v3 messages and stubs (``etcd3aio``'s generated ones), the gRPC
channel, and one bidirectional stream fed from a queue."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import AsyncIterator
from typing import Any

from .._own_task import in_own_task

try:
    import grpc  # type: ignore[import-untyped]
    import grpc.aio  # type: ignore[import-untyped]
    from etcd3aio import _protobuf as pb
except ImportError as _exc:  # pragma: no cover - reported by aiolock.connect()
    raise ImportError(
        "the etcd:// backend needs etcd3aio: pip install 'aiolock[etcd]'", name="etcd3aio"
    ) from _exc

__all__ = ["ASCEND", "CREATE", "EQUAL", "NOPUT", "SORT_CREATE", "Stream", "grpc", "open_channel",
           "own_cancel", "parse_hosts", "pb"]

DEFAULT_PORT = 2379
CREATE = pb.Compare.CompareTarget.Value("CREATE")
EQUAL = pb.Compare.CompareResult.Value("EQUAL")
SORT_CREATE = pb.RangeRequest.SortTarget.Value("CREATE")
ASCEND = pb.RangeRequest.SortOrder.Value("ASCEND")
NOPUT = pb.WatchCreateRequest.FilterType.Value("NOPUT")


async def own_cancel(call: Any) -> Any:
    """Await a ``grpc.aio`` call in a task of its own (cancelled with its caller): grpc.aio
    re-raises a cancellation as a new CancelledError without its message
    (grpc/grpc#43502), which escaped anyio's ``move_on_after`` and cancelled the task."""
    return await in_own_task(call, lambda task: task.cancel())


class Stream:
    """One bidirectional gRPC stream fed from a queue, read by a task."""

    def __init__(self, call_factory: Any, on_response: Any, on_end: Any) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._on_response = on_response
        self._on_end = on_end
        self.call = call_factory(self._requests())
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _requests(self) -> AsyncIterator[Any]:
        while True:
            batch = await self._queue.get()
            if batch is None:
                return
            for item in batch:
                yield item

    def send(self, *requests: Any) -> None:
        """Queue ``requests`` (one queue item for many: a batch costs one wake-up)."""
        self._queue.put_nowait(requests)

    @property
    def alive(self) -> bool:
        return not self.reader.done()

    async def _read(self) -> None:
        error: BaseException | None = None
        try:
            async for response in self.call:
                self._on_response(response)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            error = exc
        finally:
            # ended (the server went away, say): end the request iterator too, or grpc's
            # task feeding the call from it waits on the queue for good (a pending task
            # and a running async generator per ended stream, which held up the
            # process's exit after a server restart)
            self._end_call()
            self._on_end(self, error)

    def _end_call(self) -> None:
        """End the request iterator and the call."""
        self._queue.put_nowait(None)
        self.call.cancel()

    def close(self) -> None:
        self._end_call()
        self.reader.cancel()

    async def aclose(self) -> None:
        self.close()
        with contextlib.suppress(BaseException):
            await self.reader


async def open_channel(
    hosts: list[tuple[str, int]], *, tls: bool, files: dict[str, bytes], server_name: str | None,
) -> Any:
    """A ``grpc.aio`` channel to the members (round robin; a dead member is skipped)."""
    addrs = await _resolve(hosts)
    target = addrs[0] if len(addrs) == 1 else "ipv4:" + ",".join(addrs)
    if len(addrs) > 1 and addrs[0].startswith("["):
        target = "ipv6:" + ",".join(addrs)
    options: list[tuple[str, Any]] = [
        ("grpc.lb_policy_name", "round_robin"),
        # etcd refuses pings more often than every 5 s (--grpc-keepalive-min-time)
        ("grpc.keepalive_time_ms", 5000),
        ("grpc.keepalive_timeout_ms", 2000),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.enable_retries", 0),
    ]
    if not tls:
        return grpc.aio.insecure_channel(target, options=options)
    creds = grpc.ssl_channel_credentials(files.get("ca"), files.get("key"), files.get("cert"))
    name = server_name or (hosts[0][0] if len(addrs) > 1 else None)
    if name:
        options += [("grpc.ssl_target_name_override", name), ("grpc.default_authority", name)]
    return grpc.aio.secure_channel(target, creds, options=options)


def brief(error: BaseException | None) -> str:
    if error is None:
        return "closed"
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name} {error.details() or ''}"
    return f"{type(error).__name__}: {error}"


def hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_hosts(hosts: str) -> list[tuple[str, int]]:
    if not isinstance(hosts, str) or not hosts.strip():
        raise ValueError("give etcd endpoints as 'host:port,host:port'")
    out = []
    for item in hosts.split(","):
        item = item.strip()
        if item.startswith("["):
            host, _, rest = item[1:].partition("]")
            port = rest[1:] if rest.startswith(":") else ""
        elif item.count(":") == 1:
            host, _, port = item.partition(":")
        else:
            host, port = item, ""
        port = port or str(DEFAULT_PORT)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad etcd endpoint {item!r} in {hosts!r}: expected host:port")
        out.append((host, int(port)))
    return out


async def _resolve(hosts: list[tuple[str, int]]) -> list[str]:
    """``host:port`` targets for gRPC: one endpoint as given; several as addresses (a
    gRPC target lists addresses, not names), IPv4 first."""
    if len(hosts) == 1:
        return [hostport(*hosts[0])]
    loop = asyncio.get_running_loop()
    v4: list[str] = []
    v6: list[str] = []
    for host, port in hosts:
        try:
            addr = ipaddress.ip_address(host)
            (v6 if addr.version == 6 else v4).append(hostport(host, port))
            continue
        except ValueError:
            pass
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        for family, _, _, _, sockaddr in infos:
            text = hostport(str(sockaddr[0]), port)
            bucket = v6 if family == socket.AF_INET6 else v4
            if text not in bucket:
                bucket.append(text)
    return v4 or v6
