"""``postgresql://user@host:port/db`` (also ``postgres://``): PostgreSQL with ``asyncpg``.

User guide (modes, options, guarantees, privileges): ``docs/backends/postgresql.md``.

Layout: the claim machinery shared with MySQL is :mod:`aiolock.backends._sql`; here,
``_statements`` (the tables and one statement per primitive, each grant recorded in the
statement that takes the lock), ``_connection`` (``asyncpg``, its one exception map, the
URL's options), ``_notify`` (``LISTEN``/``NOTIFY`` signals for semaphores and elections),
``_backend`` (:class:`PostgresBackend`, session advisory locks) and ``_row``
(:class:`PostgresRowBackend`, ``?mode=row``, the ``SELECT ... FOR UPDATE`` row lock).

In short: a lock is a session advisory lock on a 64-bit hash of (family, name); a held
claim keeps its connection, whose ``idle_session_timeout = ttl`` ends a holder that stops
renewing; waiters queue in the server's own lock queue (fair, writers not starved);
tokens and holder records live in ``aiolock_tokens`` and ``aiolock_holders``, written by
the grant statement itself; a revocation deletes the holder rows, which the holders'
next renewals notice.
"""

from ._backend import PostgresBackend
from ._row import PostgresRowBackend
from ._statements import MIGRATE_SQL, advisory_key

__all__ = ["MIGRATE_SQL", "PostgresBackend", "PostgresRowBackend", "advisory_key"]
