"""What ``redis+cluster://`` and ``redis+sentinel://`` URLs share: the scheme check and
the backend's own options (timeouts and key prefix, with their defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl

from .._validate import check_timeouts
from ._redis_options import _number

__all__ = ["OWN", "HostsUrl", "split_hosts_url"]

#: The options :func:`split_hosts_url` takes out of the query (the backend's own).
OWN = ("connect_timeout", "request_timeout", "prefix")


@dataclass(frozen=True, slots=True)
class HostsUrl:
    """A multi-host Redis URL after the scheme, and the backend's own options."""

    rest: str  #: what follows ``scheme://``
    connect_timeout: float
    request_timeout: float
    prefix: str


def split_hosts_url(
    url: str, scheme: str, expected: str, *, connect_timeout: float | None,
    request_timeout: float | None, prefix: str | None,
) -> HostsUrl:
    """Check ``url``'s scheme (ValueError naming ``expected`` otherwise) and the
    timeouts, given as keywords or in the query (keywords win; the caller leaves
    :data:`OWN` out of the options it passes on); fill in the defaults (5 s, 5 s,
    ``aiolock``)."""
    got, sep, rest = url.partition("://")
    if got.lower() != scheme or not sep:
        raise ValueError(f"expected {expected}, got {url!r}")
    query = dict(parse_qsl(rest.partition("?")[2], keep_blank_values=True))
    if connect_timeout is None and "connect_timeout" in query:
        connect_timeout = _number("connect_timeout", query["connect_timeout"])
    if request_timeout is None and "request_timeout" in query:
        request_timeout = _number("request_timeout", query["request_timeout"])
    if prefix is None and query.get("prefix"):  # a blank one: refused with the query's others
        prefix = query["prefix"]
    connect = 5.0 if connect_timeout is None else connect_timeout
    request = 5.0 if request_timeout is None else request_timeout
    check_timeouts(connect_timeout=connect, request_timeout=request)
    return HostsUrl(rest, connect, request, "aiolock" if prefix is None else prefix)
