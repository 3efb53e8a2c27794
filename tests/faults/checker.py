"""The checker: owns the protected resource (one counter per lock) and logs every attempt.

    python -m tests.faults.checker SOCKET

Listens on a Unix socket for JSON lines. The resource of each lock is an
:class:`aiolock.MemoryFencedResource` (the library's own fencing helper) holding a
counter: a holder does a *fenced read* (a write of the unchanged value with its token,
so the resource learns the token before the holder's read-modify-write), then a fenced
write of the value + 1. The helper accepts an access only if its token is at least the
highest it has seen. Every message is stamped with ``time.monotonic()`` on arrival and
kept in order; ``DUMP path`` writes the log as JSON lines for the orchestrator.

Requests (a reply ``[id, result]``):
  ``["R", id, lock, token, pid, t_check]``           -> ``[accepted, value]``
  ``["W", id, lock, token, pid, t_check, value, read]`` -> ``accepted``
  ``["HOLD", id]``  -> ``[{lock: [pid, token, t]}, writes]``: who holds what, as
  reported, and how many fenced writes were attempted so far
  ``["DUMP", id, path]`` -> number of records
Reports (no reply): ``["A", lock, token, pid, t_req, t_acq]`` acquired;
``["E", lock, token, pid, t_exit, t_done, how]`` the hold ended (how: released, lost,
cancelled, error); ``["C", pid, what, ok]`` a cancellation and its nonce echo;
``["S", pid, expired, detected]`` an event-loop stall; ``["N", pid, text]`` a note.

Log records: the message with the arrival time inserted after its kind, plus for R the
value returned and for W the counter's value before the write.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from aiolock import MemoryFencedResource


class Checker:
    """The protected resources and the log."""

    def __init__(self) -> None:
        self.resources: dict[str, MemoryFencedResource] = {}
        self.log: list[list[Any]] = []
        self.holders: dict[str, list[Any]] = {}
        self.writes = 0

    def resource(self, lock: str) -> MemoryFencedResource:
        res = self.resources.get(lock)
        if res is None:
            res = self.resources[lock] = MemoryFencedResource()
            res.value = b"0"
        return res

    async def handle(self, msg: list[Any]) -> Any:
        now = time.monotonic()
        kind = msg[0]
        if kind == "R":
            _, _rid, lock, token, pid, tc = msg
            res = self.resource(lock)
            current = res.value
            ok = await res.write(int(token), current or b"0")
            value = int(current or b"0")
            self.log.append(["R", now, lock, token, pid, tc, ok, value])
            return [ok, value]
        if kind == "W":
            _, _rid, lock, token, pid, tc, value, read = msg
            res = self.resource(lock)
            before = int(res.value or b"0")
            ok = await res.write(int(token), str(value))
            self.writes += 1
            self.log.append(["W", now, lock, token, pid, tc, ok, read, before])
            return ok
        if kind == "A":
            self.holders[msg[1]] = [msg[3], msg[2], now]
        elif kind == "E":
            held = self.holders.get(msg[1])
            if held is not None and held[1] == msg[2]:
                del self.holders[msg[1]]
        elif kind == "HOLD":
            return [self.holders, self.writes]
        elif kind == "DUMP":
            text = "".join(json.dumps(rec) + "\n" for rec in self.log)
            await asyncio.to_thread(Path(msg[2]).write_text, text)
            return len(self.log)
        if kind in ("A", "E", "C", "S", "N"):
            self.log.append([kind, now, *msg[1:]])
        return None

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                msg = json.loads(line)
                result = await self.handle(msg)
                if msg[0] in ("R", "W", "HOLD", "DUMP"):
                    writer.write(json.dumps([msg[1], result]).encode() + b"\n")
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


async def main() -> int:
    path = sys.argv[1]
    checker = Checker()
    server = await asyncio.start_unix_server(checker.serve, path, limit=1 << 24)
    print("READY", flush=True)
    loop = asyncio.get_running_loop()
    # run until stdin closes (the orchestrator went away or asked us to stop)
    await loop.run_in_executor(None, sys.stdin.read)
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
