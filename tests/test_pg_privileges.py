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
from aiolock.backends.postgres._statements import MIGRATE_SQL
from aiolock.backends.postgres._statements import SCHEMA as _SCHEMA

from .pg_server import PostgresServer, find_pg_bin

pytestmark = pytest.mark.skipif(find_pg_bin() is None, reason="PostgreSQL is not installed")

#: The grants of the README's "Least privileges" section, for role {role}.
GRANTS = """
GRANT CONNECT ON DATABASE {db} TO {role};
GRANT USAGE ON SCHEMA public TO {role};
GRANT SELECT, INSERT, UPDATE, DELETE ON aiolock_tokens, aiolock_holders, aiolock_rows TO {role};
"""


#: The tables as aiolock made them before holder records (no info, since, key columns).
OLD_SCHEMA = _SCHEMA.replace("    info text,\n    since timestamptz,\n    key bigint,\n", "")


async def _role(pg: PostgresServer, grants: str, *, database: str | None = None,
                schema: str = _SCHEMA) -> str:
    role = f"app_{uuid.uuid4().hex[:8]}"
    db = database or pg.database
    admin = await asyncpg.connect(pg.url.rpartition("/")[0] + "/" + db)
    try:
        await admin.execute(schema)
        await admin.execute(f"CREATE ROLE {role} LOGIN")
        await admin.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
        await admin.execute(grants.format(db=db, role=role))
    finally:
        await admin.close()
    return f"postgresql://{role}@127.0.0.1:{pg.port}/{db}"


async def _database(pg: PostgresServer) -> str:
    """A fresh database (its public schema has no aiolock tables yet)."""
    db = f"db_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(pg.url)
    try:
        await admin.execute(f"CREATE DATABASE {db}")
    finally:
        await admin.close()
    return db


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
            # coordination: holder records, listing, revocation, elections
            async with a.lock(name, ttl=2, data="mine"):
                assert [h.data for h in (await b.status(name)).held_by] == ["mine"]
                assert [i.name async for i in b.scan(name)] == [name]
                assert await b.lock(name).force_release() is True
            election = a.election(name, ttl=2)
            async with election.campaign(data="lead") as term:
                await term.proclaim("lead-2")
                leader = await b.election(name).leader()
                assert leader is not None and leader.data == "lead-2"
        else:
            async with a.lock(name, ttl=2, data="mine"):
                assert [h.data for h in (await b.status(name)).held_by] == ["mine"]


async def test_one_privilege_less_is_access_denied(postgres_server: PostgresServer) -> None:
    url = await _role(postgres_server, GRANTS.replace("SELECT, INSERT, UPDATE, DELETE",
                                                      "SELECT, INSERT, DELETE"))
    async with aiolock.connect(url) as locks:
        with pytest.raises(aiolock.AccessDenied, match="aiolock_tokens") as info:
            await asyncio.wait_for(locks.lock("denied").acquire(timeout=1), 10)
    assert isinstance(info.value, PermissionError)


async def test_an_old_holders_table_is_migrated_by_its_owner(postgres_server: PostgresServer) -> None:
    """Tables from before holder records: the owner's first connection adds the columns."""
    db = await _database(postgres_server)
    url = postgres_server.url.rpartition("/")[0] + "/" + db
    admin = await asyncpg.connect(url)
    try:
        assert OLD_SCHEMA != _SCHEMA
        await admin.execute(OLD_SCHEMA)
        await admin.execute("INSERT INTO aiolock_tokens VALUES ('old', 'lock', 7)")
    finally:
        await admin.close()
    async with aiolock.connect(url) as locks, locks.lock("old", ttl=2, data="new") as lease:
        assert lease.token == 8  # the old tokens are kept
        assert [h.data for h in (await locks.status("old")).held_by] == ["new"]


async def test_an_old_holders_table_under_least_privileges_names_the_migration(
    postgres_server: PostgresServer,
) -> None:
    db = await _database(postgres_server)
    url = await _role(postgres_server, GRANTS, database=db, schema=OLD_SCHEMA)
    with pytest.raises(aiolock.AccessDenied) as info:  # at connect: it checks the tables
        async with aiolock.connect(url) as locks:
            await asyncio.wait_for(locks.lock("old").acquire(timeout=1), 10)
    assert MIGRATE_SQL in str(info.value) and "older aiolock" in str(info.value)
    admin = await asyncpg.connect(postgres_server.url.rpartition("/")[0] + "/" + db)
    try:
        await admin.execute(MIGRATE_SQL)  # what the message says to run
    finally:
        await admin.close()
    async with aiolock.connect(url) as locks, locks.lock("old", ttl=2, data="ok"):
        assert [h.data for h in (await locks.status("old")).held_by] == ["ok"]
