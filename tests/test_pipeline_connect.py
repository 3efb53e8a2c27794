"""The lean pipelined connection (``backends/_pipeline.py``): a connect attempt that fails
after its caller was cancelled leaves nothing for asyncio to complain about."""

from __future__ import annotations

import asyncio
import gc
import logging
from typing import Any

import pytest

from aiolock.backends._pipeline import PipelinedClient


class _Silent(PipelinedClient[Any]):
    """A server that never completes the handshake."""

    async def _open(self, loop: asyncio.AbstractEventLoop) -> Any:
        await asyncio.sleep(3600)


async def test_connect_failing_after_caller_left_is_not_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = _Silent(connect_timeout=0.2, request_timeout=0.2)
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await client.send(b"PING\r\n")
        await asyncio.sleep(0.4)  # the shielded connect attempt times out on its own
        with pytest.raises(ConnectionError, match=r"no connection within 0\.2 s"):
            await client.send(b"PING\r\n")  # a new attempt: the failed one is dropped
        await client.aclose()
        gc.collect()
        await asyncio.sleep(0)
    assert "never retrieved" not in caplog.text
