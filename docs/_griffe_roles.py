"""A griffe extension for the docs build: Sphinx roles in aiolock's docstrings -> Markdown.

aiolock's docstrings are written in reST habits (``:class:`Lease```, ``text::`` before a
literal block). mkdocstrings renders docstrings as Markdown, where those would show as
``:class:`` followed by code. This rewrites, before rendering:

* ``:role:`target``` (class, meth, func, mod, attr, exc, data, obj) to a cross-reference
  ``[`target`][aiolock.X]`` when the target is an object the API reference page renders
  (``LINKED``), else to plain code; ``~a.b.C`` shows as ``C``;
* a line ending in ``::`` to one ending in ``:`` (the indented block after it is already
  a Markdown code block).

Only the docs build loads this file (mkdocs.yml, ``plugins.mkdocstrings``); it changes
nothing in the package. Keep ``LINKED`` in step with docs/reference.md: a link to an
object that is not rendered is a broken cross-reference, which fails ``--strict``.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

#: Public objects the reference page renders, by their public path (with their members
#: as rendered there). Cross-references are made only to these.
RENDERED: dict[str, tuple[str, ...]] = {
    "aiolock.connect": (),
    "aiolock.Locks": (
        "url", "capabilities", "closed", "lock", "rwlock", "semaphore", "election", "status",
        "scan", "aclose",
    ),
    "aiolock.Lock": ("locked", "acquire", "force_release"),
    "aiolock.Lease": (
        "name", "token", "holder", "lost", "released", "ttl", "expires_in", "wait_lost",
        "extend", "release",
    ),
    "aiolock.Election": ("campaign", "leader", "observe"),
    "aiolock.Campaign": ("acquire",),
    "aiolock.Leadership": ("proclaim",),
    "aiolock.Leader": ("data", "token", "holder"),
    "aiolock.Holder": ("host", "pid", "task", "data", "since"),
    "aiolock.RWLock": ("read", "write"),
    "aiolock.Semaphore": (),
    "aiolock.Capability": (),
    "aiolock.Kind": (),
    "aiolock.LockInfo": (
        "name", "held", "holders", "token", "last_token", "ttl_left", "waiters", "held_by",
        "family",
    ),
    "aiolock.LockError": (),
    "aiolock.LockTimeout": (),
    "aiolock.LockLost": (),
    "aiolock.BackendUnavailable": (),
    "aiolock.AccessDenied": (),
    "aiolock.FencedResource": ("write", "read"),
    "aiolock.RedisFencedResource": (),
    "aiolock.MemoryFencedResource": (),
    "aiolock.abc.Backend": (
        "schemes", "capabilities", "ordered", "url", "connect", "try_acquire", "renew",
        "renewal_group", "release", "abandon", "listen", "unlisten", "inspect", "set_info",
        "force_release", "scan", "aclose",
    ),
    "aiolock.abc.Claim": (),
    "aiolock.abc.Granted": (),
    "aiolock.abc.Busy": (),
    "aiolock.abc.Waiter": ("wake",),
}

LINKED: frozenset[str] = frozenset(
    [*RENDERED, *(f"{path}.{member}" for path, members in RENDERED.items() for member in members)]
)

#: Where a class is defined -> its public path (the context of a bare ``:meth:`name```).
PUBLIC_CLASS: dict[str, str] = {
    "aiolock._locks.Locks": "aiolock.Locks",
    "aiolock._lock.Lock": "aiolock.Lock",
    "aiolock._lease.Lease": "aiolock.Lease",
    "aiolock._locks.RWLock": "aiolock.RWLock",
    "aiolock._locks.Semaphore": "aiolock.Semaphore",
    "aiolock._election.Election": "aiolock.Election",
    "aiolock._election.Campaign": "aiolock.Campaign",
    "aiolock._election.Leadership": "aiolock.Leadership",
    "aiolock._election.Leader": "aiolock.Leader",
    "aiolock._holder.Holder": "aiolock.Holder",
    "aiolock.abc.LockInfo": "aiolock.LockInfo",
    "aiolock.fencing.FencedResource": "aiolock.FencedResource",
    "aiolock.fencing.RedisFencedResource": "aiolock.RedisFencedResource",
    "aiolock.fencing.MemoryFencedResource": "aiolock.MemoryFencedResource",
    "aiolock.abc.Backend": "aiolock.abc.Backend",
    "aiolock.abc.Waiter": "aiolock.abc.Waiter",
}

_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|exc|data|obj|const):`([^`]+)`")
_LITERAL_MARKER = re.compile(r"(\S)::[ \t]*$", re.MULTILINE)


def _context_class(obj: griffe.Object) -> str | None:
    node: griffe.Object | None = obj
    while node is not None and not node.is_class:
        node = node.parent if isinstance(node.parent, griffe.Object) else None
    return PUBLIC_CLASS.get(node.path) if node is not None else None


def _rewrite(text: str, context: str | None) -> str:
    def replace(match: re.Match[str]) -> str:
        target = match.group(1).strip().lstrip("!")
        short = target.startswith("~")
        target = target.lstrip("~.")
        shown = target.rsplit(".", 1)[-1] if short else target
        candidates = [target, f"aiolock.{target}", f"aiolock.abc.{target}"]
        if context is not None:
            candidates.append(f"{context}.{target}")
        for candidate in candidates:
            if candidate in LINKED:
                return f"[`{shown}`][{candidate}]"
        return f"`{shown}`"

    return _LITERAL_MARKER.sub(r"\1:", _ROLE.sub(replace, text))


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx roles and ``::`` markers in every docstring of the package."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _rewrite(obj.docstring.value, _context_class(obj))
