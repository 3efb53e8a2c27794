"""The PostgreSQL client side: ``asyncpg``, its errors mapped to ours, and the URL's options."""

from __future__ import annotations

import difflib
import importlib
import inspect
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

from ..._validate import query_pairs
from ...errors import AccessDenied, BackendUnavailable, LockError
from .._sql_options import OPTIONS, numeric_options, without_password

try:
    _ASYNCPG: Any = importlib.import_module("asyncpg")
except ImportError as _exc:  # reported by aiolock.connect() with the extra to install
    raise ImportError(
        "the postgresql:// backend needs asyncpg: pip install 'aiolock[postgres]'", name="asyncpg"
    ) from _exc

__all__ = ["asyncpg", "close", "map_error", "parse_url", "safe_url"]

#: What :func:`map_error` says a denied permission needs.
_GRANTS = ("the user needs SELECT, INSERT, UPDATE, DELETE on aiolock_tokens, aiolock_holders "
           "and aiolock_rows (or CREATE on the schema to make them)")


def asyncpg() -> Any:
    """``asyncpg``, imported with this module (it has no type information)."""
    return _ASYNCPG


def is_denied(exc: BaseException) -> bool:
    """A refused login or a missing privilege (SQLSTATE 28000, 28P01, 42501)."""
    errors = _ASYNCPG.exceptions
    return isinstance(exc, (errors.InsufficientPrivilegeError, errors.InvalidPasswordError,
                            errors.InvalidAuthorizationSpecificationError))


def _is_connection_error(exc: BaseException) -> bool:
    if isinstance(exc, (OSError, TimeoutError, ConnectionError)):
        return True
    apg = _ASYNCPG
    return isinstance(
        exc,
        (apg.PostgresConnectionError, apg.InterfaceError, apg.exceptions.OperatorInterventionError,
         apg.exceptions.ConnectionDoesNotExistError),
    ) and not isinstance(exc, apg.exceptions.QueryCanceledError)


def map_error(exc: Exception, url: str) -> LockError:
    """The backend's one exception map: an ``asyncpg`` (or socket) error as ours."""
    if _is_connection_error(exc):
        return BackendUnavailable(f"PostgreSQL at {url} is unavailable ({type(exc).__name__}: {exc})")
    if is_denied(exc):
        return AccessDenied(f"PostgreSQL at {url} denied a permission aiolock needs ({exc}); {_GRANTS}")
    return LockError(f"PostgreSQL at {url} refused the request: {exc}")


def map_connect_error(exc: Exception, url: str) -> LockError:
    """A failed login: refused credentials, or an unreachable server."""
    if is_denied(exc):
        return AccessDenied(
            f"PostgreSQL at {url} refused the login ({exc}); check the user and password in "
            "the URL, and that the user may CONNECT to the database"
        )
    return BackendUnavailable(f"cannot reach PostgreSQL at {url} ({type(exc).__name__}: {exc})")


async def close(conn: Any) -> None:
    try:
        await conn.close(timeout=1.0)
    except BaseException:
        conn.terminate()
        raise


def safe_url(dsn: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(netloc=without_password(parts.netloc), query=""))


def _check_keywords(names: set[str], ours: set[str]) -> None:
    """Keyword options that are neither ours nor ``asyncpg.connect``'s are refused."""
    theirs = {n for n in inspect.signature(_ASYNCPG.connect).parameters
              if n not in ("dsn", "timeout", "connection_class", "record_class", "loop")}
    unknown = sorted(names - theirs)
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for postgresql://; accepted: "
            f"{', '.join(sorted(ours))}, and asyncpg.connect()'s: {', '.join(sorted(theirs))}"
        )


def _check_query(url: str, names: list[str], ours: set[str]) -> None:
    """Query parameters that are not ours go to asyncpg (libpq keywords such as
    ``sslmode``; anything else becomes a server setting, checked by the server at
    connect). One that looks like a misspelling of ours is refused now."""
    for name in names:
        close_match = difflib.get_close_matches(name, sorted(ours), n=1, cutoff=0.75)
        if close_match:
            raise ValueError(
                f"unknown option {name!r} in {safe_url(url)!r}: did you mean {close_match[0]!r}? "
                f"aiolock's options: {', '.join(sorted(ours))}"
            )


def parse_url(url: str, schemes: tuple[str, ...], options: dict[str, Any]) -> tuple[
        str, str, dict[str, Any]]:
    """``(dsn for asyncpg, printable url, our options with asyncpg's keywords)`` of a
    ``postgresql://`` URL and keyword options; ``mode`` stays in the options."""
    parts = urlsplit(url)
    expected = f"expected postgresql://user@host:port/database, got {url!r}"
    if parts.scheme.lower() not in schemes or (not parts.hostname and "host=" not in parts.query):
        raise ValueError(expected)
    try:
        parts.port  # noqa: B018 -- validates the port
    except ValueError as exc:
        raise ValueError(f"bad port in {url!r}: {exc}") from None
    ours = set(OPTIONS)
    query = list(query_pairs(parts.query, safe_url(url)).items())  # given twice: ValueError
    _check_query(url, [k for k, _ in query if k not in ours], ours)
    _check_keywords(set(options) - ours, ours)
    opts: dict[str, Any] = {k: v for k, v in query if k in ours}
    opts.update(options)
    rest = [(k, v) for k, v in query if k not in ours]
    dsn = urlunsplit(parts._replace(scheme="postgresql", query=urlencode(rest)))
    safe = urlunsplit(parts._replace(netloc=without_password(parts.netloc)))
    return dsn, safe, numeric_options(opts)
