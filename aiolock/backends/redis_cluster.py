"""``redis+cluster://host:port,host:port,...``: locks on a Redis Cluster.

The scripts and keys are those of :mod:`aiolock.backends.redis`, unchanged: every key
of one lock carries the hash tag ``{<escaped name>}``, so each script call touches one
slot and runs on the master that owns it. Requests go through
``redis.asyncio.RedisCluster``, which maps slots to masters and follows ``MOVED`` /
``ASK`` redirections (slot migrations, failovers).

The watchdog's batched ``RENEW`` spans many locks, hence many slots: the batch is split
into one ``RENEW`` per slot, the slots of each master written at once on a pipelined
connection of the backend's own to that master (hiredis packs and parses; redis-py's
cluster pipeline cost about 5x the CPU per command), the masters concurrently, and the
replies are put back in the order of the claims. A group that gets an error reply
(``MOVED`` after a slot moved, ``NOSCRIPT``...) or whose master cannot be reached on
that connection goes again through redis-py, which follows redirections and updates
the slot map that the next batch is split by.

Release signals: classic ``PUBLISH`` / ``SUBSCRIBE``, not sharded pub/sub. A Redis
Cluster forwards every ``PUBLISH`` to every node over the cluster bus, so ONE subscriber
connection, on any node, hears the releases of all masters, and the Lua scripts stay
exactly those of the plain Redis backend (``SPUBLISH`` would need other scripts, Redis
7+, and one subscriber connection per master, resubscribed on every slot move). The
price is that each release message crosses the cluster bus to every node, which is
negligible at lock-release rates. The subscriber connection is on one node; if it
fails, the next connection goes to another node of the cluster, and every waiter
retries at once and again when its channel is confirmed on the new node. A release
published while no subscription was confirmed (or lost on a cluster-bus link that is
down) is missed, and the waiter then retries after at most the holder's remaining
lease, as on plain Redis.

Guarantees and limits: each lease lives on the master owning its slot; Redis Cluster
replication is asynchronous, so a master failing over to a replica that missed the
latest writes can lose a lease (the watchdog then reports it lost at the next renewal)
or a token increment (a later token can then repeat one already given; see
:mod:`aiolock.backends.redis_sentinel` for what fencing does and does not catch then).
The watchdog renews each master's leases in batches of their own
(:meth:`RedisClusterBackend.renewal_group`): if one master cannot be reached, its
batches fail and are retried soon, and its leases are lost at their last confirmed
expiry if it stays unreachable; the leases on the other masters are renewed as usual
(``cluster-require-full-coverage yes``, the default, makes the whole cluster refuse
commands once it marks a slot down, after ``cluster-node-timeout``).

Errors: unreachable seed nodes raise :class:`aiolock.BackendUnavailable` within the
connect timeout; a failed or timed-out request, a cluster that is down, or a slot with
no master raise :class:`aiolock.BackendUnavailable`; other server errors raise
:class:`aiolock.LockError`. A request to an unresponsive master is tried up to four
times (redis-py's retries ride over redirections), so it fails after at most about
``4 x request_timeout`` (plus a quarter second of back-off), not one ``request_timeout`` -- a
bound enforced on every request (one that waited behind another's topology refresh used
to wait for a frozen node until it answered).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar

from redis import exceptions as rexc
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.crc import key_slot

from .._validate import credentials, format_hosts, parse_hosts
from ..abc import Capability, Claim, Kind
from ..errors import BackendUnavailable, LockError
from ._redis_admin import SCAN_COUNT
from ._redis_errors import CONNECTING, redis_error
from ._redis_options import check_names, connection_options, query_options
from ._redis_pubsub import Signals
from ._redis_scripts import RENEW
from ._redis_urls import OWN, split_hosts_url
from ._resp import RespClient, ResponseError, _pack
from .redis import RedisBackend

__all__ = ["RedisClusterBackend"]

log = logging.getLogger("aiolock.backends.redis_cluster")

#: Errors of ``redis.asyncio.RedisCluster`` that mean "cannot be served now".
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    rexc.ClusterDownError, rexc.TryAgainError, rexc.RedisClusterException, rexc.ClusterError,
)
_DOWN: tuple[type[BaseException], ...] = (
    TimeoutError, OSError, rexc.ConnectionError, rexc.TimeoutError, *_UNAVAILABLE,
)

_CONNECT_ERRORS: tuple[type[BaseException], ...] = (rexc.RedisError, *_DOWN)


class _ClusterSignals(Signals):
    """Pub/sub on one node of the cluster; moves to the next node when it fails."""

    def __init__(self, cluster: RedisCluster, seeds: list[tuple[str, int]],
                 request_timeout: float, node_options: dict[str, Any]) -> None:
        super().__init__(None, request_timeout)
        self._cluster = cluster
        self._seeds = seeds
        self._options = node_options
        self._turn = 0
        self._node_client: Redis | None = None
        #: ``host:port`` of the node carrying the subscription now (for tests, logs)
        self.node: str | None = None

    def _nodes(self) -> list[tuple[str, int]]:
        known = [(n.host, int(n.port)) for n in self._cluster.get_nodes()]
        return sorted(set(known)) or self._seeds

    def _new_pubsub(self) -> Any:
        nodes = self._nodes()
        host, port = nodes[self._turn % len(nodes)]
        self.node = f"{host}:{port}"
        # no silent reconnect by redis-py: a failure reaches Signals, which moves on
        options = {"retry": Retry(NoBackoff(), 0), **self._options}
        self._node_client = Redis(host=host, port=port, **options)
        return self._node_client.pubsub()

    async def _reconnect(self) -> None:
        async with self._subscribing:  # no other first SUBSCRIBE on the new PubSub
            old, old_client = self._pubsub, self._node_client
            self._turn += 1
            self._pubsub = self._new_pubsub()
            log.info("release signals now come from cluster node %s", self.node)
            await _close_quietly(old, old_client)
            channels = list(self._confirmed)
            if channels:
                try:
                    await self._pubsub.subscribe(*channels)
                except Exception as exc:  # the next read fails too and moves on again
                    log.warning("could not subscribe on cluster node %s: %s", self.node, exc)

    async def aclose(self) -> None:
        await super().aclose()
        client, self._node_client = self._node_client, None
        await _close_quietly(None, client)


async def _close_quietly(pubsub: Any, client: Any) -> None:
    for thing in (pubsub, client):
        if thing is not None:
            with contextlib.suppress(Exception):
                await thing.aclose()


class RedisClusterBackend(RedisBackend):
    """Locks on a Redis Cluster (see the module doc). Build it with
    ``aiolock.connect("redis+cluster://host:port,host:port")``, or pass a
    ``redis.asyncio.RedisCluster`` you already have (it is not closed for you)."""

    schemes: ClassVar[tuple[str, ...]] = ("redis+cluster",)
    capabilities: ClassVar[frozenset[Capability]] = RedisBackend.capabilities
    publish_counts: ClassVar[bool] = False  # a PUBLISH counts the receivers of one node

    def __init__(
        self, cluster: RedisCluster, *, prefix: str = "aiolock", request_timeout: float = 5.0,
        connect_timeout: float = 5.0, url: str | None = None, owns_client: bool = False,
        node_options: dict[str, Any] | None = None,
    ) -> None:
        seeds = [(n.host, int(n.port)) for n in cluster.startup_nodes]
        if node_options is None:  # pub/sub connections: same credentials as the cluster
            kwargs = cluster.connection_kwargs
            node_options = {k: kwargs[k] for k in ("username", "password") if kwargs.get(k)}
            node_options.update(socket_connect_timeout=connect_timeout, socket_timeout=request_timeout)
        signals = _ClusterSignals(cluster, seeds, request_timeout, node_options)
        super().__init__(
            cluster, prefix=prefix, request_timeout=request_timeout, connect_timeout=connect_timeout,
            url=url or "redis+cluster://" + ",".join(format_hosts(seeds)),
            owns_client=owns_client, signals=signals,
        )
        self._cluster = cluster
        self._raw_call = self._cluster_call  # through _limited_call (see RedisBackend)
        self._direct: dict[tuple[str, int], RespClient] = {}  # see _renew_direct
        self._closing = False
        self._direct_ok = True  # no option that our direct connections cannot honour

    @classmethod
    def from_url(
        cls, url: str, *, connect_timeout: float | None = None,
        request_timeout: float | None = None, prefix: str | None = None, **cluster_options: Any,
    ) -> RedisClusterBackend:
        """``redis+cluster://[[user]:password@]host:port[,host:port...]``: seed nodes
        (port 6379 if left out); any reachable one is enough to discover the cluster.
        Extra keyword arguments go to ``redis.asyncio.RedisCluster`` (e.g. ``ssl=True``
        for TLS; ``ssl*`` options are used for the pub/sub connection too)."""
        parsed = split_hosts_url(url, "redis+cluster", "redis+cluster://host:port,host:port",
                                 connect_timeout=connect_timeout,
                                 request_timeout=request_timeout, prefix=prefix)
        connect_timeout, request_timeout = parsed.connect_timeout, parsed.request_timeout
        netloc, _, tail = parsed.rest.partition("/")
        netloc, _, query = netloc.partition("?")
        path, _, query2 = tail.partition("?")
        if path.strip("/") not in ("", "0"):
            raise ValueError(f"a Redis Cluster has only database 0, got {url!r}")
        userinfo, _, hosts = netloc.rpartition("@")
        seeds = parse_hosts(url, hosts, 6379, "redis+cluster://host:port,host:port (port 1-65535)")
        safe = "redis+cluster://" + ",".join(format_hosts(seeds))
        # options in the query or as keywords (they win): a RedisCluster's, or one of
        # its connections' (those apply to the pub/sub connection too)
        node_level = connection_options()
        cluster_level = set(inspect.signature(RedisCluster.__init__).parameters) - {
            "self", "kwargs", "host", "port", "startup_nodes", "cluster_error_retry_attempts"}
        accepted = {"connect_timeout", "request_timeout", "prefix", *node_level, *cluster_level}
        from_query = query_options(query or query2, safe, accepted)
        given = {k: v for k, v in from_query.items() if k not in OWN}  # see split_hosts_url
        given.update(cluster_options)
        check_names(given, accepted, safe)
        if given.get("db") not in (None, 0):
            raise ValueError(f"a Redis Cluster has only database 0, got db={given['db']!r}")
        auth = credentials(userinfo)
        options: dict[str, Any] = dict(
            socket_connect_timeout=connect_timeout, socket_timeout=request_timeout,
            # a few quick retries ride over a redirection storm; the core retries the rest
            retry=Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.25), 3),
            **auth,
        )
        options.update(given)
        try:
            cluster = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in seeds], **options)
        except (rexc.RedisError, TypeError) as exc:  # a bad option value
            raise ValueError(f"bad option for {safe}: {exc}") from None
        node_options: dict[str, Any] = dict(auth)
        node_options.update(socket_connect_timeout=connect_timeout, socket_timeout=request_timeout)
        # every connection-level option (TLS, client name, credentials...) applies to the
        # pub/sub connection as well
        node_options.update({k: v for k, v in given.items() if k in node_level})
        backend = cls(cluster, prefix=parsed.prefix, request_timeout=request_timeout,
                      connect_timeout=connect_timeout, url=safe, owns_client=True,
                      node_options=node_options)
        # our direct renewal connections honour only these (see _direct_client)
        backend._direct_ok = not (set(given) & node_level) - {
            "username", "password", "decode_responses", "max_connections"}
        return backend

    @property
    def cluster(self) -> RedisCluster:
        """The ``redis.asyncio.RedisCluster`` client in use."""
        return self._cluster

    def slot(self, name: str, kind: Kind = Kind.LOCK) -> int:
        """The cluster slot of every key of lock ``name``."""
        return int(key_slot(self._base(name, kind).encode()))

    async def _cluster_call(self, *args: Any) -> Any:
        """One command, routed by its keys; cluster errors become ConnectionError, which
        ``_run`` turns into BackendUnavailable."""
        bound = 4 * self._request_timeout + 0.25
        try:
            # redis-py's own retries are bounded by the socket timeout each, but not a
            # request that waits for its topology refresh behind another (one to a
            # frozen node waited for the node): the documented bound, enforced
            async with asyncio.timeout(bound):
                try:
                    return await self._send(args)
                except AttributeError:
                    # redis-py 8 fails this way when a command meets a connection being
                    # (re)opened -- by another command, or to a restarting master -- whose
                    # writer is still None: nothing was sent, so once more, a moment later
                    await asyncio.sleep(0.01)
                    return await self._send(args)
        except TimeoutError as exc:
            raise rexc.TimeoutError(f"no answer within {bound:.2f} s") from exc
        except _UNAVAILABLE as exc:
            raise rexc.ConnectionError(f"{type(exc).__name__}: {exc}") from exc
        except AttributeError as exc:  # again: the node is unavailable, not us
            raise rexc.ConnectionError(f"connection to a restarting node: {exc}") from exc

    async def _send(self, args: tuple[Any, ...]) -> Any:
        if self._closing:  # (checked with no await before the client's initialize())
            raise LockError(f"this backend for {self._url} is closed")
        if args[:2] == ("SCRIPT", "LOAD"):
            return await self._cluster.script_load(args[2])  # on every master
        return await self._cluster.execute_command(*args)

    async def connect(self) -> None:
        try:
            async with asyncio.timeout(self._connect_timeout):
                await self._cluster.initialize()
                await self.signals.warm()
        except _CONNECT_ERRORS as exc:
            raise self._error(exc, CONNECTING) from exc

    def _error(self, exc: BaseException, what: str) -> LockError:
        """``redis_error``, where the cluster's own "cannot be connected" (and its other
        errors of an unreachable cluster) is BackendUnavailable, not a refusal."""
        error = redis_error(exc, self._url, what)
        if type(error) is LockError and isinstance(exc, _DOWN):
            return BackendUnavailable(
                f"Redis Cluster at {self._url} is unavailable for {what} ({type(exc).__name__}: {exc})")
        return error

    async def renew(self, claims: Sequence[Claim]) -> list[int | None]:
        groups: dict[int, list[int]] = {}
        for i, claim in enumerate(claims):
            groups.setdefault(self.slot(claim.name, claim.kind), []).append(i)
        if len(groups) <= 1:
            return await super().renew(claims)
        requests = [self._renew_request([claims[i] for i in group]) for group in groups.values()]
        replies: list[Any] = [None] * len(requests)
        left = await self._renew_direct(list(groups), requests, replies)
        if left:
            for i, reply in zip(left, await self._renew_pipelined([requests[i] for i in left]),
                                strict=True):
                replies[i] = reply
        out: list[int | None] = [None] * len(claims)
        for group, reply in zip(groups.values(), replies, strict=True):
            if isinstance(reply, BaseException):
                if isinstance(reply, _DOWN):
                    raise BackendUnavailable(
                        f"Redis Cluster at {self._url} is unavailable ({type(reply).__name__}: {reply})"
                    ) from reply
                raise redis_error(reply, self._url, "renew") from reply
            for i, ms in zip(group, reply, strict=True):
                out[i] = int(ms) or None
        return out

    async def _scan_keys(self, match: str) -> AsyncIterator[Any]:
        """Every key matching ``match`` on every master (``SCAN`` on each)."""
        try:
            async for key in self._cluster.scan_iter(match=match, count=SCAN_COUNT):
                yield key
        except _CONNECT_ERRORS as exc:
            raise self._error(exc, "scan") from exc

    def renewal_group(self, claim: Claim) -> object:
        """The master that serves the claim's slot (as redis-py's slot map has it): the
        watchdog renews each master's leases in batches of their own, so one slow or
        unreachable master does not hold up, or fail, the renewals on the others."""
        try:
            node = self._cluster.nodes_manager.get_node_from_slot(self.slot(claim.name, claim.kind))
        except Exception:  # not covered, or the map is not loaded yet
            return None
        return node.name

    async def _renew_direct(
        self, slots: list[int], requests: list[tuple[list[str], list[Any]]], replies: list[Any]
    ) -> list[int]:
        """Send each slot's ``RENEW`` on a pipelined connection of our own to the master
        redis-py's slot map names for it, one write per master (redis-py's cluster
        pipeline costs about 24 us of CPU per command, which 10,000 leases at ttl 2 s
        turn into a third of a core). Fills ``replies``; returns the requests left for
        redis-py: a master we have no direct connection to (TLS, a credential provider,
        a slot not in the map yet), one that failed, and every error reply (``MOVED``,
        ``NOSCRIPT``, ``CLUSTERDOWN``...), which redis-py follows or reports."""
        by_master: dict[RespClient, list[int]] = {}
        left: list[int] = []
        for i, slot in enumerate(slots):
            client = self._direct_client(slot)
            if client is None:
                left.append(i)
            else:
                by_master.setdefault(client, []).append(i)

        async def send(client: RespClient, indexes: list[int]) -> None:
            data = b"".join(
                _pack("EVALSHA", RENEW.sha, len(requests[i][0]), *requests[i][0], *requests[i][1])
                for i in indexes
            )
            try:
                got = await client.send(data, len(indexes))
            except (ConnectionError, TimeoutError, OSError, ResponseError):
                left.extend(indexes)  # (one command: its error reply raises)
                return
            for i, reply in zip(indexes, got, strict=True):
                if isinstance(reply, BaseException):
                    left.append(i)
                else:
                    replies[i] = reply

        if by_master:
            await asyncio.gather(*(send(c, idx) for c, idx in by_master.items()))
        return sorted(left)

    def _direct_client(self, slot: int) -> RespClient | None:
        try:
            node = self._cluster.nodes_manager.get_node_from_slot(slot)
        except Exception:  # not covered, or the map is not loaded yet
            return None
        key = (str(node.host), int(node.port))
        client = self._direct.get(key)
        if client is None:
            kwargs = node.connection_kwargs
            if (self._closing or not self._direct_ok or node.connection_class is not Connection
                    or kwargs.get("credential_provider")):
                return None
            client = self._direct[key] = RespClient(
                host=key[0], port=key[1], username=kwargs.get("username"),
                password=kwargs.get("password"), connect_timeout=self._connect_timeout,
                request_timeout=self._request_timeout,
            )
        return client

    async def _renew_pipelined(self, requests: list[tuple[list[str], list[Any]]]) -> list[Any]:
        """The ``RENEW``s through redis-py's cluster pipeline (it follows redirections);
        a master that does not know the script yet gets it loaded and is asked again."""
        try:
            pipe = self._cluster.pipeline()
            for keys, args in requests:
                pipe.execute_command("EVALSHA", RENEW.sha, len(keys), *keys, *args)
            replies: list[Any] = await pipe.execute(raise_on_error=False)
        except _DOWN as exc:
            raise BackendUnavailable(
                f"Redis Cluster at {self._url} is unavailable ({type(exc).__name__}: {exc})"
            ) from exc
        missing = [i for i, reply in enumerate(replies) if _is_noscript(reply)]
        if missing:
            again = await asyncio.gather(*(self._run(RENEW, *_flat(requests[i])) for i in missing))
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        return replies

    async def aclose(self) -> None:
        self._closing = True  # no request starts an initialize() from now on
        direct, self._direct = list(self._direct.values()), {}
        await asyncio.gather(*(c.aclose() for c in direct), return_exceptions=True)
        if self._owns_client:
            await self._initialized()
        await super().aclose()
        if self._owns_client:
            # one queued behind the first (which had failed) may have opened them since
            await self._initialized()
            await _close_quietly(None, self._cluster)

    async def _initialized(self) -> None:
        """Wait (bounded) for the client's initialize() in flight: RedisCluster.aclose()
        does nothing while it runs (it closes only an initialized client), and that
        initialize() then opens the nodes for good."""
        initializing = getattr(self._cluster, "_lock", None)
        if isinstance(initializing, asyncio.Lock) and initializing.locked():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._connect_timeout), initializing:
                    pass


def _is_noscript(reply: Any) -> bool:
    return isinstance(reply, rexc.NoScriptError) or (
        isinstance(reply, rexc.ResponseError) and str(reply).startswith("NOSCRIPT")
    )


def _flat(request: tuple[list[str], list[Any]]) -> tuple[Any, ...]:
    keys, args = request
    return (keys, *args)
