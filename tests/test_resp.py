"""The pipelined RESP connection (``aiolock.backends._resp``) on a real redis-server:
replies stay matched to their requests, also when a request of several commands gets an
error reply in the middle, and when callers are cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from aiolock.backends._resp import RespClient, ResponseError, _pack

from .servers import RedisServer

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[RespClient]:
    c = RespClient(port=redis_server.port, connect_timeout=2, request_timeout=2)
    yield c
    await c.aclose()


async def test_an_error_reply_fails_a_single_command(client: RespClient) -> None:
    with pytest.raises(ResponseError, match="unknown command"):
        await client.call("NO-SUCH-COMMAND")
    assert await client.call("ECHO", "next") == b"next"


async def test_an_error_reply_in_a_batch_is_returned_in_place(client: RespClient) -> None:
    data = _pack("ECHO", "a") + _pack("NO-SUCH-COMMAND") + _pack("ECHO", "c")
    first, second, third = await client.send(data, 3)
    assert first == b"a" and third == b"c"
    assert isinstance(second, ResponseError)
    # the connection is still in step: each caller gets its own reply
    replies = await asyncio.gather(*(client.call("ECHO", str(i)) for i in range(50)))
    assert replies == [str(i).encode() for i in range(50)]


async def test_batches_and_cancelled_callers_do_not_shift_replies(client: RespClient) -> None:
    async def batch(i: int) -> list[object]:
        data = b"".join(_pack("ECHO", f"{i}-{j}") if j != 1 else _pack("BAD") for j in range(3))
        return await client.send(data, 3)

    tasks = [asyncio.create_task(batch(i)) for i in range(40)]
    await asyncio.sleep(0)
    for task in tasks[::3]:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for i, result in enumerate(results):
        if i % 3 == 0:
            continue
        assert isinstance(result, list)
        assert result[0] == f"{i}-0".encode() and result[2] == f"{i}-2".encode()
        assert isinstance(result[1], ResponseError)
    assert await client.call("ECHO", "after") == b"after"
