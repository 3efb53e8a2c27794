"""``redis+sentinel://host:port,host:port/service_name``: the master Sentinel names.

The scripts, keys and release signals are those of :mod:`aiolock.backends.redis`; they
run on ``redis.asyncio.sentinel.Sentinel(...).master_for(service_name)``, a client whose
every new connection asks the sentinels where the master is now.

URL: ``redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service_name``
with optional query options ``db=N``, ``password=...`` (instead of the userinfo; the
user and password are the master's, not the sentinels'), ``sentinel_username=...`` and
``sentinel_password=...`` (for sentinels that require AUTH). Sentinel port defaults to
26379. Options (keyword, or in the query; keywords win): ``connect_timeout``,
``request_timeout``, ``prefix`` (as for ``redis://``), ``wait_replicas=N`` (see below);
keyword only: ``sentinel_kwargs`` (a dict of connection options for the sentinels, e.g.
TLS files); every other option of a ``redis.asyncio`` connection (in the query or as a
keyword: TLS, client name, credential provider...) applies to every connection to the
master, the scripts' and pub/sub's. An unknown option, one given twice or with an empty
value raises ValueError.

Following a failover: when the master changes, connections to the old one are closed
(the sentinel kills client connections on the demoted server, and a ``READONLY``
reply makes redis-py drop the connection), and the next connection goes to the new
master. Because an old master that is still alive accepts writes until the sentinel
demotes it (some seconds after the switch), this backend also asks the sentinels for
the master before every renewal batch (and, at most once a second, in the background
before acquisitions; one ``SENTINEL MASTERS`` round trip) and drops every connection,
the pub/sub one included, as soon as the answer changes. Waiters retry at once when
the pub/sub connection drops and again once their channel is confirmed on the new
master. A waiter whose retry meets no master (the old one is dead, the new one not yet
promoted) ends with :class:`aiolock.BackendUnavailable`, as on plain Redis.

What a failover can lose: Redis replication is asynchronous, so the promoted replica
may lack the latest writes of the old master --

* a lease granted or renewed just before the failure: if the grant is lost, another
  client can take the lock on the new master while the first holder still believes in
  its lease; the first holder's next renewal (within ``ttl/3``) finds it gone and
  reports the lease ``lost`` (``LockLost``, body cancelled). Until then two holders
  overlap -- which is what fencing tokens are for;
* the token counter increments of such grants: the counter falls back to its last
  replicated value, so the next holder gets the SAME token as the lost lease (one lost
  increment) or even a LOWER one (several). Fencing ("reject tokens lower than the
  highest seen") catches the lower case, at the price of refusing the new holder's
  writes until the counter passes the lost tokens; it does not catch the equal case:
  the stale holder's writes with that token are accepted as well. Tokens are strictly
  increasing only across acquisitions whose counter reached the promoted replica.

``wait_replicas=N`` closes that gap: after every grant and every renewal the backend
sends ``WAIT N`` on the same connection, and treats fewer than N acknowledgements
within half the request timeout as a failure (a grant is then abandoned and the
acquire raises :class:`aiolock.BackendUnavailable`; a renewal is retried and the lease
is lost at its last confirmed expiry). With the replica(s) acknowledging, a failover
to one of them keeps every lease and counter this client believes in. ``WAIT`` still
does not make Redis strongly consistent (a replica that acknowledged can be the one
that is not promoted), and it costs a replication round trip per grant and renewal.
Releases are not WAITed for: a release lost in a failover only keeps the lock until
its ttl runs out.

Errors: no reachable sentinel, no master known, or a failed or timed-out request raise
:class:`aiolock.BackendUnavailable` (within the connect / request timeouts); other
server errors raise :class:`aiolock.LockError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar
from urllib.parse import unquote, urlencode

from redis import exceptions as rexc
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

from .._validate import credentials, format_hosts, parse_hosts, query_pairs
from ..abc import Busy, Capability, Claim, Granted
from ..errors import BackendUnavailable
from ._redis_errors import redis_error
from ._redis_options import check_names, connection_options, query_options, refuse_blank
from ._redis_pubsub import Signals
from ._redis_scripts import ACQUIRE, RENEW, Script
from ._redis_scripts_shared import ACQUIRE_SHARED
from ._redis_urls import OWN, split_hosts_url
from .redis import RedisBackend

__all__ = ["RedisSentinelBackend"]

log = logging.getLogger("aiolock.backends.redis_sentinel")

#: At most this often (s) an acquisition asks the sentinels in the background whether
#: the master moved (renewals ask every time).
FOLLOW_INTERVAL = 1.0
_QUERY = ("db", "password", "sentinel_username", "sentinel_password", "wait_replicas")
_DOWN: tuple[type[BaseException], ...] = (
    ConnectionError, TimeoutError, OSError, rexc.ConnectionError, rexc.TimeoutError,
)
_ERRORS: tuple[type[BaseException], ...] = (*_DOWN, rexc.RedisError)


def _options(
    query: str, keywords: dict[str, Any], safe: str
) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
    """The URL's query and the keywords: our own query options (``_QUERY``), the master
    connections' options (typed as redis-py types them; keywords win) and the extra
    ``sentinel_kwargs``; an unknown option raises ValueError naming it."""
    accepted = {"connect_timeout", "request_timeout", "prefix", "wait_replicas",
                "max_connections", *_QUERY, *connection_options()}
    pairs = query_pairs(query, safe)  # a repeated option: ValueError naming it
    check_names(pairs, accepted, safe)  # an unknown option first, even a blank one
    refuse_blank(pairs, safe)
    params = {k: v for k, v in pairs.items() if k in _QUERY}
    # our own (OWN: see split_hosts_url; wait_replicas: see from_url) are not passed on
    given = {**query_options(urlencode([(k, v) for k, v in pairs.items()
                                        if k not in (*_QUERY, *OWN)]), safe),
             **keywords}
    extra_sentinel_kwargs = dict(given.pop("sentinel_kwargs", None) or {})
    check_names({**params, **given}, accepted, safe)
    check_names(extra_sentinel_kwargs, connection_options(), f"sentinel_kwargs of {safe}")
    return params, given, extra_sentinel_kwargs


class _SentinelSignals(Signals):
    """Pub/sub on the master's connection pool; :meth:`drop` forces a reconnect."""

    async def drop(self) -> None:
        """Close the pub/sub connection: the next read reconnects (asking the
        sentinels) and resubscribes, and waiters retry meanwhile."""
        connection = getattr(self._pubsub, "connection", None)
        if connection is not None:
            self._connection_lost()
            with contextlib.suppress(Exception):
                await connection.disconnect()


class RedisSentinelBackend(RedisBackend):
    """Locks on the Redis master that Sentinel names (see the module doc). Build it with
    ``aiolock.connect("redis+sentinel://host:26379/mymaster")``, or from a
    ``redis.asyncio.sentinel.Sentinel`` you already have:
    ``aiolock.connect(RedisSentinelBackend(sentinel, "mymaster"))`` (its sentinel
    connections are then not closed for you)."""

    schemes: ClassVar[tuple[str, ...]] = ("redis+sentinel",)
    capabilities: ClassVar[frozenset[Capability]] = RedisBackend.capabilities
    #: a waiter handed the lock asks once more: that request also follows a failover
    #: (a grant heard from the old master must not be taken for one on the new)
    trust_handoffs: ClassVar[bool] = False
    publish_counts: ClassVar[bool] = False  # pub/sub may sit on a replica (a failover)

    def __init__(
        self, sentinel: Sentinel, service_name: str, *, prefix: str = "aiolock",
        request_timeout: float = 5.0, connect_timeout: float = 5.0, wait_replicas: int = 0,
        url: str | None = None, owns_sentinel: bool = False, **master_options: Any,
    ) -> None:
        if isinstance(wait_replicas, bool) or not isinstance(wait_replicas, int) or wait_replicas < 0:
            raise ValueError(f"wait_replicas must be an int >= 0, got {wait_replicas!r}")
        master = sentinel.master_for(service_name, redis_class=Redis, **master_options)
        super().__init__(
            master, prefix=prefix, request_timeout=request_timeout, connect_timeout=connect_timeout,
            url=url or f"redis+sentinel://<sentinel>/{service_name}", owns_client=True,
            signals=_SentinelSignals(master, request_timeout),
        )
        self._sentinel = sentinel
        self._owns_sentinel = owns_sentinel
        self._service = service_name
        self._wait_replicas = wait_replicas
        self._wait_ms = max(1, int(request_timeout * 500))
        self._last_follow = 0.0
        self._following: asyncio.Task[None] | None = None

    @classmethod
    def from_url(
        cls, url: str, *, connect_timeout: float | None = None,
        request_timeout: float | None = None, prefix: str | None = None,
        wait_replicas: int | None = None, **master_options: Any,
    ) -> RedisSentinelBackend:
        """See the module doc for the URL and options."""
        parsed = split_hosts_url(url, "redis+sentinel",
                                 "redis+sentinel://host:port,host:port/service_name",
                                 connect_timeout=connect_timeout,
                                 request_timeout=request_timeout, prefix=prefix)
        connect_timeout, request_timeout = parsed.connect_timeout, parsed.request_timeout
        rest, _, query = parsed.rest.partition("?")
        netloc, _, service = rest.partition("/")
        service = unquote(service.strip("/"))
        if not service or "/" in service:
            raise ValueError(f"expected redis+sentinel://host:port/service_name (one service name), "
                             f"got {url!r}")
        userinfo, _, hosts = netloc.rpartition("@")
        sentinels = parse_hosts(url, hosts, 26379, "redis+sentinel://host:port,host:port/service_name")
        safe = "redis+sentinel://" + ",".join(format_hosts(sentinels)) + f"/{service}"
        params, master_options, extra_sentinel_kwargs = _options(query, master_options, safe)
        auth = credentials(userinfo)
        if params.get("password"):
            if auth.get("password"):
                raise ValueError(f"give the password once (userinfo or ?password=), in {safe!r}")
            auth["password"] = params["password"]
        db = params.get("db", "0") or "0"
        if not db.isdigit():
            raise ValueError(f"db must be a number in {safe!r}, got {db!r}")
        if wait_replicas is None:  # the keyword wins
            replicas = params.get("wait_replicas", "0")
            if not replicas.isdigit():
                raise ValueError(f"wait_replicas must be an int >= 0 in {safe!r}, got {replicas!r}")
            wait_replicas = int(replicas)
        sentinel_kwargs: dict[str, Any] = dict(
            socket_connect_timeout=connect_timeout, socket_timeout=request_timeout,
            retry=Retry(NoBackoff(), 0),
        )
        for key in ("username", "password"):
            if params.get(f"sentinel_{key}"):
                sentinel_kwargs[key] = params[f"sentinel_{key}"]
        options: dict[str, Any] = dict(
            socket_connect_timeout=connect_timeout, socket_timeout=request_timeout,
            # one quick retry: a connection found dead is replaced by one to the master
            # the sentinels name now; never after a timeout (the request timeout is the
            # caller's bound: abc rule 2); the core retries anything else
            retry=Retry(NoBackoff(), 1, supported_errors=(rexc.ConnectionError,)), db=int(db),
            **auth,
        )
        options.update(master_options)
        sentinel_kwargs.update(extra_sentinel_kwargs)
        sentinel = Sentinel(sentinels, sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call]
        return cls(sentinel, service, prefix=parsed.prefix, request_timeout=request_timeout,
                   connect_timeout=connect_timeout, wait_replicas=wait_replicas, url=safe,
                   owns_sentinel=True, **options)

    @property
    def sentinel(self) -> Sentinel:
        """The ``redis.asyncio.sentinel.Sentinel`` in use."""
        return self._sentinel

    @property
    def master_address(self) -> tuple[str, int] | None:
        """Where this backend's connections go now (None before the first one)."""
        address = self._client.connection_pool.master_address
        return (str(address[0]), int(address[1])) if address else None

    # -- following the master ---------------------------------------------------------

    async def follow_master(self) -> None:
        """Ask the sentinels for the master; if it moved, drop every connection to the
        old one (the pub/sub one included). Never raises: on failure the connections
        stay as they are."""
        self._last_follow = time.monotonic()
        pool = self._client.connection_pool
        before = pool.master_address
        try:
            async with asyncio.timeout(self._request_timeout):
                now = await pool.get_master_address()  # drops idle connections if moved
        except Exception as exc:
            log.debug("could not ask the sentinels for %s: %s", self._service, exc)
            return
        if before is not None and tuple(now) != tuple(before):
            log.warning("Sentinel moved master %s from %s:%s to %s:%s", self._service, *before, *now)
            assert isinstance(self.signals, _SentinelSignals)
            await self.signals.drop()

    def _follow_soon(self) -> None:
        if time.monotonic() - self._last_follow < FOLLOW_INTERVAL:
            return
        if self._following is None or self._following.done():
            self._last_follow = time.monotonic()
            self._following = asyncio.ensure_future(self.follow_master())

    # -- primitives ---------------------------------------------------------------------

    async def connect(self) -> None:
        await super().connect()
        with contextlib.suppress(TimeoutError):  # best effort: listening connects anyway
            async with asyncio.timeout(self._connect_timeout):
                await self.signals.warm()

    async def try_acquire(self, claim: Claim) -> Granted | Busy:
        self._follow_soon()
        heard = "grant" in claim.state  # a hand-off message came (see RedisBackend)
        result = await super().try_acquire(claim)
        if heard and isinstance(result, Busy):
            # Handed the lock by one server, found busy on another: a failover is under
            # way and this request reached the old master. Follow, and ask the new one.
            await self.follow_master()
            with contextlib.suppress(Exception):
                await self._client.connection_pool.disconnect(inuse_connections=False)
            result = await super().try_acquire(claim)
        return result

    async def renew(self, claims: Sequence[Claim]) -> list[int | None]:
        if claims:
            await self.follow_master()
        return await super().renew(claims)

    async def _run(
        self, script: Script, keys: Sequence[str], *args: Any,
        on_retry: Callable[[], object] | None = None,
    ) -> Any:
        if not self._wait_replicas or script not in (ACQUIRE, ACQUIRE_SHARED, RENEW):
            return await super()._run(script, keys, *args, on_retry=on_retry)
        try:
            reply, acked = await self._run_and_wait(script, keys, args)
        except _ERRORS as exc:
            raise redis_error(exc, self._url, script.name) from exc
        wrote = script is RENEW or reply[0] == 1  # a busy reply needs no replication
        if wrote and acked < self._wait_replicas:
            raise BackendUnavailable(
                f"{script.name} on {self._url} reached {acked} of {self._wait_replicas} "
                f"replica(s) within {self._wait_ms} ms"
            )
        return reply

    async def _run_and_wait(
        self, script: Script, keys: Sequence[str], args: Sequence[Any]
    ) -> tuple[Any, int]:
        """The script, then ``WAIT`` on the same connection (one pipeline)."""
        for attempt in (1, 2):
            async with self._in_flight, self._client.pipeline(transaction=False) as pipe:
                pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
                pipe.execute_command("WAIT", self._wait_replicas, self._wait_ms)
                reply, acked = await pipe.execute(raise_on_error=False)
            if isinstance(reply, rexc.NoScriptError) and attempt == 1:
                await self._client.execute_command("SCRIPT", "LOAD", script.source)
                continue
            for result in (reply, acked):
                if isinstance(result, BaseException):
                    raise result
            return reply, int(acked)
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        following, self._following = self._following, None
        if following is not None:
            following.cancel()
            with contextlib.suppress(BaseException):
                await following
        await super().aclose()  # the master client: always ours (made by master_for)
        for sentinel in self._sentinel.sentinels if self._owns_sentinel else ():
            with contextlib.suppress(Exception):
                await sentinel.aclose()
