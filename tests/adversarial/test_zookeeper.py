"""ZooKeeper: a try-lock loop wins promptly and leaves no phantom holder (issue 9 #4); lock
nodes protected by digest ACLs from a URL's credentials (issue 9 #13)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

import aiozk
import pytest

import aiolock

from ..zk_server import ZooKeeperServer


def _url(zk: ZooKeeperServer, chroot: str, creds: str = "") -> str:
    return f"zookeeper://{creds}{zk.hosts}/{chroot}"


async def test_try_lock_loop_wins_after_release(zk_server: ZooKeeperServer) -> None:
    chroot = f"adv-{uuid.uuid4().hex[:8]}"
    name = "job"
    async with aiolock.connect(_url(zk_server, chroot)) as a, \
            aiolock.connect(_url(zk_server, chroot)) as b:
        holder = await a.lock(name, ttl=10).acquire()
        tries = 0

        async def loop() -> float:
            nonlocal tries
            while True:
                tries += 1
                try:
                    lease = await b.lock(name, ttl=10).acquire(timeout=0)
                except aiolock.LockTimeout:
                    await asyncio.sleep(0.1)
                    continue
                won = time.monotonic()
                await lease.release()
                return won

        task = asyncio.create_task(loop())
        await asyncio.sleep(1.5)
        assert not task.done()
        info = await a.status(name)
        assert info.held and info.holders == 1 and info.waiters == 0, info
        released = time.monotonic()
        await holder.release()
        async with asyncio.timeout(10):
            won = await task
        assert won - released < 0.4, f"try-lock loop won {won - released:.2f}s after release"
        info = await b.status(name)
        assert not info.held and info.holders == 0 and info.waiters == 0, info


async def test_try_lock_on_free_lock_never_fails(zk_server: ZooKeeperServer) -> None:
    """Many one-tries in a row on a free lock, from two connections alternately: each
    must succeed (no leftover of the previous one-try in the way)."""
    chroot = f"adv-{uuid.uuid4().hex[:8]}"
    async with aiolock.connect(_url(zk_server, chroot)) as a, \
            aiolock.connect(_url(zk_server, chroot)) as b:
        for i in range(30):
            conn = (a, b)[i % 2]
            lease = await conn.lock("x", ttl=5).acquire(timeout=0)
            await lease.release()
        # and a failed one-try leaves nothing that blocks the next holder
        holder = await a.lock("x", ttl=5).acquire()
        for _ in range(5):
            with pytest.raises(aiolock.LockTimeout):
                await b.lock("x", ttl=5).acquire(timeout=0)
        await holder.release()
        lease = await b.lock("x", ttl=5).acquire(timeout=0)
        await lease.release()
        assert not (await a.status("x")).held


async def test_short_timeouts_loop(zk_server: ZooKeeperServer) -> None:
    """acquire(timeout=0.05) in a loop: the same, with a timeout that expires mid-wait."""
    chroot = f"adv-{uuid.uuid4().hex[:8]}"
    async with aiolock.connect(_url(zk_server, chroot)) as a, \
            aiolock.connect(_url(zk_server, chroot)) as b:
        holder = await a.lock("y", ttl=10).acquire()
        for _ in range(10):
            with pytest.raises(aiolock.LockTimeout):
                await b.lock("y", ttl=10).acquire(timeout=0.05)
        # nothing left counted as a waiter (a transient of ~25 ms right after the
        # LockTimeout was seen: the node is deleted in the background; allowed here)
        async with asyncio.timeout(0.3):
            while (await a.status("y")).waiters:
                await asyncio.sleep(0.01)
        await holder.release()
        lease = await b.lock("y", ttl=10).acquire(timeout=0)
        await lease.release()


# --- ACLs ------------------------------------------------------------------------------


async def _all_nodes(client: Any, path: str) -> list[str]:
    out = []
    for child in await client.get_children(path):
        full = f"{path.rstrip('/')}/{child}"
        out.append(full)
        out += await _all_nodes(client, full)
    return out


async def test_acl_strangers_cannot_delete_or_take(zk_server: ZooKeeperServer) -> None:
    chroot = f"adv-{uuid.uuid4().hex[:8]}"
    owner_url = _url(zk_server, chroot, "alice:alice-pw@")
    async with aiolock.connect(owner_url) as owner:
        lease = await owner.lock("res", ttl=6).acquire()
        # an unauthenticated raw client, and one with other credentials
        stranger = aiozk.ZKClient(zk_server.hosts)
        await stranger.start()
        other = aiozk.ZKClient(zk_server.hosts)
        await other.start()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(3):
                await other.send(aiozk.protocol.AuthRequest(type=0, scheme="digest",
                                                            auth=b"mallory:mallory-pw"))
        try:
            nodes = await _all_nodes(stranger, f"/{chroot}")
            assert nodes, "no lock nodes found under the chroot"
            deleted = []
            for client in (stranger, other):
                for node in sorted(nodes, key=len, reverse=True):
                    try:
                        await client.delete(node, force=True)
                    except Exception:
                        continue
                    deleted.append(node)
                with contextlib.suppress(Exception):
                    await client.deleteall(f"/{chroot}")
            assert not deleted, f"strangers deleted {deleted}"
            left = await _all_nodes(stranger, f"/{chroot}")
            assert sorted(left) == sorted(nodes), f"nodes gone: {set(nodes) - set(left)}"
        finally:
            await stranger.close()
            await other.close()
        await asyncio.sleep(0.3)
        assert not lease.lost
        # other aiolock users without or with other credentials cannot take it
        for url in (_url(zk_server, chroot), _url(zk_server, chroot, "mallory:mallory-pw@")):
            async with aiolock.connect(url) as them:
                with pytest.raises((aiolock.LockTimeout, aiolock.AccessDenied)):
                    await them.lock("res", ttl=6).acquire(timeout=0.3)
                info = await them.status("res")  # reading stays possible
                assert info.held
                # a name of their own under alice's chroot: theirs, or AccessDenied
                try:
                    async with asyncio.timeout(5):
                        own = await them.lock("theirs", ttl=6).acquire(timeout=1)
                except aiolock.AccessDenied:
                    pass
                else:
                    await own.release()
        assert not lease.lost
        await lease.release()


async def test_acl_wrong_password_for_same_user(zk_server: ZooKeeperServer) -> None:
    chroot = f"adv-{uuid.uuid4().hex[:8]}"
    async with aiolock.connect(_url(zk_server, chroot, "alice:right@")) as owner:
        lease = await owner.lock("r", ttl=6).acquire()
        async with aiolock.connect(_url(zk_server, chroot, "alice:wrong@")) as them:
            with pytest.raises((aiolock.LockTimeout, aiolock.AccessDenied)):
                await them.lock("r", ttl=6).acquire(timeout=0.3)
        assert not lease.lost
        await lease.release()
        # the same identity from another connection can use the lock normally
        async with aiolock.connect(_url(zk_server, chroot, "alice:right@")) as again:
            second = await again.lock("r", ttl=6).acquire(timeout=2)
            assert second.token > lease.token
            await second.release()


@pytest.mark.parametrize("url", ["zookeeper://a:b@127.0.0.1:1/x?acl=closed",
                                 "zookeeper://127.0.0.1:1/x?acl=",
                                 "zookeeper://a:b@127.0.0.1:1/x?acl=open&acl=creator"])
async def test_bad_acl_option_refused(url: str) -> None:
    async with asyncio.timeout(10):
        with pytest.raises(ValueError) as info:
            async with aiolock.connect(url, connect_timeout=1):
                pass
    assert "acl" in str(info.value)
    assert ":b@" not in str(info.value)
