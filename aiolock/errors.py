"""The exceptions aiolock raises: one flat list, all rooted at :class:`LockError`.

=====================  ===========================================================
``LockError``          base class; also raised when a task that already holds a
                       non-reentrant lock tries to acquire it again.
``LockTimeout``        the lock was not acquired before the timeout passed
                       (also a :class:`TimeoutError`).
``LockLost``           a held lease was lost: renewal found it gone, or its last
                       confirmed expiry passed.
``BackendUnavailable`` the server could not be reached within the connect or
                       request timeout, or answered that it cannot serve now
                       (loading, read-only replica, busy script, no master); also a
                       :class:`ConnectionError`. Worth retrying.
``AccessDenied``       the server refused the credentials or the permissions
                       (wrong or missing password, an ACL without a needed command,
                       a ZooKeeper ACL); also a :class:`PermissionError`. Retrying
                       does not help: fix the URL's credentials or the grants.
=====================  ===========================================================

Bad arguments raise the built-in :class:`ValueError` with a message that says what is
accepted. Backends turn their client library's errors into these with
:func:`map_exceptions`, keeping the original as ``__cause__``: one exception map per
backend module, applied around each I/O call (the way httpcore maps each transport's
errors), so no client exception escapes to the user and every backend says the same
thing for the same failure.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

__all__ = [
    "AccessDenied", "BackendUnavailable", "LockError", "LockLost", "LockTimeout", "map_exceptions",
]


class LockError(Exception):
    """Base class of every aiolock error."""


class LockTimeout(LockError, TimeoutError):
    """The lock could not be acquired before the timeout passed."""


class LockLost(LockError):
    """A lease was lost while it was held (expired, or taken away on the server)."""


class BackendUnavailable(LockError, ConnectionError):
    """The lock server could not be reached in bounded time."""


class AccessDenied(LockError, PermissionError):
    """The server refused our credentials or lacks a permission we need."""


@contextlib.contextmanager
def map_exceptions(mapping: Mapping[type[BaseException], type[Exception]]) -> Iterator[None]:
    """Re-raise a client library's exceptions as ours (``raise ours from theirs``).

    The per-backend tool: each backend module keeps one map and wraps each I/O call::

        _EXC_MAP = {
            asyncpg.InvalidPasswordError: AccessDenied,   # subclasses first
            asyncpg.PostgresConnectionError: BackendUnavailable,
            OSError: BackendUnavailable,
        }

        with map_exceptions(_EXC_MAP):
            row = await conn.fetchrow(QUERY, key)

    The first matching entry of ``mapping`` wins, so list subclasses first. The new
    exception's message is ``"TypeName: original message"``; the original is its
    ``__cause__``. Exceptions that match nothing, our own :class:`LockError` subclasses
    and base exceptions such as :class:`asyncio.CancelledError` pass through
    unchanged. A client message that may carry a secret (a DSN with its password) must
    be masked by the backend before it reaches here, or mapped to a class of its own.
    It is a context manager only: to map a whole coroutine, use it inside the coroutine
    (decorating an ``async def`` would cover only the creation of the coroutine).
    """
    try:
        yield
    except Exception as exc:
        for from_exc, to_exc in mapping.items():
            if isinstance(exc, from_exc) and not isinstance(exc, LockError):
                raise to_exc(f"{type(exc).__name__}: {exc}") from exc
        raise


def timed_out(exc: BaseException) -> bool:
    """``exc`` (or an exception it was raised from) is a request or connection that ran
    out of time, not a dead one: a backend never sends it again (``abc`` rule 2)."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, TimeoutError):
            return True
        cause = cause.__cause__
    return False
