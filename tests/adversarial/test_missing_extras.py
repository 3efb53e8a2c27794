"""A backend whose client library is missing says which extra to install (SPEC §1,
issue 9 #11), as a ValueError/LockError/ImportError naming ``aiolock[...]`` -- never a bare
ModuleNotFoundError from deep inside."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import asyncio, sys
sys.modules[{module!r}] = None          # as if the package were not installed
import aiolock

async def main():
    try:
        async with aiolock.connect({url!r}, connect_timeout=1) as locks:
            await locks.lock("x").acquire(timeout=0)
    except BaseException as exc:
        print(type(exc).__module__, type(exc).__name__, "|", exc)
    else:
        print("no error")

asyncio.run(main())
"""


@pytest.mark.parametrize(("module", "url", "extra"), [
    ("asyncpg", "postgresql://u@127.0.0.1:1/db", "postgres"),
    ("aiozk", "zookeeper://127.0.0.1:1/x", "zookeeper"),
    ("redis", "redis://127.0.0.1:1/0", "redis"),
    ("redis", "redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", "redis"),
])
def test_missing_client_library_names_the_extra(module: str, url: str, extra: str) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(module=module, url=url)],
                          capture_output=True, text=True, timeout=60)
    out = done.stdout.strip()
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"aiolock[{extra}]" in out, out
    assert not out.startswith("builtins ModuleNotFoundError"), out
