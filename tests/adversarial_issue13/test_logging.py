"""Logging (one tree ``aiolock.*``; a loss is a WARNING with its reason; per-request
detail at DEBUG only) and secrets (no password in a log line, an error or a span)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import traceback
import uuid
from collections.abc import Iterator

import pytest

import aiolock

from ..servers import RedisServer, free_port
from .conftest import ROOT, SECRET, Telemetry

PKG = str(ROOT / "aiolock")


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def ours(self) -> list[logging.LogRecord]:
        """Records logged by aiolock's code or to its loggers."""
        return [r for r in self.records
                if r.pathname.startswith(PKG) or r.name == "aiolock" or r.name.startswith("aiolock.")]

    def text(self) -> str:
        out = []
        for r in self.records:
            out.append(f"{r.name} {r.levelname} {r.getMessage()}")
            if r.exc_info:
                out.append("".join(traceback.format_exception(*r.exc_info)))
        return "\n".join(out)


@contextlib.contextmanager
def capture(level: int = logging.DEBUG) -> Iterator[Capture]:
    handler = Capture()
    root = logging.getLogger()
    old_root, old_pkg = root.level, logging.getLogger("aiolock").level
    root.addHandler(handler)
    root.setLevel(level)
    logging.getLogger("aiolock").setLevel(logging.NOTSET)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(old_root)
        logging.getLogger("aiolock").setLevel(old_pkg)



def fresh() -> str:
    return f"adv13-{uuid.uuid4().hex}"


async def busy_work(locks: aiolock.Locks) -> None:
    """Cycles, contention, a timeout, other kinds."""
    name = fresh()
    for _ in range(3):
        async with locks.lock(name, ttl=0.6):
            await asyncio.sleep(0.01)
    async with locks.lock(name, ttl=0.6):
        waiter = asyncio.create_task(locks.lock(name).acquire(timeout=0.25))
        with pytest.raises(aiolock.LockTimeout):
            await waiter
        await asyncio.sleep(0.3)  # a few renewals
    async with locks.rwlock(fresh()).read():
        pass
    async with locks.semaphore(fresh(), limit=2):
        pass


async def test_one_logger_tree(locks: aiolock.Locks) -> None:
    """Everything aiolock's code logs goes to ``aiolock`` or a logger under it."""
    with capture() as cap:
        await busy_work(locks)
        lease = await locks.lock(fresh(), ttl=0.3, watchdog=False, on_lost="raise").acquire()
        await asyncio.wait_for(lease.wait_lost(), 3)
        await lease.release()
    ours = cap.ours()
    assert ours, "nothing logged at DEBUG at all"
    stray = {r.name for r in ours if not (r.name == "aiolock" or r.name.startswith("aiolock."))}
    assert not stray, f"aiolock code logs to loggers outside aiolock.*: {stray}"


async def test_requests_quiet_above_debug(locks: aiolock.Locks) -> None:
    """At INFO, ordinary cycles, waits, timeouts and renewals log nothing; at DEBUG the
    grants and releases are there."""
    with capture(logging.INFO) as cap:
        await busy_work(locks)
    noisy = [f"{r.name} {r.levelname} {r.getMessage()}" for r in cap.ours() if r.levelno >= logging.INFO]
    assert not noisy, noisy
    with capture(logging.DEBUG) as cap:
        async with locks.lock(fresh(), ttl=5):
            pass
    assert any(r.levelno == logging.DEBUG for r in cap.ours())


@pytest.mark.parametrize("how", ["revoked", "expired"])
async def test_loss_is_one_warning_with_reason(locks: aiolock.Locks, how: str) -> None:
    name = fresh()
    with capture() as cap:
        if how == "revoked":
            with pytest.raises(aiolock.LockLost):
                async with locks.lock(name, ttl=0.6) as lease:
                    assert await locks.lock(name).force_release()
                    await lease.wait_lost()
                    await asyncio.sleep(1)
        else:
            lease = await locks.lock(name, ttl=0.2, watchdog=False, on_lost="raise").acquire()
            await asyncio.wait_for(lease.wait_lost(), 3)
            await lease.release()
    warnings = [r for r in cap.ours() if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    msg = warnings[0].getMessage()
    assert {"revoked": "revoked", "expired": "expir"}[how] in msg, msg
    assert name in msg, msg
    assert warnings[0].name.startswith("aiolock."), warnings[0].name
    assert not [r for r in cap.ours() if r.levelno > logging.WARNING]


# ------------------------------------------------------------------ secrets


def no_secret(where: str, text: str, secret: str = SECRET) -> None:
    assert secret not in text, f"the password shows in {where}: {text[:2000]}"


def exc_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc)) + repr(exc) + str(exc)


async def test_password_url_used_normally(pw_url: str, telemetry: Telemetry) -> None:
    """A working URL with a password: at DEBUG, no log line, span or metric carries it."""
    with capture() as cap:
        async with aiolock.connect(pw_url) as locks:
            await busy_work(locks)
            name = fresh()
            with pytest.raises(aiolock.LockLost) as lost:
                async with locks.lock(name, ttl=0.6) as lease:
                    assert await locks.lock(name).force_release()
                    await lease.wait_lost()
                    await asyncio.sleep(1)
    no_secret("LockLost", exc_text(lost.value))
    no_secret("a log line", cap.text())
    for span in telemetry.spans():
        no_secret("a span", repr(dict(span.attributes)) + span.name)
    for p in telemetry.collect().points:
        no_secret("a metric", repr(p.attrs))


async def test_wrong_password_error(pw_redis: RedisServer) -> None:
    wrong = "Wr0ng-Adv13-passw0rd"
    url = f"redis://:{wrong}@127.0.0.1:{pw_redis.port}/0"
    with capture() as cap, pytest.raises(aiolock.LockError) as info:
        async with aiolock.connect(url) as locks, locks.lock(fresh()):
            pass
    no_secret("the error", exc_text(info.value), wrong)
    no_secret("a log line", cap.text(), wrong)


def unreachable_urls() -> list[tuple[str, str]]:
    p, q, r = free_port(), free_port(), free_port()
    s = SECRET
    return [
        ("redis", f"redis://:{s}@127.0.0.1:{p}/0"),
        ("redis-user", f"redis://someone:{s}@127.0.0.1:{p}/0"),
        ("rediss", f"rediss://someone:{s}@127.0.0.1:{p}/0"),
        ("redis-query", f"redis://127.0.0.1:{p}/0?password={s}"),
        ("sentinel", f"redis+sentinel://:{s}@127.0.0.1:{p},127.0.0.1:{q}/mymaster"),
        ("cluster", f"redis+cluster://:{s}@127.0.0.1:{p},127.0.0.1:{q}"),
        ("redlock", f"redlock://:{s}@127.0.0.1:{p},127.0.0.1:{q},127.0.0.1:{r}"),
        ("postgresql", f"postgresql://someone:{s}@127.0.0.1:{p}/db"),
        ("mysql", f"mysql://someone:{s}@127.0.0.1:{p}/db"),
        ("mariadb", f"mariadb://someone:{s}@127.0.0.1:{p}/db"),
        ("etcd", f"etcd://someone:{s}@127.0.0.1:{p}"),
        ("zookeeper", f"zookeeper://someone:{s}@127.0.0.1:{p}/chroot"),
        ("memcached", f"memcached://someone:{s}@127.0.0.1:{p}"),
        ("bad-scheme", f"nosuch://someone:{s}@127.0.0.1:{p}"),
        ("bad-port", f"redis://someone:{s}@127.0.0.1:notaport/0"),
        ("bad-query", f"redis://someone:{s}@127.0.0.1:{p}/0?bogus_option=1"),
    ]


_URLS = unreachable_urls()


@pytest.mark.parametrize("url", [u for _, u in _URLS], ids=[i for i, _ in _URLS])
async def test_no_password_in_errors_or_logs(url: str) -> None:
    """An unreachable or malformed URL with a password: whatever is raised (ValueError,
    BackendUnavailable, ...) and whatever is logged never shows the password."""
    raised: BaseException | None = None
    with capture() as cap:
        try:
            async with (asyncio.timeout(25), aiolock.connect(url, connect_timeout=1.0) as locks,
                        locks.lock(fresh(), timeout=2)):
                pass
        except TimeoutError as exc:
            if isinstance(exc, aiolock.LockError):
                raised = exc
            else:
                raise AssertionError("hung past 25 s") from exc
        except Exception as exc:
            raised = exc
    assert raised is not None, "an unreachable server was not reported"
    assert isinstance(raised, ValueError | aiolock.LockError), repr(raised)
    no_secret("the error", exc_text(raised))
    no_secret("a log line", cap.text())
