"""CLI (SPEC §9, README "Command line"): ``revoke`` exits 0 when something was held, 1 when
nothing was; ``elect`` exits 75 when leadership is not acquired in time, 76 when it is
lost while COMMAND runs (the command stopped), COMMAND's own status otherwise; ``ls``
exits 2 on a backend that cannot list."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from typing import Any

import pytest

import aiolock

from ..scenarios import params_of

rows = pytest.mark.parametrize("crow", params_of("redis", "zookeeper", "memcached"))


async def cli(url: str, *args: str, within: float = 30) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "aiolock", *args, env={**os.environ, "AIOLOCK_URL": url},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), within)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@rows
async def test_revoke_elect_ls_exit_codes(crow: Any, request: Any, name: str) -> None:
    url = crow.url(request)
    async with aiolock.connect(url) as locks:
        assert (await cli(url, "revoke", name))[0] == 1
        election = locks.election(name, ttl=1.5)
        term = await election.campaign(data="here").acquire()
        try:
            code, _, err = await cli(url, "elect", "--timeout", "0", "--ttl", "1.5", name,
                                     "--", "true")
            assert code == 75, (code, err)
            code, out, err = await cli(url, "ls", "--json", name)
            if aiolock.Capability.SCAN in locks.capabilities:
                assert code == 0, (code, err)
                rows = [json.loads(line) for line in out.splitlines()]
                assert [(r["name"], r["kind"]) for r in rows] == [(name, "election")], rows
                assert rows[0]["holders"][0]["data"] == "here"
            else:
                assert code == 2, (code, err)
            code, _, err = await cli(url, "revoke", name)
            assert code == 0, (code, err)
            await asyncio.wait_for(term.wait_lost(), 1.5)
        finally:
            await term.release()
        # elect: the leadership revoked while COMMAND runs -> the command stopped, exit 76
        task = asyncio.create_task(cli(url, "elect", "--ttl", "1.5", name, "--", "sleep", "30"))
        deadline = time.monotonic() + 15
        while await election.leader() is None:
            assert time.monotonic() < deadline, "elect never led"
            await asyncio.sleep(0.05)
        assert await election.campaign().force_release()
        code, _, err = await asyncio.wait_for(task, 10)
        assert code == 76, (code, err)
        assert (await cli(url, "elect", "--ttl", "1.5", name, "--", "sh", "-c", "exit 7"))[0] == 7


@pytest.mark.parametrize("crow", params_of("redis", "zookeeper", "postgres", "mysql", "etcd",
                                           "memcached", "redlock", "memory"))
async def test_cli_revoke_every_kind_of_the_name(crow: Any, request: Any, name: str) -> None:
    """docs/operations.md, ``aiolock revoke``: "Revokes every holder of NAME, in every kind
    the backend offers. Each revoked holder finds its lease lost at its next renewal"."""
    if crow.id == "memory":
        pytest.skip("memory:// is one process")
    url = crow.url(request)
    async with aiolock.connect(url) as locks:
        caps = locks.capabilities
        leases = [await locks.lock(name, ttl=1.5).acquire()]
        if aiolock.Capability.RWLOCK in caps:
            leases.append(await asyncio.create_task(locks.rwlock(name, ttl=1.5).read().acquire()))
        if aiolock.Capability.SEMAPHORE in caps:
            leases.append(await asyncio.create_task(locks.semaphore(name, limit=2, ttl=1.5).acquire()))
        leases.append(await asyncio.create_task(
            locks.election(name, ttl=1.5).campaign(data="d").acquire()))
        code, _, err = await cli(url, "revoke", name)
        assert code == 0, (code, err)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(le.wait_lost() for le in leases)), 2.0)
        kept = [le for le in leases if not le.lost]
        for le in leases:
            await le.release()
        assert not kept, f"not revoked: {kept}"
