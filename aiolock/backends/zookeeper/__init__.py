"""``zookeeper://[user:password@]host:port,host:port/chroot`` (also ``zk://``): ZooKeeper
via ``aiozk`` (user guide: docs/backends/zookeeper.md).

Only ``aiozk.ZKClient``'s session is used; the recipes are our own (``aiozk``'s
``recipes.Lock`` leaks znodes on cancellation, misses deletes after a reconnect and
ignores session expiry). The package, by role, bottom up:

* :mod:`._recipe` -- pure: znode names and data; who holds and what a waiter watches,
  through the queue recipe shared with etcd (:mod:`aiolock.backends._queue`);
* :mod:`._options` -- the URL, digest credentials, the ACL of the nodes we create;
* :mod:`._session` -- the ``aiozk`` repairs (tested ``aiozk`` version range there);
* :mod:`._claim` -- what we remember per claim (:class:`._claim.ClaimState`);
* :mod:`._io` -- the session's life, single requests, the one error map;
* :mod:`._reaper` -- lease clocks: a holder that stopped renewing is deleted after ttl;
* :mod:`._watches` -- which watch wakes which waiter or election observer;
* :mod:`._acquire` -- one acquire attempt;
* :mod:`._backend` -- :class:`ZooKeeperBackend`, the core's primitives.

Logs go to the ``aiolock.backends.zookeeper`` logger.
"""

from __future__ import annotations

try:
    import aiozk  # noqa: F401
except ImportError as _exc:  # pragma: no cover - reported by aiolock.connect()
    raise ImportError(
        "the zookeeper:// backend needs aiozk: pip install 'aiolock[zookeeper]'", name="aiozk"
    ) from _exc

from ._backend import ZooKeeperBackend
from ._recipe import zk_name

__all__ = ["ZooKeeperBackend", "zk_name"]
