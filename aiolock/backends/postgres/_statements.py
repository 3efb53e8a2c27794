"""The SQL of the PostgreSQL backend: the tables, and one statement per primitive.

Every statement that grants also records the grant (token, holder row, expiry, NOTIFY)
in the same round trip; see each constant's comment for its parameters.
"""

from __future__ import annotations

from ...abc import Kind
from .._sql_claim import digest

__all__ = [
    "CHANNEL", "GRANT_HELD", "HOLDS", "INSPECT_LOCKS", "INSPECT_ROWS", "MIGRATE_SQL", "RENEW",
    "ROW_HOLDS", "ROW_LOCKER", "ROW_RENEW", "ROW_WAITING", "SCHEMA", "SCHEMA_KEY_TEXT", "SET_INFO",
    "TABLES_PRESENT", "TRY_EXCLUSIVE", "TRY_SHARED", "TRY_SLOTS", "UNLOCK", "advisory_key",
    "escape_like", "revoke_sql", "scan_sql", "signal_key",
]

SCHEMA_KEY_TEXT = "aiolock\0schema"
#: The NOTIFY channel of semaphore releases; the payload is the semaphore's base key.
CHANNEL = "aiolock_sem"

SCHEMA = """
CREATE TABLE IF NOT EXISTS aiolock_tokens (
    name text NOT NULL,
    family text NOT NULL,
    token bigint NOT NULL,
    PRIMARY KEY (family, name)
);
CREATE TABLE IF NOT EXISTS aiolock_holders (
    family text NOT NULL,
    name text NOT NULL,
    owner text NOT NULL,
    kind text NOT NULL,
    token bigint NOT NULL,
    pid integer NOT NULL,
    expires_at timestamptz NOT NULL,
    info text,
    since timestamptz,
    key bigint,
    PRIMARY KEY (family, name, owner)
);
CREATE TABLE IF NOT EXISTS aiolock_rows (
    family text NOT NULL,
    name text NOT NULL,
    PRIMARY KEY (family, name)
);
"""

#: Brings an ``aiolock_holders`` made by aiolock before holder records up to date (the
#: table's owner must run it; :data:`SCHEMA` alone does not change an existing table).
MIGRATE_SQL = (
    "ALTER TABLE aiolock_holders ADD COLUMN IF NOT EXISTS info text,"
    " ADD COLUMN IF NOT EXISTS since timestamptz, ADD COLUMN IF NOT EXISTS key bigint;"
)

#: ``(tables, columns)``: every table of :data:`SCHEMA` exists on the search path, and
#: ``aiolock_holders`` has the columns :data:`MIGRATE_SQL` adds.
TABLES_PRESENT = """
SELECT to_regclass('aiolock_tokens') IS NOT NULL AND to_regclass('aiolock_holders') IS NOT NULL
   AND to_regclass('aiolock_rows') IS NOT NULL AS tables,
   (SELECT count(*) FROM pg_attribute WHERE attrelid = to_regclass('aiolock_holders')
     AND attname IN ('info', 'since', 'key') AND NOT attisdropped) = 3 AS columns
"""

#: Record the grant: bump the token, note the holder (its record ``$8`` and the grant
#: time on the server clock), start the server-side expiry, and for an election's leader
#: NOTIFY its observers -- all in the statement that takes the lock (no extra round trip).
#: ``$1`` family, ``$2`` name, ``$3`` owner, ``$4`` kind, ``$5`` ttl ms, ``$6`` the
#: timeout setting to arm (idle_session_timeout, or the in-transaction one in row mode),
#: ``$8`` the holder record (``Claim.info``), ``$9`` the holding session's pid (NULL: this
#: one; row mode records on another connection). A session holds one claim at a time, so
#: any other row of this name with the holder's pid is stale (a cancelled wait's): gone.
GRANT_CTES = """
t AS (
    INSERT INTO aiolock_tokens AS t (name, family, token)
    SELECT $2, $1, 1 FROM l WHERE l.ok
    ON CONFLICT (family, name) DO UPDATE SET token = t.token + 1
    RETURNING t.token
),
gone AS (
    DELETE FROM aiolock_holders
    WHERE family = $1 AND name = $2 AND owner <> $3
      AND (expires_at < clock_timestamp() - interval '1 minute'
           OR pid = coalesce($9::integer, pg_backend_pid()))
),
h AS (
    INSERT INTO aiolock_holders AS h (family, name, owner, kind, token, pid, expires_at, info,
                                      since, key)
    SELECT $1, $2, $3, $4, t.token, coalesce($9::integer, pg_backend_pid()),
           clock_timestamp() + $5::bigint * interval '1 millisecond', $8::text, clock_timestamp(),
           l.k
    FROM t CROSS JOIN l
    ON CONFLICT (family, name, owner) DO UPDATE
        SET token = excluded.token, pid = excluded.pid, expires_at = excluded.expires_at,
            info = excluded.info, since = excluded.since, key = excluded.key
    RETURNING h.token
)
SELECT l.ok, l.k, (SELECT token FROM h) AS token,
       CASE WHEN l.ok AND $6 <> '' THEN set_config($6, $5::bigint::text, false) END AS armed,
       CASE WHEN l.ok AND $4 = 'leader' THEN pg_notify('""" + CHANNEL + """', l.k::text)::text
       END AS notified
FROM l
"""

#: Try one key (``$7``), exclusive or shared.
TRY_EXCLUSIVE = (
    "WITH l AS MATERIALIZED (SELECT pg_try_advisory_lock($7::bigint) AS ok, $7::bigint AS k),"
    + GRANT_CTES
)
TRY_SHARED = (
    "WITH l AS MATERIALIZED (SELECT pg_try_advisory_lock_shared($7::bigint) AS ok, $7::bigint AS k),"
    + GRANT_CTES
)
#: Try the slot keys ``$7`` in order; the first free one is taken (a semaphore permit).
TRY_SLOTS = (
    "WITH f AS MATERIALIZED (SELECT u.k FROM unnest($7::bigint[]) WITH ORDINALITY AS u(k, i)"
    " WHERE pg_try_advisory_lock(u.k) ORDER BY u.i LIMIT 1),"
    " l AS MATERIALIZED (SELECT (SELECT k FROM f) IS NOT NULL AS ok, (SELECT k FROM f) AS k),"
    + GRANT_CTES
)
#: Record a grant already held by this session (after a blocking wait, or in row mode).
GRANT_HELD = "WITH l AS MATERIALIZED (SELECT true AS ok, $7::bigint AS k)," + GRANT_CTES

#: Extend a held claim; ``kept`` is false when its holder row is gone: an operator
#: revoked it (``force_release`` deletes the rows of the holders it revokes).
RENEW = """
WITH u AS (
    UPDATE aiolock_holders SET expires_at = clock_timestamp() + $4::bigint * interval '1 millisecond'
    WHERE family = $1 AND name = $2 AND owner = $3
    RETURNING 1
)
SELECT set_config($5, $4::bigint::text, false), EXISTS (SELECT 1 FROM u) AS kept
"""

#: Row mode: restart the in-transaction timer (local to the held transaction) and look for
#: the holder row with a plain read (the transaction is READ COMMITTED: it sees a
#: revocation committed since). No UPDATE: inside the held transaction it would lock the
#: holder row until release, and a ``force_release`` would wait for it.
ROW_RENEW = """
SELECT set_config('idle_in_transaction_session_timeout', $4::bigint::text, true),
       EXISTS (SELECT 1 FROM aiolock_holders WHERE family = $1 AND name = $2 AND owner = $3) AS kept
"""

#: Give back everything the session holds (every advisory lock, its expiry disarmed), delete
#: the claim's holder row (``$1`` family, ``$2`` name, ``$3`` owner; the DELETE runs though
#: nothing reads it) and NOTIFY ``$4`` (the name's signal key) when it is not null: one
#: round trip. Also the clean-up of a failed or cancelled wait, so no holder row is left.
UNLOCK = """
WITH gone AS (DELETE FROM aiolock_holders WHERE family = $1 AND name = $2 AND owner = $3)
SELECT pg_advisory_unlock_all(), set_config('idle_session_timeout', '0', false),
       set_config('idle_in_transaction_session_timeout', '0', false),
       CASE WHEN $4::text IS NOT NULL THEN pg_notify('""" + CHANNEL + """', $4::text)::text END
"""

INSPECT_LOCKS = """
SELECT l.pid, l.mode, l.granted
FROM pg_locks l
WHERE l.locktype = 'advisory' AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND ((l.classid::bigint << 32) | l.objid::bigint) = ANY($1::bigint[])
"""

INSPECT_ROWS = """
SELECT (SELECT token FROM aiolock_tokens WHERE family = $1 AND name = $2) AS last,
       h.owner, h.kind, h.token, h.pid, h.info,
       extract(epoch FROM h.expires_at - clock_timestamp()) AS left_s,
       extract(epoch FROM clock_timestamp() - h.since) AS since_s
FROM (SELECT 1) AS one
LEFT JOIN aiolock_holders h ON h.family = $1 AND h.name = $2
ORDER BY h.token
"""

#: True where session ``pid`` holds the advisory lock ``key`` (any key: a row from before
#: the ``key`` column). A plain read of ``pg_locks``: it blocks no one.
HOLDS = """EXISTS (
    SELECT 1 FROM pg_locks l
    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 AND l.pid = {pid}
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND ({key} IS NULL OR ((l.classid::bigint << 32) | l.objid::bigint) = {key}))"""

#: True where session ``pid`` holds the row lock on ``aiolock_rows(family, name)`` (row
#: mode): the row's ``xmax`` is the transaction that locked it, and a running transaction
#: holds a lock on its own id in ``pg_locks``. Plain reads: no row is locked, so a
#: concurrent ``FOR UPDATE NOWAIT`` is never disturbed.
ROW_HOLDS = """EXISTS (
    SELECT 1 FROM aiolock_rows r
    JOIN pg_locks l ON l.locktype = 'transactionid' AND l.granted AND l.transactionid = r.xmax
    WHERE r.family = {family} AND r.name = {name} AND l.pid = {pid})"""

#: Row mode: how many sessions wait for the row ``r``: the first waits on the holder's
#: transaction id, the others on the row's tuple lock (``ctid`` is (page, tuple); the
#: rows of ``aiolock_rows`` are locked, never updated, so it does not move).
_ROW_WAITING = """(SELECT count(DISTINCT w.pid) FROM pg_locks w WHERE NOT w.granted AND (
        (w.locktype = 'transactionid' AND w.transactionid = r.xmax)
        OR (w.locktype = 'tuple' AND w.relation = 'aiolock_rows'::regclass
            AND w.page = (r.ctid::text::point)[0]::int
            AND w.tuple = (r.ctid::text::point)[1]::int)))"""

#: Row mode: the session holding the row lock of ``$1``/``$2`` (no row if free), and how
#: many wait for it.
ROW_LOCKER = """
SELECT l.pid, """ + _ROW_WAITING + """ AS waiting FROM aiolock_rows r
JOIN pg_locks l ON l.locktype = 'transactionid' AND l.granted AND l.transactionid = r.xmax
WHERE r.family = $1 AND r.name = $2
"""

#: Row mode, in :func:`scan_sql`: how many wait for the holder row ``h``'s row lock.
ROW_WAITING = ("(SELECT " + _ROW_WAITING + " FROM aiolock_rows r"
               " WHERE r.family = h.family AND r.name = h.name)")

#: How many wait on the server for the holder's advisory key.
_WAITING = """(SELECT count(*) FROM pg_locks w
        WHERE w.locktype = 'advisory' AND NOT w.granted AND w.objsubid = 1
          AND ((w.classid::bigint << 32) | w.objid::bigint) = h.key)"""


def scan_sql(holds: str, waiting: str = _WAITING) -> str:
    """``scan``: every holder row whose session really holds its lock (``holds``:
    :data:`HOLDS` or :data:`ROW_HOLDS`), for names ``LIKE $1`` (the prefix with ``!``,
    ``%`` and ``_`` escaped), with the name's last token and how many wait. Plain SELECTs:
    no row is locked."""
    return """
SELECT h.family, h.name, h.kind, h.token, h.pid, h.info,
       extract(epoch FROM h.expires_at - clock_timestamp()) AS left_s,
       extract(epoch FROM clock_timestamp() - h.since) AS since_s,
       (SELECT t.token FROM aiolock_tokens t WHERE t.family = h.family AND t.name = h.name) AS last,
       """ + waiting + """ AS waiting
FROM aiolock_holders h
WHERE h.name LIKE $1 ESCAPE '!' AND """ + holds.format(pid="h.pid", key="h.key", family="h.family",
                                                      name="h.name") + """
ORDER BY h.name, h.family, h.token
"""


def revoke_sql(holds: str) -> str:
    """``force_release``: delete every holder row of ``$1``/``$2`` (each holder's next
    renewal then finds its row gone: revoked), counting those whose session held the lock;
    NOTIFY ``$3`` (the name's signal key, for elections and semaphores) when not null."""
    return """
WITH d AS (
    DELETE FROM aiolock_holders h WHERE h.family = $1 AND h.name = $2 RETURNING h.pid, h.key
)
SELECT (SELECT count(*) FROM d WHERE """ + holds.format(pid="d.pid", key="d.key", family="$1",
                                                        name="$2") + """) AS live,
       CASE WHEN $3::text IS NOT NULL THEN pg_notify('""" + CHANNEL + """', $3::text)::text
       END AS notified
"""


#: ``set_info`` (an elected leader's ``proclaim``): replace the record, NOTIFY observers.
SET_INFO = """
WITH u AS (
    UPDATE aiolock_holders SET info = $4 WHERE family = $1 AND name = $2 AND owner = $3
    RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM u) AS kept, pg_notify('""" + CHANNEL + """', $5::text)::text
"""


def advisory_key(family: str, name: str, slot: int | None = None) -> int:
    """The signed 64-bit advisory lock key of ``name`` in ``family`` (and a slot)."""
    return int.from_bytes(digest(family, name, slot, 8), "big", signed=True)


def signal_key(kind: Kind, name: str) -> int | None:
    """The NOTIFY payload key of ``name``'s releases (semaphores) and of its leadership
    changes (elections); None for the kinds whose waiters queue on the server."""
    if kind is Kind.PERMIT:
        return advisory_key("sem", name)
    if kind is Kind.LEADER:
        return advisory_key("elect", name)
    return None


def escape_like(prefix: str) -> str:
    """``prefix`` as a ``LIKE ... ESCAPE '!'`` pattern matching names that start with it."""
    return prefix.replace("!", "!!").replace("%", "!%").replace("_", "!_") + "%"
