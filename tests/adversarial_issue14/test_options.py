"""etcd URL and keyword options (docs/backends/etcd.md "Options", SPEC §1, §4): unknown
and repeated options refused, bad values ValueError, users and the least role on a server
with auth enabled, TLS with client certificates; the password never in an error or a log."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import aiolock

from ..etcd_server import EtcdServer, make_certs
from ..servers import free_port
from .conftest import SECRET, Target, claim_keys


async def _use(url: str, **kw: Any) -> None:
    """connect() and one acquire/release: where a bad option must be refused at the latest."""
    locks = aiolock.connect(url, **kw)
    try:
        lease = await asyncio.wait_for(locks.lock("opt", ttl=5).acquire(), 15)
        await lease.release()
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(locks.aclose(), 10)


@pytest.mark.parametrize("query,kw,named", [
    ("?bogus=1", {}, "bogus"),
    ("", {"bogus": 1}, "bogus"),
    ("?ssl_ca_certs=/x", {}, "ssl_ca_certs"),
    ("?socket_timeout=3", {}, "socket_timeout"),
    ("", {"decode_responses": True}, "decode_responses"),
])
async def test_unknown_option_refused_naming_it(
        etcd: Target, query: str, kw: dict[str, Any], named: str) -> None:
    base = f"etcd://app:{SECRET}@{etcd.server.endpoint}"
    with pytest.raises(ValueError) as err:
        await _use(base + query, **kw)
    assert named in str(err.value)
    assert SECRET not in str(err.value) and SECRET not in repr(err.value)


@pytest.mark.parametrize("query", [
    "?connect_timeout=abc", "?request_timeout=-1", "?request_timeout=0", "?connect_timeout=nan",
    "?request_timeout=inf", "?connect_timeout=inf", "?tls=maybe", "?prefix=",
    "?prefix=a&prefix=b", "?ca_file=",
    "?ca_file=/nonexistent/ca.pem", "?cert_file=/nonexistent/c.pem&key_file=/nonexistent/k.pem",
    "?cert_file=/etc/hostname",
])
async def test_bad_option_value_is_value_error(etcd: Target, query: str) -> None:
    """A bad value (or an option given twice, or a file that is not there) is a ValueError
    saying what is wrong, never a later grpc error or a silent default."""
    with pytest.raises(ValueError):
        await _use(f"etcd://{etcd.server.endpoint}{query}")


@pytest.mark.parametrize("query", ["?connect_timeout=abc", "?prefix=a&prefix=b", "?tls=maybe"])
async def test_bad_option_error_never_shows_password(etcd: Target, query: str) -> None:
    with pytest.raises(ValueError) as err:
        await _use(f"etcd://app:{SECRET}@{etcd.server.endpoint}{query}")
    assert SECRET not in f"{err.value} {err.value!r}"


@pytest.mark.parametrize("kw", [{"request_timeout": -1}, {"connect_timeout": "soon"},
                                {"tls": "perhaps"}, {"prefix": ""}, {"username": ""}],
                         ids=["request_timeout", "connect_timeout", "tls", "prefix", "username"])
async def test_bad_keyword_value_is_value_error(etcd: Target, kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        await _use(etcd.url, **kw)


async def test_same_option_in_url_and_keyword(etcd: Target) -> None:
    """An option given both ways must not be dropped silently: the keyword wins, or it is
    refused. Here the prefix: the key must be under the keyword's (or ValueError)."""
    other = f"adv14kw-{uuid.uuid4().hex[:8]}"
    try:
        locks = aiolock.connect(etcd.url, prefix=other)
    except ValueError:
        return
    async with locks:
        try:
            lease = await locks.lock("both", ttl=5).acquire(timeout=2)
        except ValueError:
            return
        kw_keys = claim_keys(etcd.server, other)
        url_keys = claim_keys(etcd.server, etcd.prefix)
        await lease.release()
    assert len(kw_keys) == 1 and url_keys == []


# -- a member with users, roles and auth enabled ------------------------------------------

ROOT_PW = "Adv14-root-pw"


@pytest.fixture(scope="module")
def auth_etcd() -> Iterator[EtcdServer]:
    server = EtcdServer().start()
    try:
        root = f"root:{ROOT_PW}"
        server.etcdctl("user", "add", root)
        server.etcdctl("user", "add", f"app:{SECRET}")
        server.etcdctl("user", "add", f"other:{SECRET}")
        server.etcdctl("role", "add", "aiolock-role")
        server.etcdctl("role", "grant-permission", "aiolock-role", "--prefix=true", "readwrite", "least/")
        server.etcdctl("user", "grant-role", "app", "aiolock-role")
        server.etcdctl("role", "add", "elsewhere")
        server.etcdctl("role", "grant-permission", "elsewhere", "--prefix=true", "readwrite", "nope/")
        server.etcdctl("user", "grant-role", "other", "elsewhere")
        server.etcdctl("auth", "enable")
        yield server
    finally:
        server.close()


@pytest.mark.parametrize("how", ["url", "keywords"])
async def test_least_role_runs_every_primitive(auth_etcd: EtcdServer, how: str) -> None:
    """The documented least role (readwrite on the prefix) is enough for lock, rwlock,
    semaphore, election, status, scan and force_release."""
    if how == "url":
        locks = aiolock.connect(f"etcd://app:{SECRET}@{auth_etcd.endpoint}?prefix=least")
    else:
        locks = aiolock.connect(f"etcd://{auth_etcd.endpoint}", username="app", password=SECRET,
                                prefix="least")
    async with locks:
        n = f"n-{how}"
        async with locks.lock(n, ttl=3) as a, locks.rwlock(n, ttl=3).read() as b, \
                locks.semaphore(n, 2, ttl=3) as c, locks.election(n, ttl=3).campaign(data="d") as d:
            assert len({a.token, b.token, c.token, d.token}) == 4
            assert (await locks.status(n)).held
            assert n in {i.name async for i in locks.scan(prefix="n-")}
            await asyncio.sleep(1.2)  # a renewal round under the role
            assert not a.lost
        victim = await locks.lock(n, ttl=3).acquire()
        assert await locks.lock(n).force_release()
        await asyncio.wait_for(victim.wait_lost(), 3)


@pytest.mark.parametrize("user,pw", [("app", "wrong-" + SECRET), ("nobody", SECRET), ("other", SECRET)])
async def test_refused_credentials_or_permission_access_denied(
        auth_etcd: EtcdServer, user: str, pw: str, caplog: pytest.LogCaptureFixture) -> None:
    """Wrong password, unknown user, a role on another prefix: AccessDenied, quickly, and
    no password in the error, its cause, or any log line."""
    caplog.set_level(logging.DEBUG)
    url = f"etcd://{user}:{pw}@{auth_etcd.endpoint}?prefix=least&request_timeout=3"
    t0 = time.monotonic()
    with pytest.raises(aiolock.AccessDenied) as err:
        await _use(url)
    assert time.monotonic() - t0 < 5
    text = f"{err.value} {err.value!r} {err.value.__cause__!r} {err.value.__context__!r}"
    assert pw not in text and SECRET not in text
    assert SECRET not in caplog.text and pw not in caplog.text


async def test_no_credentials_on_auth_server(auth_etcd: EtcdServer) -> None:
    with pytest.raises(aiolock.AccessDenied):
        await _use(f"etcd://{auth_etcd.endpoint}?prefix=least&request_timeout=3")


async def test_password_not_in_repr_or_url(auth_etcd: EtcdServer) -> None:
    locks = aiolock.connect(f"etcd://app:{SECRET}@{auth_etcd.endpoint}?prefix=least")
    async with locks:
        shown = f"{locks!r} {locks} {locks.url}"
        lease = await locks.lock("r", ttl=3).acquire()
        shown += f" {lease!r} {await locks.status('r')!r}"
        await lease.release()
    assert SECRET not in shown, shown


# -- a member with TLS and client certificates required -----------------------------------

@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EtcdServer, dict[str, Path]]]:
    certs = make_certs(tmp_path_factory.mktemp("adv14-certs"))
    server = EtcdServer(certs=certs).start()
    try:
        yield server, certs
    finally:
        server.close()


@pytest.mark.parametrize("how", ["url", "keywords"])
async def test_tls_client_certificates(tls_etcd: tuple[EtcdServer, dict[str, Path]], how: str) -> None:
    server, c = tls_etcd
    if how == "url":
        locks = aiolock.connect(f"etcd://{server.endpoint}?ca_file={c['ca']}&cert_file={c['client_cert']}"
                                f"&key_file={c['client_key']}")
    else:
        locks = aiolock.connect(f"etcd://{server.endpoint}", ca_file=str(c["ca"]),
                                cert_file=str(c["client_cert"]), key_file=str(c["client_key"]))
    async with locks, locks.lock("tls", ttl=3) as lease:
        assert lease.token > 0
        assert (await locks.status("tls")).held


@pytest.mark.parametrize("what", ["no-tls", "no-client-cert", "wrong-ca", "wrong-server-name"])
async def test_tls_misconfigured_fails_bounded(tls_etcd: tuple[EtcdServer, dict[str, Path]],
                                               what: str, tmp_path: Path) -> None:
    """Plain text to a TLS port, no client certificate, a CA that did not sign the server,
    a server_name the certificate does not carry: a LockError (BackendUnavailable or
    AccessDenied), never a hang nor a raw grpc error."""
    server, c = tls_etcd
    base = f"etcd://{server.endpoint}?connect_timeout=2&request_timeout=2"
    if what == "no-tls":
        url = base
    elif what == "no-client-cert":
        url = f"{base}&ca_file={c['ca']}"
    elif what == "wrong-ca":
        other = make_certs(tmp_path / "other")
        url = f"{base}&ca_file={other['ca']}&cert_file={c['client_cert']}&key_file={c['client_key']}"
    else:
        url = (f"{base}&ca_file={c['ca']}&cert_file={c['client_cert']}&key_file={c['client_key']}"
               "&server_name=not-this-host.example")
    t0 = time.monotonic()
    with pytest.raises(aiolock.LockError) as err:
        await _use(url)
    assert isinstance(err.value, aiolock.BackendUnavailable | aiolock.AccessDenied), repr(err.value)
    assert time.monotonic() - t0 < 2 + 2 + 2


@pytest.mark.parametrize("what", ["wrong-ca", "no-tls"])
async def test_permanent_tls_failure_is_unavailable_not_timeout(
        tls_etcd: tuple[EtcdServer, dict[str, Path]], what: str, tmp_path: Path) -> None:
    """A handshake that fails at once (wrong CA, plain text to TLS) with connect_timeout=1
    and a generous acquire(timeout=5): the server was never reached, so BackendUnavailable
    within the connect timeout, not LockTimeout ("could not acquire") after 5 s."""
    server, c = tls_etcd
    url = f"etcd://{server.endpoint}?connect_timeout=1&request_timeout=1"
    if what == "wrong-ca":
        other = make_certs(tmp_path / "other")
        url += f"&ca_file={other['ca']}&cert_file={c['client_cert']}&key_file={c['client_key']}"
    locks = aiolock.connect(url)
    t0 = time.monotonic()
    try:
        with pytest.raises(aiolock.LockError) as err:
            await asyncio.wait_for(locks.lock("x", ttl=3).acquire(timeout=5), 15)
    finally:
        await asyncio.wait_for(locks.aclose(), 10)
    took = time.monotonic() - t0
    assert isinstance(err.value, aiolock.BackendUnavailable), f"{err.value!r} after {took:.1f}s"
    assert took <= 1 + 1.5


async def test_tls_true_refuses_plaintext_server(etcd: Target) -> None:
    """tls=true against a plain-text member: an error in bounded time, not plain text."""
    t0 = time.monotonic()
    with pytest.raises(aiolock.BackendUnavailable):
        await _use(f"etcd://{etcd.server.endpoint}?tls=true&connect_timeout=2&request_timeout=2")
    assert time.monotonic() - t0 < 6


async def test_every_member_dead_is_unavailable_bounded() -> None:
    """Two members, both dead (refused): BackendUnavailable within the timeouts."""
    url = f"etcd://127.0.0.1:{free_port()},127.0.0.1:{free_port()}?connect_timeout=1&request_timeout=1"
    t0 = time.monotonic()
    with pytest.raises(aiolock.BackendUnavailable):
        await _use(url)
    assert time.monotonic() - t0 < 4
