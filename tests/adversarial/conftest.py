"""Fixtures of the adversarial tests (the servers of ``tests/conftest.py`` are reused)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .servers import PasswordRedis, TLSRedis

SECRET = "s3cr3t-Pa55w0rd-xyz"

# an ACL user allowed everything but scripting, and one allowed exactly nothing useful
ACL_USERS = [
    "default on nopass ~* &* +@all",
    f"noscript on >{SECRET} ~* &* +@all -@scripting",
    f"nothing on >{SECRET} ~* &* -@all +auth +hello +ping",
    f"full on >{SECRET} ~* &* +@all",
    f"nochannels on >{SECRET} ~* resetchannels +@all",
]


@pytest.fixture(scope="session")
def password_redis() -> Iterator[PasswordRedis]:
    server = PasswordRedis(password=SECRET).start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def acl_redis() -> Iterator[PasswordRedis]:
    server = PasswordRedis(users=ACL_USERS).start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def tls_redis() -> Iterator[TLSRedis]:
    server = TLSRedis().start()
    yield server
    server.close()
