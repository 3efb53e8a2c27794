"""SPEC §4: bad input gets a ValueError saying what is accepted. (Unreachable servers:
one contract test over every backend, in test_contract.py.)"""

from __future__ import annotations

import math

import pytest

import aiolock
from aiolock.backends.redis import redis_key_part


def test_exception_hierarchy() -> None:
    assert issubclass(aiolock.LockTimeout, aiolock.LockError)
    assert issubclass(aiolock.LockTimeout, TimeoutError)
    assert issubclass(aiolock.LockLost, aiolock.LockError)
    assert issubclass(aiolock.BackendUnavailable, aiolock.LockError)
    assert issubclass(aiolock.BackendUnavailable, ConnectionError)


@pytest.mark.parametrize(
    ("bad", "says"),
    [("", "1 to 512"), ("x" * 513, "1 to 512"), (None, "str"), (42, "str"), (b"x", "str")],
)
async def test_bad_names(locks: aiolock.Locks, bad: object, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        locks.lock(bad)  # type: ignore[arg-type]


async def test_longest_and_odd_names_work(locks: aiolock.Locks) -> None:
    for name in ("x" * 512, "{a}", "}{", "%7B", "a b\nc", "ünï/cødé", "}"):
        async with locks.lock(name) as lease:
            assert lease.name == name
            assert await locks.lock(name).locked()
        assert not await locks.lock(name).locked()


@pytest.mark.parametrize("ttl", [0, -1, math.nan, math.inf, "5", None, True])
async def test_bad_ttl(locks: aiolock.Locks, ttl: object) -> None:
    with pytest.raises(ValueError, match="ttl must be a number of seconds"):
        locks.lock("x", ttl=ttl)  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout", [-1, math.nan, "1", True])
async def test_bad_timeout(locks: aiolock.Locks, timeout: object) -> None:
    with pytest.raises(ValueError, match="timeout must be"):
        locks.lock("x", timeout=timeout)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout must be"):
        await locks.lock("x").acquire(timeout=timeout)  # type: ignore[arg-type]


async def test_bad_on_lost(locks: aiolock.Locks) -> None:
    with pytest.raises(ValueError, match="'cancel', 'raise' or a callable"):
        locks.lock("x", on_lost="ignore")


async def test_bad_extend(locks: aiolock.Locks) -> None:
    lease = await locks.lock("ext").acquire()
    with pytest.raises(ValueError, match="ttl must be"):
        await lease.extend(0)
    await lease.release()


async def test_bad_semaphore_limit(locks: aiolock.Locks) -> None:
    if aiolock.Capability.SEMAPHORE not in locks.capabilities:
        pytest.skip("no semaphores")
    for limit in (0, -1, 1.5, "3", True):
        with pytest.raises(ValueError, match="limit must be an int >= 1"):
            locks.semaphore("s", limit=limit)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("nosuch://x", "supported schemes: memory://, redis://"),
        ("localhost:6379", "expected a URL"),
        ("", "expected a URL"),
        ("redis://localhost:notaport/0", "port"),
        ("redis:///0", "host"),
        ("redis://localhost:6379/abc", "database"),
    ],
)
def test_bad_urls(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        aiolock.connect(url)


def test_bad_connect_target() -> None:
    with pytest.raises(ValueError, match="URL"):
        aiolock.connect(42)


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="connect_timeout"):
        aiolock.connect("redis://localhost:6379/0", connect_timeout=0)
    with pytest.raises(ValueError, match="memory:// takes no options"):
        aiolock.connect("memory://", connect_timeout=1)
    with pytest.raises(ValueError, match="prefix"):
        aiolock.connect("redis://localhost:6379/0", prefix="{x}")


async def test_unsupported_feature_is_a_clear_value_error() -> None:
    from aiolock.backends.memory import MemoryBackend

    class Plain(MemoryBackend):
        capabilities = frozenset()

    async with aiolock.connect(Plain("plain")) as locks:
        with pytest.raises(ValueError, match="rwlock\\(\\) is not supported"):
            locks.rwlock("x")
        with pytest.raises(ValueError, match="semaphore\\(\\) is not supported"):
            locks.semaphore("x", limit=2)
        with pytest.raises(ValueError, match="fair=True is not supported"):
            locks.lock("x", fair=True)


def test_redis_names_are_escaped_into_one_hash_tag() -> None:
    for name in ("a", "{a}", "a}b", "}", "%7D", "x{y}z"):
        part = redis_key_part(name)
        assert "{" not in part and "}" not in part
    assert redis_key_part("{") != redis_key_part("%7B")


def test_import_needs_no_backend_library() -> None:
    import subprocess
    import sys

    code = ("import sys, aiolock; assert 'redis' not in sys.modules, sorted(sys.modules);"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("url", ["redis//user:s3cret-pw@host/0", "redis:/user:s3cret-pw@host"])
def test_almost_a_url_never_shows_its_password(url: str) -> None:
    with pytest.raises(ValueError, match="expected a URL") as refused:
        aiolock.connect(url)
    assert "s3cret-pw" not in str(refused.value)
    assert "user:***@host" in str(refused.value)


def test_broken_aiolock_module_is_not_reported_as_a_missing_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib

    def broken(name: str) -> None:
        raise ImportError("cannot import name 'x' from 'aiolock._validate'", name="aiolock._validate")

    monkeypatch.setattr(importlib, "import_module", broken)
    with pytest.raises(ImportError) as raised:
        aiolock.connect("redis://127.0.0.1:1/0")
    assert "pip install" not in str(raised.value)


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:1/0", "zookeeper://127.0.0.1:1/x", "postgresql://u@127.0.0.1:1/d",
    "memcached://127.0.0.1:1", "redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3",
    "mysql://u@127.0.0.1:1/d", "redis+cluster://127.0.0.1:1", "redis+sentinel://127.0.0.1:1/s",
    "etcd://127.0.0.1:1",
])
@pytest.mark.parametrize("option", ["connect_timeout", "request_timeout"])
@pytest.mark.parametrize("where", ["query", "keyword"])
def test_infinite_timeout_refused_everywhere(url: str, option: str, where: str) -> None:
    """'Bounded time' stays bounded: inf (or nan) is a ValueError, on every backend."""
    with pytest.raises(ValueError, match=option):
        if where == "query":
            aiolock.connect(f"{url}?{option}=inf")
        else:
            aiolock.connect(url, **{option: math.inf})
