"""etcd backend specifics and faults, on real etcd members started here
(:mod:`tests.etcd_server`); the shared contract suite runs on etcd through
``conftest.BACKENDS`` ("etcd", "etcd-cluster").

Faults: a holder killed with ``kill -9`` (freed within its lease), a member and the
leader killed in a 3-member cluster (leases kept: the cluster keeps quorum), quorum
lost (BackendUnavailable in bounded time, leases lost at their expiry), a holder
paused past its ttl (lost on wake; the next holder has a higher token). TLS with client
certificates and etcd users, under the least role (readwrite on the key prefix).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

import aiolock

from .conftest import acquire_cancelled_after
from .etcd_server import EtcdCluster, EtcdServer, etcd_installed, make_certs

pytest.importorskip("etcd3aio")

from aiolock.backends.etcd import EtcdBackend

if not etcd_installed():
    pytest.skip("etcd is not installed (apt-get install etcd-server etcd-client)", allow_module_level=True)

HOLDER = Path(__file__).parent / "procs" / "holder.py"


@pytest.fixture
def url(etcd_server: EtcdServer) -> str:
    return f"{etcd_server.url}?prefix=t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def cluster() -> Iterator[EtcdCluster]:
    """A cluster of its own per fault test (they kill members)."""
    c = EtcdCluster(3).start()
    yield c
    c.close()


def _keys(server: EtcdServer, url: str) -> list[str]:
    """The claim keys under the URL's prefix (not the token keys, which stay, nor the
    tombstones of abandoned claims, which go with their lease)."""
    prefix = url.partition("prefix=")[2]
    out = server.etcdctl("get", "--prefix", "--keys-only", prefix + "/")
    return [line for line in out.splitlines() if line.strip()
            and not line.startswith((f"{prefix}/token/", f"{prefix}/gone/"))]


# -- URL and options -----------------------------------------------------------------------


def test_url_parsing_and_validation() -> None:
    b = EtcdBackend.from_url("etcd://h1:2379,h2,[::1]:2380?request_timeout=2&prefix=app")
    assert b.url == "etcd://h1:2379,h2:2379,[::1]:2380"
    secret = EtcdBackend.from_url("etcd://alice:s3cr%40t@h1:2379")
    assert "s3cr" not in secret.url and "alice" in secret.url
    with pytest.raises(ValueError, match="accepted: username, password, ca_file"):
        EtcdBackend.from_url("etcd://h1:2379?bogus=1")
    with pytest.raises(ValueError, match="accepted"):
        aiolock.connect("etcd://h1:2379", session_timeout=3)
    for bad in ("etcd://", "etcd://h1:notaport", "etcd://h1:2379/path", "etcd://h1?tls=maybe",
                "etcd://h1?connect_timeout=0", "etcd://h1?prefix=a/", "etcd://alice@h1"):
        with pytest.raises(ValueError):
            EtcdBackend.from_url(bad)
    with pytest.raises(ValueError, match="ca_file"):
        EtcdBackend.from_url("etcd://h1", ca_file="/nonexistent/ca.pem")


def test_missing_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in [m for m in sys.modules if m.startswith("aiolock.backends.etcd")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, "etcd3aio", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'aiolock\[etcd\]'"):
        aiolock.connect("etcd://127.0.0.1:2379")


# -- recipe ----------------------------------------------------------------------------------


async def test_tokens_are_create_revisions_and_increase(url: str, etcd_server: EtcdServer) -> None:
    async with aiolock.connect(url) as a, aiolock.connect(url) as b:
        tokens = []
        for i in range(6):
            async with (a, b)[i % 2].lock("orders/42") as lease:
                tokens.append(lease.token)
                keys = _keys(etcd_server, url)
                prefix = url.partition("prefix=")[2] + "/lock/orders%2F42/"
                assert len(keys) == 1 and keys[0].startswith(prefix)
        assert tokens == sorted(set(tokens))
        assert _keys(etcd_server, url) == []


async def test_last_token_is_kept_once_the_name_is_free(url: str) -> None:
    async with aiolock.connect(url) as locks:
        assert (await locks.status("free")).last_token is None  # never locked
        async with locks.lock("free") as lease:
            pass
        info = await locks.status("free")
        assert not info.held and info.last_token == lease.token
        async with locks.semaphore("free", limit=2) as permit:  # another family: its own
            pass
        assert (await locks.status("free")).last_token == lease.token
        async with locks.lock("free") as again:
            assert (await locks.status("free")).last_token == again.token > permit.token
        assert (await locks.status("free")).last_token == again.token


async def test_cancelled_acquires_leave_no_keys(url: str, etcd_server: EtcdServer) -> None:
    async with aiolock.connect(url) as locks:
        lock = locks.lock("x", ttl=10)
        for steps in range(0, 14, 2):
            await acquire_cancelled_after(lock, steps)
        holder = await locks.lock("x").acquire()
        tasks = [asyncio.create_task(locks.lock("x", fair=True).acquire()) for _ in range(10)]
        await asyncio.sleep(0.3)
        assert len(_keys(etcd_server, url)) == 11  # each fair waiter keeps its place
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await holder.release()
        await asyncio.sleep(0.1)
        assert _keys(etcd_server, url) == []


async def test_try_once_leaves_no_place_in_the_queue(url: str, etcd_server: EtcdServer) -> None:
    async with aiolock.connect(url) as a, aiolock.connect(url) as b:
        lease = await a.lock("y").acquire()
        with pytest.raises(aiolock.LockTimeout):
            await b.lock("y").acquire(timeout=0)
        await asyncio.sleep(0.8)  # an unattended Busy claim loses its key
        assert len(_keys(etcd_server, url)) == 1
        await lease.release()


async def test_extend_beyond_the_etcd_lease_keeps_the_token(url: str) -> None:
    async with aiolock.connect(url) as locks:
        lease = await locks.lock("z", ttl=1, watchdog=False).acquire()
        await lease.extend(4)
        await asyncio.sleep(1.6)  # past the first etcd lease (1 s + the 0.5 s sweep)
        assert not lease.lost and (await locks.status("z")).token == lease.token
        await lease.release()


async def test_keepalives_share_one_stream(url: str) -> None:
    async with aiolock.connect(url) as locks:
        backend = locks.backend
        assert isinstance(backend, EtcdBackend)
        leases = [await locks.lock(f"n{i}", ttl=1).acquire() for i in range(20)]
        await asyncio.sleep(1.2)
        stream = backend._leases.stream
        assert stream is not None and stream.alive
        await asyncio.sleep(0.6)
        assert backend._leases.stream is stream  # the same one stream renewed them all
        assert not any(lease.lost for lease in leases)
        for lease in leases:
            await lease.release()


# -- shared leases --------------------------------------------------------------------------


async def _lease_of_keys(backend: EtcdBackend, url: str) -> set[int]:
    """The etcd leases the claim keys under the URL's prefix are attached to."""
    from aiolock.backends.etcd._recipe import range_end
    from aiolock.backends.etcd._wire import pb

    prefix = (url.partition("prefix=")[2] + "/lock/").encode()
    request = pb.RangeRequest(key=prefix, range_end=range_end(prefix))
    reply = await backend._unary("KV", "Range", request, "a read")
    return {int(kv.lease) for kv in reply.kvs}


async def _lease_ttl(backend: EtcdBackend, lease: int) -> tuple[int, int]:
    """(TTL left, -1 once gone; keys attached) of an etcd lease."""
    from aiolock.backends.etcd._wire import pb

    request = pb.LeaseTimeToLiveRequest(ID=lease, keys=True)
    reply = await backend._unary("Lease", "LeaseTimeToLive", request, "a read")
    return int(reply.TTL), len(reply.keys)


async def _all_leases(backend: EtcdBackend) -> set[int]:
    from aiolock.backends.etcd._wire import pb

    reply = await backend._unary("Lease", "LeaseLeases", pb.LeaseLeasesRequest(), "a read")
    return {int(lease.ID) for lease in reply.leases}


async def test_claims_of_one_ttl_share_one_lease(url: str) -> None:
    async with aiolock.connect(url) as locks, aiolock.connect(url) as other:
        backend = locks.backend
        assert isinstance(backend, EtcdBackend)
        before = await _all_leases(backend)
        leases = await asyncio.gather(*(locks.lock(f"many{i}", ttl=2).acquire() for i in range(200)))
        permits = [await locks.semaphore("sem", limit=3, ttl=2).acquire() for _ in range(3)]
        reader = await locks.rwlock("rw", ttl=2).read().acquire()
        longer = await locks.lock("longer", ttl=5).acquire()  # another length: its own lease
        shared, five = backend._leases.current[2].id, backend._leases.current[5].id
        assert await _lease_of_keys(backend, url) == {shared, five}  # every lock key of ttl 2 on one
        assert await _all_leases(backend) - before == {shared, five} == set(backend._leases.leases)
        ttl, keys = await _lease_ttl(backend, shared)
        assert ttl > 0 and keys == 200 + 3 + 1
        await asyncio.sleep(2.5)  # renewed: one keep-alive per lease a round
        assert not any(lease.lost for lease in [*leases, *permits, reader, longer])
        with pytest.raises(aiolock.LockTimeout):
            await other.lock("many7").acquire(timeout=0.2)
        tokens = [lease.token for lease in leases]
        assert len(set(tokens)) == len(tokens)  # each claim its own key: its own token
        for lease in [*leases, *permits, reader, longer]:
            await lease.release()


async def test_losing_the_shared_lease_loses_every_claim_on_it(url: str) -> None:
    from aiolock.backends.etcd._wire import pb

    async with aiolock.connect(url) as locks, aiolock.connect(url) as other:
        backend = locks.backend
        assert isinstance(backend, EtcdBackend)
        leases = [await locks.lock(f"l{i}", ttl=2).acquire() for i in range(5)]
        (shared,) = await _lease_of_keys(backend, url)
        await other.backend._unary("Lease", "LeaseRevoke", pb.LeaseRevokeRequest(ID=shared), "a revoke")
        async with asyncio.timeout(3):  # the next keep-alive answers TTL 0
            await asyncio.gather(*(lease.wait_lost() for lease in leases))
        assert all("no longer has it" in str(lease._hold.lost_reason) for lease in leases)
        async with other.lock("l3", timeout=1):  # freed on the server with the lease
            pass
        again = await locks.lock("l0", ttl=2).acquire(timeout=2)  # a new lease for later claims
        assert await _lease_of_keys(backend, url) == {backend._leases.current[2].id} != {shared}
        await asyncio.sleep(1.0)
        assert not again.lost
        await again.release()


async def test_an_individual_revoke_loses_only_that_claim(url: str) -> None:
    async with aiolock.connect(url) as locks, aiolock.connect(url) as admin:
        backend = locks.backend
        assert isinstance(backend, EtcdBackend)
        leases = {name: await locks.lock(name, ttl=1).acquire() for name in ("a", "b", "c")}
        (shared,) = await _lease_of_keys(backend, url)
        assert await admin.lock("b").force_release()
        async with asyncio.timeout(2):
            await leases["b"].wait_lost()
        assert "revoked" in str(leases["b"]._hold.lost_reason)
        await asyncio.sleep(1.2)  # the others are renewed on, on the same lease
        assert not leases["a"].lost and not leases["c"].lost
        assert await _lease_of_keys(backend, url) == {shared}
        assert (await _lease_ttl(backend, shared))[1] == 2
        for name in ("a", "c"):
            await leases[name].release()


async def test_the_last_release_ends_the_lease(url: str) -> None:
    async with aiolock.connect(url) as locks:
        backend = locks.backend
        assert isinstance(backend, EtcdBackend)
        leases = [await locks.lock(f"r{i}", ttl=3).acquire() for i in range(3)]
        (shared,) = await _lease_of_keys(backend, url)
        for lease in leases[:2]:
            await lease.release()
        assert (await _lease_ttl(backend, shared))[1] == 1  # still in use
        await leases[2].release()
        released = time.monotonic()
        assert (await _lease_ttl(backend, shared))[1] == 0  # kept for reuse while fresh...
        again = await locks.lock("r9", ttl=3).acquire()  # ... and reused: no new grant
        assert await _lease_of_keys(backend, url) == {shared}
        await again.release()
        await asyncio.sleep(max(0.0, released + 2.2 - time.monotonic()))
        # ... then revoked once under half its ttl is left (it would live until 3 s)
        assert (await _lease_ttl(backend, shared))[0] == -1
        assert shared not in backend._leases.leases and 3 not in backend._leases.current
        third = await locks.lock("r9", ttl=3).acquire()  # a new one
        assert await _lease_of_keys(backend, url) != {shared}
        await third.release()
        fourth = backend._leases.current[3].id
    async with aiolock.connect(url) as check:  # closing the connection revoked it
        assert isinstance(check.backend, EtcdBackend)
        assert (await _lease_ttl(check.backend, fourth))[0] == -1


async def test_a_put_in_flight_when_abandoned_is_barred(url: str, etcd_server: EtcdServer) -> None:
    """An acquire cancelled mid-request: its put may still land after the abandon; the
    shared lease cannot be revoked for it, so a tombstone on the lease bars it."""
    from aiolock.abc import Claim, Granted, Kind
    from aiolock.backends.etcd._claim import state

    backend = EtcdBackend.from_url(url)
    try:
        other = Claim("other", Kind.LOCK, uuid.uuid4().hex, ttl_ms=2000)
        assert isinstance(await backend.try_acquire(other), Granted)  # (the lease stays in use)
        claim = Claim("late", Kind.LOCK, uuid.uuid4().hex, ttl_ms=2000)
        assert isinstance(await backend.try_acquire(claim), Granted)
        st = state(claim)
        lease = st.lease
        st.uncertain = True  # as if the reply never came
        await backend.abandon(claim)
        assert len(_keys(etcd_server, url)) == 1
        # the put arrives late: the same transaction, on the same lease
        st.abandoned = False
        backend._leases.attach(lease, claim.owner, st)
        assert await backend._attempt(claim, st, time.monotonic()) is None
        assert len(_keys(etcd_server, url)) == 1  # not written
        assert lease is not None and lease.tombstones == 1
    finally:
        await backend.aclose()


async def test_keys_nobody_counts_on_are_deleted_before_a_keep_alive(
    url: str, etcd_server: EtcdServer,
) -> None:
    """A claim whose delete failed (an orphan) or that the core stopped renewing (past
    its own expiry) must not live on with the shared lease."""
    from aiolock.abc import Claim, Granted, Kind
    from aiolock.backends.etcd._claim import state

    backend = EtcdBackend.from_url(url)
    try:
        kept, failed, left = (Claim(n, Kind.LOCK, uuid.uuid4().hex, ttl_ms=3000) for n in ("k", "f", "l"))
        for claim in (kept, failed, left):
            assert isinstance(await backend.try_acquire(claim), Granted)
        lease = state(kept).lease
        assert lease is not None and state(failed).lease is lease is state(left).lease
        # a delete that failed
        backend._leases.orphan(state(failed), failed.owner, backend._claim_key(failed), False)
        state(left).own_until = time.monotonic() - 0.01  # the core's expiry passed unrenewed
        lease.swept = 0.0
        assert len(_keys(etcd_server, url)) == 3
        (ms,) = await backend.renew([kept])
        assert ms is not None and ms > 0
        assert [k.rsplit("/", 2)[1] for k in _keys(etcd_server, url)] == ["k"]
        assert list(lease.claims) == [kept.owner] and not lease.orphans
        assert (await backend.renew([left])) == [None]
    finally:
        await backend.aclose()


# -- faults ----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _holder(url: str, name: str, ttl: float) -> AsyncIterator[tuple[subprocess.Popen[str], int]]:
    proc = subprocess.Popen([sys.executable, str(HOLDER), url, name, str(ttl)],  # noqa: ASYNC220
                            stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 15)
        assert line.startswith("ACQUIRED"), line
        yield proc, int(line.split()[1])
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait()


async def test_killed_holder_is_freed_within_its_lease(url: str) -> None:
    async with _holder(url, "k", 1.0) as (proc, token), aiolock.connect(url) as locks:
        proc.kill()  # kill -9: no release, no more keep-alives
        killed = time.monotonic()
        lease = await locks.lock("k").acquire(timeout=5)
        waited = time.monotonic() - killed
        assert lease.token > token
        assert waited < 1.0 + 1.0, waited  # the 1 s lease + the server's 0.5 s sweep + slack
        await lease.release()


async def test_paused_holder_loses_its_lease(url: str) -> None:
    async with _holder(url, "p", 1.0) as (proc, token), aiolock.connect(url) as locks:
        os.kill(proc.pid, signal.SIGSTOP)  # past its ttl: no keep-alives
        lease = await locks.lock("p").acquire(timeout=5)
        assert lease.token > token
        os.kill(proc.pid, signal.SIGCONT)
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 5)
        assert line.startswith("LOST"), line  # it knows at once on waking
        assert await asyncio.to_thread(proc.wait, 5) == 3
        assert (await locks.status("p")).token == lease.token
        await lease.release()


async def _held_through(locks: aiolock.Locks, lease: aiolock.Lease, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        await asyncio.sleep(0.25)
        assert not lease.lost


async def test_member_and_leader_kill_keep_leases(cluster: EtcdCluster) -> None:
    url = cluster.url + "?request_timeout=1"
    async with aiolock.connect(url) as locks, aiolock.connect(url) as other:
        lease = await locks.lock("m", ttl=3).acquire()
        leader = cluster.leader_index()
        follower = (leader + 1) % 3
        cluster.kill(follower)
        await _held_through(locks, lease, 2.0)
        cluster.restart(follower)
        cluster.wait_healthy()
        cluster.kill(cluster.leader_index())
        await _held_through(locks, lease, 4.0)  # a new leader is elected meanwhile
        assert (await locks.status("m")).token == lease.token
        with pytest.raises(aiolock.LockTimeout):
            await other.lock("m").acquire(timeout=0.3)
        async with locks.lock("m2") as second:  # and new acquisitions work
            assert second.token > lease.token
        await lease.release()


async def test_quorum_loss_is_bounded_and_loses_leases(cluster: EtcdCluster) -> None:
    url = cluster.url + "?request_timeout=1"
    async with aiolock.connect(url) as locks:
        lease = await locks.lock("q", ttl=2).acquire()
        cluster.kill(0)
        cluster.kill(1)
        lost_by = lease.expires_in + 1.0  # its last confirmed expiry, at the latest
        started = time.monotonic()
        with pytest.raises(aiolock.BackendUnavailable):
            await locks.lock("q2").acquire(timeout=10)
        assert time.monotonic() - started < 2.5
        await asyncio.wait_for(lease.wait_lost(), lost_by + 2.5)
        assert lease.lost
        with pytest.raises(aiolock.BackendUnavailable):
            async with aiolock.connect(url, connect_timeout=1):
                pass


# -- TLS and users -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EtcdServer, dict[str, Path]]]:
    """TLS with client certificates required, users on: root, and 'locker' whose only
    role has readwrite on the prefix 'aiolock/' (the least aiolock needs)."""
    certs = make_certs(tmp_path_factory.mktemp("certs"))
    server = EtcdServer(certs=certs).start()
    try:
        ctl = server.etcdctl
        ctl("user", "add", "root:rootpw")
        ctl("role", "add", "aiolock-role")
        ctl("role", "grant-permission", "aiolock-role", "--prefix=true", "readwrite", "aiolock/")
        ctl("user", "add", "locker:lockpw")
        ctl("user", "grant-role", "locker", "aiolock-role")
        ctl("user", "add", "nobody:nopw")
        ctl("auth", "enable")
        yield server, certs
    finally:
        server.close()


def _tls_query(certs: dict[str, Path], client: bool = True) -> str:
    q = f"ca_file={certs['ca']}"
    if client:
        q += f"&cert_file={certs['client_cert']}&key_file={certs['client_key']}"
    return q


async def test_tls_and_least_role(secured: tuple[EtcdServer, dict[str, Path]]) -> None:
    server, certs = secured
    url = f"etcd://locker:lockpw@{server.endpoint}?{_tls_query(certs)}"
    async with aiolock.connect(url) as a, aiolock.connect(url) as b:
        lease = await a.lock("t", ttl=1).acquire()
        waiter = asyncio.create_task(b.lock("t").acquire(timeout=5))
        await asyncio.sleep(1.5)  # renewed under the role
        assert not lease.lost and (await b.status("t")).token == lease.token
        await lease.release()
        second = await waiter
        assert second.token > lease.token
        await second.release()
        async with a.rwlock("t").read(), a.semaphore("s", limit=2):
            pass
    kw: dict[str, Any] = {"username": "locker", "password": "lockpw", "ca_file": str(certs["ca"]),
                          "cert_file": str(certs["client_cert"]), "key_file": str(certs["client_key"])}
    async with aiolock.connect(f"etcd://{server.endpoint}", **kw) as c, c.lock("kw"):
        pass


async def test_refused_credentials_are_access_denied(secured: tuple[EtcdServer, dict[str, Path]]) -> None:
    server, certs = secured
    for userinfo in ("locker:wrong-secret-pw@", "nobody:nopw@", ""):
        with pytest.raises(aiolock.AccessDenied) as info:
            async with aiolock.connect(f"etcd://{userinfo}{server.endpoint}?{_tls_query(certs)}"):
                pass
        assert "wrong-secret-pw" not in str(info.value) and "nopw" not in str(info.value)
    # the role covers 'aiolock/' only
    url = f"etcd://locker:lockpw@{server.endpoint}?{_tls_query(certs)}&prefix=elsewhere"
    with pytest.raises(aiolock.AccessDenied):
        async with aiolock.connect(url):
            pass


async def test_tls_without_client_certificate_is_refused(
    secured: tuple[EtcdServer, dict[str, Path]],
) -> None:
    server, certs = secured
    for url in (f"etcd://locker:lockpw@{server.endpoint}?{_tls_query(certs, client=False)}",
                f"etcd://locker:lockpw@{server.endpoint}"):  # plaintext to a TLS server
        started = time.monotonic()
        with pytest.raises(aiolock.BackendUnavailable):
            async with aiolock.connect(url, connect_timeout=1):
                pass
        assert time.monotonic() - started < 3


async def test_blackholed_holder_knows_before_anyone_else_gets_it(url: str, etcd_server: EtcdServer) -> None:
    from .faults.proxy import Proxy

    proxy = await Proxy(etcd_server.port).start()
    try:
        query = url.partition("?")[2]
        async with aiolock.connect(f"etcd://127.0.0.1:{proxy.port}?{query}&request_timeout=0.5") as cut, \
                aiolock.connect(url) as other:
            lease = await cut.lock("b", ttl=2).acquire()
            lost_at: list[float] = []
            lease._hold.callbacks.append(lambda: lost_at.append(time.monotonic()))
            proxy.set_faults(up=True, down=True)  # nothing moves either way
            started = time.monotonic()
            with pytest.raises(aiolock.BackendUnavailable):
                await cut.lock("b2").acquire(timeout=5)
            assert time.monotonic() - started < 1.5
            theirs = await other.lock("b").acquire(timeout=6)  # once the server expired it
            granted_at = time.monotonic()
            assert lease.lost and lost_at and lost_at[0] <= granted_at  # it knew first
            assert theirs.token > lease.token
            await theirs.release()
            proxy.heal()
            async with asyncio.timeout(10):  # and it recovers
                while True:
                    try:
                        async with cut.lock("b3"):
                            break
                    except aiolock.BackendUnavailable:
                        await asyncio.sleep(0.2)
    finally:
        await proxy.aclose()


async def test_a_stale_idle_lease_is_replaced(url: str) -> None:
    async with aiolock.connect(url) as locks:
        backend = locks.backend
        assert isinstance(backend, EtcdBackend)
        lease = await locks.lock("s", ttl=1).acquire()
        await lease.release()  # its etcd lease is kept for reuse while fresh
        shared = backend._leases.current[1]
        assert not shared.claims
        await asyncio.sleep(1.6)  # expired on the server (1 s + the 0.5 s sweep)
        if shared.idle_timer is not None:
            shared.idle_timer.cancel()
            shared.idle_timer = None
        backend._leases.current[1] = shared
        backend._leases.leases[shared.id] = shared
        shared.retired = False
        shared.confirmed = time.monotonic()  # believed fresh
        again = await locks.lock("s", ttl=1).acquire(timeout=2)  # the put finds no lease: a new one
        assert again.token > lease.token and not again.lost
        assert backend._leases.current[1] is not shared and shared.lost
        await again.release()


async def test_an_expired_waiting_lease_does_not_hold_up_renewals() -> None:
    """etcd answers a stream's keep-alives in order, and one for a lease that expired but
    is not yet revoked waits for the revocation (1,000 a second, after a 0.5 s sweep):
    behind a backlog of expired leases, one such keep-alive held up every renewal of the
    connection for seconds. A waiting claim re-checked after its lease ran out must
    not send one."""
    from aiolock.abc import Busy, Claim, Granted, Kind

    with contextlib.closing(EtcdServer().start()) as server:
        url = f"{server.url}?prefix=hol"
        holder, waiting = EtcdBackend.from_url(url), EtcdBackend.from_url(url)
        try:
            held = Claim("h", Kind.LOCK, uuid.uuid4().hex, ttl_ms=30_000)
            mine = Claim("w", Kind.LOCK, uuid.uuid4().hex, ttl_ms=30_000)
            assert isinstance(await holder.try_acquire(held), Granted)
            assert isinstance(await waiting.try_acquire(mine), Granted)
            # a backlog of leases to revoke, then our waiting claim's (ttl 1 s) after it
            await _expired_lease_backlog(waiting, 5000)
            waiter = _Waiter(Claim("h", Kind.LOCK, uuid.uuid4().hex, ttl_ms=1000))
            await waiting.listen("h", Kind.LOCK, waiter)  # (not unattended: it waits)
            assert isinstance(await waiting.try_acquire(waiter.claim), Busy)
            await asyncio.sleep(1.3)  # its lease expired on the server, not yet revoked
            started = time.monotonic()
            assert isinstance(await waiting.try_acquire(waiter.claim), Busy)
            renewed = await waiting.renew([mine])
            assert time.monotonic() - started < 1.0
            assert renewed[0] is not None and renewed[0] > 0
        finally:
            await holder.aclose()
            await waiting.aclose()


class _Waiter:
    def __init__(self, claim: Any) -> None:
        self.claim = claim

    def wake(self, hint: str | None = None) -> None:
        pass


async def _expired_lease_backlog(backend: EtcdBackend, count: int) -> None:
    from aiolock.backends.etcd._wire import pb

    base = uuid.uuid4().int % 2**60
    for i in range(0, count, 500):
        await asyncio.gather(*(
            backend._unary("Lease", "LeaseGrant", pb.LeaseGrantRequest(TTL=1, ID=base + j), "a grant")
            for j in range(i, min(count, i + 500))))


# -- waiting: watches start at the server's revision ----------------------------------------


async def test_a_key_gone_before_its_watch_is_confirmed_still_wakes(url: str) -> None:
    """A waiter's watch starts at the server's current revision (a watch from an older
    revision, or one a write races, is caught up by etcd only every 100 ms); a deletion
    that falls between the claim's listing and the watch's confirmation is found by a
    read and wakes the waiter at once, not at its next re-check."""
    from aiolock._waiter import LocalWaiter
    from aiolock.abc import Claim, Kind
    from aiolock.backends.etcd._wire import pb

    async with aiolock.connect(url) as locks:
        backend = locks.backend
        assert isinstance(backend, EtcdBackend)
        key = (url.partition("prefix=")[2] + "/probe").encode()
        await backend._unary("KV", "Put", pb.PutRequest(key=key), "a write")  # (the listing)
        await backend._unary("KV", "DeleteRange", pb.DeleteRangeRequest(key=key), "a write")
        claim = Claim("probe", Kind.LOCK, uuid.uuid4().hex, 5000)
        waiter = LocalWaiter(claim)
        await backend.listen("probe", Kind.LOCK, waiter)
        backend._watches.watch(claim, {key})
        started = time.monotonic()
        await waiter.wait(5.0)
        assert time.monotonic() - started < 1.0  # woken, not timed out
        backend.unlisten("probe", Kind.LOCK, waiter)



@pytest.mark.parametrize("stall", [0.3, 1.2])
async def test_a_keep_alive_answered_during_a_loop_stall_counts(url: str, stall: float) -> None:
    """The event loop blocked (a CPU-bound callback, a starved process) past a keep-alive
    batch's deadline while the server answered: the reply, queued behind the timer, is
    read and believed -- not a BackendUnavailable with the server up (which failed every
    waiter of the connection; tests/adversarial_load_other found it under load)."""
    async with asyncio.timeout(20), aiolock.connect(url) as locks:
        backend = locks.backend
        assert isinstance(backend, EtcdBackend)
        async with locks.lock(f"stall-{uuid.uuid4().hex}", ttl=3):
            session = backend._leases
            (lease_id,) = list(session.leases)
            batch = asyncio.ensure_future(session.keep_alive([lease_id], time.monotonic() + 0.1))
            await asyncio.sleep(0)  # sent
            time.sleep(stall)  # (the stall under test)
            (ttl,) = await batch
            assert ttl > 0
