"""``aiolock.connect(url)``: one URL per backend, through a registry of schemes."""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from ._locks import Locks
from ._validate import check_timeouts
from .abc import Backend

__all__ = ["SCHEMES", "connect"]

#: ``user:password@`` in something that is not quite a URL (``redis//u:pw@host``): masked
_USERINFO = re.compile(r"([^/:@]*:)[^@/]*@")

_TIMEOUTS = ("connect_timeout", "request_timeout")

#: Each backend class: its URL schemes, ``module.Class`` under ``aiolock.backends``, and
#: the pip extra its client library comes with (None: no dependency).
_BACKENDS: tuple[tuple[tuple[str, ...], str, str | None], ...] = (
    (("memory",), "memory.MemoryBackend", None),
    (("redis", "rediss", "unix"), "redis.RedisBackend", "redis"),
    (("zookeeper", "zk"), "zookeeper.ZooKeeperBackend", "zookeeper"),
    (("postgresql", "postgres"), "postgres.PostgresBackend", "postgres"),
    (("memcached",), "memcached.MemcachedBackend", None),
    (("redis+cluster",), "redis_cluster.RedisClusterBackend", "redis"),
    (("redis+sentinel",), "redis_sentinel.RedisSentinelBackend", "redis"),
    (("redlock",), "redlock.RedlockBackend", "redis"),
    (("mysql", "mariadb"), "mysql.MySQLBackend", "mysql"),
    (("etcd",), "etcd.EtcdBackend", "etcd"),
)

#: scheme -> (module, class, pip extra); modules are imported only when used.
SCHEMES: dict[str, tuple[str, str, str | None]] = {
    scheme: (f"aiolock.backends.{path.rpartition('.')[0]}", path.rpartition(".")[2], extra)
    for schemes, path, extra in _BACKENDS
    for scheme in schemes
}


def backend_from_url(url: str, **options: Any) -> Backend:
    """Build (but do not connect) the backend for ``url``."""
    if not isinstance(url, str) or "://" not in url:
        shown = _USERINFO.sub(r"\1***@", url) if isinstance(url, str) else url
        raise ValueError(
            f"expected a URL such as 'memory://' or 'redis://localhost:6379/0', got {shown!r}"
        )
    scheme = urlsplit(url).scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(
            f"unknown URL scheme {scheme!r} in {url!r}; supported schemes: "
            + ", ".join(f"{s}://" for s in SCHEMES)
        )
    _check_timeouts(url, options)
    module_name, class_name, extra = SCHEMES[scheme]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] == "aiolock":
            raise  # aiolock's own module: not a missing extra
        raise ImportError(
            f"the {scheme}:// backend needs an optional dependency ({exc.name}); "
            f"install it with: pip install 'aiolock[{extra}]'"
        ) from exc
    backend_class = getattr(module, class_name)
    _check_options(backend_class.from_url, scheme, options)
    backend: Backend = backend_class.from_url(url, **options)
    return backend


def _check_timeouts(url: str, options: dict[str, Any]) -> None:
    """``connect_timeout`` / ``request_timeout``, in the URL's query or as keywords, are
    finite seconds > 0 on every backend (``inf`` would make "bounded time" unbounded);
    None as a keyword means the backend's default. Other malformed values are left to the
    backend, which names what it accepts."""
    try:
        query = urlsplit(url).query
    except ValueError:
        return  # (the backend reports the malformed URL)
    given: dict[str, object] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key in _TIMEOUTS:
            try:
                given[key] = float(value)
            except ValueError:
                continue
    given.update((k, v) for k, v in options.items() if k in _TIMEOUTS and v is not None)
    check_timeouts(**given)


def _check_options(from_url: Any, scheme: str, options: dict[str, Any]) -> None:
    """Refuse keyword options ``from_url`` does not take, naming the accepted ones (a
    backend whose ``from_url`` takes ``**options`` checks them itself)."""
    params = inspect.signature(from_url).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    accepted = [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
                and p.name != "url"]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for {scheme}://; accepted: "
            + (", ".join(accepted) or "none")
        )


def connect(target: str | Backend | Any, **options: Any) -> Locks:
    """Connect to a lock backend.

    ``target`` is a URL (``memory://``, ``redis://host:port/db``, ``rediss://...``,
    ``unix:///path.sock``, ``zookeeper://host:port,host:port/chroot``,
    ``postgresql://user@host:port/db``, ``memcached://host:port``,
    ``redis+cluster://host:port,host:port``, ``redis+sentinel://host:port,.../service``,
    ``redlock://host:port,host:port,host:port``), a :class:`aiolock.abc.Backend`, or a
    client you already have (a ``redis.asyncio.Redis`` or ``RedisCluster``; it is not
    closed when the connection closes).

    Use ``async with aiolock.connect(url) as locks:`` (connects eagerly and raises
    :class:`aiolock.BackendUnavailable` if the server cannot be reached within
    ``connect_timeout``), or keep the returned :class:`Locks` and ``await
    locks.aclose()`` when done. Options for Redis: ``connect_timeout`` (s, default 5),
    ``request_timeout`` (s, default 5), ``prefix`` (key prefix, default ``"aiolock"``).
    """
    if isinstance(target, Backend):
        if options:
            raise ValueError("options are given to the backend's constructor, not to connect()")
        return Locks(target)
    if isinstance(target, str):
        try:
            backend = backend_from_url(target, **options)
        except ValueError as exc:
            error = _without_secret(exc, target)
        else:
            return Locks(backend)
        raise error  # outside the handler: a masked error keeps no chain to the original
    kind = _redis_client_kind(target)
    if kind == "cluster":
        from .backends.redis_cluster import RedisClusterBackend

        return Locks(RedisClusterBackend(target, **_client_options(target, options, scripting=False)))
    if kind == "redis":
        from .backends._redis_txn import scripting_class
        from .backends.redis import RedisBackend

        options = _client_options(target, options, scripting=True)
        # as for a URL: scripting auto (the default) falls back to WATCH/MULTI/EXEC
        # transactions where the server refuses scripts (an ACL without @scripting)
        cls = scripting_class(RedisBackend, options.pop("scripting", "auto"))
        return Locks(cls(target, **options))
    if kind is not None:
        raise ValueError(
            f"connect() needs an asyncio client: got {kind} {type(target).__name__}; pass a "
            "redis.asyncio.Redis or redis.asyncio.RedisCluster (for Sentinel: "
            "sentinel.master_for(service, redis_class=redis.asyncio.Redis), or the URL "
            "redis+sentinel://host:port/service), or a URL"
        )
    raise ValueError(
        "connect() takes a URL (e.g. 'redis://localhost:6379/0'), an aiolock.abc.Backend, or a "
        f"redis.asyncio.Redis / RedisCluster client, got {target!r}"
    )


def _client_options(target: object, options: dict[str, Any], *, scripting: bool) -> dict[str, Any]:
    """The options ``connect(client, ...)`` accepts for a Redis client, checked: anything
    else, or a bad value, is a ValueError that says what is accepted."""
    accepted = ["connect_timeout", "request_timeout", "prefix"] + (["scripting"] if scripting else [])
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"unknown option(s) for a {type(target).__name__} client: "
                         f"{', '.join(unknown)}; accepted: {', '.join(accepted)}")
    check_timeouts(**{k: v for k, v in options.items() if k.endswith("_timeout")})
    if "scripting" in options and options["scripting"] not in ("auto", "on", "off"):
        raise ValueError(f"scripting must be one of auto, on, off, got {options['scripting']!r}")
    return dict(options)


def _without_secret(exc: ValueError, url: str) -> ValueError:
    """``exc`` with the URL's password masked wherever its message (or a message it was
    raised from) repeats it: a refused URL may be shown, its password never."""
    try:
        password = urlsplit(url).password
    except ValueError:
        password = None
    messages = []
    error: BaseException | None = exc
    while error is not None:
        messages.append(str(error))
        error = error.__cause__ or error.__context__
    text = str(exc)
    if not password or not any(password in m or unquote(password) in m for m in messages):
        return exc if exc.__cause__ is None and exc.__context__ is None else ValueError(text)
    for secret in {password, unquote(password)}:
        text = text.replace(secret, "***")
    return ValueError(text)


def _redis_client_kind(target: object) -> str | None:
    """``"redis"`` / ``"cluster"`` for a ``redis.asyncio`` client (subclasses and
    fakeredis's async client included), a description of a redis-py object that is not
    one (a sync client, a Sentinel), or None for anything else. Imports nothing that the
    caller has not imported already."""
    if sys.modules.get("redis") is None:
        return None
    import redis
    import redis.asyncio

    if isinstance(target, redis.asyncio.RedisCluster):
        return "cluster"
    if isinstance(target, redis.asyncio.Redis):
        return "redis"
    sync_types: tuple[type, ...] = (redis.Redis, redis.RedisCluster)
    if isinstance(target, sync_types):
        return "a synchronous redis-py client"
    if isinstance(target, (redis.sentinel.Sentinel, redis.asyncio.sentinel.Sentinel)):
        return "a Sentinel object (it is not a client)"
    return None
