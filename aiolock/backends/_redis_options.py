"""The options of a Redis URL: what ``redis.asyncio`` accepts, checked at ``connect()``.

Every option ``redis.asyncio`` accepts for a URL, in its query or as a keyword, applies
to every connection aiolock opens for it, or is refused with ``ValueError`` naming it:

* names are checked against the parameters of the connection class the URL selects
  (``rediss://`` -> ``SSLConnection``...) and of the connection pool, plus aiolock's own
  (``connect_timeout``, ``request_timeout``, ``prefix``); an unknown one is refused with
  the list of accepted ones (redis-py itself would only fail at the first connection);
* values are checked by building one (unconnected) redis-py connection from them;
* an option given twice in the query, or with an empty value (``?scripting=``), is
  refused (redis-py would keep one of the two, or drop the empty one, silently);
* ``scripting`` (aiolock's own) is ``on``, ``off`` or ``auto`` (the default): ``off`` runs
  ``lock()`` as ``WATCH``/``MULTI``/``EXEC`` transactions, ``auto`` moves to them if the
  server refuses scripts (see :mod:`aiolock.backends._redis_txn`), ``on`` never does;
* ``socket_connect_timeout`` / ``socket_timeout`` are aiolock's ``connect_timeout`` /
  ``request_timeout`` (every connection gets them; giving both spellings differently is
  refused);
* the lean connection of :mod:`aiolock.backends._resp` carries the scripts only if it
  honours every option given (:data:`LEAN`: address, db, credentials, TLS, client name,
  keepalive, timeouts; any option at its default value); otherwise (a credential
  provider, a retry policy, a custom connection class, RESP3...) the scripts run through
  the ``redis.asyncio`` client, which honours them all.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from redis.asyncio import Redis
from redis.asyncio.connection import (
    AbstractConnection,
    Connection,
    ConnectionPool,
    SSLConnection,
    UnixDomainSocketConnection,
    parse_url,
    to_bool,
)

from .._validate import check_timeouts, query_pairs
from ._resp import RespClient

__all__ = ["OWN", "SCRIPTING", "RedisOptions", "accepted_options", "check_names", "query_options",
           "refuse_blank", "resolve"]

#: aiolock's own options (keyword or URL query).
OWN = ("connect_timeout", "request_timeout", "prefix", "scripting")
#: The values ``scripting`` accepts.
SCRIPTING = ("on", "off", "auto")
#: Options of the pool / client rather than of a connection (one connection honours them).
_POOL = ("max_connections", "single_connection_client", "auto_close_connection_pool")
#: Options the lean connection honours (see RespClient).
LEAN = frozenset({
    "host", "port", "path", "db", "username", "password", "client_name", "socket_keepalive",
    "socket_keepalive_options", "socket_timeout", "socket_connect_timeout",
    "decode_responses",  # shapes replies to redis-py's callers; aiolock reads its own
    *_POOL,
}) | frozenset(p for p in inspect.signature(SSLConnection.__init__).parameters
               if p.startswith("ssl_"))
_LEAN_CLASSES = (Connection, SSLConnection, UnixDomainSocketConnection)
_ALIASES = {"socket_connect_timeout": "connect_timeout", "socket_timeout": "request_timeout"}


def _parameters(cls: type) -> dict[str, inspect.Parameter]:
    found: dict[str, inspect.Parameter] = {}
    for klass in reversed(cls.__mro__):
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                found[p.name] = p
    return found


#: redis-py's internal plumbing: accepted, but not listed in error messages
_INTERNAL = ("maint", "orig_", "oss_cluster", "himport", "event_dispatcher", "encoder_class",
             "socket_type", "legacy_responses")


def accepted_options(connection_class: type = Connection) -> list[str]:
    """Every option name a URL of ``connection_class`` accepts, aiolock's own first."""
    names = set(_parameters(connection_class)) | set(_POOL) | {"connection_class"}
    names -= {"host", "port", "path"} if connection_class in _LEAN_CLASSES else set()
    return [*OWN, *sorted(names)]


def _listed(names: Any) -> str:
    return ", ".join(n for n in names if not n.startswith(_INTERNAL))


def connection_options() -> set[str]:
    """Option names of one connection, plain or TLS (for Cluster and Sentinel nodes)."""
    return (set(_parameters(SSLConnection)) | {"ssl"}) - {"host", "port", "path"}


def check_names(given: Any, accepted: Any, where: str) -> None:
    """ValueError naming every option in ``given`` that is not ``accepted``."""
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)} for {where}; accepted: "
                         + _listed(sorted(accepted)))


def refuse_blank(pairs: dict[str, Any], where: str) -> None:
    """ValueError for the first option of a URL query given with an empty value
    (``?scripting=``): redis-py would drop it silently, running on its default. The
    message says what the option accepts where aiolock knows it (``where``: a URL
    without its password)."""
    for name, value in pairs.items():
        if value:
            continue
        if name == "scripting":
            _scripting(value)
        if name in ("connect_timeout", "request_timeout", *_ALIASES):
            _number(name, value)
        if name == "prefix":
            raise ValueError(f"prefix must be a non-empty str without braces, got '' in {where}")
        raise ValueError(f"option {name} has an empty value in {where}: give it a value, or "
                         "leave it out for its default")


def query_options(query: str, where: str, accepted: Any = None) -> dict[str, Any]:
    """A URL query parsed as redis-py parses one (typed where redis-py types it). An
    option given twice, one not in ``accepted`` (if given: every name, blank or not) or
    one with an empty value raises ValueError naming it."""
    pairs = query_pairs(query, where)
    if accepted is not None:
        check_names(pairs, accepted, where)
    refuse_blank(pairs, where)
    try:
        parsed = dict(parse_url("redis://x/?" + query)) if query else {}
        parsed.pop("host", None)
        if "ssl" in parsed:  # redis-py has no parser for it: "false" must not be truthy
            parsed["ssl"] = bool(to_bool(parsed["ssl"]))
        return parsed
    except ValueError as exc:
        raise ValueError(f"bad option in {where}: {exc}") from None


@dataclass
class RedisOptions:
    """What one Redis URL plus keywords resolve to."""

    connect_timeout: float
    request_timeout: float
    prefix: str
    #: for ``redis.asyncio.ConnectionPool(**pool_kwargs)`` (timeouts included)
    pool_kwargs: dict[str, Any]
    single_connection_client: bool
    #: the lean connection, or None if it cannot honour every option
    resp: RespClient | None
    #: names of the options that made the scripts go through redis.asyncio
    not_lean: list[str] = field(default_factory=list)
    #: ``on``, ``off`` or ``auto``: see :data:`SCRIPTING`
    scripting: str = "auto"

    def client(self) -> Redis:
        """A new ``redis.asyncio`` client with every option (it owns its pool)."""
        pool = ConnectionPool(**self.pool_kwargs)
        client = Redis(connection_pool=pool, single_connection_client=self.single_connection_client)
        client.auto_close_connection_pool = True
        return client


def _number(name: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}") from None
    if isinstance(value, bool) or not number > 0:
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    return number


def resolve(
    url: str, safe_url: str, keywords: dict[str, Any], *, connect_timeout: float | None,
    request_timeout: float | None, prefix: str | None,
) -> RedisOptions:
    """Check the options of ``url`` (query) and ``keywords`` (they win) for
    ``redis://``, ``rediss://`` or ``unix://``; raise ValueError naming a bad one."""
    pairs = query_pairs(urlsplit(url).query, safe_url)  # a repeated option: ValueError naming it
    try:
        params: dict[str, Any] = dict(parse_url(url))
    except ValueError as exc:
        raise ValueError(f"bad Redis URL {safe_url}: {exc}") from None
    blank: dict[str, Any] = {k: v for k, v in pairs.items() if not v}  # redis-py drops them
    merged = {**params, **blank, **keywords}
    own: dict[str, Any] = {k: merged.pop(k) for k in OWN if k in merged}
    for key, value in (("connect_timeout", connect_timeout), ("request_timeout", request_timeout),
                       ("prefix", prefix)):
        if value is not None:
            own[key] = value
    cls = merged.pop("connection_class", Connection)
    if not (isinstance(cls, type) and issubclass(cls, AbstractConnection)):
        raise ValueError(f"connection_class must be a redis.asyncio connection class, got {cls!r}")
    _check_known(merged, cls, safe_url)  # an unknown option first, even a blank one
    refuse_blank(blank, safe_url)
    timeouts = _timeouts(own, merged)
    pool_only = {k: merged.pop(k) for k in _POOL if k in merged}
    connection_kwargs = dict(merged, socket_connect_timeout=timeouts["connect_timeout"],
                             socket_timeout=timeouts["request_timeout"])
    try:
        probe = cls(**connection_kwargs)  # checks the values; opens nothing
    except Exception as exc:
        raise ValueError(f"bad Redis option for {safe_url}: {exc}") from None
    single = bool(pool_only.pop("single_connection_client", False))
    pool_only.pop("auto_close_connection_pool", None)  # aiolock closes what it opened
    defaults = _parameters(cls)
    not_lean = sorted(  # an option at its default value changes nothing
        k for k, v in merged.items()
        if k not in LEAN and not (k in defaults and _same(defaults[k].default, v))
    )
    if cls not in _LEAN_CLASSES:
        not_lean.insert(0, "connection_class")
    resp = None if not_lean else _lean(probe, timeouts, safe_url)
    return RedisOptions(
        connect_timeout=timeouts["connect_timeout"], request_timeout=timeouts["request_timeout"],
        prefix=str(own.get("prefix", "aiolock")),
        pool_kwargs=dict(connection_kwargs, connection_class=cls, **pool_only),
        single_connection_client=single, resp=resp, not_lean=not_lean,
        scripting=_scripting(own.get("scripting", "auto")),
    )


def _check_known(merged: dict[str, Any], cls: type, safe_url: str) -> None:
    """ValueError naming every option of ``merged`` a URL of ``cls`` does not accept."""
    accepted = set(accepted_options(cls)) | {"host", "port", "path"}
    unknown = sorted(set(merged) - accepted)
    if unknown:
        hint = ""
        if any(u.startswith("ssl") for u in unknown) and not issubclass(cls, SSLConnection):
            hint = " (TLS options need a rediss:// URL)"
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for {safe_url}{hint}; accepted: "
            + _listed(accepted_options(cls))
        )


def _timeouts(own: dict[str, Any], merged: dict[str, Any]) -> dict[str, float]:
    """The connect and request timeouts: aiolock's names, or redis-py's (taken out of
    ``merged``), not both with different values."""
    for alias, ours in _ALIASES.items():  # one timeout per kind, for every connection
        if alias in merged:
            value = _number(alias, merged.pop(alias))
            if ours in own and _number(ours, own[ours]) != value:
                raise ValueError(f"{alias}={value} and {ours}={own[ours]} disagree: give "
                                 f"{ours} only (it applies to every connection)")
            own[ours] = value
    timeouts = {k: _number(k, own.get(k, 5.0)) for k in ("connect_timeout", "request_timeout")}
    check_timeouts(**timeouts)
    return timeouts


def _scripting(value: Any) -> str:
    if value not in SCRIPTING:
        raise ValueError(f"scripting must be one of {', '.join(SCRIPTING)} (Lua scripts always, "
                         f"never: WATCH/MULTI/EXEC transactions, or only if the server "
                         f"refuses scripts), got {value!r}")
    return str(value)


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(type(a) is type(b) and a == b)
    except Exception:
        return False


def _lean(probe: Any, timeouts: dict[str, float], safe_url: str) -> RespClient:
    ssl_context = None
    if isinstance(probe, SSLConnection):
        try:
            ssl_context = probe.ssl_context.get()  # redis-py's own reading of ssl_*
        except Exception as exc:  # unreadable files, a wrong key password...
            raise ValueError(f"the TLS options for {safe_url} are not usable: {exc}") from None
    return RespClient(
        host=getattr(probe, "host", "localhost"), port=int(getattr(probe, "port", 6379)),
        path=getattr(probe, "path", None), db=int(probe.db or 0), username=probe.username,
        password=probe.password, ssl_context=ssl_context, client_name=probe.client_name,
        keepalive=bool(getattr(probe, "socket_keepalive", False)),
        keepalive_options=dict(getattr(probe, "socket_keepalive_options", None) or {}),
        connect_timeout=timeouts["connect_timeout"], request_timeout=timeouts["request_timeout"],
    )
