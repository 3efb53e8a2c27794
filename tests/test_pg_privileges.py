"""PostgreSQL under the least privileges the README documents, on a real server.

The administrator makes the three tables once; the application's role gets CONNECT, USAGE
on the schema and SELECT/INSERT/UPDATE/DELETE on those tables, nothing else (no CREATE,
not a superuser). Every primitive works under exactly that; one privilege less is
:class:`aiolock.AccessDenied` with a message naming what is missing.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

pytest.importorskip("asyncpg")

import asyncpg

import aiolock
from aiolock.backends.postgres import _SCHEMA

from .pg_server import PostgresServer, find_pg_bin

pytestmark = pytest.mark.skipif(find_pg_bin() is None, reason="PostgreSQL is not installed")

#: The grants of the README's "Least privileges" section, for role {role}.
GRANTS = """
GRANT CONNECT ON DATABASE {db} TO {role};
GRANT USAGE ON SCHEMA public TO {role};
GRANT SELECT, INSERT, UPDATE, DELETE ON aiolock_tokens, aiolock_holders, aiolock_rows TO {role};
"""


async def _role(pg: PostgresServer, grants: str) -> str:
    role = f"app_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(pg.url)
    try:
        await admin.execute(_SCHEMA)
        await admin.execute(f"CREATE ROLE {role} LOGIN")
        await admin.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
        await admin.execute(grants.format(db=pg.database, role=role))
    finally:
        await admin.close()
    return f"postgresql://{role}@127.0.0.1:{pg.port}/{pg.database}"


@pytest.mark.parametrize("mode", ["advisory", "row"])
async def test_every_primitive_under_the_documented_grants(
    postgres_server: PostgresServer, mode: str
) -> None:
    url = await _role(postgres_server, GRANTS)
    name = f"lp-{uuid.uuid4().hex[:8]}"
    async with aiolock.connect(url, mode=mode) as a, aiolock.connect(url, mode=mode) as b:
        async with a.lock(name, ttl=2) as lease:
            assert lease.token >= 1
            assert (await b.status(name)).held
            with pytest.raises(aiolock.LockTimeout):
                await b.lock(name).acquire(timeout=0)
            await lease.extend(3)
        second = await b.lock(name, fair=mode == "advisory").acquire(timeout=2)
        assert second.token > lease.token
        await second.release()
        if mode == "advisory":
            rw = a.rwlock(name)
            async with rw.read(), b.rwlock(name).read():
                pass
            async with rw.write():
                pass
            sem = a.semaphore(name, limit=2)
            async with sem, b.semaphore(name, limit=2):
                assert (await a.status(name, aiolock.Kind.PERMIT)).holders == 2


async def test_one_privilege_less_is_access_denied(postgres_server: PostgresServer) -> None:
    url = await _role(postgres_server, GRANTS.replace("SELECT, INSERT, UPDATE, DELETE",
                                                      "SELECT, INSERT, DELETE"))
    async with aiolock.connect(url) as locks:
        with pytest.raises(aiolock.AccessDenied, match="aiolock_tokens") as info:
            await asyncio.wait_for(locks.lock("denied").acquire(timeout=1), 10)
    assert isinstance(info.value, PermissionError)
