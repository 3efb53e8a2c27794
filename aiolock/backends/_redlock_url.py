"""``redlock://`` URLs: the nodes (each a :class:`~aiolock.backends.redis.RedisBackend`),
the drift factor and the printable URL, from a URL and keyword options."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode, urlsplit

from .._validate import format_hosts, parse_hosts, query_pairs
from .redis import RedisBackend

__all__ = ["DEFAULT_DRIFT_FACTOR", "parse_url"]

#: Clock drift allowance as a fraction of the ttl (plus a constant 2 ms).
DEFAULT_DRIFT_FACTOR = 0.01

#: Options of redlock:// itself (every other one is its nodes'), and their defaults.
_OWN_OPTIONS = ("drift_factor", "connect_timeout", "request_timeout", "prefix")
#: What each of :data:`_OWN_OPTIONS` accepts (for messages).
_ACCEPTS = {"drift_factor": "a number in [0, 0.5)", "connect_timeout": "a number of seconds > 0",
            "request_timeout": "a number of seconds > 0",
            "prefix": "a non-empty str without braces"}
#: What ``ssl=`` in the query accepts.
_TLS = {"true": True, "1": True, "yes": True, "on": True,
        "false": False, "0": False, "no": False, "off": False}
_DEFAULTS = {"drift_factor": DEFAULT_DRIFT_FACTOR, "connect_timeout": 5.0, "request_timeout": 5.0}


def _number(url: str, query: dict[str, str], key: str, given: float | None, default: float) -> float:
    """Option ``key``: the keyword if given, else the query's, else ``default``."""
    if given is not None:
        return given
    if key not in query:
        return default
    try:
        return float(query[key])
    except ValueError:
        raise ValueError(f"{key} in {url!r} must be a number, got {query[key]!r}") from None


def parse_url(
    url: str, *, drift_factor: float | None = None, connect_timeout: float | None = None,
    request_timeout: float | None = None, prefix: str | None = None, **node_options: Any,
) -> tuple[list[RedisBackend], float, str]:
    """(nodes, drift factor, the URL without password) for
    :meth:`aiolock.backends.redlock.RedlockBackend.from_url` (see there)."""
    parts = urlsplit(url)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    shown = url.replace(userinfo + "@", "") if userinfo else url  # no password in errors
    accepted = "redlock://host:port,host:port,host:port (at least 3 distinct nodes)"
    if parts.scheme != "redlock":
        raise ValueError(f"expected {accepted}, got {shown!r}")
    # a repeated option: ValueError naming it (the query may hold a password: not shown)
    pairs = query_pairs(parts.query, shown.partition("?")[0])
    query: dict[str, str] = {k: v for k, v in pairs.items() if k in _OWN_OPTIONS}
    # any other query option is a node's (RedisBackend checks it, and names it if bad,
    # a blank one too)
    node_query = urlencode([(k, v) for k, v in pairs.items()
                            if k not in _OWN_OPTIONS and k != "ssl"])
    tls = node_options.pop("ssl", None)
    if "scripting" in node_options or "scripting" in pairs:  # issue 15: never off
        raise ValueError("unknown option scripting for redlock:// (its nodes run Lua scripts)")
    for key, value in query.items():
        if not value:
            raise ValueError(f"{key} must be {_ACCEPTS[key]}, got '' in "
                             f"{shown.partition('?')[0]!r} (leave it out for its default)")
    if tls is None and "ssl" in pairs:
        tls = _TLS.get(pairs["ssl"].lower())
        if tls is None:
            raise ValueError(f"ssl in {shown.partition('?')[0]!r} must be one of "
                             f"{', '.join(_TLS)}, got {pairs['ssl']!r}")
    hosts = parse_hosts(shown, hostlist, 6379, accepted)
    if len(hosts) < 3:
        raise ValueError(f"Redlock needs at least 3 nodes, got {len(hosts)} in {shown!r}; "
                         f"expected {accepted}")
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ValueError(f"the database in {shown!r} must be a number, got {db!r}")
    given = dict(drift_factor=drift_factor, connect_timeout=connect_timeout,
                 request_timeout=request_timeout)
    number = {key: _number(shown, query, key, given[key], default)
              for key, default in _DEFAULTS.items()}
    prefix = prefix if prefix is not None else query.get("prefix", "aiolock")
    auth = userinfo + "@" if userinfo else ""
    where = format_hosts(hosts)
    scheme = "rediss" if tls else "redis"
    tail = f"?{node_query}" if node_query else ""
    nodes = [RedisBackend.from_url(
        f"{scheme}://{auth}{node}/{db or 0}{tail}", connect_timeout=number["connect_timeout"],
        request_timeout=number["request_timeout"], prefix=prefix, scripting="on", **node_options,
    ) for node in where]
    safe = "redlock://" + ",".join(where) + (f"/{db}" if db else "")
    return nodes, number["drift_factor"], safe
