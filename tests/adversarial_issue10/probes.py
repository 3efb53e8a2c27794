"""What each server saw each agent process do, per backend: a ``Probe`` is started when
every agent waits and stopped at the end; ``requests()`` then says, per agent pid, how
many requests (lock attempts, listings, statements) its connections made meanwhile, or
None where the server cannot tell processes apart (etcd: ``total()`` only)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import urllib.request
from collections import Counter
from collections.abc import Iterable
from typing import Any

from ..zk_server import four_letter, packets_and_watches
from .conftest import Backend, Monitor, client_ports, redis_ports


class Probe:
    def __init__(self, b: Backend, pids: Iterable[int]) -> None:
        self.b = b
        self.pids = list(pids)

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def requests(self) -> dict[int, int] | None:
        return None

    def total(self) -> int | None:
        return None

    def detail(self) -> str:
        return ""


class RedisProbe(Probe):
    """``MONITOR`` on every data server: the non-housekeeping commands per process."""

    async def start(self) -> None:
        self.monitor = Monitor(redis_ports(self.b))
        await self.monitor.__aenter__()
        await asyncio.sleep(0.1)
        self.mark = self.monitor.mark()

    async def stop(self) -> None:
        await asyncio.sleep(0.2)
        self.counts = self.monitor.attempts_by_pid(self.pids, self.mark)
        await self.monitor.__aexit__(None, None, None)

    def requests(self) -> dict[int, int]:
        return {pid: sum(c.values()) for pid, c in self.counts.items()}

    def detail(self) -> str:
        return str({pid: dict(c) for pid, c in self.counts.items()})


_CONS = re.compile(r"/127\.0\.0\.1:(\d+)\[\d+\]\(([^)]*)\)")


class ZkProbe(Probe):
    """``cons``: requests received per connection; ``mntr``: watches triggered."""

    def _cons(self) -> dict[int, int]:
        port = self.b.server.port
        owners = client_ports(self.pids, [port])
        per_pid: Counter[int] = Counter()
        for local, stats in _CONS.findall(four_letter(port, "cons", 2.0)):
            fields = dict(kv.split("=", 1) for kv in stats.split(",") if "=" in kv)
            if int(local) in owners:
                per_pid[owners[int(local)]] += int(fields.get("recved", 0))
        return dict(per_pid)

    async def start(self) -> None:
        self.before = self._cons()
        self.watches0 = packets_and_watches(self.b.server.port)[1]

    async def stop(self) -> None:
        await asyncio.sleep(0.2)
        self.after = self._cons()
        self.watches = packets_and_watches(self.b.server.port)[1] - self.watches0

    def requests(self) -> dict[int, int]:
        return {pid: self.after.get(pid, 0) - self.before.get(pid, 0) for pid in self.pids}

    def total(self) -> int:
        """Watches triggered on the server meanwhile."""
        return self.watches

    def detail(self) -> str:
        return f"watches triggered {self.watches}, cons before {self.before} after {self.after}"


class SqlProbe(Probe):
    """Samples the server's session list every 20 ms; a statement is a (session, start)
    pair seen active; per agent process: the statements its sessions ran meanwhile."""

    def __init__(self, b: Backend, pids: Iterable[int]) -> None:
        super().__init__(b, pids)
        self.statements: dict[int, set[tuple[Any, ...]]] = {pid: set() for pid in self.pids}
        self.last: dict[Any, tuple[Any, ...]] = {}
        self.running = True

    async def _rows(self) -> list[tuple[int, Any, Any, str]]:
        """(client port, session id, statement start, text) of every active session."""
        raise NotImplementedError

    async def start(self) -> None:
        await self._connect()
        self.task = asyncio.create_task(self._sample())
        await asyncio.sleep(0.1)
        self.statements = {pid: set() for pid in self.pids}  # what ran before we looked

    async def _connect(self) -> None: ...

    async def _sample(self) -> None:
        port = self.b.server.port
        while self.running:
            owners = client_ports(self.pids, [port])
            for client, session, start, text in await self._rows():
                if client in owners:
                    self.statements[owners[client]].add((session, start, text))
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        await asyncio.sleep(0.1)
        self.running = False
        await self.task
        await self._close()

    async def _close(self) -> None: ...

    def requests(self) -> dict[int, int]:
        return {pid: len(s) for pid, s in self.statements.items()}

    def detail(self) -> str:
        return str({pid: sorted(map(str, s))[:8] for pid, s in self.statements.items()})


class PgProbe(SqlProbe):
    async def _connect(self) -> None:
        import asyncpg

        self.conn = await asyncpg.connect(self.b.server.url)

    async def _rows(self) -> list[tuple[int, Any, Any, str]]:
        rows = await self.conn.fetch(
            "SELECT client_port, pid, query_start, query FROM pg_stat_activity"
            " WHERE state = 'active' AND pid <> pg_backend_pid() AND client_port IS NOT NULL")
        return [(r["client_port"], r["pid"], r["query_start"], r["query"][:60]) for r in rows]

    async def _close(self) -> None:
        await self.conn.close()


class MysqlProbe(SqlProbe):
    """``information_schema.PROCESSLIST``: a statement's start is now - TIME_MS, to the
    nearest 50 ms (the sampling skew)."""

    async def _connect(self) -> None:
        import asyncmy

        from ..mysql_server import PASSWORD, USER

        self.conn = await asyncmy.connect(host="127.0.0.1", port=self.b.server.port,
                                          user=USER, password=PASSWORD, autocommit=True)

    async def _rows(self) -> list[tuple[int, Any, Any, str]]:
        async with self.conn.cursor() as cur:
            await cur.execute("SELECT HOST, ID, TIME_MS, INFO FROM information_schema.PROCESSLIST"
                              " WHERE COMMAND = 'Query' AND ID <> CONNECTION_ID()")
            rows = await cur.fetchall()
        now = time.monotonic()
        out = []
        for host, session, time_ms, info in rows:
            with contextlib.suppress(ValueError, AttributeError):
                port = int(str(host).rsplit(":", 1)[1])
                out.append((port, session, round((now - float(time_ms) / 1000) / 0.05),
                            str(info)[:60]))
        return out

    async def _close(self) -> None:
        self.conn.close()
        await self.conn.ensure_closed()

    def requests(self) -> dict[int, int]:
        # one statement seen at starts a sample apart (rounding): count each run of
        # consecutive starts of one session and text once
        out = {}
        for pid, stmts in self.statements.items():
            seen = sorted(stmts, key=lambda s: (str(s[0]), s[2], s[1]))
            runs = 0
            prev: tuple[Any, ...] | None = None
            for session, start, text in seen:
                if prev is None or prev[0] != session or prev[2] != text or start - prev[1] > 2:
                    runs += 1
                prev = (session, start, text)
            out[pid] = runs
        return out


_GRPC = re.compile(r'^grpc_server_started_total\{grpc_method="(\w+)",grpc_service="([\w.]+)"'
                   r'.*\} (\d+(?:\.\d+)?(?:e\+\d+)?)$')


class EtcdProbe(Probe):
    """``/metrics``: the KV requests (Range, Txn, Put, DeleteRange) every client made."""

    def _kv(self) -> Counter[str]:
        with urllib.request.urlopen(f"http://{self.b.server.endpoint}/metrics", timeout=5) as r:
            text = r.read().decode()
        out: Counter[str] = Counter()
        for line in text.splitlines():
            m = _GRPC.match(line)
            if m and m.group(2) == "etcdserverpb.KV":
                out[m.group(1)] += int(float(m.group(3)))
        return out

    async def start(self) -> None:
        self.before = await asyncio.to_thread(self._kv)

    async def stop(self) -> None:
        await asyncio.sleep(0.2)
        self.after = await asyncio.to_thread(self._kv)

    def total(self) -> int:
        return sum((self.after - self.before).values())

    def detail(self) -> str:
        return str(dict(self.after - self.before))


def probe_for(b: Backend, pids: Iterable[int]) -> Probe:
    if b.id.startswith("redis"):
        return RedisProbe(b, pids)
    kind = {"zookeeper": ZkProbe, "postgres": PgProbe, "mysql": MysqlProbe, "etcd": EtcdProbe}
    return kind[b.id](b, pids)
