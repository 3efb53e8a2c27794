"""Fast unit tests of the Redis Lua scripts on fakeredis (in addition to the real-server
suite, never instead of it)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import fakeredis
import pytest

from aiolock.backends._redis_scripts import ACQUIRE, INSPECT, RELEASE, RENEW, Script
from aiolock.backends._redis_scripts_shared import ACQUIRE_SHARED, RELEASE_SHARED
from aiolock.fencing import FENCED_WRITE


@pytest.fixture
async def r() -> AsyncIterator[Any]:
    client = fakeredis.FakeAsyncRedis()
    yield client
    await client.aclose()


def keys(name: str, owner: str) -> list[str]:
    base = f"aiolock:lock:{{{name}}}"
    return [base, base + ":seq", base + ":q", base + ":qt", base + ":x:" + owner]


async def run(r: Any, script: Script, k: list[str], *args: Any) -> Any:
    return await r.eval(script.source, len(k), *k, *args)


async def acquire(r: Any, owner: str, ttl: int = 10_000, fair: bool = False,
                  wttl: int | None = None) -> list[int]:
    return await run(r, ACQUIRE, keys("n", owner), owner, ttl, "1" if fair else "0",
                     ttl if wttl is None else wttl, "inbox-" + owner)


async def release_reply(r: Any, owner: str, abandon: bool = False, mark: int = 0,
                        heir: str = "") -> list[Any]:
    return await run(r, RELEASE, keys("n", owner), owner, "chan", "1" if abandon else "0",
                     60_000 if abandon else mark, heir, 5_000 if heir else 0)


async def queued(r: Any) -> list[str]:
    """The owners in the plain lock's queue (entries ``<owner>|<registration>``)."""
    return [e.decode().partition("|")[0] for e in await r.lrange("aiolock:lock:{n}:q", 0, -1)]


async def release(r: Any, owner: str, abandon: bool = False, mark: int = 0) -> int:
    return int((await release_reply(r, owner, abandon, mark))[0])


async def test_grant_busy_release(r: Any) -> None:
    assert await acquire(r, "a") == [1, 1, 10_000]
    busy = await acquire(r, "b", wttl=0)  # a single try: not registered
    assert busy[0] == 0 and 9_000 < busy[1] <= 10_000  # the holder's remaining ttl
    assert busy[2] == 1  # the holder's token
    assert not await r.exists("aiolock:lock:{n}:q")
    busy = await acquire(r, "b")  # registered: retry within a third of its waiter ttl
    assert busy[0] == 0 and 3_000 < busy[1] <= 10_000 // 3
    again = await acquire(r, "a")  # a repeated grant (lost reply) is the same grant
    assert again[0] == 1 and again[1] == 1
    assert await release(r, "b") == 0  # not the owner: nothing happens
    assert await release(r, "a") == 1  # ...and b is handed the lock
    assert await release(r, "a") == 0  # idempotent
    assert (await acquire(r, "b"))[:2] == [1, 2]  # tokens keep rising


async def test_token_counter_never_expires(r: Any) -> None:
    await acquire(r, "a", ttl=500)
    assert await r.ttl("aiolock:lock:{n}:seq") == -1
    assert 0 < await r.pttl("aiolock:lock:{n}") <= 500


async def test_abandon_bars_a_late_grant(r: Any) -> None:
    await release(r, "late", abandon=True)  # the cancel cleanup ran first...
    assert await acquire(r, "late") == [-1]  # ...so the acquire still in flight cannot grant
    assert not await r.exists("aiolock:lock:{n}")


async def test_abandon_releases_a_granted_claim(r: Any) -> None:
    await acquire(r, "a")
    assert await release(r, "a", abandon=True) == 1
    assert not await r.exists("aiolock:lock:{n}")


async def test_release_hands_the_lock_to_the_first_live_waiter_and_says_so(r: Any) -> None:
    """Wake ONE: the release grants the next waiter and publishes one message naming it."""
    pubsub = r.pubsub()
    await pubsub.subscribe("inbox-b")
    await acquire(r, "a")
    await acquire(r, "dead", wttl=1)  # its place lapses in 1 ms
    await acquire(r, "gone")
    await release(r, "gone", abandon=True)  # left: never handed the lock
    await acquire(r, "b")
    await acquire(r, "c")
    import asyncio

    await asyncio.sleep(0.01)
    assert await release_reply(r, "a") == [1, b"b", 2, 0]  # "dead" and "gone" skipped
    owner, token = await r.hmget("aiolock:lock:{n}", "owner", "token")
    assert owner == b"b" and token == b"2"
    assert 9_000 < await r.pttl("aiolock:lock:{n}") <= 10_000  # b's own ttl
    msgs = []
    for _ in range(10):
        m = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if m:
            msgs.append(m["data"])
    assert msgs == [b"aiolock:lock:{n}|b|" + token]  # on b's inbox only
    assert await queued(r) == ["c"]
    assert (await acquire(r, "b"))[:2] == [1, int(token)]  # b learns it by asking, too
    await pubsub.aclose()


async def test_abandon_of_a_handed_claim_hands_it_on(r: Any) -> None:
    await acquire(r, "a")
    await acquire(r, "b")
    await acquire(r, "c")
    await release(r, "a")  # to b, who is cancelled before it hears
    assert await release(r, "b", abandon=True) == 1
    assert (await r.hget("aiolock:lock:{n}", "owner")) == b"c"
    assert (await acquire(r, "b"))[0] == -1


async def test_abandon_while_free_hands_it_to_the_next(r: Any) -> None:
    """The lock is free (its holder's lease lapsed) while others wait: an abandon (a
    waiter giving up) hands it to the next live waiter rather than leave it idle."""
    await acquire(r, "a", ttl=20)
    await acquire(r, "remote")
    import asyncio

    await asyncio.sleep(0.05)
    assert not await r.exists("aiolock:lock:{n}")
    await release(r, "leaving", abandon=True)
    assert (await r.hget("aiolock:lock:{n}", "owner")) == b"remote"


async def test_release_hands_it_to_a_named_local_waiter(r: Any) -> None:
    """A local hand-off: the release names a waiting claim of its own process, which gets
    it past the queue (told in the reply, no message); an abandoned one does not."""
    pubsub = r.pubsub()
    await pubsub.subscribe("inbox-remote")
    await acquire(r, "a")
    await acquire(r, "remote")
    await acquire(r, "local")  # registered too: it leaves the queue when handed the lock
    assert await release_reply(r, "a", heir="local") == [1, b"local", 2, 1]
    assert await queued(r) == ["remote"]
    assert 4_000 < await r.pttl("aiolock:lock:{n}") <= 5_000  # the heir's ttl
    assert await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1) is None
    assert (await acquire(r, "local"))[:2] == [1, 2]
    await release(r, "gone", abandon=True)
    assert await release_reply(r, "local", heir="gone") == [1, b"remote", 3, 0]
    await pubsub.aclose()


async def test_non_fair_takes_a_free_lock_past_the_queue(r: Any) -> None:
    await acquire(r, "a", ttl=20)
    await acquire(r, "remote")
    import asyncio

    await asyncio.sleep(0.05)  # a's lease lapsed: nobody was handed it
    assert (await acquire(r, "newcomer"))[0] == 1
    assert await queued(r) == ["remote"]
    await release(r, "newcomer")
    assert (await r.hget("aiolock:lock:{n}", "owner")) == b"remote"


async def test_busy_reply_token_exposes_a_stale_grant(r: Any) -> None:
    await acquire(r, "a", ttl=20)
    await acquire(r, "b", ttl=20)
    await release(r, "a")  # b is handed token 2 with a 20 ms lease...
    import asyncio

    await asyncio.sleep(0.05)  # ...which lapses before b hears of it
    await acquire(r, "c")
    busy = await acquire(r, "b")
    assert busy[0] == 0 and busy[2] >= 2  # b may not believe a grant of token <= 2


async def test_renew_batch(r: Any) -> None:
    await acquire(r, "a", ttl=1000)
    k = ["aiolock:lock:{n}", "aiolock:lock:{n}", "aiolock:lock:{other}", "aiolock:lock:{other}"]
    out = await r.eval(RENEW.source, 4, *k, "h", "a", 5000, "h", "b", 5000)
    assert out == [5000, 0]
    assert 4000 < await r.pttl("aiolock:lock:{n}") <= 5000
    out = await r.eval(RENEW.source, 2, k[0], k[1], "h", "intruder", 5000)
    assert out == [0]


async def test_fair_queue_order_and_refresh(r: Any) -> None:
    assert (await acquire(r, "a", fair=True))[0] == 1
    assert (await acquire(r, "b", fair=True))[0] == 0
    assert (await acquire(r, "c", fair=True))[0] == 0
    assert await queued(r) == ["b", "c"]
    await release(r, "a")
    assert (await acquire(r, "c", fair=True))[0] == 0  # not c's turn: b is first
    assert (await acquire(r, "b", fair=True))[0] == 1
    assert await queued(r) == ["c"]
    busy = await acquire(r, "c", fair=True)
    assert busy[0] == 0 and 0 < busy[1] <= 10_000 // 3  # refresh within a third of its ttl


async def test_fair_abandon_leaves_queue_and_wakes_next(r: Any) -> None:
    await acquire(r, "a", fair=True)
    await acquire(r, "b", fair=True)
    await acquire(r, "c", fair=True)
    await release(r, "b", abandon=True)
    assert await queued(r) == ["c"]
    await release(r, "a")  # hands it to c
    assert (await acquire(r, "c", fair=True))[0] == 1


async def test_fair_dead_waiter_is_skipped(r: Any) -> None:
    await acquire(r, "a", fair=True)
    await run(r, ACQUIRE, keys("n", "dead"), "dead", 10_000, "1", 1, "i")  # lapses in 1 ms
    await acquire(r, "b", fair=True)
    import asyncio

    await asyncio.sleep(0.01)  # the dead place lapsed before the release: it is skipped
    await release(r, "a")
    assert (await acquire(r, "b", fair=True))[0] == 1


async def test_inspect(r: Any) -> None:
    out = await run(r, INSPECT, keys("n", "-"))
    assert out[0] == b"" and out[1] == -1 and out[3] == -1
    await run(r, ACQUIRE, keys("n", "a"), "a", 10_000, "0", 10_000, "inbox-a", '{"d":"x|y"}')
    owner, token, pttl, last, queued, info, held = await run(r, INSPECT, keys("n", "-"))
    assert owner == b"a" and token == 1 and 0 < pttl <= 10_000 and last == 1 and queued == 0
    assert info == b'{"d":"x|y"}' and 0 <= held < 1000


async def test_fenced_write(r: Any) -> None:
    async def write(token: int, value: str) -> list[int]:
        return await r.eval(FENCED_WRITE, 1, "res", token, value)

    assert await write(5, "x") == [1, 5]
    assert await write(5, "y") == [1, 5]  # the same holder may write again
    assert await write(4, "stale") == [0, 5]
    assert await write(6, "z") == [1, 6]
    assert await r.hget("res", "value") == b"z"
    assert await r.hget("res", "rejected") == b"1"


def shared_keys(owner: str, family: str = "rw") -> list[str]:
    base = f"aiolock:{family}:{{n}}"
    return [base, base + ":seq", base + ":q", base + ":qt", base + ":x:" + owner,
            base + ":h", base + ":ht"]


async def shared(r: Any, owner: str, kind: str, ttl: int = 10_000, limit: int = 1,
                 fair: bool = False) -> list[int]:
    family = "sem" if kind == "p" else "rw"
    return await run(r, ACQUIRE_SHARED, shared_keys(owner, family), owner, ttl,
                     "1" if fair else "0", ttl, kind, limit)


async def shared_release(r: Any, owner: str, kind: str, mark: int = 0) -> int:
    family = "sem" if kind == "p" else "rw"
    return await run(r, RELEASE_SHARED, shared_keys(owner, family), owner, "c", "0", mark, kind)


async def test_readers_share_and_waiting_writer_goes_first(r: Any) -> None:
    assert (await shared(r, "r1", "r"))[:2] == [1, 1]
    assert (await shared(r, "r2", "r"))[:2] == [1, 2]
    assert (await shared(r, "w", "w"))[0] == 0  # readers hold: the writer queues
    assert (await shared(r, "r3", "r"))[0] == 0  # a writer waits: new readers wait too
    assert await shared_release(r, "r1", "r") == 1
    assert await shared_release(r, "r2", "r") == 1
    granted = await shared(r, "w", "w")
    assert granted[0] == 1 and granted[1] == 3
    assert (await shared(r, "r3", "r"))[0] == 0  # the writer holds
    assert await shared_release(r, "w", "w") == 1
    assert (await shared(r, "r3", "r"))[:2] == [1, 4]


async def test_dead_reader_share_expires(r: Any) -> None:
    import asyncio

    assert (await shared(r, "r1", "r", ttl=20))[0] == 1
    assert (await shared(r, "w", "w"))[0] == 0
    await asyncio.sleep(0.05)
    assert (await shared(r, "w", "w"))[0] == 1  # the reader's share lapsed with its ttl


async def test_semaphore_limit_and_regrant(r: Any) -> None:
    assert (await shared(r, "a", "p", limit=2))[:2] == [1, 1]
    assert (await shared(r, "b", "p", limit=2))[:2] == [1, 2]
    busy = await shared(r, "c", "p", limit=2)
    assert busy[0] == 0 and 9_000 < busy[1] <= 10_000
    assert (await shared(r, "a", "p", limit=2))[:2] == [1, 1]  # repeated: same grant
    assert await shared_release(r, "a", "p") == 1
    assert (await shared(r, "c", "p", limit=2))[:2] == [1, 3]


async def test_renew_batch_spares_the_rest_when_a_key_has_another_type(r: Any) -> None:
    """A key overwritten by another client (a string, a list...) fails its own claim (0:
    not held) and not the whole batch with WRONGTYPE."""
    await acquire(r, "a", ttl=1000)
    await shared(r, "b", "p", ttl=1000, limit=3)
    await r.set("aiolock:lock:{s}", "x")
    await r.set("aiolock:sem:{t}:h", "x")
    await r.hset("aiolock:lock:{s}:x:c", "f", "v")  # even its waiter key: no WRONGTYPE
    k = ["aiolock:lock:{s}", "aiolock:lock:{s}", "aiolock:lock:{n}", "aiolock:lock:{n}",
         "aiolock:sem:{t}:h", "aiolock:sem:{t}:ht", "aiolock:sem:{n}:h", "aiolock:sem:{n}:ht"]
    out = await r.eval(RENEW.source, 8, *k, "h", "c", 5000, "h", "a", 5000, "z", "d", 5000,
                       "z", "b", 5000)
    assert out == [0, 5000, 0, 5000]
    assert await r.get("aiolock:lock:{s}") == b"x"  # left as it is


async def test_redlock_renew_spares_the_rest_when_a_key_has_another_type(r: Any) -> None:
    from aiolock.backends import _redlock_scripts as lua

    for name in ("a", "b"):
        await r.hset(f"aiolock:lock:{{{name}}}", "owner", name)
    await r.set("aiolock:lock:{s}", "x")
    await r.hset("aiolock:lock:{s}:x:s", "f", "v")
    k = ["aiolock:lock:{a}", "aiolock:lock:{a}:x:a", "aiolock:lock:{s}", "aiolock:lock:{s}:x:s",
         "aiolock:lock:{b}", "aiolock:lock:{b}:x:b"]
    out = await r.eval(lua.RENEW.source, 6, *k, "a", 5000, "s", 5000, "b", 5000)
    assert out == [5000, 0, 5000]


async def test_renew_shared_holder(r: Any) -> None:
    await shared(r, "a", "p", ttl=1000, limit=3)
    k = ["aiolock:sem:{n}:h", "aiolock:sem:{n}:ht"]
    assert await r.eval(RENEW.source, 2, *k, "z", "a", 5000) == [5000]
    assert await r.eval(RENEW.source, 2, *k, "z", "gone", 5000) == [0]


async def test_a_resent_release_is_still_a_release(r: Any) -> None:
    """A client that resends a RELEASE after a lost reply (redis-py's retry) must hear 1
    again, not 0 (which would read as a lost lease)."""
    await acquire(r, "a")
    assert await release(r, "a", mark=60_000) == 1
    assert await release(r, "a", mark=60_000) == 1  # the resend
    assert await release(r, "b", mark=60_000) == 0  # someone else's: still not theirs
    assert (await acquire(r, "a"))[0] == -1  # a released claim is never granted again
    assert (await acquire(r, "b"))[:2] == [1, 2]
    for kind in ("w", "r", "p"):
        await shared(r, "s-" + kind, kind)
        assert await shared_release(r, "s-" + kind, kind, mark=60_000) == 1
        assert await shared_release(r, "s-" + kind, kind, mark=60_000) == 1


async def test_a_hand_off_carries_the_waiters_holder_record(r: Any) -> None:
    """Holder records cost no round trip: the waiter's registration carries its record,
    and the release that hands it the lock stores it beside the grant."""
    await run(r, ACQUIRE, keys("n", "a"), "a", 10_000, "0", 10_000, "in|box", "rec-a")
    await run(r, ACQUIRE, keys("n", "b"), "b", 10_000, "0", 10_000, "in|box", "rec|b")
    assert (await release_reply(r, "a"))[1] == b"b"
    lock = await r.hmget("aiolock:lock:{n}", "owner", "info", "gttl", "since")
    # held for gttl - PTTL ms: no TIME; since '' (unknown), not a's
    assert lock == [b"b", b"rec|b", b"10000", b""]
    k = ["aiolock:lock:{n}", "aiolock:lock:{n}"]
    assert await r.eval(RENEW.source, 2, *k, "h", "b", 10_000) == [10_000]
    since = await r.hget("aiolock:lock:{n}", "since")  # the first renewal fixes it
    held = (await run(r, INSPECT, keys("n", "-")))[6]
    assert since and 0 <= held < 1000
    await release(r, "b")
    await shared(r, "p1", "p", limit=2)
    record = await r.hget("aiolock:sem:{n}:ht", "p1")
    assert record is not None and record.startswith(b"1|") and record.endswith(b"|")


async def test_revoke_marks_the_holder_and_hands_the_lock_on(r: Any) -> None:
    from aiolock.backends._redis_admin import REVOKE, SET_INFO

    await acquire(r, "a")
    await acquire(r, "b")
    assert await run(r, REVOKE, keys("n", "-"), "x", "0", 60_000) == 1
    assert await r.hget("aiolock:lock:{n}", "owner") == b"b"  # handed to the waiter
    assert await r.get("aiolock:lock:{n}:seq") == b"2"  # the counter only moved for b
    k = ["aiolock:lock:{n}", "aiolock:lock:{n}"]
    assert await r.eval(RENEW.source, 2, *k, "h", "a", 5000) == [-1]  # a: revoked
    assert await release(r, "a") == 0  # its late release frees nothing
    assert await run(r, SET_INFO, keys("n", "b"), "b", "new", "h") == 1
    assert await run(r, SET_INFO, keys("n", "a"), "a", "zombie", "h") == 0
    assert await r.hget("aiolock:lock:{n}", "info") == b"new"
    await shared(r, "p1", "p", limit=2)
    await shared(r, "p2", "p", limit=2)
    assert await run(r, REVOKE, shared_keys("-", "sem"), "sem", "0", 60_000) == 2
    ks = ["aiolock:sem:{n}:h", "aiolock:sem:{n}:ht"]
    assert await r.eval(RENEW.source, 2, *ks, "z", "p1", 5000) == [-1]
    assert await run(r, REVOKE, shared_keys("-", "sem"), "sem", "0", 60_000) == 0


async def test_trusted_publish_counts_skip_a_waiter_nobody_hears(r: Any) -> None:
    """ARGV[9] = "1" (plain Redis): the entry carries the registration and the PUBLISH's
    count tells whether the waiter's process still listens -- no read of its waiter key.
    A waiter whose inbox nobody hears (a dead process) is skipped; if nobody is left, the
    lock is freed (not left to a dead waiter)."""
    pubsub = r.pubsub()
    await pubsub.subscribe("inbox-live")
    await acquire(r, "a")
    await acquire(r, "dead")  # registered, but its process (inbox) is gone
    await acquire(r, "live")
    reply = await run(r, RELEASE, keys("n", "a"), "a", "chan", "0", 0, "", 0, "", "0", "1")
    assert reply[:2] == [1, b"live"]
    assert await r.hget("aiolock:lock:{n}", "owner") == b"live"
    assert await queued(r) == []
    await acquire(r, "dead2")
    reply = await run(r, RELEASE, keys("n", "live"), "live", "chan", "0", 0, "", 0, "", "0", "1")
    assert reply[:2] == [1, b""]  # handed to nobody: free
    assert not await r.exists("aiolock:lock:{n}")
    await pubsub.aclose()


async def test_an_entry_of_the_owner_alone_is_still_handed_over(r: Any) -> None:
    """aiolock before this layout queued the owner alone: its registration is read from its
    waiter key, whether PUBLISH counts are trusted or not."""
    await acquire(r, "a")
    await acquire(r, "b")
    await r.delete("aiolock:lock:{n}:q")
    await r.rpush("aiolock:lock:{n}:q", "b")  # as an older aiolock queued it
    assert (await release_reply(r, "a"))[:2] == [1, b"b"]


async def test_abandon_removes_its_entry_even_if_its_waiter_key_lapsed(r: Any) -> None:
    await acquire(r, "a")
    await acquire(r, "b")
    await acquire(r, "c")
    await r.delete("aiolock:lock:{n}:x:b")  # b's registration lapsed (a stalled process)
    await run(r, RELEASE, keys("n", "b"), "b", "chan", "1", 60_000, "", 0, "", "0", "1",
              10_000, "inbox-b", "")
    assert await queued(r) == ["c"]


async def test_only_the_first_waiter_watches_the_holders_lease(r: Any) -> None:
    """The first registered waiter retries when the holder's lease ends (should the holder
    die); the others within a third of their waiter ttl (a release hands it on in order)."""
    await acquire(r, "a", ttl=1_000)
    first = await acquire(r, "b", ttl=30_000)
    second = await acquire(r, "c", ttl=30_000)
    assert first[0] == 0 and 900 < first[1] <= 1_000
    assert second[0] == 0 and second[1] == 10_000


async def test_a_refresh_keeps_one_entry_per_waiter(r: Any) -> None:
    await acquire(r, "a")
    await acquire(r, "b")
    await acquire(r, "c")
    await acquire(r, "b")  # the same registration: it keeps its place
    assert await queued(r) == ["b", "c"]
    await acquire(r, "b", ttl=20_000)  # registered otherwise: one entry, the new one
    entries = await r.lrange("aiolock:lock:{n}:q", 0, -1)
    assert [e.decode() for e in entries] == ["c|10000|7|inbox-c", "b|20000|7|inbox-b"]
