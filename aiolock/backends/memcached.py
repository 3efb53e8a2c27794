"""``memcached://host:port``: best-effort locks on one memcached server (>= 1.6).

What it guarantees and what not (a cache: no persistence, evictions, whole-second
expiries) is in ``docs/backends/memcached.md``; this is how it works, with memcached's
meta commands on one lean pipelined connection (:mod:`aiolock.backends._mc_proto`):

* **acquire** -- ``ms <key> ... ME`` (*add*: only if absent) with an expiry, the value
  being the claim's owner id, grant time and holder record (``_mc_proto.Value``); in the
  same round trip ``ma`` increments the name's token counter (after the add on one
  connection: the token is drawn once the key is ours); a second request writes the
  token into the value (``cas``-checked).
* **renew** (and ``set_info``, which writes a new record) -- ``ms <key> ... C<cas>`` with
  a new expiry, all due claims in one round trip; if the cas changed, the value is read
  again and the renewal made only if the owner id is still ours.
* **release** -- ``md <key> C<cas>``: never deletes a lock someone took after ours expired.
* **abandon** (a cancelled or failed acquire) -- commands on one connection are
  processed in order: if the connection that carried the acquire is still up, a read
  now sees its effect and our key is deleted (cas). If it was lost, the add might still
  arrive, so a free key is first taken by a *tombstone* (``~<owner>``, a few seconds)
  that any acquirer may replace but that makes a late add fail. (An add arriving late
  just after another holder released is an orphan that expires with its ttl.)
* **force_release** -- marks each holder's owner id revoked (role ``R``), then deletes
  its key (cas); a renewal that finds its key gone looks for the mark (``REVOKED``).
* **tokens** -- ``ma <counter> N0 J<seed>``: per name, no expiry, created with a seed
  from the client's wall clock (µs) so a counter memcached lost comes back higher.
* **expiries** -- ``E = ceil(ttl) + 2`` whole seconds, reported as granted for
  ``min(ttl, E - 2 - 0.1)`` s (the server's clock ticks about once a second, and now
  and then by two).
* **no events, no listing** -- waiters poll every ``poll_interval``; an election's
  observers read the leader every ``ttl / 2``; no ``scan``.

**Keys.** ``<prefix>:<role>:=<name>`` when the name is printable ASCII without spaces and
the key fits memcached's 250 bytes, else ``<prefix>:<role>:#<sha256 of the name>``.
Roles: ``L`` lock, ``T`` its token counter, ``E`` election, ``ET`` its counter, ``S<i>``
semaphore slot ``i``, ``ST`` the semaphore's counter, ``SN`` the largest ``limit`` used
(for ``status``), ``R`` a revoked owner id.

**Errors.** Every request goes through ``_request``, the one map: connection failures
and timeouts raise :class:`aiolock.BackendUnavailable` (every call is bounded by
``connect_timeout`` and ``request_timeout``), an error reply :class:`aiolock.LockError`.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections.abc import Sequence
from typing import ClassVar
from urllib.parse import urlsplit

from .._holder import decode_holder
from ..abc import REVOKED, Backend, Busy, Capability, Claim, Granted, Kind, LockInfo
from ..errors import BackendUnavailable, LockError
from ._mc_proto import MAX_EXPTIME, McClient, McError, Reply, Value, exptime, granted_ms, mg, ms, to_int

__all__ = ["MemcachedBackend", "exptime", "granted_ms"]

#: memcached's longest key, in bytes.
MAX_KEY = 250
#: Seconds a tombstone (an abandoned claim's bar against a late add) stays.
TOMBSTONE_SECONDS = 3
#: Seconds a revoked owner id stays marked, at least (and twice its lease's time left).
REVOKED_SECONDS = 60
#: How often to retry a compare-and-swap that lost a race against ourselves.
CAS_RETRIES = 5
#: The key role and counter role of each kind (a permit's key is its slot's, ``S<i>``).
_ROLES = {Kind.LOCK: ("L", "T"), Kind.LEADER: ("E", "ET"), Kind.PERMIT: ("S", "ST")}


def _seed() -> int:
    """The first value of a newly created token counter (see the module doc)."""
    return time.time_ns() // 1000


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


def _check_kind(kind: Kind) -> None:
    if kind not in _ROLES:
        raise LockError("memcached:// does not offer read-write locks (see aiolock.backends.memcached)")


class MemcachedBackend(Backend):
    """Locks on one memcached server (see the module doc for what that guarantees).

    ``MemcachedBackend(host, port)``, or ``aiolock.connect("memcached://host:port")``.
    """

    schemes: ClassVar[tuple[str, ...]] = ("memcached",)
    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.SEMAPHORE, Capability.EXPIRY, Capability.DISTRIBUTED, Capability.HOLDERS,
         Capability.REVOKE, Capability.ELECTION}
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
        return self._key(_ROLES[claim.kind][0], claim.name)

    def _counter_key(self, name: str, kind: Kind) -> bytes:
        return self._key(_ROLES[kind][1], name)

    def _revoked_key(self, owner: str) -> bytes:
        return self._key("R", owner)

    async def _holder_keys(self, name: str, kind: Kind) -> list[bytes]:
        """The keys where holders of ``name`` in ``kind``'s family may be."""
        _check_kind(kind)
        if kind is not Kind.PERMIT:
            return [self._key(_ROLES[kind][0], name)]
        (limit,) = await self._request(mg(self._key("SN", name), b"v"))
        return [self._key(f"S{i}", name) for i in range(to_int(limit.value) or 0)]

    # -- requests ---------------------------------------------------------------------------

    async def _request(
        self, *commands: bytes, mark: dict[str, object] | None = None, retry: bool = True,
        within: float | None = None,
    ) -> list[Reply]:
        """Every request to the server goes through here: the backend's one error map.
        ``within`` bounds it all (connecting, a retry) in seconds."""
        request = self._client.request(*commands, mark=mark, retry=retry)
        try:
            return await (request if within is None else asyncio.wait_for(request, within))
        except McError as exc:
            raise LockError(f"memcached at {self.url} refused a request: {exc}") from exc
        except (ConnectionError, TimeoutError, OSError) as exc:
            if self._client.closed:
                raise LockError(f"this connection to {self.url} is closed") from None
            raise BackendUnavailable(
                f"memcached at {self.url} is unavailable ({type(exc).__name__}: {exc})"
            ) from exc

    async def connect(self) -> None:
        await self._request(b"mn\r\n", within=self._connect_timeout)

    # -- acquire ------------------------------------------------------------------------------

    async def try_acquire(self, claim: Claim) -> Granted | Busy:
        if claim.kind is Kind.PERMIT:
            return await self._acquire_permit(claim)
        _check_kind(claim.kind)
        return await self._acquire_slot(claim, None)

    async def _acquire_permit(self, claim: Claim) -> Granted | Busy:
        limit = claim.limit
        name = claim.name
        keys = [self._key(f"S{i}", name) for i in range(limit)]
        limit_key = self._key("SN", name)
        *slots, limit_reply = await self._request(*(mg(key, b"v c t") for key in keys),
                                                  mg(limit_key, b"v"))
        known = to_int(limit_reply.value)
        if known is None or known < limit:
            # ``status`` reads this to know how many slots to look at; a race that writes
            # a smaller limit back only hides slots from ``status``, never from acquirers
            await self._request(ms(limit_key, str(limit).encode(), b"T0 MS"))
        free: list[int] = []
        tombs: list[tuple[int, int]] = []
        for i, reply in enumerate(slots):
            if reply.code == b"EN":
                free.append(i)
            elif reply.value is not None:
                owner = Value.decode(reply.value).owner
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
            add, counter, now = await self._request(
                ms(key, self._value(claim, None, taking=True), b"T%d ME c" % exp),
                self._incr(claim),
                mg(key, b"v c t"),
                mark=claim.state,
            )
            if add.code == b"HD":
                return await self._store_token(claim, key, add, counter)
            if add.code != b"NS":
                return Busy(self._poll)
            seen = now
        if seen.code == b"EN" or seen.value is None:
            return Busy(min(self._poll, 0.005))  # freed just now: try again at once
        held = Value.decode(seen.value)
        cas = seen.flag_int("c")
        if cas is None:
            return Busy(self._poll)
        if held.owner == claim.owner:
            # A repeated request (e.g. its reply was lost): ours already. Refresh it.
            if held.token is None:
                (counter,) = await self._request(self._incr(claim))
                return await self._store_token(claim, key, Reply(b"HD", {"c": str(cas)}), counter)
            (ok,) = await self._request(ms(key, seen.value, b"C%d T%d c" % (cas, exp)))
            if ok.code != b"HD":
                return Busy(self._poll)
            return self._granted(claim, ok, held.token)
        if held.owner == "~" + claim.owner:
            raise LockError(f"claim on {claim.name!r} was abandoned")
        if held.owner.startswith("~"):
            return await self._take_tombstone(claim, cas)
        return Busy(self._poll)

    async def _take_tombstone(self, claim: Claim, cas: int) -> Granted | Busy:
        """Replace an abandoned claim's tombstone (a free key) with ours."""
        key = self._lock_key(claim)
        exp = exptime(claim.ttl_ms)
        swap, counter = await self._request(
            ms(key, self._value(claim, None, taking=True), b"C%d T%d c" % (cas, exp)),
            self._incr(claim),
            mark=claim.state,
        )
        if swap.code != b"HD":
            return Busy(self._poll)
        return await self._store_token(claim, key, swap, counter)

    async def _store_token(self, claim: Claim, key: bytes, taken: Reply, counter: Reply) -> Granted | Busy:
        """The key is ours (``taken`` has its cas): write the token into its value."""
        token = to_int(counter.value)
        cas = taken.flag_int("c")
        if token is None or cas is None:
            raise LockError(f"memcached at {self.url} gave no token counter for {claim.name!r}")
        (ok,) = await self._request(
            ms(key, self._value(claim, token), b"C%d T%d c" % (cas, exptime(claim.ttl_ms))),
            mark=claim.state,
        )
        if ok.code == b"HD":
            return self._granted(claim, ok, token)
        # A retried write whose first copy got through (then the value is ours), or the
        # key is gone between two requests (flushed, evicted, restarted).
        (seen,) = await self._request(mg(key, b"v c t"))
        value = None if seen.value is None else Value.decode(seen.value)
        if value is not None and (value.owner, value.token) == (claim.owner, token):
            return await self._acquire_slot(claim, seen)
        return Busy(self._poll)

    def _granted(self, claim: Claim, written: Reply, token: int) -> Granted:
        claim.state["cas"] = written.flag_int("c")
        claim.state["token"] = token
        return Granted(token, granted_ms(claim.ttl_ms))

    def _incr(self, claim: Claim) -> bytes:
        return b"ma %s N0 J%d v\r\n" % (self._counter_key(claim.name, claim.kind), _seed())

    def _value(self, claim: Claim, token: int | None, *, taking: bool = False) -> bytes:
        """The claim's value: owner id, ``token``, grant time and holder record. An
        attempt to take the key (``taking``) is the grant time if it succeeds."""
        if taking or "since" not in claim.state:
            claim.state["since"] = _wall_ms()
        since = claim.state["since"]
        assert isinstance(since, int)
        return Value(claim.owner, token, since, claim.info).encode()

    # -- renew / release / abandon ----------------------------------------------------------

    async def renew(self, claims: Sequence[Claim]) -> list[int | None]:
        out: list[int | None] = [None] * len(claims)
        todo: list[int] = []
        commands: list[bytes] = []
        for i, claim in enumerate(claims):
            if not isinstance(claim.state.get("cas"), int) or "token" not in claim.state:
                continue  # never granted here: nothing to renew
            todo.append(i)
            commands.append(self._renew_command(claim, claim.state["cas"]))  # type: ignore[arg-type]
        granted = list(todo)
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
                seen = await self._request(*(mg(self._lock_key(claims[i]), b"v c") for i in stale))
                for i, reply in zip(stale, seen, strict=True):
                    cas = reply.flag_int("c")
                    if reply.value is not None and cas is not None and self._mine(claims[i], reply.value):
                        todo.append(i)
                        commands.append(self._renew_command(claims[i], cas))
        gone = [i for i in granted if out[i] is None]
        if gone:  # revoked by an operator, or lost (expired, evicted, restarted)?
            marks = await self._request(*(mg(self._revoked_key(claims[i].owner), b"v") for i in gone))
            for i, mark in zip(gone, marks, strict=True):
                if mark.value is not None:
                    out[i] = REVOKED
        return out

    def _renew_command(self, claim: Claim, cas: int) -> bytes:
        token = claim.state["token"]
        assert isinstance(token, int)
        return ms(self._lock_key(claim), self._value(claim, token),
                  b"C%d T%d c" % (cas, exptime(claim.ttl_ms)))

    def _mine(self, claim: Claim, value: bytes) -> bool:
        return Value.decode(value).owner == claim.owner

    async def set_info(self, claim: Claim) -> bool:
        """A renewal that writes the claim's new holder record (no listeners to wake)."""
        (granted,) = await self.renew([claim])
        return granted is not None and granted != REVOKED

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
            (seen,) = await self._request(mg(key, b"v c"))
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
            ms(key, tomb, b"T%d ME" % TOMBSTONE_SECONDS), mg(key, b"v c")
        )
        if add.code == b"HD":
            return
        cas = seen.flag_int("c")
        if seen.value is not None and cas is not None and self._mine(claim, seen.value):
            # ours: turn it into a tombstone (not a delete, which would let a late add in)
            await self._request(ms(key, tomb, b"C%d T%d" % (cas, TOMBSTONE_SECONDS)))

    # -- operators: inspect, force_release --------------------------------------------------

    async def inspect(self, name: str, kind: Kind = Kind.LOCK) -> LockInfo:
        keys = await self._holder_keys(name, kind)
        *slots, last = await self._request(*(mg(key, b"v t") for key in keys),
                                            mg(self._counter_key(name, kind), b"v"))
        now = _wall_ms()
        held: list[Value] = []
        left: list[int] = []
        for reply in slots:
            value = None if reply.value is None else Value.decode(reply.value)
            if value is None or value.owner.startswith("~"):
                continue  # free, or a tombstone
            held.append(value)
            secs = reply.flag_int("t")
            if secs is not None and secs >= 0:
                left.append(max(secs - 2, 0))  # at least this long (see the module doc)
        held.sort(key=lambda v: v.token or 0)
        return LockInfo(
            name, bool(held), holders=len(held),
            token=held[0].token if held and kind is not Kind.PERMIT else None,
            last_token=to_int(last.value), ttl_left=float(max(left)) if left else None,
            held_by=tuple(decode_holder(v.info, None if v.since is None else (now - v.since) / 1000)
                          for v in held),
            family=kind.family,
        )

    async def force_release(self, name: str, kind: Kind = Kind.LOCK) -> bool:
        keys = await self._holder_keys(name, kind)
        revoked = False
        for _ in range(CAS_RETRIES):
            if not keys:
                break
            seen = await self._request(*(mg(key, b"v c t") for key in keys))
            commands: list[bytes] = []
            sent: list[bytes] = []
            for key, reply in zip(keys, seen, strict=True):
                cas = reply.flag_int("c")
                owner = None if reply.value is None else Value.decode(reply.value).owner
                if owner is None or cas is None or owner.startswith("~"):
                    continue  # free, or a tombstone
                keep = min(max(REVOKED_SECONDS, 2 * (reply.flag_int("t") or 0)), MAX_EXPTIME)
                # mark first: the holder's renewal, which finds its key gone, then sees it
                commands += (ms(self._revoked_key(owner), b"1", b"T%d" % keep),
                             b"md %s C%d\r\n" % (key, cas))
                sent.append(key)
            if not commands:
                break
            deletes = (await self._request(*commands))[1::2]
            revoked = revoked or any(r.code == b"HD" for r in deletes)
            # a key whose holder renewed (or changed) meanwhile: read and revoke it again
            keys = [key for key, r in zip(sent, deletes, strict=True) if r.code == b"EX"]
        return revoked

    async def aclose(self) -> None:
        await self._client.aclose()
