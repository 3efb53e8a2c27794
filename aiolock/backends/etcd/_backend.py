"""The etcd backend's adapter: the core's primitives on the recipe (:mod:`._recipe`),
over one keep-alive stream and one watch stream per connection (see the package doc)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import parse_qsl, quote, unquote

from ..._holder import decode_holder
from ...abc import FAMILY_KIND, REVOKED, Backend, Busy, Capability, Claim, Granted, Kind, LockInfo, Waiter
from ...errors import AccessDenied, BackendUnavailable, LockError
from . import _recipe as recipe
from ._recipe import KIND, lease_seconds, range_end
from ._wire import (
    ASCEND,
    CREATE,
    EQUAL,
    NOPUT,
    SORT_CREATE,
    Stream,
    brief,
    grpc,
    hostport,
    open_channel,
    parse_hosts,
    pb,
)

__all__ = ["EtcdBackend"]

log = logging.getLogger("aiolock")

#: At most this long between re-checks of a waiting claim (a missed watch costs this).
MAX_RECHECK = 5.0
#: A claim answered Busy and then neither asked again nor listening for this long (the
#: core gave up after one try) loses its key.
UNATTENDED = 0.5
#: Spare leases are kept for at most this many lease lengths (seconds) at once...
SPARE_TTLS = 8
#: ... and at most this many of one length.
SPARES = 32
#: Keys per page of a scan.
SCAN_PAGE = 500
#: Operations per transaction (etcd's --max-txn-ops defaults to 128).
TXN_OPS = 100
_OPTIONS = ("username", "password", "ca_file", "cert_file", "key_file", "tls", "server_name",
            "connect_timeout", "request_timeout", "prefix")


class _LeaseGone(Exception):
    """The server has no such lease (expired or revoked)."""



class EtcdBackend(Backend):
    """Locks on an etcd v3 cluster (or one member). See the module doc."""

    schemes: ClassVar[tuple[str, ...]] = ("etcd",)
    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.FAIR, Capability.RWLOCK, Capability.SEMAPHORE, Capability.EVENTS,
         Capability.EXPIRY, Capability.DISTRIBUTED, Capability.HOLDERS, Capability.SCAN,
         Capability.REVOKE, Capability.ELECTION}
    )

    def __init__(
        self, hosts: str, *, username: str | None = None, password: str | None = None,
        ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None,
        tls: bool | None = None, server_name: str | None = None, connect_timeout: float = 5.0,
        request_timeout: float = 5.0, prefix: str = "aiolock",
    ) -> None:
        self._hosts = parse_hosts(hosts)
        for what, value in (("connect_timeout", connect_timeout), ("request_timeout", request_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{what} must be a number of seconds > 0, got {value!r}")
        if not isinstance(prefix, str) or not prefix or prefix.endswith("/"):
            raise ValueError(f"prefix must be a non-empty key prefix without a trailing '/', got {prefix!r}")
        if bool(username) != bool(password):
            raise ValueError("etcd authentication needs both a username and a password")
        if (cert_file is None) != (key_file is None):
            raise ValueError("a client certificate needs both cert_file and key_file")
        self._username = username or None
        self._password = password or None
        self._files: dict[str, bytes] = {}
        for what, path in (("ca", ca_file), ("cert", cert_file), ("key", key_file)):
            if path:
                try:
                    self._files[what] = Path(path).read_bytes()
                except OSError as exc:
                    raise ValueError(f"cannot read the etcd {what}_file {path!r}: {exc.strerror}") from None
        self._tls = bool(tls) or bool(self._files)
        self._server_name = server_name
        self._connect_timeout = float(connect_timeout)
        self._request_timeout = float(request_timeout)
        self._prefix = prefix
        self._channel: Any = None
        self._stubs: dict[str, Any] = {}
        self._metadata: tuple[tuple[str, str], ...] | None = None
        self._reauth = False  # a stream was refused our token: log in again first
        self._ready_lock = asyncio.Lock()
        self._started = False
        self._closed = False
        self._keepalive: Stream | None = None
        self._alive_waiting: dict[int, collections.deque[asyncio.Future[int]]] = {}
        self._watch_stream: Stream | None = None
        self._watch_ids = itertools.count(1)
        self._watch_owner: dict[int, str] = {}  # watch id -> owner of the claim it wakes
        #: watch id -> (listener, family prefix): an election's listeners watch every change
        #: of the family (a new leader, a proclaim, a release), for as long as they listen
        self._family_watches: dict[int, tuple[Waiter, bytes]] = {}
        self._created: dict[int, asyncio.Future[None]] = {}
        self._waiters: dict[str, Waiter] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        #: lease seconds -> leases with no key on them: (id, last confirmed, ttl); granted
        #: ahead, or given back by a release (which deletes the key, not the lease). An
        #: acquire takes one and needs one request, not two.
        self._spares: dict[int, list[tuple[int, float, int]]] = {}
        self._replenishing: set[int] = set()
        #: releases and abandons under way, by family prefix: an inspect waits for them
        #: (requests may take different members: this keeps them in order for the caller)
        self._deleting: dict[bytes, set[asyncio.Future[None]]] = {}
        #: bumped whenever the watch stream ends: a Busy answer from before is stale
        self._epoch = 0

    @classmethod
    def from_url(cls, url: str, **options: Any) -> EtcdBackend:
        """``etcd://[user:password@]host:port[,host:port...][?option=value...]``; the port
        defaults to 2379. Options (query or keyword): ``username``, ``password``,
        ``ca_file``, ``cert_file``, ``key_file``, ``tls`` (``true`` to use TLS with the
        system's CAs), ``server_name`` (the name the server certificate is checked for),
        ``connect_timeout``, ``request_timeout`` (seconds, default 5), ``prefix`` (key
        prefix, default ``aiolock``)."""
        scheme, sep, rest = url.partition("://")
        if not sep or scheme.lower() not in cls.schemes:
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
        for key, value in parse_qsl(query, keep_blank_values=True):
            given[key] = value
        overlap = set(given) & set(options)
        if overlap:
            raise ValueError(f"option(s) {sorted(overlap)} given both in the URL and as keywords")
        given.update(options)
        unknown = sorted(set(given) - set(_OPTIONS))
        if unknown:
            raise ValueError(f"unknown etcd option(s) {unknown}; accepted: {', '.join(_OPTIONS)}")
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
        return cls(hosts, **given)

    @property
    def url(self) -> str:
        user = f"{quote(self._username, safe='')}@" if self._username else ""
        return f"etcd://{user}" + ",".join(hostport(h, p) for h, p in self._hosts)

    # -- connection -----------------------------------------------------------------------

    async def connect(self) -> None:
        await self._ready()

    async def _ready(self) -> None:
        if self._closed:
            raise LockError(f"this connection to {self.url} is closed")
        if self._started:
            return
        async with self._ready_lock:
            if self._started:
                return
            try:
                async with asyncio.timeout(self._connect_timeout):
                    if self._channel is None:
                        self._channel = await open_channel(
                            self._hosts, tls=self._tls, files=self._files, server_name=self._server_name)
                        self._stubs = {s: getattr(pb, f"{s}Stub")(self._channel)
                                       for s in ("KV", "Lease", "Watch", "Auth")}
                    await self._channel.channel_ready()
                    if self._username:
                        await self._authenticate()
                    # a first read checks the permissions on our prefix
                    probe = pb.RangeRequest(key=self._prefix.encode() + b"/", limit=1, keys_only=True)
                    await self._unary("KV", "Range", probe, "a first read")
            except TimeoutError as exc:
                raise BackendUnavailable(
                    f"cannot reach etcd at {self.url} within {self._connect_timeout} s"
                ) from exc
            except LockError:  # (AccessDenied and BackendUnavailable are OSErrors too)
                raise
            except OSError as exc:
                raise BackendUnavailable(f"cannot reach etcd at {self.url}: {exc}") from exc
            self._started = True

    async def _authenticate(self) -> None:
        request = pb.AuthenticateRequest(name=self._username, password=self._password)
        try:
            reply = await self._stubs["Auth"].Authenticate(request, timeout=self._request_timeout)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc, "authentication") from None
        self._metadata = (("token", reply.token),)
        self._reauth = False

    async def _check_token(self) -> None:
        if self._reauth and self._username:
            await self._authenticate()

    def _error(self, exc: Any, what: str) -> Exception:
        code = exc.code()
        detail = exc.details() or ""
        text = f"etcd at {self.url} refused {what}: {code.name} {detail}"
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) or (
            code == grpc.StatusCode.INVALID_ARGUMENT
            and ("authentication failed" in detail or "user name is empty" in detail)
        ):
            return AccessDenied(text)
        if code == grpc.StatusCode.NOT_FOUND and "lease not found" in detail:
            return _LeaseGone(detail)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                    grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
            return BackendUnavailable(f"etcd at {self.url} is unavailable for {what}: {code.name} {detail}")
        return LockError(text)

    async def _unary(self, service: str, method: str, request: Any, what: str) -> Any:
        stub = self._stubs[service]
        for attempt in (1, 2):
            try:
                return await getattr(stub, method)(
                    request, metadata=self._metadata, timeout=self._request_timeout)
            except grpc.aio.AioRpcError as exc:
                if (attempt == 1 and self._username and exc.code() == grpc.StatusCode.UNAUTHENTICATED
                        and "invalid auth token" in (exc.details() or "")):
                    await self._authenticate()  # the server forgot our token: log in again
                    continue
                raise self._error(exc, what) from None
        raise AssertionError("unreachable")

    @contextlib.asynccontextmanager
    async def _bounded(self, what: str) -> AsyncIterator[None]:
        await self._ready()
        try:
            async with asyncio.timeout(self._request_timeout):
                yield
        except TimeoutError as exc:
            raise BackendUnavailable(
                f"etcd at {self.url} did not answer {what} within {self._request_timeout} s"
            ) from exc

    # -- keep-alive stream ----------------------------------------------------------------

    def _keepalive_stream(self) -> Stream:
        stream = self._keepalive
        if stream is None or not stream.alive:
            stub = self._stubs["Lease"]
            stream = self._keepalive = Stream(
                lambda it: stub.LeaseKeepAlive(it, metadata=self._metadata),
                self._on_keepalive, self._keepalive_ended)
        return stream

    def _on_keepalive(self, response: Any) -> None:
        futures = self._alive_waiting.get(int(response.ID))
        if futures:
            future = futures.popleft()  # replies for one lease come in request order
            if not futures:
                del self._alive_waiting[int(response.ID)]
            if not future.done():
                future.set_result(int(response.TTL))

    def _note_auth(self, error: BaseException | None) -> None:
        if isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.UNAUTHENTICATED:
            self._reauth = True

    def _keepalive_ended(self, stream: Stream, error: BaseException | None) -> None:
        self._note_auth(error)
        if self._keepalive is stream:
            self._keepalive = None
        waiting, self._alive_waiting = self._alive_waiting, {}
        for futures in waiting.values():
            for future in futures:
                if not future.done():
                    future.set_exception(BackendUnavailable(
                        f"the etcd keep-alive stream to {self.url} ended ({brief(error)})"))
        if error is not None and not self._closed:
            log.debug("etcd keep-alive stream ended: %s", brief(error))

    async def _keep_alive(self, leases: Sequence[int]) -> list[int]:
        """One keep-alive per lease over the connection's stream: each one's TTL (0: gone)."""
        await self._check_token()
        stream = self._keepalive_stream()
        loop = asyncio.get_running_loop()
        futures = []
        for lease in leases:
            future: asyncio.Future[int] = loop.create_future()
            self._alive_waiting.setdefault(lease, collections.deque()).append(future)
            futures.append(future)
            stream.send(pb.LeaseKeepAliveRequest(ID=lease))
        try:
            async with asyncio.timeout(self._request_timeout):
                return list(await asyncio.gather(*futures))
        except TimeoutError:
            if self._keepalive is stream:  # stuck (a member cut off?): start afresh
                self._keepalive = None
                stream.close()
            raise BackendUnavailable(
                f"etcd at {self.url} did not answer a keep-alive within {self._request_timeout} s"
            ) from None
        finally:
            for future in futures:
                if not future.done():
                    future.cancel()

    # -- watch stream ---------------------------------------------------------------------

    def _watch_stream_open(self) -> Stream:
        stream = self._watch_stream
        if stream is None or not stream.alive:
            stub = self._stubs["Watch"]
            stream = self._watch_stream = Stream(
                lambda it: stub.Watch(it, metadata=self._metadata), self._on_watch, self._watch_ended)
            for watch_id, (_, prefix) in self._family_watches.items():
                stream.send(self._family_watch_request(watch_id, prefix))
        return stream

    @staticmethod
    def _family_watch_request(watch_id: int, prefix: bytes) -> Any:
        return pb.WatchRequest(create_request=pb.WatchCreateRequest(
            key=prefix, range_end=range_end(prefix), watch_id=watch_id))

    def _on_watch(self, response: Any) -> None:
        watch_id = int(response.watch_id)
        if response.created:
            created = self._created.pop(watch_id, None)
            if created is not None and not created.done():
                created.set_result(None)
        family = self._family_watches.get(watch_id)
        if family is not None:
            if response.canceled:
                del self._family_watches[watch_id]
            if response.events or response.canceled or response.compact_revision:
                family[0].wake()
            return
        if response.events or response.canceled or response.compact_revision:
            # (only deletions are sent: NOPUT) the key went, or the watch cannot serve
            self._fire(int(response.watch_id))

    def _fire(self, watch_id: int) -> None:
        owner = self._watch_owner.pop(watch_id, None)
        if owner is None:
            return
        stream = self._watch_stream
        if stream is not None and stream.alive:
            stream.send(pb.WatchRequest(cancel_request=pb.WatchCancelRequest(watch_id=watch_id)))
        waiter = self._waiters.get(owner)
        if waiter is not None:
            waiter.wake()

    def _watch_ended(self, stream: Stream, error: BaseException | None) -> None:
        self._note_auth(error)
        if self._watch_stream is stream:
            self._watch_stream = None
        self._epoch += 1
        self._watch_owner.clear()
        for created in self._created.values():
            if not created.done():
                created.set_result(None)
        self._created.clear()
        if not self._closed:
            if error is not None:
                log.debug("etcd watch stream ended: %s", brief(error))
            for waiter in list(self._waiters.values()):  # never trust a watch across this
                waiter.wake()
            if self._family_watches:
                self._spawn(self._rewatch_families())

    async def _rewatch_families(self) -> None:
        """The family watches again, on a new stream (their listeners were woken)."""
        await asyncio.sleep(0.2)
        if self._closed or (self._watch_stream is not None and self._watch_stream.alive):
            return  # (a new stream is open already: _watch_stream_open re-sent them)
        self._watch_stream_open()

    def _watch(self, claim: Claim, keys: set[bytes], start: int) -> None:
        """Make ``keys`` the set whose deletion (after revision ``start``) wakes ``claim``."""
        current: dict[bytes, int] = claim.state.setdefault("watch", {})  # type: ignore[assignment]
        for key, watch_id in list(current.items()):
            if key not in keys or watch_id not in self._watch_owner:
                self._cancel_watch(watch_id)
                del current[key]
        new = keys - current.keys()
        if not new:
            return
        stream = self._watch_stream_open()
        for key in new:
            watch_id = next(self._watch_ids)
            self._watch_owner[watch_id] = claim.owner
            current[key] = watch_id
            stream.send(pb.WatchRequest(create_request=pb.WatchCreateRequest(
                key=key, start_revision=start, filters=[NOPUT], watch_id=watch_id)))

    def _cancel_watch(self, watch_id: int) -> None:
        if self._watch_owner.pop(watch_id, None) is not None:
            stream = self._watch_stream
            if stream is not None and stream.alive:
                stream.send(pb.WatchRequest(cancel_request=pb.WatchCancelRequest(watch_id=watch_id)))

    def _unwatch(self, claim: Claim) -> None:
        current: dict[bytes, int] = claim.state.pop("watch", {})  # type: ignore[assignment]
        for watch_id in current.values():
            self._cancel_watch(watch_id)

    # -- primitives -----------------------------------------------------------------------

    def _family_prefix(self, name: str, kind: Kind) -> bytes:
        return f"{self._prefix}/{kind.family}/{quote(name, safe='')}/".encode()

    def _claim_key(self, claim: Claim) -> bytes:
        return self._family_prefix(claim.name, claim.kind) + f"{KIND[claim.kind]}-{claim.owner}".encode()

    def _forget(self, claim: Claim) -> None:
        self._unwatch(claim)
        for key in ("lease", "lease_ttl", "confirmed", "rev", "busy", "asked", "granted", "revoking",
                    "stamp"):
            claim.state.pop(key, None)

    async def _new_lease(self, claim: Claim) -> int:
        """A lease for ``claim``: the spare one if it is fresh (over half its ttl left),
        else granted now; either way another spare is asked for in the background."""
        ttl_s = lease_seconds(claim.ttl_ms)
        spares = self._spares.get(ttl_s, [])
        while spares:
            lease, sent, granted = spares.pop()
            if sent + granted - time.monotonic() > granted / 2:
                claim.state.update(lease=lease, confirmed=sent, lease_ttl=granted)
                break
            self._spawn(self._revoke_quietly(lease))
        else:
            lease = 0
        if not spares:
            self._spares.pop(ttl_s, None)
            self._replenish(ttl_s)
        return lease or await self._grant_lease(claim)

    def _give_back(self, claim: Claim) -> None:
        """After a release that deleted the key: keep its lease as a spare."""
        lease, sent, granted = (claim.state.get(k) for k in ("lease", "confirmed", "lease_ttl"))
        if not (isinstance(lease, int) and isinstance(sent, float) and isinstance(granted, int)):
            return
        ttl_s = lease_seconds(claim.ttl_ms)
        spares = self._spares.get(ttl_s)
        if spares is None and len(self._spares) + len(self._replenishing) < SPARE_TTLS:
            spares = self._spares[ttl_s] = []
        if spares is not None and len(spares) < SPARES and not self._closed:
            spares.append((lease, sent, granted))
        else:
            self._spawn(self._revoke_quietly(lease))

    def _replenish(self, ttl_s: int) -> None:
        if (self._closed or ttl_s in self._spares or ttl_s in self._replenishing
                or len(self._spares) + len(self._replenishing) >= SPARE_TTLS):
            return
        self._replenishing.add(ttl_s)
        self._spawn(self._grant_spare(ttl_s))

    async def _grant_spare(self, ttl_s: int) -> None:
        lease = secrets.randbelow(2**62) + 1
        sent = time.monotonic()
        try:
            async with self._bounded("a lease grant"):
                reply = await self._unary("Lease", "LeaseGrant", pb.LeaseGrantRequest(TTL=ttl_s, ID=lease),
                                          "a lease grant")
            if not reply.error and not self._closed:
                self._spares.setdefault(ttl_s, []).append((lease, sent, int(reply.TTL)))
        except Exception as exc:  # the next acquire grants its own
            log.debug("granting a spare etcd lease failed: %s", exc)
        finally:
            self._replenishing.discard(ttl_s)

    async def _grant_lease(self, claim: Claim) -> int:
        lease = secrets.randbelow(2**62) + 1  # ours: an abandon can revoke it before the reply
        claim.state["lease"] = lease
        sent = time.monotonic()
        request = pb.LeaseGrantRequest(TTL=lease_seconds(claim.ttl_ms), ID=lease)
        reply = await self._unary("Lease", "LeaseGrant", request, "a lease grant")
        if reply.error:
            raise LockError(f"etcd at {self.url} refused a lease: {reply.error}")
        claim.state["lease_ttl"] = int(reply.TTL)
        claim.state["confirmed"] = sent
        return lease

    def _left_ms(self, claim: Claim, since: float) -> int:
        """How long the lease surely lasts counted from ``since`` (ms, at most its ttl)."""
        confirmed = claim.state.get("confirmed")
        ttl = claim.state.get("lease_ttl")
        assert isinstance(confirmed, float) and isinstance(ttl, int)
        return int(min(claim.ttl_ms, (confirmed + ttl - since) * 1000))

    async def _refresh(self, claim: Claim) -> bool:
        """Keep a claim's lease alive now; False if it is gone."""
        lease = claim.state["lease"]
        assert isinstance(lease, int)
        sent = time.monotonic()
        (ttl,) = await self._keep_alive([lease])
        if ttl <= 0:
            return False
        claim.state["confirmed"] = sent
        claim.state["lease_ttl"] = ttl
        return True

    async def try_acquire(self, claim: Claim) -> Granted | Busy:
        if claim.state.get("abandoned"):
            raise LockError(f"claim on {claim.name!r} was abandoned")
        claim.state.pop("asked", None)  # being asked: not unattended
        busy = self._same_answer(claim)
        if busy is not None:
            return busy
        async with self._bounded("an acquire"):
            await self._check_token()
            return await self._try_acquire(claim)

    def _same_answer(self, claim: Claim) -> Busy | None:
        """Asked again with nothing changed (no watch fired, no stream restart, no re-check
        or keep-alive due): the same answer, without a request."""
        busy = claim.state.pop("busy", None)
        if not isinstance(busy, tuple) or busy[0] != self._epoch or self._closed:
            return None
        left = busy[1] - time.monotonic()
        watched: dict[bytes, int] = claim.state.get("watch", {})  # type: ignore[assignment]
        if left <= 0 or not watched or not all(w in self._watch_owner for w in watched.values()):
            return None
        claim.state["busy"] = busy
        self._answered_busy(claim)
        return Busy(left)

    async def _try_acquire(self, claim: Claim) -> Granted | Busy:
        started = time.monotonic()
        prefix = self._family_prefix(claim.name, claim.kind)
        key = self._claim_key(claim)
        value = recipe.value(claim, _stamp(claim))
        listing = pb.RequestOp(request_range=pb.RangeRequest(
            key=prefix, range_end=range_end(prefix), sort_target=SORT_CREATE, sort_order=ASCEND))
        for _ in range(4):
            lease = claim.state.get("lease")
            if not isinstance(lease, int):
                lease = await self._new_lease(claim)
            txn = pb.TxnRequest(
                compare=[pb.Compare(key=key, target=CREATE, result=EQUAL, create_revision=0)],
                success=[pb.RequestOp(request_put=pb.PutRequest(key=key, value=value, lease=lease)), listing],
                failure=[listing],
            )
            try:
                reply = await self._unary("KV", "Txn", txn, "an acquire")
            except _LeaseGone:  # our lease expired while we waited: start again
                self._forget(claim)
                continue
            entries = recipe.entries(reply.responses[-1].response_range.kvs, prefix)
            index = next((i for i, e in enumerate(entries) if e.owner == claim.owner), None)
            if index is None:  # cannot be (one transaction), but never grant on it
                self._forget(claim)
                continue
            me = entries[index]
            if me.lease != lease:  # a key of ours from another lease (a lost reply): adopt it
                claim.state["lease"] = me.lease
                claim.state["confirmed"] = 0.0  # unknown: refresh before believing it
                claim.state["lease_ttl"] = 0
            claim.state["rev"] = me.rev
            if any(e.owner == claim.owner for e in recipe.holders(entries, claim.limit)):
                if self._left_ms(claim, started) < claim.ttl_ms / 2 and not await self._refresh(claim):
                    self._forget(claim)
                    continue
                self._unwatch(claim)
                claim.state["granted"] = True
                return Granted(me.rev, self._left_ms(claim, started))
            targets = {e.key for e in recipe.watch_targets(entries, index, claim)}
            self._watch(claim, targets, int(reply.header.revision) + 1)
            # keep our own lease (our place in the queue) alive while we wait
            ttl = claim.state["lease_ttl"]
            assert isinstance(ttl, int)
            if self._left_ms(claim, time.monotonic()) < ttl * 1000 * 2 / 3 and not await self._refresh(claim):
                self._forget(claim)
                continue
            confirmed = claim.state["confirmed"]
            assert isinstance(confirmed, float)
            now = time.monotonic()
            wait = max(0.001, min(MAX_RECHECK, confirmed + ttl / 3 - now))
            claim.state["busy"] = (self._epoch, now + wait)
            self._answered_busy(claim)
            return Busy(wait)
        return Busy(0.05)

    async def renew(self, claims: Sequence[Claim]) -> list[int | None]:
        if not claims:
            return []
        out: list[int | None] = [None] * len(claims)
        ask: list[tuple[int, Claim, int]] = []
        moves: list[tuple[int, Claim]] = []
        for i, claim in enumerate(claims):
            lease = claim.state.get("lease")
            if not isinstance(lease, int) or not claim.state.get("granted"):
                continue
            ttl = claim.state.get("lease_ttl")
            if isinstance(ttl, int) and claim.ttl_ms > ttl * 1000:
                moves.append((i, claim))  # extended past its etcd lease: a longer one
            else:
                ask.append((i, claim, lease))
        async with self._bounded("a renewal"):
            sent = time.monotonic()
            if ask:
                # the keep-alives, and (one transaction per TXN_OPS claims) whether each key
                # is still there: a key gone under a live lease was revoked by an operator
                ttls, present = await asyncio.gather(
                    self._keep_alive([lease for _, _, lease in ask]),
                    self._present([claim for _, claim, _ in ask]))
            else:
                ttls, present = [], []
            for (i, claim, _), ttl, there in zip(ask, ttls, present, strict=True):
                if ttl > 0 and not there:
                    out[i] = REVOKED
                elif ttl > 0:
                    claim.state["confirmed"] = sent
                    claim.state["lease_ttl"] = ttl
                    out[i] = min(claim.ttl_ms, ttl * 1000)
            for i, claim in moves:
                out[i] = await self._move_lease(claim)
        return out

    async def _present(self, claims: Sequence[Claim]) -> list[bool]:
        """Whether each claim's key exists (one read-only transaction per TXN_OPS keys)."""
        async def chunk(part: Sequence[Claim]) -> list[bool]:
            ops = [pb.RequestOp(request_range=pb.RangeRequest(key=self._claim_key(c), count_only=True))
                   for c in part]
            reply = await self._unary("KV", "Txn", pb.TxnRequest(success=ops), "a renewal")
            return [r.response_range.count > 0 for r in reply.responses]

        parts = await asyncio.gather(*(chunk(claims[i : i + TXN_OPS])
                                       for i in range(0, len(claims), TXN_OPS)))
        return [there for part in parts for there in part]

    async def set_info(self, claim: Claim) -> bool:
        """Rewrite the held claim's value with its new record (same lease, same key, so
        the same token); the election's listeners see the put."""
        rev, lease = claim.state.get("rev"), claim.state.get("lease")
        if not (claim.state.get("granted") and isinstance(rev, int) and isinstance(lease, int)):
            return False
        key = self._claim_key(claim)
        txn = pb.TxnRequest(
            compare=[pb.Compare(key=key, target=CREATE, result=EQUAL, create_revision=rev)],
            success=[pb.RequestOp(request_put=pb.PutRequest(
                key=key, value=recipe.value(claim, _stamp(claim)), lease=lease))])
        async with self._bounded("a proclaim"):
            try:
                reply = await self._unary("KV", "Txn", txn, "a proclaim")
            except _LeaseGone:
                return False
        return bool(reply.succeeded)

    async def force_release(self, name: str, kind: Kind = Kind.LOCK) -> bool:
        """Delete every holder's key of ``name`` in ``kind``'s family: their next renewal
        finds the key gone under a live lease (revoked); the waiters' watches fire."""
        prefix = self._family_prefix(name, kind)
        request = pb.RangeRequest(key=prefix, range_end=range_end(prefix),
                                  sort_target=SORT_CREATE, sort_order=ASCEND)
        async with self._bounded("a revocation"):
            reply = await self._unary("KV", "Range", request, "a revocation")
            entries = recipe.entries(reply.kvs, prefix)
            holders = recipe.holders(entries, entries[0].limit) if entries else []
            if not holders:
                return False
            # each only if it is still the key we saw (not a later claim's)
            deletes = [pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=e.key)) for e in holders]
            compare = [pb.Compare(key=e.key, target=CREATE, result=EQUAL, create_revision=e.rev)
                       for e in holders]
            txn = pb.TxnRequest(compare=compare, success=deletes)
            done = await self._unary("KV", "Txn", txn, "a revocation")
        return bool(done.succeeded)

    async def _move_lease(self, claim: Claim) -> int | None:
        """Attach the claim's key to a new lease of its (longer) ttl; same key, same
        create_revision, so the same token. The ms granted, or None if the key is gone."""
        old, rev = claim.state.get("lease"), claim.state.get("rev")
        assert isinstance(rev, int)
        sent = time.monotonic()
        lease = await self._grant_lease(claim)
        key = self._claim_key(claim)
        txn = pb.TxnRequest(
            compare=[pb.Compare(key=key, target=CREATE, result=EQUAL, create_revision=rev)],
            success=[pb.RequestOp(request_put=pb.PutRequest(
                key=key, value=recipe.value(claim, _stamp(claim)), lease=lease))],
        )
        reply = await self._unary("KV", "Txn", txn, "a renewal")
        stale = lease if not reply.succeeded else old
        if isinstance(stale, int):
            self._spawn(self._revoke_quietly(stale))
        if not reply.succeeded:
            return None
        return self._left_ms(claim, sent)

    @contextlib.contextmanager
    def _deletion(self, claim: Claim) -> Iterator[None]:
        prefix = self._family_prefix(claim.name, claim.kind)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._deleting.setdefault(prefix, set()).add(done)
        try:
            yield
        finally:
            done.set_result(None)
            pending = self._deleting[prefix]
            pending.discard(done)
            if not pending:
                del self._deleting[prefix]

    async def release(self, claim: Claim) -> bool:
        self._unwatch(claim)
        lease = claim.state.get("lease")
        if not isinstance(lease, int):
            return False
        repeated = claim.state.get("revoking") == lease  # an earlier release was interrupted
        claim.state["revoking"] = lease
        with self._deletion(claim):
            async with self._bounded("a release"):
                request = pb.DeleteRangeRequest(key=self._claim_key(claim))
                reply = await self._unary("KV", "DeleteRange", request, "a release")
        held = reply.deleted > 0 or repeated
        if reply.deleted > 0:
            self._give_back(claim)  # the lease lives on, with no key: the next acquire's
        self._forget(claim)
        return held

    async def abandon(self, claim: Claim) -> None:
        claim.state["abandoned"] = True
        self._unwatch(claim)
        waiter = self._waiters.get(claim.owner)
        if waiter is not None and waiter.claim is claim:
            del self._waiters[claim.owner]
        lease = claim.state.get("lease")
        if not isinstance(lease, int):
            return
        # Revoking deletes our key; a put still in flight finds no lease and fails; a
        # grant still in flight makes a lease without keys, which expires by its ttl.
        # Then the key is deleted by its name (our owner id) too, whatever lease it has
        # (one attached to an earlier lease of this claim, say).
        key = self._claim_key(claim)
        with self._deletion(claim):
            async with self._bounded("an abandon"):
                with contextlib.suppress(_LeaseGone):
                    await self._unary("Lease", "LeaseRevoke", pb.LeaseRevokeRequest(ID=lease), "an abandon")
                await self._unary("KV", "DeleteRange", pb.DeleteRangeRequest(key=key), "an abandon")
        self._forget(claim)

    async def _revoke_quietly(self, lease: int) -> None:
        try:
            async with self._bounded("a revoke"):
                with contextlib.suppress(_LeaseGone):
                    await self._unary("Lease", "LeaseRevoke", pb.LeaseRevokeRequest(ID=lease), "a revoke")
        except Exception as exc:  # it expires by its ttl
            log.debug("revoking etcd lease %x failed: %s", lease, exc)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def listen(self, name: str, kind: Kind, waiter: Waiter) -> None:
        self._waiters[waiter.claim.owner] = waiter
        if kind is Kind.LEADER:  # observers and candidates: every change of the election
            await self._ready()
            prefix = self._family_prefix(name, kind)
            watch_id = next(self._watch_ids)
            created: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._created[watch_id] = created
            stream = self._watch_stream_open()
            self._family_watches[watch_id] = (waiter, prefix)
            stream.send(self._family_watch_request(watch_id, prefix))
            waiter.claim.state["family_watch"] = watch_id
            with contextlib.suppress(TimeoutError):  # (the caller re-reads on a timer anyway)
                async with asyncio.timeout(self._request_timeout):
                    await created

    def unlisten(self, name: str, kind: Kind, waiter: Waiter) -> None:
        claim = waiter.claim
        if self._waiters.get(claim.owner) is waiter:
            del self._waiters[claim.owner]
        family_watch = claim.state.pop("family_watch", None)
        if isinstance(family_watch, int) and self._family_watches.pop(family_watch, None) is not None:
            self._created.pop(family_watch, None)
            stream = self._watch_stream
            if stream is not None and stream.alive:
                stream.send(pb.WatchRequest(cancel_request=pb.WatchCancelRequest(watch_id=family_watch)))
        self._unwatch(claim)
        if "lease" in claim.state and not claim.state.get("granted") and not claim.state.get("abandoned"):
            # the core stopped waiting without a grant; our key keeps a place in the
            # queue, which would block the lock: give it up
            self._spawn(self._give_up(claim))

    async def _give_up(self, claim: Claim) -> None:
        if self._closed or claim.state.get("abandoned"):
            return
        try:
            await self.abandon(claim)
        except Exception as exc:  # its lease expires by its ttl
            log.debug("giving up an etcd claim on %r failed: %s", claim.name, exc)

    def _answered_busy(self, claim: Claim) -> None:
        """After a Busy answer: a claim not asked again nor listening soon (the core gave
        up after one try) loses its key, so it cannot block the lock."""
        if claim.owner in self._waiters:
            return
        token = object()
        claim.state["asked"] = token
        asyncio.get_running_loop().call_later(UNATTENDED, self._check_unattended, claim, token)

    def _check_unattended(self, claim: Claim, token: object) -> None:
        if (claim.state.get("asked") is token and claim.owner not in self._waiters
                and isinstance(claim.state.get("lease"), int) and not self._closed
                and not claim.state.get("granted") and not claim.state.get("abandoned")):
            lease = claim.state["lease"]
            assert isinstance(lease, int)
            self._forget(claim)  # asked again later, it takes a new place
            self._spawn(self._revoke_quietly(lease))

    async def inspect(self, name: str, kind: Kind = Kind.LOCK) -> LockInfo:
        """Holders, token and time left (the server's, in whole seconds) from one listing.

        ``last_token`` is the newest claim key's ``create_revision`` while any key exists,
        None once the name is free: etcd keeps no trace of deleted keys but its history,
        and a counter key per name would stay in etcd forever for every name ever locked.
        """
        prefix = self._family_prefix(name, kind)
        request = pb.RangeRequest(key=prefix, range_end=range_end(prefix),
                                  sort_target=SORT_CREATE, sort_order=ASCEND)
        pending = self._deleting.get(prefix)
        if pending:  # our own releases first
            await asyncio.wait(list(pending), timeout=self._request_timeout)
        async with self._bounded("an inspect"):
            reply = await self._unary("KV", "Range", request, "an inspect")
            entries = recipe.entries(reply.kvs, prefix)
            if not entries:
                return LockInfo(name, False, family=kind.family)
            holders = recipe.holders(entries, entries[0].limit)
            lives = await asyncio.gather(*(
                self._unary("Lease", "LeaseTimeToLive", pb.LeaseTimeToLiveRequest(ID=e.lease), "an inspect")
                for e in holders))
        # (the server truncates the time left to whole seconds, -1 once it expired)
        live = [(e, min(e.ttl_ms / 1000, r.TTL + 0.5)) for e, r in zip(holders, lives, strict=True)
                if r.TTL >= 0]
        waiters = len(entries) - len(holders)
        if not live:
            return LockInfo(name, False, waiters=waiters, family=kind.family)
        exclusive = [e.rev for e, _ in live if e.kind.exclusive]
        now = time.time()  # "since": from the stamp the writer put (etcd keeps no times)
        return LockInfo(
            name, True, holders=len(live), token=exclusive[0] if exclusive else None,
            last_token=max(e.rev for e in entries), ttl_left=max(left for _, left in live),
            waiters=waiters, family=kind.family,
            held_by=tuple(decode_holder(e.info, None if e.stamp is None else now - e.stamp)
                          for e, _ in live),
        )

    async def scan(self, prefix: str = "") -> AsyncIterator[LockInfo]:
        """Every held name starting with ``prefix``: each family's keys under the escaped
        prefix, read in pages of :data:`SCAN_PAGE` keys (keys only), then inspected."""
        await self._ready()
        for family in ("lock", "rw", "sem", "elect"):
            start = f"{self._prefix}/{family}/{quote(prefix, safe='')}".encode()
            base = len(f"{self._prefix}/{family}/")
            end = range_end(f"{self._prefix}/{family}/".encode()) if not prefix else range_end(start)
            names: list[str] = []
            key = start
            while True:
                request = pb.RangeRequest(key=key, range_end=end, keys_only=True, limit=SCAN_PAGE)
                async with self._bounded("a scan"):
                    reply = await self._unary("KV", "Range", request, "a scan")
                for kv in reply.kvs:
                    escaped = bytes(kv.key)[base:].split(b"/", 1)[0].decode(errors="replace")
                    name = unquote(escaped)
                    if (not names or names[-1] != name) and name.startswith(prefix):
                        names.append(name)
                if not reply.more or not reply.kvs:
                    break
                key = bytes(reply.kvs[-1].key) + b"\0"
            for name in names:
                info = await self.inspect(name, FAMILY_KIND[family])
                if info.held:
                    yield info

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for stream in (self._keepalive, self._watch_stream):
            if stream is not None:
                stream.close()
                with contextlib.suppress(BaseException):
                    await stream.reader
        self._waiters.clear()
        self._watch_owner.clear()
        self._family_watches.clear()
        self._created.clear()
        spares = [spare for pool in self._spares.values() for spare in pool]
        self._spares.clear()
        if spares and self._channel is not None:  # (unused, they would expire by their ttl)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(min(1.0, self._request_timeout)):
                    await asyncio.gather(*(
                        self._unary("Lease", "LeaseRevoke", pb.LeaseRevokeRequest(ID=lease), "a revoke")
                        for lease, _, _ in spares), return_exceptions=True)
        if self._channel is not None:
            with contextlib.suppress(Exception):
                await self._channel.close()


def _stamp(claim: Claim) -> float:
    """When the claim's key was first written (wall clock): kept across rewrites."""
    stamp = claim.state.get("stamp")
    if not isinstance(stamp, float):
        stamp = claim.state["stamp"] = time.time()
    return stamp
