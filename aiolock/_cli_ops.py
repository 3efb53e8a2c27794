"""The operators' commands of the CLI: ``aiolock ls`` and ``aiolock revoke``."""

from __future__ import annotations

import json
import sys

from ._connect import connect
from ._validate import check_name
from .abc import FAMILY_KIND, Capability, LockInfo

__all__ = [
    "FAMILY_NAMES", "format_info", "info_json", "list_held", "offered", "printable", "revoke",
]

FAMILY_NAMES = {"lock": "lock", "rw": "rwlock", "sem": "semaphore", "elect": "election"}


def info_json(info: LockInfo) -> dict[str, object]:
    """One held name as the JSON object ``aiolock ls --json`` prints."""
    return {
        "name": info.name, "kind": FAMILY_NAMES.get(info.family, info.family),
        "token": info.token, "last_token": info.last_token, "ttl_left": info.ttl_left,
        "waiters": info.waiters, "holders": [
            {"host": h.host, "pid": h.pid, "task": h.task, "data": h.data, "since": h.since,
             "waiting": h.waiting}
            for h in info.held_by
        ],
    }


def printable(name: str) -> str:
    """``name`` as is, or ``repr()``'d if it holds control characters (a newline would
    split one entry over two lines)."""
    return name if name.isprintable() else repr(name)


def format_info(info: LockInfo) -> str:
    """One held name as a line of ``aiolock ls``."""
    left = "-" if info.ttl_left is None else f"{info.ttl_left:.1f}s"
    who = ", ".join(
        f"{h.host}:{h.pid}" + (f"/{h.task}" if h.task else "") + (f" {h.data!r}" if h.data else "")
        for h in info.held_by
    ) or f"{info.holders} holder(s)"
    token = "-" if info.token is None else str(info.token)
    kind = FAMILY_NAMES.get(info.family, info.family)
    return f"{printable(info.name)}  {kind}  token {token}  left {left}  waiters {info.waiters}  {who}"


async def list_held(url: str, prefix: str, *, as_json: bool) -> int:
    """``aiolock ls``: every held name starting with ``prefix``."""
    async with connect(url) as locks:
        if Capability.SCAN not in locks.capabilities:
            print(f"aiolock: {locks.url} cannot list its locks (no scan); use 'aiolock status NAME'",
                  file=sys.stderr)
            return 2
        async for info in locks.scan(prefix):
            print(json.dumps(info_json(info)) if as_json else format_info(info))
    return 0


async def revoke(url: str, name: str) -> int:
    """``aiolock revoke``: force-release every holder of ``name``, in every family the
    backend offers; 0 if something was held, 1 if nothing was."""
    name = check_name(name)
    async with connect(url) as locks:
        locks._engine.need(Capability.REVOKE, "revoke")
        revoked = [
            FAMILY_NAMES[family] for family, kind in FAMILY_KIND.items()
            if offered(locks.capabilities, family)
            and await locks.backend.force_release(name, kind)
        ]
    if revoked:
        print(f"{printable(name)}: revoked ({', '.join(revoked)}); the holders lose it at their next renewal")
        return 0
    print(f"{printable(name)}: nothing was held")
    return 1


def offered(capabilities: frozenset[Capability], family: str) -> bool:
    need = {"rw": Capability.RWLOCK, "sem": Capability.SEMAPHORE, "elect": Capability.ELECTION}
    return family not in need or need[family] in capabilities
