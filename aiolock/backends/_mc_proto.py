"""A lean, pipelined asyncio client for memcached's meta text protocol (``mg``/``ms``/``md``/``ma``),
the value format of a held key (:class:`Value`) and memcached's expiry arithmetic.

Why not ``aiomcache``: it has no meta commands (no compare-and-swap delete, no remaining
TTL on a read, no auto-created counters), and it pools connections, where a request
cancelled half-way through its reply leaves the pooled connection out of step.

The connection machinery -- one socket for many callers, replies matched in order,
cancellation that never desyncs, timeouts, one retry on a fresh connection, generations
-- is :mod:`aiolock.backends._pipeline`; this module adds the meta-protocol parser and
the handshake. Any ``ERROR`` / ``CLIENT_ERROR`` / ``SERVER_ERROR`` reply aborts the
connection (after a protocol error memcached may send a second error line for the same
command), and the request fails with :class:`McError`.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from ._pipeline import PipelinedClient, PipelinedProtocol

__all__ = ["MAX_EXPTIME", "McClient", "McError", "Reply", "Value", "exptime", "granted_ms", "mg", "ms",
           "to_int"]

#: Reply codes of the meta commands (see memcached's protocol.txt).
_ONE_LINE = {b"HD", b"NS", b"EX", b"NF", b"EN", b"MN"}
_ERRORS = (b"ERROR", b"CLIENT_ERROR", b"SERVER_ERROR")
#: Expiries above this many seconds would be read as Unix timestamps.
MAX_EXPTIME = 30 * 24 * 3600
#: Milliseconds by which the server's clock tick may run late (see ``exptime``).
CLOCK_MARGIN_MS = 100


def exptime(ttl_ms: int) -> int:
    """memcached expiry (whole seconds) that is sure to keep a lease ``ttl_ms`` long.

    The server's clock ticks about once a second, so an expiry of ``E`` normally lasts
    ``(E-1, E]`` s; but the tick drifts against the seconds it counts (its timer is
    re-armed a second after each tick), so now and then it advances by two and an item
    lives only a little over ``E-2`` s: hence ``ceil(ttl) + 2``, capped at 30 days."""
    return min(math.ceil(ttl_ms / 1000) + 2, MAX_EXPTIME)


def granted_ms(ttl_ms: int) -> int:
    """What we may report as granted for an expiry written for ``ttl_ms``: the least
    time the server keeps it (``E - 2`` seconds, less the margin), at most ``ttl_ms``."""
    return min(ttl_ms, (exptime(ttl_ms) - 2) * 1000 - CLOCK_MARGIN_MS)


class McError(Exception):
    """memcached answered a command with ``ERROR``, ``CLIENT_ERROR`` or ``SERVER_ERROR``."""


@dataclass(slots=True)
class Reply:
    """One meta reply: ``code`` (``HD``, ``VA``, ``EN``, ``NS``, ``EX``, ``NF``, ``MN``),
    its return flags (``{"c": "17", "t": "29"}``) and, for ``VA``, the value."""

    code: bytes
    flags: dict[str, str] = field(default_factory=dict)
    value: bytes | None = None

    def flag_int(self, name: str) -> int | None:
        raw = self.flags.get(name)
        if raw is None:
            return None
        try:
            return int(raw)
        except ValueError:
            return None


@dataclass(slots=True, frozen=True)
class Value:
    """What a lock (or permit slot) key holds: ``<owner> <token> <since> <info>``.

    ``token`` is ``-`` until the claim drew one; ``since`` is the grant time, ms of the
    granting client's wall clock (memcached shows no clock of its own); ``info`` the
    holder record, last as it may contain spaces. A tombstone holds ``~<owner>`` only.
    """

    owner: str
    token: int | None = None
    since: int | None = None
    info: str = ""

    def encode(self) -> bytes:
        token = "-" if self.token is None else str(self.token)
        since = "-" if self.since is None else str(self.since)
        return f"{self.owner} {token} {since} {self.info}".encode()

    @classmethod
    def decode(cls, raw: bytes) -> Value:
        owner, token, since, info = [*raw.decode(errors="replace").split(" ", 3), "", "", ""][:4]
        return cls(owner, to_int(token.encode()), to_int(since.encode()), info)


def mg(key: bytes, flags: bytes) -> bytes:
    """A meta get of ``key`` returning ``flags`` (``v`` value, ``c`` cas, ``t`` ttl)."""
    return b"mg %s %s\r\n" % (key, flags)


def ms(key: bytes, value: bytes, flags: bytes) -> bytes:
    """A meta set of ``key`` to ``value`` with ``flags`` (``T`` ttl, ``C`` cas, ``ME`` add...)."""
    return b"ms %s %d %s\r\n%s\r\n" % (key, len(value), flags, value)


def to_int(raw: bytes | None) -> int | None:
    """An integer reply or value, None if absent or not a number."""
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        return None


class _Protocol(PipelinedProtocol):
    peer = "memcached"

    def __init__(self, timeout: float) -> None:
        super().__init__(timeout)
        self._buf = bytearray()

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos = 0
        try:
            while True:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                words = bytes(buf[pos:end]).split(b" ")
                code = words[0]
                value: bytes | None = None
                if code == b"VA":
                    size = int(words[1])
                    if len(buf) < end + 2 + size + 2:
                        break  # the value is not all here yet
                    value = bytes(buf[end + 2 : end + 2 + size])
                    if buf[end + 2 + size : end + 4 + size] != b"\r\n":
                        raise ValueError("value not terminated by CRLF")
                    pos = end + 4 + size
                    words = words[2:]
                elif code in _ONE_LINE:
                    pos = end + 2
                    words = words[1:]
                elif code.startswith(_ERRORS):
                    text = bytes(buf[pos:end]).decode(errors="replace")
                    self._error(McError(f"memcached answered {text!r}"))
                    return
                else:
                    raise ValueError(f"unexpected reply line {bytes(buf[pos:end])[:80]!r}")
                flags = {w[:1].decode(): w[1:].decode() for w in words if w}
                self.deliver(Reply(code, flags, value))
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            self.abort(ConnectionError(f"protocol error from memcached: {exc}"))
            return
        del buf[:pos]

    def _error(self, exc: McError) -> None:
        """An error reply: the connection may be out of step now, so drop it."""
        if self._pending:
            self.deliver(exc)
        self.abort(ConnectionError(f"connection dropped after an error reply ({exc})"))


class McClient(PipelinedClient[_Protocol]):
    """One lazily (re)connected, pipelined connection to a memcached server."""

    def __init__(
        self, host: str, port: int, *, connect_timeout: float = 5.0, request_timeout: float = 5.0
    ) -> None:
        super().__init__(connect_timeout=connect_timeout, request_timeout=request_timeout)
        self._host, self._port = host, port

    async def _open(self, loop: asyncio.AbstractEventLoop) -> _Protocol:
        proto = _Protocol(self._request_timeout)
        await loop.create_connection(lambda: proto, self._host, self._port)
        try:
            # memcached < 1.6 has no meta commands: it answers "ERROR" to "mn"
            await proto.send(b"mn\r\n", loop)
        except McError as exc:
            raise McError(
                f"memcached at {self._host}:{self._port} does not speak the meta protocol "
                f"(memcached >= 1.6 is needed): {exc}"
            ) from exc
        except BaseException as exc:
            proto.abort(exc)
            raise
        return proto

    async def request(
        self, *commands: bytes, mark: dict[str, object] | None = None, retry: bool = True
    ) -> list[Reply]:
        """Send ``commands`` (each a complete meta command, CRLF-terminated, with its data
        block) in one write and return their replies in order.

        ``mark``, if given, gets ``mark["gen"]`` = the generation the commands were
        written on, set *before* waiting. With ``retry`` a batch written on a connection
        that turns out dead is sent once more on a fresh one (callers make their batches
        safe to repeat); a timed-out batch is never retried.
        """
        replies: list[Reply] = await self.send(
            b"".join(commands), len(commands), retry=retry, mark=mark
        )
        return replies
