"""Refused credentials and permissions (issue 9 #3, SPEC §4): an aiolock.AccessDenied
(a LockError and a PermissionError) saying what to fix, never a private exception, and
never the password; the CLI prints one line and exits with a documented code."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

import aiolock

from .conftest import SECRET
from .servers import PasswordRedis

WRONG = "WrOnG-pAsSwOrD-42"
CLI = [sys.executable, "-m", "aiolock"]


def _chain(exc: BaseException) -> str:
    """The text of an exception and everything chained to it."""
    parts: list[str] = []
    seen: BaseException | None = exc
    while seen is not None and len(parts) < 10:
        parts.append(f"{type(seen).__name__}: {seen} {seen!r}")
        seen = seen.__cause__ or seen.__context__
    return "\n".join(parts)


async def _denied(url: str, **options: object) -> aiolock.AccessDenied:
    async with asyncio.timeout(15):
        with pytest.raises(aiolock.LockError) as info:
            async with aiolock.connect(url, connect_timeout=3, request_timeout=3,
                                       **options) as locks:
                lease = await locks.lock(f"c-{uuid.uuid4().hex}").acquire(timeout=1)
                await lease.release()
    exc = info.value
    assert isinstance(exc, aiolock.AccessDenied), f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    assert isinstance(exc, PermissionError)
    return exc


def _no_secret(text: str) -> None:
    assert SECRET not in text and WRONG not in text, f"secret in: {text}"


async def test_requirepass_without_password(password_redis: PasswordRedis,
                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    exc = await _denied(password_redis.url)
    assert "password" in str(exc).lower() or "auth" in str(exc).lower(), str(exc)
    _no_secret(caplog.text)


@pytest.mark.parametrize("how", ["url", "keyword"])
async def test_wrong_password_never_shown(password_redis: PasswordRedis, how: str,
                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    if how == "url":
        exc = await _denied(f"redis://:{WRONG}@127.0.0.1:{password_redis.port}/0")
    else:
        exc = await _denied(password_redis.url, password=WRONG)
    _no_secret(_chain(exc))
    _no_secret(caplog.text)


@pytest.mark.parametrize("how", ["url", "keyword", "query"])
async def test_right_password_works(password_redis: PasswordRedis, how: str) -> None:
    url, opts = {
        "url": (f"redis://:{SECRET}@127.0.0.1:{password_redis.port}/0", {}),
        "keyword": (password_redis.url, {"password": SECRET}),
        "query": (f"{password_redis.url}?password={SECRET}", {}),
    }[how]
    if how != "url":  # SPEC §1: honoured, or refused with a ValueError naming it
        try:
            aiolock.connect(url, **opts)
        except ValueError as exc:
            assert "password" in str(exc)
            _no_secret(str(exc))
            return
    async with aiolock.connect(url, **opts) as locks:
        name = f"c-{uuid.uuid4().hex}"
        lease = await locks.lock(name, ttl=5).acquire()
        waiter = asyncio.create_task(locks.lock(name, ttl=5).acquire())
        await asyncio.sleep(0.2)
        await lease.release()
        async with asyncio.timeout(3):  # woken by pub/sub, which needs the password too
            await (await waiter).release()


async def test_unreachable_url_with_password_not_shown(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with asyncio.timeout(15):
        for url in (f"redis://user:{SECRET}@127.0.0.1:1/0",
                    f"zookeeper://alice:{SECRET}@127.0.0.1:1/x"):
            with pytest.raises(aiolock.BackendUnavailable) as info:
                async with aiolock.connect(url, connect_timeout=1):
                    pass
            _no_secret(_chain(info.value))
    _no_secret(caplog.text)


@pytest.mark.parametrize("url", [
    f"zookeeper://alice:{SECRET}@127.0.0.1:1/x?bogus=1",
    f"redis://u:{SECRET}@127.0.0.1:notaport/0",
    f"redis://u:{SECRET}@127.0.0.1:1/0?bogus=1",
    f"redis+cluster://u:{SECRET}@127.0.0.1:1?bogus=1",
    f"redlock://u:{SECRET}@127.0.0.1:1?bogus=1",
    f"redlock://u:{SECRET}@127.0.0.1:1,127.0.0.1:2,127.0.0.1:3?bogus=1",
    f"memcached://u:{SECRET}@127.0.0.1:1?bogus=1",
    f"postgresql://u:{SECRET}@127.0.0.1:1/db?bogus=1",
    f"redis+nope://u:{SECRET}@127.0.0.1:1/0",
])
async def test_refused_url_never_echoes_password(url: str) -> None:
    """A URL refused for any reason: the error may show the URL, never its password."""
    async with asyncio.timeout(15):
        with pytest.raises((ValueError, aiolock.LockError)) as info:
            async with aiolock.connect(url, connect_timeout=1):
                pass
    _no_secret(_chain(info.value))


async def test_subscription_refused_surfaces_to_waiter(acl_redis: PasswordRedis) -> None:
    """A user who may not SUBSCRIBE: the waiting acquire gets an error (AccessDenied)
    soon, instead of silently degrading to ttl-bounded retries (issue 9 #2)."""
    name = f"c-{uuid.uuid4().hex}"
    async with aiolock.connect(acl_redis.url) as owner:
        holder = await owner.lock(name, ttl=20).acquire()
        url = f"redis://nochannels:{SECRET}@127.0.0.1:{acl_redis.port}/0"
        async with aiolock.connect(url, connect_timeout=2, request_timeout=2) as locks:
            with pytest.raises(aiolock.AccessDenied):
                async with asyncio.timeout(3):
                    await locks.lock(name, ttl=20).acquire()
        await holder.release()


@pytest.mark.parametrize("url", [f"redis://user:{SECRET}@127.0.0.1:1/0",
                                 f"redis://:{SECRET}@127.0.0.1:1/0?db=1",
                                 f"redis://127.0.0.1:1/0?password={SECRET}",
                                 f"redlock://:{SECRET}@127.0.0.1:1,127.0.0.1:2,127.0.0.1:3",
                                 f"postgresql://u:{SECRET}@127.0.0.1:1/db",
                                 f"redis+sentinel://:{SECRET}@127.0.0.1:1/m",
                                 f"zookeeper://alice:{SECRET}@127.0.0.1:1/x"])
async def test_locks_url_hides_password(url: str) -> None:
    """README: no password appears in an error, a log line or ``locks.url``."""
    locks = aiolock.connect(url, connect_timeout=1)
    try:
        _no_secret(str(locks.url))
        _no_secret(repr(locks))
    finally:
        await locks.aclose()


async def test_lazy_connection_denied_on_first_use(password_redis: PasswordRedis) -> None:
    locks = aiolock.connect(password_redis.url, connect_timeout=2, request_timeout=2)
    try:
        async with asyncio.timeout(15):
            with pytest.raises(aiolock.AccessDenied):
                await locks.lock(f"c-{uuid.uuid4().hex}").acquire(timeout=0)
            with pytest.raises(aiolock.AccessDenied):
                await locks.status(f"c-{uuid.uuid4().hex}")
    finally:
        async with asyncio.timeout(10):
            await locks.aclose()


async def test_acl_user_without_any_permission(acl_redis: PasswordRedis) -> None:
    exc = await _denied(f"redis://nothing:{SECRET}@127.0.0.1:{acl_redis.port}/0")
    _no_secret(_chain(exc))
    text = str(exc).lower()
    assert "nothing" in text or "permission" in text or "acl" in text or "noperm" in text, text


async def test_acl_user_without_scripting_falls_back(acl_redis: PasswordRedis) -> None:
    """SPEC §6: the server refusing EVALSHA (an ACL without @scripting) -> WATCH/MULTI."""
    url = f"redis://noscript:{SECRET}@127.0.0.1:{acl_redis.port}/0"
    async with asyncio.timeout(20), aiolock.connect(url) as locks:
        name = f"c-{uuid.uuid4().hex}"
        first = await locks.lock(name, ttl=5).acquire()
        with pytest.raises(aiolock.LockTimeout):  # another task (this one would deadlock)
            await asyncio.create_task(locks.lock(name, ttl=5).acquire(timeout=0))
        await first.release()
        second = await locks.lock(name, ttl=5).acquire(timeout=2)
        assert second.token > first.token
        await second.release()


# --- the command line ------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("AIOLOCK_URL", None)
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=60)


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    out = (done.stdout + done.stderr).strip()
    assert "Traceback" not in out, out
    assert len(out.splitlines()) == 1, out
    return out


def test_cli_status_denied_one_line(password_redis: PasswordRedis) -> None:
    url = f"redis://:{WRONG}@127.0.0.1:{password_redis.port}/0"
    done = _cli("status", "--url", url, "x")
    line = _one_line(done)
    assert done.returncode == 77, (done.returncode, line)  # EX_NOPERM
    _no_secret(line)


def test_cli_run_denied_one_line_child_not_run(password_redis: PasswordRedis, tmp_path) -> None:  # type: ignore[no-untyped-def]
    marker = tmp_path / "ran"
    done = _cli("run", "--url", password_redis.url, "x", "--", "touch", str(marker))
    _one_line(done)
    assert done.returncode == 77, done.returncode
    assert not marker.exists()


def test_cli_unreachable_one_line() -> None:
    done = _cli("status", "--url", f"redis://u:{SECRET}@127.0.0.1:1/0", "x")
    line = _one_line(done)
    assert done.returncode == 69, (done.returncode, line)
    _no_secret(line)


@pytest.mark.parametrize("url", ["redis+bogus://127.0.0.1:1/0", f"redis://u:{SECRET}@h:x/0",
                                 "redis://127.0.0.1:1/0?conect_timeout=1"])
def test_cli_bad_url_one_line(url: str) -> None:
    done = _cli("status", "--url", url, "x")
    line = _one_line(done)
    assert done.returncode == 2, (done.returncode, line)  # README: 2 = usage
    _no_secret(line)


def test_cli_bad_name_one_line() -> None:
    done = _cli("status", "--url", "memory://", "x" * 513)
    _one_line(done)
    assert done.returncode == 2, done.returncode


@pytest.fixture(scope="module")
def password_trio() -> Iterator[list[PasswordRedis]]:
    servers = [PasswordRedis(password=SECRET).start() for _ in range(3)]
    yield servers
    for s in servers:
        s.close()


@pytest.mark.parametrize("how", ["url", "keyword"])
async def test_redlock_with_password(password_trio: list[PasswordRedis], how: str) -> None:
    hosts = ",".join(f"127.0.0.1:{s.port}" for s in password_trio)
    url, opts = ((f"redlock://:{SECRET}@{hosts}", {}) if how == "url"
                 else (f"redlock://{hosts}", {"password": SECRET}))
    if opts:  # SPEC §1: honoured, or refused with a ValueError naming it
        try:
            aiolock.connect(url, **opts)
        except ValueError as exc:
            assert "password" in str(exc)
            return
    async with asyncio.timeout(20), aiolock.connect(url, connect_timeout=2,
                                                    request_timeout=2, **opts) as locks:
        lease = await locks.lock(f"c-{uuid.uuid4().hex}", ttl=5).acquire(timeout=2)
        await lease.release()


async def test_redlock_without_password_denied(password_trio: list[PasswordRedis]) -> None:
    hosts = ",".join(f"127.0.0.1:{s.port}" for s in password_trio)
    await _denied(f"redlock://{hosts}")


def test_cli_status_acl_user_without_permissions(acl_redis: PasswordRedis) -> None:
    done = _cli("status", "--url", f"redis://nothing:{SECRET}@127.0.0.1:{acl_redis.port}/0", "x")
    line = _one_line(done)
    assert done.returncode == 77, (done.returncode, line)
    _no_secret(line)


async def test_postgres_unknown_role_denied(request: pytest.FixtureRequest) -> None:
    pg = request.getfixturevalue("postgres_server")
    url = f"postgresql://nobody-{uuid.uuid4().hex[:6]}:{SECRET}@127.0.0.1:{pg.port}/{pg.database}"
    exc = await _denied(url)
    _no_secret(_chain(exc))


async def test_postgres_unknown_database(request: pytest.FixtureRequest) -> None:
    pg = request.getfixturevalue("postgres_server")
    url = f"postgresql://{pg.user}:{SECRET}@127.0.0.1:{pg.port}/nodb_{uuid.uuid4().hex[:6]}"
    async with asyncio.timeout(15):
        with pytest.raises(aiolock.LockError) as info:
            async with aiolock.connect(url, connect_timeout=3) as locks:
                await locks.lock("x").acquire(timeout=0)
    _no_secret(_chain(info.value))
    assert "nodb_" in str(info.value), str(info.value)


async def test_scripting_off_is_honoured() -> None:
    """SPEC §6: ``?scripting=off`` runs lock() as WATCH/MULTI/EXEC transactions: the
    server must see no script at all (an ignored option would go unnoticed otherwise)."""
    server = PasswordRedis().start()
    try:
        async with asyncio.timeout(20), aiolock.connect(f"{server.url}?scripting=off") as locks:
            name = f"s-{uuid.uuid4().hex}"
            first = await locks.lock(name, ttl=5).acquire()
            with pytest.raises(aiolock.LockTimeout):
                await asyncio.create_task(locks.lock(name, ttl=5).acquire(timeout=0))
            await first.release()
            second = await locks.lock(name, ttl=5).acquire(timeout=1)
            assert second.token > first.token
            await second.release()
        admin = redis.Redis(port=server.port, decode_responses=True)
        try:
            stats = admin.info("commandstats")
        finally:
            admin.close()
        scripts = {k: v for k, v in stats.items() if "eval" in k or "script" in k or "fcall" in k}
        assert not scripts, f"scripting=off still ran scripts: {scripts}"
    finally:
        server.close()


def _documented_acl_line() -> str:
    """The least-privilege Redis ACL line exactly as the README gives it."""
    readme = Path(__file__).resolve().parents[2] / "README.md"
    for line in readme.read_text().splitlines():
        if line.strip().startswith("user aiolock on >PASSWORD"):
            return line.strip().replace(">PASSWORD", f">{SECRET}", 1)
    raise AssertionError("README has no 'user aiolock on >PASSWORD ...' ACL line")


async def test_documented_least_privileges_run_every_primitive() -> None:
    """README "Least privileges": the documented Redis ACL line runs every primitive,
    with contention, wake-ups, fair queues, waiting writers, renewals and cancellation."""
    acl = _documented_acl_line().removeprefix("user ")
    server = PasswordRedis(users=["default on nopass ~* &* +@all", acl])
    server.start()
    url = f"redis://aiolock:{SECRET}@127.0.0.1:{server.port}/0"
    try:
        async with asyncio.timeout(40), aiolock.connect(url) as a, aiolock.connect(url) as b:
            n = uuid.uuid4().hex
            for fair in (False, True):
                first = await a.lock(f"{n}l{fair}", ttl=1, fair=fair).acquire()
                waiter = asyncio.create_task(b.lock(f"{n}l{fair}", ttl=1, fair=fair).acquire())
                await asyncio.sleep(0.1 if fair else 1.2)  # renewals ran
                assert not first.lost and not waiter.done()
                await first.extend(1)
                await first.release()
                second = await asyncio.wait_for(waiter, 2)
                await second.release()
                # a cancelled waiter and a failed one-try
                held = await a.lock(f"{n}l{fair}", ttl=1, fair=fair).acquire()
                task = asyncio.create_task(b.lock(f"{n}l{fair}", ttl=1, fair=fair).acquire())
                await asyncio.sleep(0.05)
                task.cancel()
                await asyncio.wait([task], timeout=5)
                with pytest.raises(aiolock.LockTimeout):
                    await b.lock(f"{n}l{fair}", ttl=1, fair=fair).acquire(timeout=0)
                await held.release()
                info = await b.status(f"{n}l{fair}")
                assert not info.held
            reader = await a.rwlock(n + "rw", ttl=1).read().acquire()
            writer = asyncio.create_task(b.rwlock(n + "rw", ttl=1).write().acquire())
            await asyncio.sleep(0.1)
            with pytest.raises(aiolock.LockTimeout):  # queued behind the waiting writer
                await b.rwlock(n + "rw", ttl=1).read().acquire(timeout=0.1)
            await reader.release()
            await (await asyncio.wait_for(writer, 2)).release()
            for fair in (False, True):
                sem = b.semaphore(f"{n}s{fair}", limit=2, ttl=1, fair=fair)
                p1, p2 = await sem.acquire(), await sem.acquire()
                third = asyncio.create_task(a.semaphore(f"{n}s{fair}", limit=2, ttl=1,
                                                        fair=fair).acquire())
                await asyncio.sleep(0.1)
                assert not third.done() and not p1.lost
                await p1.release()
                await (await asyncio.wait_for(third, 2)).release()
                await p2.release()
    finally:
        server.close()
