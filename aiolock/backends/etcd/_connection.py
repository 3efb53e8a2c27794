"""The connection: options, the gRPC channel, authentication, and the one exception map
applied at every request (:func:`Connection.errors`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from ..._validate import check_timeouts, query_pairs
from ...errors import AccessDenied, BackendUnavailable, LockError
from ._wire import grpc, hostport, open_channel, own_cancel, parse_hosts, pb

__all__ = ["OPTIONS", "Connection", "LeaseGone", "options_from_url"]

log = logging.getLogger("aiolock.backends.etcd")

OPTIONS = ("username", "password", "ca_file", "cert_file", "key_file", "tls", "server_name",
           "connect_timeout", "request_timeout", "prefix")


class LeaseGone(Exception):
    """The server has no such lease (expired or revoked)."""


#: The exception map: gRPC status -> what a caller sees (the first match of
#: :meth:`Connection.error` wins: credentials, then a missing lease, then these).
_UNAVAILABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
})
_DENIED = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})
_DENIED_DETAILS = ("authentication failed", "user name is empty")


def options_from_url(
    url: str, schemes: tuple[str, ...], options: dict[str, Any],
) -> tuple[str, dict[str, Any]]:
    """``etcd://[user:password@]host:port[,...][?option=value...]`` -> (hosts, keywords)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in schemes:
        raise ValueError("expected etcd://host:port,host:port")
    rest, _, fragment = rest.partition("#")
    netloc, _, query = rest.partition("?")
    netloc, _, path = netloc.partition("/")
    if fragment or path:
        raise ValueError("etcd URLs take no path or fragment: expected etcd://host:port,host:port"
                         "[?option=value]; use the 'prefix' option for a key prefix")
    given: dict[str, Any] = {}
    userinfo, at, hosts = netloc.rpartition("@")
    if at:
        user, _, password = userinfo.partition(":")
        given.update({k: unquote(v) for k, v in (("username", user), ("password", password)) if v})
    for key, value in query_pairs(query, f"etcd://{hosts}").items():  # twice: ValueError
        if value == "" and key != "tls" and key in OPTIONS:  # (``?tls`` alone means tls=true)
            raise ValueError(f"etcd option {key} needs a value (got {key}= in the URL)")
        given[key] = value
    overlap = set(given) & set(options)
    if overlap:
        raise ValueError(f"option(s) {sorted(overlap)} given both in the URL and as keywords")
    given.update(options)
    unknown = sorted(set(given) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown etcd option(s) {unknown}; accepted: {', '.join(OPTIONS)}")
    for what in ("connect_timeout", "request_timeout"):
        if isinstance(given.get(what), str):
            try:
                given[what] = float(given[what])
            except ValueError:
                raise ValueError(f"{what} must be a number of seconds > 0, got {given[what]!r}") from None
    if isinstance(given.get("tls"), str):
        flag = given["tls"].lower()
        if flag not in ("true", "false", "1", "0", "yes", "no", ""):
            raise ValueError(f"tls must be true or false, got {given['tls']!r}")
        given["tls"] = flag in ("true", "1", "yes", "")
    return hosts, given


def _read_files(ca_file: str | None, cert_file: str | None, key_file: str | None) -> dict[str, bytes]:
    if (cert_file is None) != (key_file is None):
        raise ValueError("a client certificate needs both cert_file and key_file")
    files: dict[str, bytes] = {}
    for what, path in (("ca", ca_file), ("cert", cert_file), ("key", key_file)):
        if path:
            try:
                files[what] = Path(path).read_bytes()
            except OSError as exc:
                raise ValueError(f"cannot read the etcd {what}_file {path!r}: {exc.strerror}") from None
    return files


class Connection:
    """One gRPC channel to the members, its credentials and its background tasks."""

    def __init__(
        self, hosts: str, *, username: str | None, password: str | None, ca_file: str | None,
        cert_file: str | None, key_file: str | None, tls: bool | None, server_name: str | None,
        connect_timeout: float, request_timeout: float, prefix: str,
    ) -> None:
        self.hosts = parse_hosts(hosts)
        check_timeouts(connect_timeout=connect_timeout, request_timeout=request_timeout)
        for what, given in (("username", username), ("password", password), ("ca_file", ca_file),
                            ("cert_file", cert_file), ("key_file", key_file),
                            ("server_name", server_name)):
            if given is not None and (not isinstance(given, str) or not given):
                raise ValueError(f"{what} must be a non-empty string or None, got {given!r}")
        if not isinstance(prefix, str) or not prefix or prefix.endswith("/"):
            raise ValueError(f"prefix must be a non-empty key prefix without a trailing '/', got {prefix!r}")
        if bool(username) != bool(password):
            raise ValueError("etcd authentication needs both a username and a password")
        self.username = username or None
        self._password = password or None
        self._files = _read_files(ca_file, cert_file, key_file)
        self._tls = bool(tls) or bool(self._files)
        self._server_name = server_name
        self.connect_timeout = float(connect_timeout)
        self.request_timeout = float(request_timeout)
        self.prefix = prefix
        self.channel: Any = None
        self.stubs: dict[str, Any] = {}
        self.metadata: tuple[tuple[str, str], ...] | None = None
        self._reauth = False  # a stream was refused our token: log in again first
        self._ready_lock = asyncio.Lock()
        self._started = False
        self.closed = False
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def url(self) -> str:
        user = f"{quote(self.username, safe='')}@" if self.username else ""
        return f"etcd://{user}" + ",".join(hostport(h, p) for h, p in self.hosts)

    # -- errors ---------------------------------------------------------------------------

    def error(self, exc: Any, what: str) -> Exception:
        """The exception map: a gRPC error -> ours (never with a password in it)."""
        code = exc.code()
        detail = exc.details() or ""
        text = f"etcd at {self.url} refused {what}: {code.name} {detail}"
        if code in _DENIED or (code == grpc.StatusCode.INVALID_ARGUMENT
                               and any(d in detail for d in _DENIED_DETAILS)):
            return AccessDenied(text)
        if code == grpc.StatusCode.NOT_FOUND and "lease not found" in detail:
            return LeaseGone(detail)
        if code in _UNAVAILABLE:
            return BackendUnavailable(f"etcd at {self.url} is unavailable for {what}: {code.name} {detail}")
        return LockError(text)

    @contextlib.contextmanager
    def errors(self, what: str) -> Iterator[None]:
        """Apply the exception map around one request."""
        try:
            yield
        except grpc.aio.AioRpcError as exc:
            raise self.error(exc, what) from None

    def note_stream_end(self, error: BaseException | None) -> None:
        """A stream refused our token: log in again before the next request."""
        if isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.UNAUTHENTICATED:
            self._reauth = True

    # -- requests -------------------------------------------------------------------------

    async def unary(self, service: str, method: str, request: Any, what: str) -> Any:
        """One request; logs in again once if the server forgot our token."""
        call = getattr(self.stubs[service], method)
        try:
            with self._closing():
                return await own_cancel(call(request, metadata=self.metadata, timeout=self.request_timeout))
        except grpc.aio.AioRpcError as exc:
            if not (self.username and exc.code() == grpc.StatusCode.UNAUTHENTICATED
                    and "invalid auth token" in (exc.details() or "")):
                raise self.error(exc, what) from None
        await self.authenticate()
        with self.errors(what), self._closing():
            return await own_cancel(call(request, metadata=self.metadata, timeout=self.request_timeout))

    def closed_error(self) -> LockError:
        """What a call on this connection raises once :meth:`aclose` ran."""
        return LockError(f"this connection to {self.url} is closed")

    @contextlib.contextmanager
    def _closing(self) -> Iterator[None]:
        """A call the closing channel cancelled (grpc.aio raises CancelledError in the
        caller, who was not cancelled) is a LockError: this connection was closed."""
        try:
            yield
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.closed and (task is None or not task.cancelling()):
                raise self.closed_error() from None
            raise
        except grpc.aio.UsageError:  # "Channel is closed." (a call made as it closed)
            if self.closed:
                raise self.closed_error() from None
            raise

    @contextlib.asynccontextmanager
    async def bounded(self, what: str) -> AsyncIterator[None]:
        """Connected, and done within ``request_timeout`` (else BackendUnavailable)."""
        await self.ready()
        try:
            async with asyncio.timeout(self.request_timeout):
                yield
        except TimeoutError as exc:
            raise BackendUnavailable(
                f"etcd at {self.url} did not answer {what} within {self.request_timeout} s"
            ) from exc

    async def revoke_quietly(self, lease: int) -> None:
        """Revoke a lease we no longer need; if that fails it expires by its ttl."""
        try:
            async with self.bounded("a revoke"):
                with contextlib.suppress(LeaseGone):
                    await self.unary("Lease", "LeaseRevoke", pb.LeaseRevokeRequest(ID=lease), "a revoke")
        except Exception as exc:
            log.debug("revoking etcd lease %x failed: %s", lease, exc)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- connecting -----------------------------------------------------------------------

    async def ready(self) -> None:
        if self.closed:
            raise self.closed_error()
        if self._started:
            return
        async with self._ready_lock:
            if self._started:
                return
            if self.closed:  # closed while another call was connecting
                raise self.closed_error()
            try:
                async with asyncio.timeout(self.connect_timeout):
                    with self._closing():  # closed while connecting
                        await self._open()
            except TimeoutError as exc:
                raise BackendUnavailable(
                    f"cannot reach etcd at {self.url} within {self.connect_timeout} s"
                ) from exc
            except LockError:  # (AccessDenied and BackendUnavailable are OSErrors too)
                raise
            except OSError as exc:
                raise BackendUnavailable(f"cannot reach etcd at {self.url}: {exc}") from exc
            if self.closed:  # closed while connecting, and the last step still answered
                raise self.closed_error()
            self._started = True

    async def _open(self) -> None:
        if self.channel is None:
            channel = await open_channel(
                self.hosts, tls=self._tls, files=self._files, server_name=self._server_name)
            if self.closed:  # aclose() ran meanwhile, with no channel to close
                await channel.close()
                raise self.closed_error()
            self.channel = channel
            self.stubs = {s: getattr(pb, f"{s}Stub")(self.channel) for s in ("KV", "Lease", "Watch", "Auth")}
        await own_cancel(self.channel.channel_ready())
        if self.username:
            await self.authenticate()
        # a first read checks the permissions on our prefix
        probe = pb.RangeRequest(key=self.prefix.encode() + b"/", limit=1, keys_only=True)
        await self.unary("KV", "Range", probe, "a first read")

    async def authenticate(self) -> None:
        request = pb.AuthenticateRequest(name=self.username, password=self._password)
        with self.errors("authentication"):
            reply = await own_cancel(self.stubs["Auth"].Authenticate(request, timeout=self.request_timeout))
        self.metadata = (("token", reply.token),)
        self._reauth = False

    async def check_token(self) -> None:
        if self._reauth and self.username:
            await self.authenticate()

    def cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    async def aclose(self) -> None:
        """Close the channel (after the streams and the last requests)."""
        self.closed = True
        if self.channel is not None:
            with contextlib.suppress(Exception):
                await self.channel.close()
