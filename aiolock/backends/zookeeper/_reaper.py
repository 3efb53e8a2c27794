"""The reaper's lease clocks: a holder that stopped renewing frees the lock within ttl.

A znode lives as long as its session, and also carries its lease's ``ttl``; renewal
rewrites the node's data (a new version). A contender that sees a *holding* node
unchanged for its whole ``ttl`` -- measured on its own monotonic clock from when it
first saw that version -- deletes it with a version-conditional delete. The owner counts
its own lease from before its last renewal was sent, so it knows it lost it first.
Pure bookkeeping: the backend reads the nodes and sends the delete.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ._recipe import Node, decode_data, holders, parse


class Reaper:
    """The lease clocks of the holder nodes this backend has looked at."""

    def __init__(self) -> None:
        #: holder path -> (data version, when we first saw that version, monotonic)
        self.seen: dict[str, tuple[int, float]] = {}

    def forget(self, path: str) -> None:
        """``path`` was deleted (or will be): its clock is no longer needed."""
        self.seen.pop(path, None)

    def clear(self) -> None:
        self.seen.clear()

    def prune(self, parent: str, nodes: Sequence[Node], family: str) -> None:
        """Forget the clocks of ``family``'s nodes under ``parent`` that are not in
        ``nodes`` (released since we last looked)."""
        if not self.seen:
            return
        present = {n.name for n in nodes}
        for path in list(self.seen):
            head, _, name = path.rpartition("/")
            if head != parent or name in present:
                continue
            node = parse(name)
            if node is None or node.kind.family == family:
                del self.seen[path]

    def to_read(self, parent: str, nodes: Sequence[Node], held: Sequence[Node],
                limit: int) -> set[str]:
        """The holders whose lease clock to read (forgetting the clocks of nodes gone).

        Clocks run only for nodes that hold in the full listing ``nodes``: a node in
        ``held`` that holds only because our own abandoned (not yet deleted) nodes are
        left out does not know it holds yet, and counts its lease from later than we
        would.
        """
        if nodes:
            self.prune(parent, nodes, nodes[0].kind.family)
        real = {n.name for n in holders(nodes, limit)}
        return {f"{parent}/{n.name}" for n in held if n.name in real}

    def due(
        self, paths: Sequence[str], got: Sequence[tuple[bytes, Any] | None], wait: float,
    ) -> tuple[str, int] | float:
        """Run the clocks of the holders at ``paths`` (their data and stat in ``got``):
        ``(path, version)`` of one unchanged for its whole ttl (delete it), else how long
        to wait (at most ``wait``) before looking again."""
        now = time.monotonic()
        for path, node in zip(paths, got, strict=True):
            if node is None:  # released meanwhile: its successor takes over
                self.seen.pop(path, None)
                continue
            data, stat = node
            ttl_ms = decode_data(data)[0]
            version = int(stat.version)
            seen = self.seen.get(path)
            if seen is None or seen[0] != version:
                self.seen[path] = seen = (version, now)
            stale_at = seen[1] + ttl_ms / 1000
            if now >= stale_at:
                self.seen.pop(path, None)
                return path, version
            wait = min(wait, stale_at - now + 0.002)
        return max(wait, 0.001)

    def stale(self, path: str, version: int, ttl_ms: int, now: float) -> bool:
        """Run the clock of the holder at ``path`` (for a report: ``status()``, an
        election's ``leader()`` and ``observe()``): True once we have seen it unchanged
        for its whole ttl. A report made once cannot tell (a holder granted after a wait
        may not have rewritten its node yet); one repeated, as observers do, can."""
        seen = self.seen.get(path)
        if seen is None or seen[0] != version:
            self.seen[path] = seen = (version, now)
        return now - seen[1] >= ttl_ms / 1000
