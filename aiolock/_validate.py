"""Argument checks shared by every entry point; each error says what is accepted."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, unquote

MAX_NAME_LENGTH = 512
#: The longest lease any backend accepts, in seconds (about 23 days): within PostgreSQL's
#: ``idle_session_timeout`` (a 32-bit count of ms) and Memcached's relative expiry
#: (at most 30 days), and far inside Redis's and ZooKeeper's ranges.
MAX_TTL = 2_000_000.0
ON_LOST_CHOICES = ("cancel", "raise")


def check_name(name: object) -> str:
    """A lock name: any non-empty ``str`` of at most 512 characters."""
    if not isinstance(name, str):
        raise ValueError(
            f"lock name must be a str of 1 to {MAX_NAME_LENGTH} characters, "
            f"got {type(name).__name__}"
        )
    if not 1 <= len(name) <= MAX_NAME_LENGTH:
        raise ValueError(
            f"lock name must be 1 to {MAX_NAME_LENGTH} characters long, got {len(name)}"
        )
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"lock name must be encodable as UTF-8 (no lone surrogates), got {name!r} "
            f"({exc.reason} at position {exc.start})"
        ) from None
    return name


def check_seconds(what: str, value: object, *, allow_none: bool, allow_zero: bool) -> float | None:
    """A finite duration in seconds (``None`` meaning 'forever' where allowed)."""
    if value is None and allow_none:
        return None
    accepted = "a number of seconds " + (">= 0" if allow_zero else "> 0")
    if allow_none:
        accepted += " or None"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be {accepted}, got {value!r}")
    seconds = float(value)
    if math.isnan(seconds) or math.isinf(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        raise ValueError(f"{what} must be {accepted}, got {value!r}")
    return seconds


def check_ttl(ttl: object) -> float:
    """A lease length: seconds from 0.001 (1 ms) to :data:`MAX_TTL`."""
    seconds = check_seconds("ttl", ttl, allow_none=False, allow_zero=False)
    assert seconds is not None
    if not 0.001 <= seconds <= MAX_TTL:
        raise ValueError(
            f"ttl must be a number of seconds from 0.001 to {MAX_TTL:,.0f} (about 23 days), "
            f"got {ttl!r}"
        )
    return seconds


def check_on_lost(on_lost: object) -> str | Callable[[Any], object]:
    """``"cancel"``, ``"raise"`` or a callable taking the lost lease."""
    if callable(on_lost) or on_lost in ON_LOST_CHOICES:
        return on_lost
    raise ValueError(f"on_lost must be 'cancel', 'raise' or a callable(lease), got {on_lost!r}")


def check_limit(limit: object) -> int:
    """A semaphore size: an int >= 1."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"semaphore limit must be an int >= 1, got {limit!r}")
    return limit


def check_timeouts(**values: object) -> None:
    """ValueError unless each value is a finite number of seconds > 0 (:func:`check_seconds`)."""
    for what, value in values.items():
        check_seconds(what, value, allow_none=False, allow_zero=False)


def parse_hosts(url: str, netloc: str, default_port: int, expected: str) -> list[tuple[str, int]]:
    """``host:port,host:port`` (IPv6 in brackets: ``[::1]:6379``) -> ``[(host, port), ...]``,
    hosts without brackets, lower-cased; the port defaults to ``default_port``. A malformed,
    empty or repeated node raises ValueError naming ``url`` and saying ``expected``."""
    hosts: list[tuple[str, int]] = []
    for part in netloc.split(","):
        part = part.strip()
        if part.startswith("["):
            host, bracket, rest = part[1:].partition("]")
            if not bracket or (rest and not rest.startswith(":")):
                raise ValueError(f"bad node {part!r} in {url!r}; expected {expected}")
            port_text = rest[1:]
        else:
            host, _, port_text = part.partition(":")
        if not host or ":" in port_text:
            raise ValueError(f"bad node {part!r} in {url!r}; expected {expected}")
        port_text = port_text or str(default_port)
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(f"bad port {port_text!r} in {url!r} (1-65535); expected {expected}")
        node = (host.lower(), int(port_text))
        if node in hosts:
            raise ValueError(f"node {part!r} appears twice in {url!r}; expected {expected}")
        hosts.append(node)
    return hosts


def format_hosts(hosts: list[tuple[str, int]]) -> list[str]:
    """``[(host, port), ...]`` -> ``["host:port", "[::1]:port", ...]`` (IPv6 in brackets)."""
    return [f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in hosts]


def credentials(userinfo: str) -> dict[str, str]:
    """The ``user:password`` part of a URL (percent-decoded) as redis-py keyword
    arguments, leaving out what is empty: ``{"username": ..., "password": ...}``."""
    user, _, password = userinfo.partition(":")
    given = {"username": unquote(user), "password": unquote(password)}
    return {k: v for k, v in given.items() if v}


def query_pairs(query: str, shown_url: str) -> dict[str, str]:
    """A URL query (the part after ``?``, percent-encoded) as ``{name: value}``, values
    percent-decoded, blank ones kept (``?a=`` and ``?a`` give ``{"a": ""}``: each backend
    decides whether a blank value is meaningful, none drops it silently).

    An option given twice (``?mode=lock&mode=row``, even with one value twice) raises
    ValueError naming it and ``shown_url`` (pass a URL without its password), never a
    value: the caller could otherwise only keep one of them silently."""
    pairs: dict[str, str] = {}
    repeated: list[str] = []
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key in pairs and key not in repeated:
            repeated.append(key)
        pairs[key] = value
    if repeated:
        raise ValueError(
            f"option(s) {', '.join(repeated)} given more than once in {shown_url}: "
            "give each option once"
        )
    return pairs
