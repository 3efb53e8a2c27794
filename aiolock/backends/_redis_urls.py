"""What ``redis+cluster://`` and ``redis+sentinel://`` URLs share: the scheme check and
the backend's own options (timeouts and key prefix, with their defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from .._validate import check_timeouts

__all__ = ["HostsUrl", "split_hosts_url"]


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
    timeouts; fill in the defaults (5 s, 5 s, ``aiolock``)."""
    connect = 5.0 if connect_timeout is None else connect_timeout
    request = 5.0 if request_timeout is None else request_timeout
    check_timeouts(connect_timeout=connect, request_timeout=request)
    got, sep, rest = url.partition("://")
    if got.lower() != scheme or not sep:
        raise ValueError(f"expected {expected}, got {url!r}")
    return HostsUrl(rest, connect, request, "aiolock" if prefix is None else prefix)
