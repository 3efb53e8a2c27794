"""``memcached://host:port``: best-effort locks on one memcached server (>= 1.6).

**Best effort.** memcached is a cache: it has no persistence and no replication, and it
may evict any key under memory pressure. A restart, a ``flush_all`` or an eviction
loses the locks it held: every holder then finds its lease gone at its next renewal
(the watchdog reports it lost, and ``async with`` cancels the body), but in the meantime
another process may already have taken the lock. Size the server so that it never
evicts (``-M`` makes it refuse writes instead), and use fencing tokens where a second
holder must not be able to do harm: a holder that lost its lease without knowing yet
(the server restarted or evicted the key between two renewals) carries a lower token
than whoever took the lock after it, as long as the token counter survived or was
re-created higher (see *fencing tokens* below), so a resource that checks tokens
(:class:`aiolock.RedisFencedResource` or your own) rejects the stale writer.

How it works, with memcached's meta commands (one lean pipelined connection, see
:mod:`aiolock.backends._mc_proto`):

* **acquire** -- ``ms <key> ... ME`` (mode *add*: only if absent) with an expiry, the
  value being the claim's owner id; in the same round trip ``ma`` increments the
  name's token counter (written after the add on one connection, so it is processed
  after it: the token is drawn only once the lock is ours, and any later holder draws a
  higher one). A second request stores ``<owner> <token>`` with a ``cas`` check, so
  ``status`` can show the token.
* **renew** -- ``ms <key> ... C<cas>``: compare-and-swap the same value with a new expiry
  (all due claims in one pipelined round trip). The cas unique of our last write is kept
  in ``claim.state``; if it changed, the value is read again (``mg``) and the renewal
  happens only if the owner id is still ours.
* **release** -- ``md <key> C<cas>``: a compare-and-swap delete, one command, so a
  release never deletes a lock someone else took after ours expired.
* **abandon** (a cancelled or failed acquire) -- commands on one connection are
  processed in order, so when the connection that carried the acquire is still up, an
  acquire in flight has been processed before the abandon's read: if the key holds our
  owner id it is deleted (cas). If that connection was lost, the acquire might still be
  processed late, so a free key is first taken by a *tombstone* (``~<owner>``, a few
  seconds' expiry) that any acquirer may replace (cas) but that makes a late ``add``
  fail. Not covered: an add still in flight on a lost connection that arrives just after
  another holder released; that orphan then expires with its ttl.
* **fencing tokens** -- ``ma <counter> N0 J<seed>``: one counter per name, created on
  first use without expiry. memcached may still lose it (restart, eviction), so the
  counter is created with a seed taken from the *client's* wall clock (microseconds since
  the epoch) rather than 0: tokens then keep increasing across a reset as long as fewer
  than one acquisition per microsecond happened since the counter was last created and
  the creating clients' clocks agree to within the time since then. That is best effort,
  not a guarantee. Tokens skip numbers (every attempt draws one).

**Clock: whole seconds.** memcached expiries are whole seconds of a server clock that
ticks about once a second. An expiry of ``E`` seconds normally lasts ``(E-1, E]``; but the
tick drifts against the second boundaries it counts (its timer is re-armed one second
after each tick), so now and then one tick advances the clock by two and an item lives
only ``E-2`` seconds and a little. A lease of ``ttl`` seconds is therefore written with
``E = ceil(ttl) + 2`` and reported as granted for ``min(ttl, E - 2 - 0.1)`` seconds, the
time the server is sure to keep it: a holder never believes in its lease longer than
the server keeps it, but a crashed holder's lock comes free only ``ceil(ttl) + 1`` to
``ceil(ttl) + 2`` seconds after its last renewal (rarely as early as ``ceil(ttl)``),
never within a second, however short the ttl. Expiries are capped at 30 days (memcached
reads larger numbers as dates).

**Capabilities.** Mutex and semaphore (``limit`` slot keys, each taken with *add*; an
attempt reads all ``limit`` slots in one round trip, so keep ``limit`` modest), expiry,
distributed. Not offered:

* ``fair=True`` -- a first-come-first-served queue needs an ordered list with per-entry
  expiry read and changed atomically; memcached only has single-key cas, and waiters
  cannot be woken, so a queue would be slow polling on a value every waiter rewrites.
* ``rwlock()`` -- likewise: shared readers with individual expiries plus a waiting
  writer that blocks new readers need multi-key atomic state.
* release events -- memcached has no pub/sub: waiters poll (``Busy.retry_after`` is
  ``poll_interval``, 50 ms by default). Waiters in one process still queue locally and a
  local release wakes the next one at once.

**Keys.** ``<prefix>:<role>:=<name>`` when the name is printable ASCII without spaces and
the key fits memcached's 250 bytes, else ``<prefix>:<role>:#<sha256 of the name>``.
Roles: ``L`` lock, ``T`` its token counter, ``S<i>`` semaphore slot ``i``, ``ST`` the
semaphore's token counter, ``SN`` the largest ``limit`` used (for ``status``).

**Errors.** Connection failures and timeouts raise :class:`aiolock.BackendUnavailable`
(every call is bounded by ``connect_timeout`` and ``request_timeout``); an error reply
from the server raises :class:`aiolock.LockError`.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import time
from collections.abc import Sequence
from typing import ClassVar
from urllib.parse import urlsplit

from ..abc import Backend, Busy, Capability, Claim, Granted, Kind, LockInfo
from ..errors import BackendUnavailable, LockError
from ._mc_proto import McClient, McError, Reply

__all__ = ["MemcachedBackend"]

#: memcached's longest key, in bytes.
MAX_KEY = 250
#: Expiries above this many seconds would be read as Unix timestamps.
MAX_EXPTIME = 30 * 24 * 3600
#: Seconds a tombstone (an abandoned claim's bar against a late add) stays.
TOMBSTONE_SECONDS = 3
#: How often to retry a compare-and-swap that lost a race against ourselves.
CAS_RETRIES = 5


#: Milliseconds by which the server's clock tick may run late (see the module doc).
CLOCK_MARGIN_MS = 100


def exptime(ttl_ms: int) -> int:
    """memcached expiry (whole seconds) that is sure to keep a lease ``ttl_ms`` long."""
    return min(math.ceil(ttl_ms / 1000) + 2, MAX_EXPTIME)


def granted_ms(ttl_ms: int) -> int:
    """What we may report as granted for an expiry written for ``ttl_ms``: the least
    time the server keeps it (``E - 2`` seconds, less the margin), at most ``ttl_ms``."""
    return min(ttl_ms, (exptime(ttl_ms) - 2) * 1000 - CLOCK_MARGIN_MS)


def _seed() -> int:
    """The first value of a newly created token counter (see the module doc)."""
    return time.time_ns() // 1000


class MemcachedBackend(Backend):
    """Locks on one memcached server (see the module doc for what that guarantees).

    ``MemcachedBackend(host, port)``, or ``aiolock.connect("memcached://host:port")``.
    """

    schemes: ClassVar[tuple[str, ...]] = ("memcached",)
    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.SEMAPHORE, Capability.EXPIRY, Capability.DISTRIBUTED}
    )
    #: One pipelined connection: a release is processed before any later acquire.
    ordered = True

    def __init__(
        self, host: str = "127.0.0.1", port: int = 11211, *, prefix: str = "aiolock",
        connect_timeout: float = 5.0, request_timeout: float = 5.0, poll_interval: float = 0.05,
    ) -> None:
        for what, value in (("connect_timeout", connect_timeout), ("request_timeout", request_timeout),
                            ("poll_interval", poll_interval)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{what} must be a number of seconds > 0, got {value!r}")
        if (not isinstance(prefix, str) or not prefix or len(prefix) > 64
                or not all("!" <= ch <= "~" for ch in prefix)):
            raise ValueError(
                "prefix must be 1 to 64 printable ASCII characters without spaces, "
                f"got {prefix!r}"
            )
        self._host, self._port = host, port
        self._prefix = prefix
        self._connect_timeout = connect_timeout
        self._poll = float(poll_interval)
        self._client = McClient(
            host, port, connect_timeout=connect_timeout, request_timeout=request_timeout
        )

    @classmethod
    def from_url(cls, url: str, **options: object) -> MemcachedBackend:
        """``memcached://host[:port]`` (port 11211 by default). Options: ``prefix``
        (key prefix, default ``"aiolock"``), ``connect_timeout`` and ``request_timeout``
        (seconds, default 5), ``poll_interval`` (seconds between a waiter's attempts,
        default 0.05)."""
        parts = urlsplit(url)
        if parts.scheme != "memcached" or not parts.hostname or parts.path.strip("/") or parts.query:
            raise ValueError(f"expected memcached://host:port, got {url!r}")
        try:
            port = parts.port or 11211
        except ValueError as exc:
            raise ValueError(f"bad port in {url!r}: {exc}") from None
        unknown = set(options) - {"prefix", "connect_timeout", "request_timeout", "poll_interval"}
        if unknown:
            raise ValueError(
                f"unknown memcached option(s) {sorted(unknown)}; accepted: prefix, "
                "connect_timeout, request_timeout, poll_interval"
            )
        return cls(parts.hostname, port, **options)  # type: ignore[arg-type]

    @property
    def url(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"memcached://{host}:{self._port}"

    # -- keys -------------------------------------------------------------------------------

    def _key(self, role: str, name: str) -> bytes:
        head = f"{self._prefix}:{role}:"
        # room for the longest role ("S" + slot digits) so one name is encoded one way
        if len(head) + 12 + 1 + len(name) <= MAX_KEY and all("!" <= ch <= "~" for ch in name):
            return (head + "=" + name).encode()
        return (head + "#" + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()).encode()

    def _lock_key(self, claim: Claim) -> bytes:
        if claim.kind is Kind.PERMIT:
            slot = claim.state.get("slot")
            assert isinstance(slot, int)
            return self._key(f"S{slot}", claim.name)
        return self._key("L", claim.name)

    def _counter_key(self, name: str, kind: Kind) -> bytes:
        return self._key("ST" if kind is Kind.PERMIT else "T", name)

    # -- requests ---------------------------------------------------------------------------

    async def _request(
        self, *commands: bytes, mark: dict[str, object] | None = None, retry: bool = True
    ) -> list[Reply]:
        try:
            return await self._client.request(*commands, mark=mark, retry=retry)
        except McError as exc:
            raise LockError(f"memcached at {self.url} refused a request: {exc}") from exc
        except (ConnectionError, TimeoutError, OSError) as exc:
            raise BackendUnavailable(
                f"memcached at {self.url} is unavailable ({type(exc).__name__}: {exc})"
            ) from exc

    async def connect(self) -> None:
        try:
            async with asyncio.timeout(self._connect_timeout):
                await self._request(b"mn\r\n")
        except TimeoutError as exc:
            raise BackendUnavailable(f"cannot reach memcached at {self.url} (timed out)") from exc

    # -- acquire ------------------------------------------------------------------------------

    async def try_acquire(self, claim: Claim) -> Granted | Busy:
        if claim.kind is Kind.LOCK:
            return await self._acquire_slot(claim, None)
        if claim.kind is Kind.PERMIT:
            return await self._acquire_permit(claim)
        raise LockError(f"{self.url} does not offer read-write locks (see aiolock.backends.memcached)")

    async def _acquire_permit(self, claim: Claim) -> Granted | Busy:
        limit = claim.limit
        name = claim.name
        keys = [self._key(f"S{i}", name) for i in range(limit)]
        limit_key = self._key("SN", name)
        replies = await self._request(
            *(_mg(key, b"v c t") for key in keys),
            _mg(limit_key, b"v"),
        )
        slots, limit_reply = replies[:-1], replies[-1]
        known = _int(limit_reply.value)
        if known is None or known < limit:
            # ``status`` reads this to know how many slots to look at; a race that writes
            # a smaller limit back only hides slots from ``status``, never from acquirers
            await self._request(_ms(limit_key, str(limit).encode(), b"T0 MS"))
        free: list[int] = []
        tombs: list[tuple[int, int]] = []
        for i, reply in enumerate(slots):
            if reply.code == b"EN":
                free.append(i)
            elif reply.value is not None:
                owner, _token = _parse(reply.value)
                cas = reply.flag_int("c")
                if owner == claim.owner:  # a repeated request for a permit we hold
                    claim.state["slot"] = i
                    return await self._acquire_slot(claim, reply)
                if owner == "~" + claim.owner:
                    raise LockError(f"claim on {name!r} was abandoned")
                if owner.startswith("~") and cas is not None:
                    tombs.append((i, cas))
        random.shuffle(free)  # contenders of many processes spread over the free slots
        for i in free:
            claim.state["slot"] = i
            result = await self._acquire_slot(claim, None)
            if isinstance(result, Granted):
                return result
        for i, cas in tombs:
            claim.state["slot"] = i
            result = await self._take_tombstone(claim, cas)
            if isinstance(result, Granted):
                return result
        claim.state.pop("slot", None)
        return Busy(self._poll)

    async def _acquire_slot(self, claim: Claim, seen: Reply | None) -> Granted | Busy:
        """Take the claim's key (the lock, or the permit slot in ``claim.state``)."""
        key = self._lock_key(claim)
        exp = exptime(claim.ttl_ms)
        if seen is None:
            owner = claim.owner.encode()
            add, counter, now = await self._request(
                _ms(key, owner, b"T%d ME c" % exp),
                self._incr(claim),
                _mg(key, b"v c t"),
                mark=claim.state,
            )
            if add.code == b"HD":
                return await self._store_token(claim, key, add, counter)
            if add.code != b"NS":
                return Busy(self._poll)
            seen = now
        if seen.code == b"EN" or seen.value is None:
            return Busy(min(self._poll, 0.005))  # freed just now: try again at once
        holder, token = _parse(seen.value)
        cas = seen.flag_int("c")
        if cas is None:
            return Busy(self._poll)
        if holder == claim.owner:
            # A repeated request (e.g. its reply was lost): ours already. Refresh it.
            if token is None:
                (counter,) = await self._request(self._incr(claim))
                return await self._store_token(claim, key, Reply(b"HD", {"c": str(cas)}), counter)
            (ok,) = await self._request(_ms(key, seen.value, b"C%d T%d c" % (cas, exp)))
            if ok.code != b"HD":
                return Busy(self._poll)
            return self._granted(claim, ok, token)
        if holder == "~" + claim.owner:
            raise LockError(f"claim on {claim.name!r} was abandoned")
        if holder.startswith("~"):
            return await self._take_tombstone(claim, cas)
        return Busy(self._poll)

    async def _take_tombstone(self, claim: Claim, cas: int) -> Granted | Busy:
        """Replace an abandoned claim's tombstone (a free key) with ours."""
        key = self._lock_key(claim)
        exp = exptime(claim.ttl_ms)
        swap, counter = await self._request(
            _ms(key, claim.owner.encode(), b"C%d T%d c" % (cas, exp)),
            self._incr(claim),
            mark=claim.state,
        )
        if swap.code != b"HD":
            return Busy(self._poll)
        return await self._store_token(claim, key, swap, counter)

    async def _store_token(self, claim: Claim, key: bytes, taken: Reply, counter: Reply) -> Granted | Busy:
        """The key is ours (``taken`` has its cas): write ``<owner> <token>`` into it."""
        token = _int(counter.value)
        cas = taken.flag_int("c")
        if token is None or cas is None:
            raise LockError(f"memcached at {self.url} gave no token counter for {claim.name!r}")
        value = f"{claim.owner} {token}".encode()
        (ok,) = await self._request(
            _ms(key, value, b"C%d T%d c" % (cas, exptime(claim.ttl_ms))), mark=claim.state
        )
        if ok.code == b"HD":
            return self._granted(claim, ok, token)
        # A retried write whose first copy got through (then the value is ours), or the
        # key is gone between two requests (flushed, evicted, restarted).
        (seen,) = await self._request(_mg(key, b"v c t"))
        if seen.value is not None and _parse(seen.value) == (claim.owner, token):
            return await self._acquire_slot(claim, seen)
        return Busy(self._poll)

    def _granted(self, claim: Claim, written: Reply, token: int) -> Granted:
        claim.state["cas"] = written.flag_int("c")
        claim.state["token"] = token
        return Granted(token, granted_ms(claim.ttl_ms))

    def _incr(self, claim: Claim) -> bytes:
        return b"ma %s N0 J%d v\r\n" % (self._counter_key(claim.name, claim.kind), _seed())

    # -- renew / release / abandon ----------------------------------------------------------

    async def renew(self, claims: Sequence[Claim]) -> list[int | None]:
        if not claims:
            return []
        out: list[int | None] = [None] * len(claims)
        todo: list[int] = []
        commands: list[bytes] = []
        for i, claim in enumerate(claims):
            if not isinstance(claim.state.get("cas"), int) or "token" not in claim.state:
                continue  # never granted here: nothing to renew
            todo.append(i)
            commands.append(self._renew_command(claim, claim.state["cas"]))  # type: ignore[arg-type]
        for _ in range(CAS_RETRIES):
            if not todo:
                break
            replies = await self._request(*commands)
            stale: list[int] = []
            for i, reply in zip(todo, replies, strict=True):
                if reply.code == b"HD":
                    claims[i].state["cas"] = reply.flag_int("c")
                    out[i] = granted_ms(claims[i].ttl_ms)
                elif reply.code == b"EX":
                    stale.append(i)  # changed since our last write: read and check the owner
            todo, commands = [], []
            if stale:
                seen = await self._request(*(_mg(self._lock_key(claims[i]), b"v c") for i in stale))
                for i, reply in zip(stale, seen, strict=True):
                    cas = reply.flag_int("c")
                    if reply.value is not None and cas is not None and self._mine(claims[i], reply.value):
                        todo.append(i)
                        commands.append(self._renew_command(claims[i], cas))
        return out

    def _renew_command(self, claim: Claim, cas: int) -> bytes:
        return _ms(self._lock_key(claim), self._value(claim), b"C%d T%d c" % (cas, exptime(claim.ttl_ms)))

    def _value(self, claim: Claim) -> bytes:
        return f"{claim.owner} {claim.state['token']}".encode()

    def _mine(self, claim: Claim, value: bytes) -> bool:
        return _parse(value)[0] == claim.owner

    async def release(self, claim: Claim) -> bool:
        cas = claim.state.get("cas")
        if "token" not in claim.state or not isinstance(cas, int):
            return False
        return await self._delete_mine(claim, cas)

    async def _delete_mine(self, claim: Claim, cas: int | None) -> bool:
        """Delete the claim's key if it still holds our owner id (cas-checked)."""
        key = self._lock_key(claim)
        for _ in range(CAS_RETRIES):
            if cas is not None:
                (reply,) = await self._request(b"md %s C%d\r\n" % (key, cas))
                if reply.code == b"HD":
                    claim.state.pop("cas", None)
                    return True
                if reply.code == b"NF":
                    return False
            (seen,) = await self._request(_mg(key, b"v c"))
            cas = seen.flag_int("c")
            if seen.value is None or cas is None or not self._mine(claim, seen.value):
                return False
        return False

    async def abandon(self, claim: Claim) -> None:
        if claim.kind is Kind.PERMIT and "slot" not in claim.state:
            return  # no slot was tried
        if "gen" not in claim.state:
            return  # nothing was ever sent
        cas = claim.state.get("cas")
        if isinstance(cas, int) and await self._delete_mine(claim, cas):
            return
        ordered = claim.state.get("gen") == self._client.generation
        key = self._lock_key(claim)
        if ordered:
            # Everything this claim sent went out on this connection, so it has been
            # processed before this read: no add of ours can come later.
            await self._delete_mine(claim, None)
            return
        # The connection that carried the add is gone: it may still be processed. Bar a
        # free key with a tombstone first, then delete ours if it is there.
        tomb = f"~{claim.owner}".encode()
        add, seen = await self._request(
            _ms(key, tomb, b"T%d ME" % TOMBSTONE_SECONDS), _mg(key, b"v c")
        )
        if add.code == b"HD":
            return
        cas = seen.flag_int("c")
        if seen.value is not None and cas is not None and self._mine(claim, seen.value):
            # ours: turn it into a tombstone (not a delete, which would let a late add in)
            await self._request(_ms(key, tomb, b"C%d T%d" % (cas, TOMBSTONE_SECONDS)))

    # -- inspect ------------------------------------------------------------------------------

    async def inspect(self, name: str, kind: Kind = Kind.LOCK) -> LockInfo:
        if kind in (Kind.READ, Kind.WRITE):
            raise LockError(f"{self.url} does not offer read-write locks")
        counter = self._counter_key(name, kind)
        if kind is Kind.LOCK:
            seen, last = await self._request(_mg(self._key("L", name), b"v t"), _mg(counter, b"v"))
            slots = [seen]
        else:
            limit_reply, last = await self._request(_mg(self._key("SN", name), b"v"), _mg(counter, b"v"))
            limit = _int(limit_reply.value) or 0
            slots = await self._request(
                *(_mg(self._key(f"S{i}", name), b"v t") for i in range(limit))
            ) if limit else []
        holders = 0
        token: int | None = None
        left: list[float] = []
        for reply in slots:
            if reply.value is None:
                continue
            owner, tok = _parse(reply.value)
            if owner.startswith("~"):
                continue  # a tombstone: free
            holders += 1
            token = tok if kind is Kind.LOCK else None
            secs = reply.flag_int("t")
            if secs is not None and secs >= 0:
                left.append(max(secs - 2, 0))  # at least this long (see the module doc)
        return LockInfo(
            name, holders > 0, holders=holders, token=token, last_token=_int(last.value),
            ttl_left=float(max(left)) if left else None,
        )

    async def aclose(self) -> None:
        await self._client.aclose()


# -- protocol helpers -----------------------------------------------------------------------


def _mg(key: bytes, flags: bytes) -> bytes:
    return b"mg %s %s\r\n" % (key, flags)


def _ms(key: bytes, value: bytes, flags: bytes) -> bytes:
    return b"ms %s %d %s\r\n%s\r\n" % (key, len(value), flags, value)


def _parse(value: bytes) -> tuple[str, int | None]:
    """``b"<owner> <token>"`` (or just the owner) -> (owner, token)."""
    owner, _, token = value.decode(errors="replace").partition(" ")
    return owner, _int(token.encode()) if token else None


def _int(raw: bytes | None) -> int | None:
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        return None
