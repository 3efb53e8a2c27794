"""An idempotent "charge this order" endpoint in Starlette, guarded by an aiolock lock.

What it shows
-------------
* ``POST /orders/{order_id}/charge`` takes ``locks.lock(f"orders:{order_id}", timeout=...)``
  around "is it charged already? if not, charge and record it". Concurrent requests for
  the same order -- even on different replicas of the service -- queue on the lock; the
  first charges, the rest find the charge record and answer ``already_charged``.
* The charge record is a *fenced* write: it carries the lease's fencing token, and the
  store refuses a token older than one it has seen. If this request's lease had expired
  (a long GC pause, a network stall) and another request took the lock and wrote, our
  late write is rejected instead of overwriting the newer record.
* A request that cannot get the lock within ``LOCK_TIMEOUT`` answers ``409 Conflict``
  with ``Retry-After`` rather than hanging; a lease lost mid-request answers 503.
* The aiolock connection is opened and closed in the app's lifespan: one connection
  (one watchdog, one pub/sub connection on Redis) per process, shared by all requests.

Run it
------
    python examples/web_handler.py                                   # memory://, no server
    AIOLOCK_URL=redis://127.0.0.1:6379/0 python examples/web_handler.py

As a script it starts two replicas of the app in-process (``httpx.ASGITransport``, no
sockets), fires 20 concurrent charge requests for one order at them, and checks that the
payment provider was called exactly once. Then it holds one order's lock from another
connection to show a request timing out with 409. To serve the app for real::

    python examples/web_handler.py --serve        # or: uvicorn examples.web_handler:app
    curl -X POST localhost:8000/orders/42/charge -H 'content-type: application/json' \\
         -d '{"amount": 1999}'

With ``memory://`` the lock only spans one process; run several workers or hosts against
Redis to get the guarantee across them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import aiolock

AIOLOCK_URL = os.environ.get("AIOLOCK_URL", "memory://")
#: How long a request waits for the order's lock before answering 409.
LOCK_TIMEOUT = 1.0
#: Lease length; the watchdog renews it every ttl/3 while the request runs.
LOCK_TTL = 10.0


def is_redis(url: str) -> bool:
    return url.startswith(("redis://", "rediss://", "unix://"))


class ChargeRecords:
    """Where charge records live: one fenced record per order.

    On Redis it is a hash per order written by :class:`aiolock.RedisFencedResource`
    (check-and-write in one Lua script), so every replica sees it. On ``memory://`` it is
    an in-process :class:`aiolock.MemoryFencedResource` per order, shared by every app in
    the process (like ``memory://`` itself).
    """

    _memory: ClassVar[dict[str, aiolock.MemoryFencedResource]] = {}

    def __init__(self, url: str, prefix: str = "example:charges") -> None:
        self.prefix = prefix
        self._client: Any = None
        if is_redis(url):
            import redis.asyncio as aioredis

            self._client = aioredis.Redis.from_url(url)

    def record(self, order_id: str) -> aiolock.FencedResource:
        if self._client is not None:
            return aiolock.RedisFencedResource(self._client, f"{self.prefix}:{order_id}")
        return self._memory.setdefault(order_id, aiolock.MemoryFencedResource())

    async def forget(self, order_id: str) -> None:
        """Delete an order's record (the demo cleans up after itself)."""
        if self._client is not None:
            await self._client.delete(f"{self.prefix}:{order_id}")
        self._memory.pop(order_id, None)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


class FakePaymentProvider:
    """Stands in for Stripe & co: slow, and it counts how often each order was charged."""

    def __init__(self) -> None:
        self.charges: Counter[str] = Counter()

    async def charge(self, order_id: str, amount: int) -> str:
        await asyncio.sleep(0.05)  # a network round trip
        self.charges[order_id] += 1
        return f"ch_{uuid.uuid4().hex[:12]}"


def create_app(
    url: str = AIOLOCK_URL, *, provider: FakePaymentProvider | None = None,
    lock_timeout: float = LOCK_TIMEOUT,
) -> Starlette:
    """The order service. ``url`` is the lock backend (and, on Redis, the record store)."""
    payments = provider or FakePaymentProvider()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # One connection per process, opened at startup; closing it releases what it holds.
        async with aiolock.connect(url) as locks:
            records = ChargeRecords(url)
            app.state.locks = locks
            app.state.records = records
            try:
                yield
            finally:
                await records.aclose()

    async def charge(request: Request) -> JSONResponse:
        order_id = request.path_params["order_id"]
        try:
            amount = int((await request.json())["amount"])
        except (ValueError, KeyError, TypeError):
            return JSONResponse({"error": 'body must be {"amount": <cents>}'}, status_code=400)
        locks: aiolock.Locks = request.app.state.locks
        records: ChargeRecords = request.app.state.records
        lock = locks.lock(f"orders:{order_id}", ttl=LOCK_TTL, timeout=lock_timeout)
        try:
            async with lock as lease:
                record = records.record(order_id)
                _, existing = await record.read()
                if existing is not None:  # charged before (by us or another replica)
                    return JSONResponse(
                        {"order": order_id, "status": "already_charged", **json.loads(existing)}
                    )
                charge_id = await payments.charge(order_id, amount)
                body = {"charge_id": charge_id, "amount": amount, "token": lease.token}
                if not await record.write(lease.token, json.dumps(body)):
                    # A newer lock holder wrote first: our lease expired under us. In real
                    # life also pass an idempotency key to the provider so it dedupes too.
                    return JSONResponse(
                        {"error": "stale lease: the order was handled by a newer request"},
                        status_code=409,
                    )
                return JSONResponse({"order": order_id, "status": "charged", **body}, 201)
        except aiolock.LockTimeout:
            return JSONResponse(
                {"error": f"order {order_id} is busy, retry later"}, status_code=409,
                headers={"Retry-After": "1"},
            )
        except aiolock.LockLost:
            # The body was cancelled when the lease was lost (on_lost="cancel").
            return JSONResponse({"error": "lost the order lock, retry"}, status_code=503)
        except aiolock.BackendUnavailable:
            return JSONResponse({"error": "lock service unavailable"}, status_code=503)

    return Starlette(
        routes=[Route("/orders/{order_id}/charge", charge, methods=["POST"])], lifespan=lifespan
    )


#: For ``uvicorn examples.web_handler:app``.
app = create_app()


async def main(url: str) -> int:
    print(f"lock backend: {url}")
    provider = FakePaymentProvider()  # shared by both replicas: it is "the outside world"
    replicas = [create_app(url, provider=provider) for _ in range(2)]
    order_id = f"A-{uuid.uuid4().hex[:8]}"
    busy_order = f"B-{uuid.uuid4().hex[:8]}"
    async with contextlib.AsyncExitStack() as stack:
        clients: list[httpx.AsyncClient] = []
        for replica in replicas:
            # Run the app's lifespan (startup/shutdown) ourselves: ASGITransport does not.
            await stack.enter_async_context(replica.router.lifespan_context(replica))
            transport = httpx.ASGITransport(app=replica)
            clients.append(
                await stack.enter_async_context(
                    httpx.AsyncClient(transport=transport, base_url="http://orders")
                )
            )

        # 1. A double-clicking customer and a retrying client: 20 requests at once,
        #    spread over two replicas of the service.
        print(f"firing 20 concurrent POST /orders/{order_id}/charge at 2 replicas")
        responses = await asyncio.gather(*(
            clients[i % 2].post(f"/orders/{order_id}/charge", json={"amount": 1999})
            for i in range(20)
        ))
        outcome = Counter(
            f"{r.status_code} {r.json().get('status') or r.json().get('error')}" for r in responses
        )
        for line, n in sorted(outcome.items()):
            print(f"  {n:2d} x {line}")
        charge_ids = {r.json()["charge_id"] for r in responses if "charge_id" in r.json()}
        calls = provider.charges[order_id]
        print(f"payment provider calls for {order_id}: {calls}; "
              f"distinct charge ids in responses: {len(charge_ids)}")
        ok = calls == 1 and len(charge_ids) == 1 and outcome.get("201 charged") == 1
        if ok:
            print(f"order {order_id} was charged exactly once")
        else:
            print(f"FAIL: order {order_id} was charged {calls} times")

        # 2. Somebody else (a refund job, another service) holds the order's lock: the
        #    request gives up after LOCK_TIMEOUT and says 409 instead of hanging.
        async with aiolock.connect(url) as other, other.lock(f"orders:{busy_order}"):
            r = await clients[0].post(f"/orders/{busy_order}/charge", json={"amount": 500})
        print(f"while another client held orders:{busy_order}: {r.status_code} "
              f"{r.json()['error']} (Retry-After: {r.headers.get('retry-after')})")
        busy_ok = r.status_code == 409 and provider.charges[busy_order] == 0
        if busy_ok:
            print("busy order answered 409 Conflict without charging")
        else:
            print("FAIL: busy order was not answered with 409")

        await replicas[0].state.records.forget(order_id)  # tidy up the demo's record
    return 0 if ok and busy_ok else 1


if __name__ == "__main__":
    if "--serve" in sys.argv[1:]:
        import uvicorn

        uvicorn.run(app, host="127.0.0.1", port=int(os.environ.get("PORT", "8000")))
    else:
        sys.exit(asyncio.run(main(AIOLOCK_URL)))
