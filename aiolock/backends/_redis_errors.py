"""What a Redis error means for the caller: one map, used at every Redis I/O call.

* refused credentials or permissions (``NOAUTH``, ``WRONGPASS``, ``NOPERM``, a script
  whose ACL user may not touch a key or channel) -> :class:`aiolock.AccessDenied`, with
  what to fix (never the password: the server's text does not contain it);
* "cannot serve now" (``LOADING``, ``READONLY``, ``BUSY``, ``MASTERDOWN``, ``TRYAGAIN``,
  ``CLUSTERDOWN``), a dropped connection or a timeout -> :class:`aiolock.BackendUnavailable`
  (worth retrying);
* anything else the server refused -> :class:`aiolock.LockError`.

Both the lean connection's errors (:class:`~aiolock.backends._resp.ResponseError`, whose
text starts with the server's error code) and redis-py's (which strips the code and
encodes it in the class) are understood.
"""

from __future__ import annotations

from redis import exceptions as rexc

from ..errors import AccessDenied, BackendUnavailable, LockError

__all__ = ["CONNECTING", "error_code", "redis_error"]

#: ``what`` for errors while connecting (the message then says "cannot reach")
CONNECTING = "the connection"

#: Error codes that mean "the server is there but cannot serve this now".
NOT_NOW = ("LOADING", "READONLY", "BUSY", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN")

_HINTS = {
    "NOAUTH": "the server requires a password: put it in the URL "
              "(redis://[user]:password@host:port/db) or pass password=...",
    "WRONGPASS": "check the user name and password in the URL",
    "NOPERM": "the ACL user lacks a command, key or channel that aiolock needs "
              "(see the least-privilege ACL line in the README)",
    "NOPASS": "the server has no password for this user: leave the password out of the URL",
}
#: redis-py's exception classes for the codes above (it strips the code from the text)
_CLASSES: tuple[tuple[type[BaseException], str], ...] = (
    (rexc.AuthenticationWrongNumberOfArgsError, "NOPASS"),
    (rexc.AuthenticationError, "WRONGPASS"),
    (rexc.NoPermissionError, "NOPERM"),
    (rexc.BusyLoadingError, "LOADING"),
    (rexc.ReadOnlyError, "READONLY"),
    (rexc.TryAgainError, "TRYAGAIN"),
    (rexc.ClusterDownError, "CLUSTERDOWN"),
    (rexc.MasterDownError, "MASTERDOWN"),
)
_DOWN: tuple[type[BaseException], ...] = (
    ConnectionError, TimeoutError, OSError, rexc.ConnectionError, rexc.TimeoutError,
)


def error_code(exc: BaseException) -> str | None:
    """The Redis error code ``exc`` stands for (``NOPERM``, ``READONLY``...), if known."""
    text = str(exc)
    status = getattr(exc, "status_code", None)  # redis-py >= 7 keeps the stripped code
    if isinstance(status, str) and (status in _HINTS or status in NOT_NOW):
        return status
    for cls, code in _CLASSES:
        if isinstance(exc, cls):
            if code == "WRONGPASS" and "authentication required" in text.lower():
                return "NOAUTH"
            if code == "WRONGPASS" and "without any password" in text:
                return "NOPASS"
            return code
    word = text.split(" ", 1)[0].upper()
    if word in _HINTS or word in NOT_NOW:
        return word
    if "user executing the script can't" in text or "no permissions to" in text:
        return "NOPERM"  # a script's command denied by the ACL (Redis 7: an ERR reply)
    if "Authentication required" in text or "Protocol error: unauthenticated" in text:
        return "NOAUTH"
    if "without any password configured" in text or "invalid username-password" in text:
        return "NOPASS" if "without any password" in text else "WRONGPASS"
    return None


def redis_error(exc: BaseException, where: str, what: str) -> LockError:
    """The aiolock error for ``exc`` raised while doing ``what`` on Redis at ``where``
    (a URL without credentials). Raise it ``from exc``."""
    code = error_code(exc)
    text = str(exc)
    if code is not None and not text.upper().startswith(code):
        text = f"{code} {text}"
    if code in _HINTS:
        return AccessDenied(f"Redis at {where} refused {what}: {text} -- {_HINTS[code]}")
    if code in NOT_NOW:
        return BackendUnavailable(f"Redis at {where} cannot serve {what} now: {text}")
    if isinstance(exc, _DOWN) and what == CONNECTING:
        return BackendUnavailable(f"cannot reach Redis at {where} ({type(exc).__name__}: {exc})")
    if isinstance(exc, _DOWN):
        return BackendUnavailable(
            f"Redis at {where} is unavailable for {what} ({type(exc).__name__}: {exc})"
        )
    return LockError(f"Redis at {where} refused {what}: {exc}")
