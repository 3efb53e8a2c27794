"""The options every SQL backend takes, checked the same way (URL query or keyword)."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["OPTIONS", "number", "numeric_options", "refuse_contradictions", "without_password"]

#: The options every SQL backend takes (URL query or keyword).
OPTIONS = ("mode", "connect_timeout", "request_timeout", "max_connections", "pool_timeout",
           "poll_interval")


def number(what: str, value: object, *, integer: bool = False) -> float:
    """``value`` (a number, or its text from a URL) checked > 0 and finite."""
    kind = "whole number" if integer else "number"
    if isinstance(value, str):
        try:
            value = int(value) if integer else float(value)
        except ValueError:
            raise ValueError(f"{what} must be a {kind}, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or (
        integer and not isinstance(value, int)
    ) or not math.isfinite(value):
        raise ValueError(f"{what} must be a {kind} > 0, got {value!r}")
    return value


def numeric_options(opts: dict[str, Any]) -> dict[str, Any]:
    """The numeric options of :data:`OPTIONS` in ``opts`` converted and checked."""
    for name in ("connect_timeout", "request_timeout", "pool_timeout", "poll_interval"):
        if name in opts and opts[name] is not None:
            opts[name] = number(name, opts[name])
    if "max_connections" in opts:
        opts["max_connections"] = int(number("max_connections", opts["max_connections"], integer=True))
    return opts


def refuse_contradictions(query: dict[str, str], options: dict[str, Any]) -> None:
    """An option of :data:`OPTIONS` in the URL's ``query`` and in the keyword ``options``
    with another value (``?mode=row`` and ``mode="lock"``): ValueError naming both. Which
    one should run would be a guess, and ``locks.url`` would show the other."""
    clash = sorted(k for k in set(query) & set(options) & set(OPTIONS)
                   if str(query[k]).lower() != str(options[k]).lower())
    if clash:
        raise ValueError(
            f"option(s) {', '.join(clash)} given both in the URL ("
            + ", ".join(f"{k}={query[k]}" for k in clash) + ") and as keywords ("
            + ", ".join(f"{k}={options[k]!r}" for k in clash) + "): give each once")


def without_password(netloc: str) -> str:
    """``user:password@host:port`` -> ``user@host:port``: the user stays (an operator copies
    ``locks.url`` into ``aiolock ls --url``), the password never shows."""
    userinfo, at, hostport = netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    return f"{user}@{hostport}" if at and user else hostport
