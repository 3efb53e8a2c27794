"""Logging: one tree ``aiolock.*``; a lost lease is a WARNING with its reason, a retry INFO,
per-request detail DEBUG; and no password or claim owner id (the secret that releases a
lease) in any log line (of any library, at DEBUG), error message, ``locks.url`` or repr --
on real servers: a Redis with ``requirepass``, the test PostgreSQL, and closed ports.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterator, Sequence
from urllib.parse import quote

import pytest

import aiolock
from aiolock.backends.memory import MemoryBackend
from aiolock.cli import main as cli_main

from .pg_server import PostgresServer
from .servers import RedisServer, free_port

PASSWORD = "pw-Secret/7f3a:@x"  # characters that need quoting in a URL
QUOTED = quote(PASSWORD, safe="")


def _name() -> str:
    return f"log-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def records() -> Iterator[list[logging.LogRecord]]:
    """Every log record of every logger, at DEBUG, while the test runs."""
    got: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record)

    root = logging.getLogger()
    handler = Keep(logging.DEBUG)
    old = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield got
    finally:
        root.removeHandler(handler)
        root.setLevel(old)


def _text(records: Sequence[logging.LogRecord]) -> str:
    out = []
    for r in records:
        out.append(f"{r.name} {r.levelname} {r.getMessage()}")
        if r.exc_info and r.exc_info[1] is not None:
            out.append(repr(r.exc_info[1]))
    return "\n".join(out)


def _assert_no_secret(text: str, *secrets: str) -> None:
    for secret in (PASSWORD, QUOTED, *secrets):
        assert secret not in text, f"{secret!r} leaked into: {text[:2000]}"


def _ours(records: Sequence[logging.LogRecord]) -> list[logging.LogRecord]:
    return [r for r in records if r.name == "aiolock" or r.name.startswith("aiolock.")]


# -- levels ------------------------------------------------------------------------------


class FlakyMemory(MemoryBackend):
    """memory://, whose renewals fail while ``down`` is set."""

    down = False

    async def renew(self, claims: Sequence[aiolock.abc.Claim]) -> list[int | None]:
        if self.down:
            raise aiolock.BackendUnavailable("cannot reach the test server (down)")
        return await super().renew(claims)


async def test_levels_debug_detail_info_retry_warning_loss(records: list[logging.LogRecord]) -> None:
    backend = FlakyMemory(f"log-{uuid.uuid4().hex}")
    name = _name()
    async with aiolock.connect(backend) as locks:
        async with locks.lock(name, ttl=0.3):
            await asyncio.sleep(0.15)  # one renewal at ~0.1 s
        lease = await locks.lock(name, ttl=0.3).acquire()
        backend.down = True
        await asyncio.wait_for(lease.wait_lost(), 2)
        assert lease.lost
    ours = _ours(records)
    assert ours and all(r.name.startswith("aiolock.") for r in ours), {r.name for r in ours}
    debug = [r for r in ours if r.levelno == logging.DEBUG]
    assert any(r.name == "aiolock.lease" and "acquired" in r.getMessage() and name in r.getMessage()
               for r in debug)
    assert any(r.name == "aiolock.lease" and "released" in r.getMessage() for r in debug)
    assert any(r.name == "aiolock.watchdog" and "renewed 1 lease" in r.getMessage() for r in debug)
    retries = [r for r in ours if "renewal of" in r.getMessage()]
    assert retries and all(r.levelno == logging.INFO and r.name == "aiolock.watchdog" for r in retries)
    assert "retrying" in retries[0].getMessage() and "down" in retries[0].getMessage()
    (lost,) = [r for r in ours if r.levelno >= logging.WARNING]
    assert lost.levelno == logging.WARNING and lost.name == "aiolock.lease"
    assert name in lost.getMessage() and "expiry passed without a renewal" in lost.getMessage()


async def test_revoked_lease_warning_names_the_reason(records: list[logging.LogRecord]) -> None:
    name = _name()
    async with aiolock.connect(f"memory://log-{uuid.uuid4().hex}") as locks:
        lease = await locks.lock(name, ttl=0.3).acquire()
        await locks.lock(name).force_release()
        await asyncio.wait_for(lease.wait_lost(), 2)
    warnings = [r for r in _ours(records) if r.levelno >= logging.WARNING]
    assert [(r.levelname, r.name) for r in warnings] == [("WARNING", "aiolock.lease")]
    assert "revoked by an operator" in warnings[0].getMessage()


# -- secrets -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def password_redis() -> Iterator[RedisServer]:
    server = RedisServer(args=["--requirepass", PASSWORD]).start()
    yield server
    server.close()


async def _exercise(url: str, **options: object) -> list[str]:
    """Hold, renew, wait behind, time out, inspect and release on ``url``; everything it
    shows (reprs, urls, error messages) and every claim owner id it used."""
    shown: list[str] = []
    owners: list[str] = []
    name = _name()
    async with aiolock.connect(url, **options) as locks:
        shown += [locks.url, repr(locks), str(locks)]
        lock = locks.lock(name, ttl=0.6, data="data")
        async with lock as lease:
            owners.append(lease._hold.claim.owner)
            shown += [repr(lease), repr(lock), str(lease.holder)]
            await asyncio.sleep(0.3)  # a renewal
            try:
                await asyncio.ensure_future(locks.lock(name).acquire(timeout=0.1))
            except aiolock.LockTimeout as exc:
                shown.append(str(exc))
            shown.append(repr(await locks.status(name)))
        lost = await locks.lock(name, ttl=0.3, watchdog=False).acquire()
        owners.append(lost._hold.claim.owner)
        await lost.wait_lost()
        try:
            await lost.extend()
        except aiolock.LockError as exc:
            shown.append(str(exc))
    return shown + [f"owner:{o}" for o in owners]


def _check(shown: list[str], records: list[logging.LogRecord]) -> None:
    owners = [s.removeprefix("owner:") for s in shown if s.startswith("owner:")]
    text = "\n".join(s for s in shown if not s.startswith("owner:")) + "\n" + _text(records)
    _assert_no_secret(text, *owners)
    assert any(r.levelno == logging.WARNING and r.name == "aiolock.lease" for r in records)


async def test_redis_password_never_shown(password_redis: RedisServer,
                                          records: list[logging.LogRecord]) -> None:
    pytest.importorskip("redis")
    url = f"redis://:{QUOTED}@127.0.0.1:{password_redis.port}/0"
    shown = await _exercise(url, connect_timeout=2)
    _check(shown, records)
    assert "***" in shown[0] or PASSWORD not in shown[0]


@pytest.mark.parametrize("userinfo", [f":{QUOTED}@", f"app:{QUOTED}@"])
async def test_redis_refused_or_unreachable_errors_hide_the_password(
    password_redis: RedisServer, records: list[logging.LogRecord], userinfo: str,
) -> None:
    pytest.importorskip("redis")
    shown = []
    wrong = userinfo.replace(QUOTED, QUOTED + "-wrong")
    for url in (f"redis://{wrong}127.0.0.1:{password_redis.port}/0",
                f"redis://{userinfo}127.0.0.1:{free_port()}/0"):
        locks = aiolock.connect(url, connect_timeout=1)
        shown += [locks.url, repr(locks)]
        with pytest.raises((aiolock.AccessDenied, aiolock.BackendUnavailable)) as info:
            await locks.lock(_name()).acquire(timeout=2)
        shown += [str(info.value), repr(info.value), str(info.value.__cause__ or "")]
        await locks.aclose()
    _assert_no_secret("\n".join(shown) + "\n" + _text(records))


@pytest.fixture(scope="module")
def pg() -> Iterator[PostgresServer]:
    pytest.importorskip("asyncpg")
    server = PostgresServer().start()
    yield server
    server.close()


async def test_postgres_password_never_shown(pg: PostgresServer, records: list[logging.LogRecord]) -> None:
    # the test server trusts loopback: the password is accepted and ignored
    url = f"postgresql://{pg.user}:{QUOTED}@127.0.0.1:{pg.port}/{pg.database}"
    shown = await _exercise(url)
    _check(shown, records)


async def test_postgres_unreachable_error_hides_the_password(records: list[logging.LogRecord]) -> None:
    pytest.importorskip("asyncpg")
    locks = aiolock.connect(f"postgresql://app:{QUOTED}@127.0.0.1:{free_port()}/db", connect_timeout=1)
    shown = [locks.url, repr(locks)]
    with pytest.raises(aiolock.BackendUnavailable) as info:
        await locks.lock(_name()).acquire(timeout=2)
    shown += [str(info.value), repr(info.value), str(info.value.__cause__ or "")]
    await locks.aclose()
    _assert_no_secret("\n".join(shown) + "\n" + _text(records))


@pytest.mark.parametrize("scheme", ["redis", "postgresql"])
def test_cli_errors_hide_the_password(scheme: str, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"{scheme}://app:{QUOTED}@127.0.0.1:{free_port()}/0"
    for argv in (["status", "--url", url, "x"], ["ls", "--url", url], ["revoke", "--url", url, "x"],
                 ["run", "--url", url, "--timeout", "1", "x", "--", "true"]):
        code = cli_main(argv)
        out, err = capsys.readouterr()
        assert code in (2, 69, 70), (argv, code, err)
        _assert_no_secret(out + err)
