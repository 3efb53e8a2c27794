"""Fixtures of the Redlock adversarial tests, written from README.md, SPEC.md,
docs/redlock.md and docs/backends/index.md only.

Every test gets fresh redis-servers of its own on free loopback ports (never 6379), and
may put a node behind a TCP proxy (``tests/faults/proxy.py``) to make it slow. Nodes are
read directly with redis-py, on the key layout that ``tests/test_redlock.py`` reads
(``aiolock:lock:{name}``: a hash with ``owner`` and ``token``; ``...:seq``: the counter).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
import redis.asyncio as aioredis

import aiolock

from ..faults.proxy import Proxy
from ..servers import RedisServer

#: short timeouts: a dead or stopped node is given up on quickly
FAST = "connect_timeout=1&request_timeout=1"


def make_servers(count: int) -> Iterator[list[RedisServer]]:
    started: list[RedisServer] = []
    try:
        for _ in range(count):
            started.append(RedisServer().start())
        yield started
    finally:
        for server in started:
            server.close()  # SIGKILL: also ends a paused (SIGSTOPped) server


@pytest.fixture
def servers() -> Iterator[list[RedisServer]]:
    """Three fresh redis-servers of this test alone."""
    yield from make_servers(3)


@pytest.fixture
def five_servers() -> Iterator[list[RedisServer]]:
    """Five fresh redis-servers of this test alone."""
    yield from make_servers(5)


@pytest.fixture
async def proxies() -> AsyncIterator[Callable[[RedisServer], Awaitable[Proxy]]]:
    """A factory of started proxies in front of a server (closed at the end)."""
    made: list[Proxy] = []

    async def make(server: RedisServer) -> Proxy:
        proxy = await Proxy(server.port).start()
        made.append(proxy)
        return proxy

    yield make
    for proxy in made:
        await proxy.aclose()


@pytest.fixture
def name() -> str:
    return f"adv-{uuid.uuid4().hex}"


def url_of(ports: list[int], query: str = FAST) -> str:
    return "redlock://" + ",".join(f"127.0.0.1:{p}" for p in ports) + (f"?{query}" if query else "")


def key(name: str) -> str:
    return f"aiolock:lock:{{{name}}}"


async def node_state(port: int, name: str) -> tuple[str | None, int | None, int]:
    """(owner, token) of the lock hash and the counter on one node, read directly."""
    client = aioredis.Redis(port=port, decode_responses=True)
    try:
        owner, token = await client.hmget(key(name), "owner", "token")
        seq = await client.get(key(name) + ":seq")
        return (None if owner is None else str(owner)), (int(token) if token else None), int(seq or 0)
    finally:
        await client.aclose()


async def set_counter(port: int, name: str, value: int) -> None:
    client = aioredis.Redis(port=port)
    try:
        await client.set(key(name) + ":seq", value)
    finally:
        await client.aclose()


async def wait_for(predicate: Callable[[], Awaitable[bool]], timeout: float,
                   what: str = "condition", step: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not met within {timeout} s")
        await asyncio.sleep(step)


async def token_on_nodes(ports: list[int], name: str, token: int, timeout: float = 3.0) -> None:
    """Wait until every node of ``ports`` holds the lease with ``token`` and its counter
    is at least ``token`` (late grants labelled, background raises done)."""

    async def everywhere() -> bool:
        states = [await node_state(p, name) for p in ports]
        return all(s[1] == token and s[2] >= token for s in states)

    await wait_for(everywhere, timeout, f"token {token} on nodes {ports}")


async def all_free(ports: list[int], name: str, timeout: float) -> None:
    async def free() -> bool:
        return all([(await node_state(p, name))[0] is None for p in ports])

    await wait_for(free, timeout, f"{name} free on every node")


def connect(url: str) -> aiolock.Locks:
    return aiolock.connect(url)
