"""Fencing: a protected resource that rejects writes carrying an old token.

A lease's token is strictly greater than that of every earlier acquisition of its name.
A holder that paused past its lease (GC, SIGSTOP, a network stall) may still try to
write after someone else took the lock; the resource stops it by remembering the
highest token it has seen and refusing anything lower::

    store = RedisFencedResource(redis_client, "balance:42")
    async with locks.lock("balance:42") as lease:
        if not await store.write(lease.token, b"new value"):
            ...  # a newer holder has written: we are stale, do nothing

:class:`RedisFencedResource` does the check and the write in one Lua script, so it is
atomic on the server; :class:`MemoryFencedResource` is the same for one process.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["FencedResource", "MemoryFencedResource", "RedisFencedResource"]


class FencedResource(Protocol):
    """A value guarded by fencing tokens."""

    async def write(self, token: int, value: bytes | str) -> bool:
        """Store ``value`` if ``token`` is at least the highest seen; True if stored."""

    async def read(self) -> tuple[int | None, bytes | None]:
        """The highest token seen and the value last written."""


class MemoryFencedResource:
    """An in-process fenced value (the demo's resource on ``memory://``)."""

    def __init__(self) -> None:
        self.token: int | None = None
        self.value: bytes | None = None
        self.accepted = 0
        self.rejected = 0

    async def write(self, token: int, value: bytes | str) -> bool:
        if self.token is not None and token < self.token:
            self.rejected += 1
            return False
        self.token = token
        self.value = value.encode() if isinstance(value, str) else value
        self.accepted += 1
        return True

    async def read(self) -> tuple[int | None, bytes | None]:
        return self.token, self.value


#: FENCED_WRITE -- store a value unless a newer token has been seen.
#: KEYS[1]  hash of the resource: fields token, value, accepted, rejected
#: ARGV[1]  the writer's fencing token (integer)
#: ARGV[2]  the value
#: returns  {1, token} if stored; {0, highest token seen} if rejected as stale
FENCED_WRITE = """
local seen = redis.call('hget', KEYS[1], 'token')
local token = tonumber(ARGV[1])
if seen and token < tonumber(seen) then
  redis.call('hincrby', KEYS[1], 'rejected', 1)
  return {0, tonumber(seen)}
end
redis.call('hset', KEYS[1], 'token', ARGV[1], 'value', ARGV[2])
redis.call('hincrby', KEYS[1], 'accepted', 1)
return {1, token}
"""


class RedisFencedResource:
    """A value in a Redis hash, written only by the newest token (one Lua script).

    ``client`` is a ``redis.asyncio.Redis`` (or cluster client); ``key`` the hash's key.
    """

    def __init__(self, client: Any, key: str) -> None:
        self._client = client
        self.key = key
        self._script = client.register_script(FENCED_WRITE)

    async def write(self, token: int, value: bytes | str) -> bool:
        if isinstance(token, bool) or not isinstance(token, int):
            raise ValueError(f"token must be an int (a lease's token), got {token!r}")
        stored, _ = await self._script(keys=[self.key], args=[token, value])
        return bool(stored)

    async def read(self) -> tuple[int | None, bytes | None]:
        token, value = await self._client.hmget(self.key, "token", "value")
        return (int(token) if token is not None else None), value

    async def counts(self) -> tuple[int, int]:
        """(accepted, rejected) writes so far."""
        accepted, rejected = await self._client.hmget(self.key, "accepted", "rejected")
        return int(accepted or 0), int(rejected or 0)
