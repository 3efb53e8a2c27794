"""``mysql://user@host:port/db`` (also ``mariadb://``): MySQL / MariaDB with ``asyncmy``.

User guide (modes, options, guarantees, privileges): ``docs/backends/mysql.md``.

Layout: the claim machinery shared with PostgreSQL is :mod:`aiolock.backends._sql`; here,
``_statements`` (the tables and the multi-statement requests), ``_connection``
(``asyncmy``, its one exception map, the URL), ``_backend`` (:class:`MySQLBackend`,
``GET_LOCK`` named locks) and ``_row`` (:class:`MySQLRowBackend`, ``?mode=row``, the
``SELECT ... FOR UPDATE`` row lock).

In short: a lock is a ``GET_LOCK`` named lock on a hash of (family, name), held by the
claim's connection, whose ``wait_timeout = ceil(ttl)`` ends a holder that stops
renewing; the token (``LAST_INSERT_ID(token + 1)`` in InnoDB) and the holder row are
written in the request that takes the lock; a waiter blocks in ``GET_LOCK`` on its own
connection, which a cancellation ends with ``KILL CONNECTION``; a revocation deletes the
holder rows, which the holders' next renewals notice.
"""

from ._backend import MySQLBackend
from ._row import MySQLRowBackend
from ._statements import lock_key

__all__ = ["MySQLBackend", "MySQLRowBackend", "lock_key"]
