"""Small helpers shared by the adversarial coordination tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import aiolock


async def eventually(pred: Callable[[], Awaitable[bool]], timeout: float, step: float = 0.02) -> float:
    """Wait until ``pred()`` is true; return the seconds it took; AssertionError on timeout."""
    start = time.monotonic()
    while True:
        if await pred():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(step)


async def scan_names(locks: aiolock.Locks, prefix: str = "") -> list[str]:
    return [info.name async for info in locks.scan(prefix)]
