"""The SQL of the MySQL / MariaDB backend: the tables, and the statements per primitive.

Statements run as one multi-statement request (the client sets ``MULTI_STATEMENTS``), so a
grant and its bookkeeping take one round trip; ``%s`` are the client's parameters.
"""

from __future__ import annotations

from .._sql_claim import digest

__all__ = [
    "FOREVER", "GRANT_TAIL", "INSPECT", "INSPECT_SEM", "RECORD", "RELEASE", "RENEW", "REVOKE",
    "ROW_INSPECT", "ROW_RELEASE", "ROW_RENEW", "ROW_RESET", "ROW_SET_INFO", "ROW_SLOT", "SCAN",
    "SCHEMA", "SET_INFO", "TABLES_PRESENT", "lock_key", "like_prefix",
]

#: A blocking ``GET_LOCK``'s timeout (s): "forever" (MariaDB refuses negative values).
FOREVER = 365 * 86400

#: The tables by name, each with the statement that makes it if missing.
SCHEMA = {
    "aiolock_tokens": "CREATE TABLE IF NOT EXISTS aiolock_tokens ("
    " family VARCHAR(8) NOT NULL, name VARBINARY(2048) NOT NULL, token BIGINT NOT NULL,"
    " PRIMARY KEY (family, name)) ENGINE=InnoDB",
    "aiolock_holders": "CREATE TABLE IF NOT EXISTS aiolock_holders ("
    " family VARCHAR(8) NOT NULL, name VARBINARY(2048) NOT NULL, slot INT NOT NULL,"
    " owner CHAR(32) NOT NULL, kind VARCHAR(8) NOT NULL, token BIGINT NOT NULL,"
    " conn BIGINT NOT NULL, ttl_ms BIGINT NOT NULL, since DATETIME(6) NOT NULL,"
    " info TEXT CHARACTER SET utf8mb4 NOT NULL,"
    " PRIMARY KEY (family, name, slot)) ENGINE=InnoDB",
    "aiolock_rows": "CREATE TABLE IF NOT EXISTS aiolock_rows ("
    " family VARCHAR(8) NOT NULL, name VARBINARY(2048) NOT NULL,"
    " PRIMARY KEY (family, name)) ENGINE=InnoDB",
}

#: Which of the tables exist in the connection's database (a plain read: no privilege
#: beyond those on the tables themselves).
TABLES_PRESENT = ("SELECT TABLE_NAME FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE()"
                  " AND TABLE_NAME IN ('aiolock_tokens', 'aiolock_holders', 'aiolock_rows')")

#: After ``@aiolock_slot`` is set (the slot taken, or NULL): arm the session's expiry,
#: bump the token (autocommit: its own transaction), record the holder, report.
#: Parameters: ttl s, family, name, family, name, owner, kind, ttl ms, holder record.
GRANT_TAIL = """;
SET SESSION wait_timeout = IF(@aiolock_slot IS NULL, @@GLOBAL.wait_timeout, %s);
INSERT INTO aiolock_tokens (family, name, token)
    SELECT %s, %s, LAST_INSERT_ID(1) FROM DUAL WHERE @aiolock_slot IS NOT NULL
    ON DUPLICATE KEY UPDATE token = LAST_INSERT_ID(token + 1);
REPLACE INTO aiolock_holders (family, name, slot, owner, kind, token, conn, ttl_ms, since, info)
    SELECT %s, %s, @aiolock_slot, %s, %s, LAST_INSERT_ID(), CONNECTION_ID(), %s, NOW(6), %s
    FROM DUAL WHERE @aiolock_slot IS NOT NULL;
SELECT @aiolock_slot, LAST_INSERT_ID()"""

#: Is the holder row of (family, name, slot, owner) still there? (a revocation deletes it)
_KEPT = ("EXISTS (SELECT 1 FROM aiolock_holders WHERE family = %s AND name = %s AND slot = %s"
         " AND owner = %s)")

#: 1: held; 0: gone; 2: held, but its holder row was deleted (revoked by an operator).
#: Parameters: ttl s, the lock name, family, name, slot, owner.
RENEW = ("SET SESSION wait_timeout = %s; SELECT CASE WHEN NOT IS_USED_LOCK(%s) <=> CONNECTION_ID()"
         " THEN 0 WHEN " + _KEPT + " THEN 1 ELSE 2 END")

#: Parameters: the lock name, family, name, slot, owner.
RELEASE = (
    "SELECT RELEASE_LOCK(%s);"
    " DELETE FROM aiolock_holders WHERE family = %s AND name = %s AND slot = %s AND owner = %s;"
    " SET SESSION wait_timeout = @@GLOBAL.wait_timeout"
)

_UPDATE_INFO = ("UPDATE aiolock_holders SET info = %s WHERE family = %s AND name = %s AND slot = %s"
                " AND owner = %s; ")

#: A proclaim on the holding session: is it still ours? Parameters: info, family, name,
#: slot, owner, the lock name, family, name, slot, owner.
SET_INFO = _UPDATE_INFO + "SELECT IS_USED_LOCK(%s) <=> CONNECTION_ID() AND " + _KEPT

#: Row mode's proclaim, on a connection other than the holder's (its transaction is never
#: committed). Parameters: info, family, name, slot, owner, family, name, slot, owner.
ROW_SET_INFO = _UPDATE_INFO + "SELECT " + _KEPT

#: The holder's session and its idle time (``{idle_ms}``: MariaDB's ``TIME_MS`` or MySQL's
#: ``TIME * 1000``) and the holder row's columns, for :func:`_backend._left`.
_HOLDER_COLUMNS = ("h.ttl_ms, {idle_ms}, p.COMMAND, h.info,"
                   " TIMESTAMPDIFF(MICROSECOND, h.since, NOW(6)) / 1e6")

#: Parameters: the lock name, family, name, family, name.
INSPECT = """
SELECT IS_USED_LOCK(%s), t.token, h.token, h.conn, """ + _HOLDER_COLUMNS + """
FROM (SELECT 1) AS one
LEFT JOIN aiolock_tokens t ON t.family = %s AND t.name = %s
LEFT JOIN aiolock_holders h ON h.family = %s AND h.name = %s AND h.slot = 0
LEFT JOIN information_schema.PROCESSLIST p ON p.ID = h.conn
"""

#: A semaphore's holder rows (the limit is not stored). Parameters: name, name.
INSPECT_SEM = """
SELECT h.slot, h.conn, """ + _HOLDER_COLUMNS + """,
       (SELECT token FROM aiolock_tokens WHERE family = 'sem' AND name = %s)
FROM (SELECT 1) AS one LEFT JOIN aiolock_holders h ON h.family = 'sem' AND h.name = %s
LEFT JOIN information_schema.PROCESSLIST p ON p.ID = h.conn
"""

#: Names held (by a holder row) that match a ``LIKE`` pattern.
SCAN = ("SELECT DISTINCT family, name FROM aiolock_holders WHERE name LIKE %s"
        " ORDER BY name, family")

#: Delete the holder rows of (family, name): each holder's next renewal finds it revoked.
REVOKE = "DELETE FROM aiolock_holders WHERE family = %s AND name = %s; SELECT ROW_COUNT()"

#: Row mode's holder rows are apart from the named locks' (``slot`` 0, or a semaphore's
#: 0 ... limit - 1): the two modes are separate locks, each keeps its own holder record.
ROW_SLOT = -1

#: Row mode: commit the token and the holder row (on a connection other than the holder's).
#: Parameters: family, name, family, name, owner, kind, holder conn id, ttl ms, info.
RECORD = (
    "INSERT INTO aiolock_tokens (family, name, token) VALUES (%s, %s, LAST_INSERT_ID(1))"
    " ON DUPLICATE KEY UPDATE token = LAST_INSERT_ID(token + 1);"
    " REPLACE INTO aiolock_holders (family, name, slot, owner, kind, token, conn, ttl_ms,"
    f" since, info) VALUES (%s, %s, {ROW_SLOT}, %s, %s, LAST_INSERT_ID(), %s, %s, NOW(6), %s);"
    " SELECT LAST_INSERT_ID()"
)

#: Row mode: restart the session's idle timer, and look for the holder row (a plain
#: read: the transaction is READ COMMITTED, so it sees a revocation committed since).
#: Parameters: ttl s, family, name, owner.
ROW_RENEW = ("SET SESSION wait_timeout = %s; SELECT EXISTS (SELECT 1 FROM aiolock_holders"
             f" WHERE family = %s AND name = %s AND slot = {ROW_SLOT} AND owner = %s)")

#: Row mode: end the transaction (and the row lock with it), put the session's timeouts back.
ROW_RESET = ("ROLLBACK; SET SESSION wait_timeout = @@GLOBAL.wait_timeout,"
             " innodb_lock_wait_timeout = @@GLOBAL.innodb_lock_wait_timeout")

#: Row mode: give the row lock back (:data:`ROW_RESET`), forget the holder row.
ROW_RELEASE = ROW_RESET + (
    "; DELETE FROM aiolock_holders WHERE family = %s AND name = %s"
    f" AND slot = {ROW_SLOT} AND owner = %s"
)

#: Row mode: is the row locked (a ``SKIP LOCKED`` probe in a transaction of its own), and
#: the holder row. Parameters: family, name (four times).
ROW_INSPECT = (
    "START TRANSACTION;"
    " SELECT (SELECT COUNT(*) FROM aiolock_rows WHERE family = %s AND name = %s),"
    " (SELECT COUNT(*) FROM (SELECT 1 FROM aiolock_rows WHERE family = %s AND name = %s"
    "  LOCK IN SHARE MODE SKIP LOCKED) AS f) INTO @aiolock_exists, @aiolock_free;"
    " ROLLBACK;"
    " SELECT @aiolock_exists, @aiolock_free, t.token, h.token, " + _HOLDER_COLUMNS +
    " FROM (SELECT 1) AS one"
    " LEFT JOIN aiolock_tokens t ON t.family = %s AND t.name = %s"
    f" LEFT JOIN aiolock_holders h ON h.family = %s AND h.name = %s AND h.slot = {ROW_SLOT}"
    " LEFT JOIN information_schema.PROCESSLIST p ON p.ID = h.conn"
)


def lock_key(family: str, name: str, slot: int | None = None) -> str:
    """The ``GET_LOCK`` name of ``name`` in ``family`` (and a semaphore slot): 48 chars.

    ``GET_LOCK`` names are limited to 64 characters and compared without case: every name
    is hashed, and the family keeps ``lock()`` and ``semaphore()`` of one name apart."""
    return "aiolock:" + digest(family, name, slot, 20).hex()


def like_prefix(prefix: str) -> bytes:
    """A ``LIKE`` pattern matching names that start with ``prefix`` (``\\`` escapes)."""
    raw = prefix.encode("utf-8", "surrogatepass")
    for char in (b"\\", b"%", b"_"):
        raw = raw.replace(char, b"\\" + char)
    return raw + b"%"
