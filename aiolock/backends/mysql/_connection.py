"""The MySQL / MariaDB client side: ``asyncmy``, its errors mapped to ours, the URL."""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from ..._validate import query_pairs
from ...errors import AccessDenied, BackendUnavailable, LockError
from .._sql_options import OPTIONS, numeric_options, refuse_contradictions, without_password

__all__ = ["asyncmy", "code", "map_connect_error", "map_error", "name_bytes", "parse_url", "run",
           "seconds"]

#: MySQL client/server error codes: the connection is gone or cannot be made.
_CONNECTION_ERRORS = frozenset({
    1040,  # too many connections
    1053,  # server shutdown in progress
    1077, 1079, 1080,  # normal shutdown, shutdown complete, forcing close
    1152, 1153, 1154, 1155, 1156, 1157, 1158, 1159, 1160, 1161,  # aborted / net errors
    1927,  # MariaDB: connection was killed
    2002, 2003, 2005, 2006, 2013, 2055,  # cannot connect, gone away, lost during query
    4031,  # MySQL: disconnected by the server for inactivity
})
#: Refused credentials or permissions.
_ACCESS_ERRORS = frozenset({1044, 1045, 1142, 1143, 1227, 1370, 1698})


def asyncmy() -> Any:
    """Import ``asyncmy`` on first use; say which extra installs it if it is missing."""
    try:
        return importlib.import_module("asyncmy")
    except ImportError as exc:
        raise ImportError(
            "the mysql:// backend needs the asyncmy client; install it with: "
            "pip install 'aiolock[mysql]'", name="asyncmy",
        ) from exc


def code(exc: BaseException) -> int | None:
    """The server's (or client's) error number of ``exc``, if it has one."""
    args = getattr(exc, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def _is_connection_error(exc: BaseException) -> bool:
    if isinstance(exc, (OSError, TimeoutError, ConnectionError, EOFError)):
        return True
    errors = asyncmy().errors
    if isinstance(exc, errors.InterfaceError):
        return True
    return isinstance(exc, errors.MySQLError) and code(exc) in _CONNECTION_ERRORS


def map_error(exc: Exception, url: str) -> LockError:
    """The backend's one exception map: an ``asyncmy`` (or socket) error as ours."""
    if _is_connection_error(exc):
        return BackendUnavailable(f"MySQL at {url} is unavailable ({type(exc).__name__}: {exc})")
    if code(exc) in _ACCESS_ERRORS:
        return AccessDenied(f"MySQL at {url} refused the request: {exc}")
    return LockError(f"MySQL at {url} refused the request: {exc}")


def map_connect_error(exc: Exception, url: str) -> LockError:
    """A failed login: refused credentials, or an unreachable server."""
    if isinstance(exc, asyncmy().errors.MySQLError) and code(exc) in _ACCESS_ERRORS:
        return AccessDenied(f"MySQL at {url} refused the login: {exc}")
    return BackendUnavailable(f"cannot reach MySQL at {url} ({type(exc).__name__}: {exc})")


def seconds(ttl_ms: int) -> int:
    """The session's ``wait_timeout`` for a lease of ``ttl_ms``: whole seconds, >= 1."""
    return max(1, math.ceil(ttl_ms / 1000))


def name_bytes(claim_name: str) -> bytes:
    """A lock name as stored (``VARBINARY``: compared byte for byte, with case)."""
    return claim_name.encode("utf-8", "surrogatepass")


async def run(conn: Any, sql: str, args: Sequence[Any] = ()) -> list[Any]:
    """Run ``sql`` (one or more statements); the rows of the last result set."""
    async with conn.cursor() as cur:
        await cur.execute(sql, tuple(args) if args else None)
        rows = list(await cur.fetchall() or ())
        while await cur.nextset():
            rows = list(await cur.fetchall() or ())
    return rows


def parse_url(url: str, schemes: tuple[str, ...], options: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of :class:`MySQLBackend` for a ``mysql://`` URL and options
    (``mode`` among them); the printable ``url`` keeps the user, never the password."""
    parts = urlsplit(url)
    shown = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))  # no credentials
    expected = f"expected mysql://user@host:port/database, got {shown!r}"
    if parts.scheme.lower() not in schemes or not parts.hostname:
        raise ValueError(expected)
    try:
        port = parts.port or 3306
    except ValueError as exc:
        raise ValueError(f"bad port in {shown!r}: {exc}") from None
    database = unquote(parts.path.lstrip("/"))
    if not database or "/" in database:
        raise ValueError(expected)
    query = query_pairs(parts.query, shown)
    refuse_contradictions(query, options)
    opts: dict[str, Any] = {**query, **options}
    unknown = sorted(set(opts) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)} for {parts.scheme}://; accepted: "
                         + ", ".join(OPTIONS))
    user = unquote(parts.username) if parts.username is not None else None
    password = unquote(parts.password) if parts.password is not None else None
    safe = urlunsplit(parts._replace(netloc=without_password(parts.netloc)))
    return {"host": parts.hostname, "port": port, "user": user, "password": password,
            "database": database, "url": safe, **numeric_options(opts)}
