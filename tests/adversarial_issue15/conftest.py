"""Fixtures of the issue-15 adversarial tests (Redis without scripting; MySQL / MariaDB),
written from README.md, SPEC.md and the backend pages alone.

Servers: a private redis-server with ACL users (``noscript``: everything but
``@scripting``; ``minimal``: exactly the least-privilege line of
docs/backends/redis-noscripting.md; ``notx``: neither scripts nor transactions), one with
the script commands renamed away, and the session's MariaDB (``tests/conftest.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from .._children import Child as _Child
from .._children import children, known_defects, since, slow_but  # noqa: F401 -- children: a fixture
from ..adversarial.servers import PasswordRedis
from ..conftest import session_server

#: the password of every ACL user here; no error, log line or URL may show it
SECRET = "Adv15-S3cret-pw"

ACL_USERS = [
    "default on nopass ~* &* +@all",
    f"noscript on >{SECRET} ~* &* +@all -@scripting",
    f"notx on >{SECRET} ~* &* +@all -@scripting -@transaction",
    f"noevalsha on >{SECRET} ~* &* +@all -evalsha -eval -evalsha_ro -eval_ro",
    # the least-privilege line of docs/backends/redis-noscripting.md, word for word
    f"minimal on >{SECRET} ~aiolock:* resetchannels &aiolock:* -@all +ping +watch +unwatch"
    " +multi +exec +get +set +mget +incr +del +hget +hmget +hset +pttl +pexpire +lrange"
    " +ltrim +llen +time +publish +subscribe +unsubscribe",
]

tx_redis = session_server("tx_redis", lambda: PasswordRedis(users=ACL_USERS),
                          "redis-server with the ACL users of this package.")
renamed_redis = session_server(
    "renamed_redis",
    lambda: PasswordRedis(extra=["--rename-command", "EVALSHA", "", "--rename-command",
                                 "EVAL", "", "--rename-command", "SCRIPT", ""]),
    "redis-server whose script commands are renamed away (unknown command).")


def _own_mariadb() -> object:
    from ..mysql_server import MariaDBServer

    return MariaDBServer()


own_mariadb = session_server("own_mariadb", _own_mariadb,
                             "A MariaDB of this package alone, which its tests restart.")


def user_url(server: PasswordRedis, user: str, query: str = "") -> str:
    cred = "" if user == "default" else f"{user}:{SECRET}@"
    return f"redis://{cred}127.0.0.1:{server.port}/0{query}"


@pytest.fixture
def lua_url(tx_redis: PasswordRedis) -> str:
    """The Lua path (default user, scripts allowed)."""
    return user_url(tx_redis, "default")


@pytest.fixture
def auto_url(tx_redis: PasswordRedis) -> str:
    """The automatic fallback: a user without @scripting, scripting=auto (the default)."""
    return user_url(tx_redis, "noscript")


@pytest.fixture
def off_url(tx_redis: PasswordRedis) -> str:
    """scripting=off on a user that could run scripts."""
    return user_url(tx_redis, "default", "?scripting=off")


@pytest.fixture(params=["auto-noscript", "off"])
def tx_url(request: pytest.FixtureRequest, tx_redis: PasswordRedis) -> str:
    """Either way onto the transaction path."""
    if request.param == "off":
        return user_url(tx_redis, "default", "?scripting=off")
    return user_url(tx_redis, "noscript")


@pytest.fixture
async def raw_redis(tx_redis: PasswordRedis) -> AsyncIterator[object]:
    """A plain redis.asyncio client (default user) to look at and tamper with keys."""
    import redis.asyncio as aioredis

    client = aioredis.Redis(host="127.0.0.1", port=tx_redis.port)
    yield client
    await client.aclose()


def lock_key(name: str, prefix: str = "aiolock") -> str:
    """The lock hash of ``name`` as docs/backends/redis-noscripting.md names it."""
    return f"{prefix}:lock:{{{name}}}"


PROCS = Path(__file__).parent / "procs"
ROOT = Path(__file__).parents[2]


class Child(_Child):
    """A child Python process running ``procs/<script>.py``; reads its stdout lines."""

    @classmethod
    async def start(cls, script: str, *args: str) -> Child:
        return await cls.run(str(PROCS / f"{script}.py"), *args)


# Defects these tests found that are still open: test id (as pytest shows it, without the
# file) -> the one-line symptom. Each is marked xfail(strict=True): the suite stays green,
# the defect stays visible, and a fix turns the entry into an error to delete.
KNOWN_DEFECTS: dict[str, str] = {
}

# Tests whose `off` variant (tx_url) goes to the slow tier: the `auto-noscript` variant
# takes the same transaction path in the default run.
SLOW_OFF = {
    "test_watchdog_keeps_lease_several_ttls", "test_killed_holder_freed_within_ttl",
    "test_watchdog_false_expires_and_extend", "test_loss_detected_when_key_tampered",
    "test_waiter_woken_by_release_not_ttl", "test_cancellation_at_random_points_never_leaks",
    "test_cancel_release_at_random_points", "test_escaped_names_same_lock_on_both_paths",
    "test_release_of_lost_lease_spares_new_holder", "test_try_lock_never_waits",
}


# Further variants that guard a promise the default run already covers (slow tier).
SLOW_IDS = {
    "test_tampered_lease_spares_rest_of_renewal_batch[lua-delete]",
    "test_tampered_lease_spares_rest_of_renewal_batch[tx-delete]",
    "test_frozen_server_bounded[lock]",
    "test_max_connections_n_holds_n_leases[lock-2]",
    "test_max_connections_n_holds_n_leases[row-2]",
    "test_waiter_woken_by_release_not_ttl[auto-noscript-lua]",
    "test_killed_connection_loses_lease_and_frees_lock[row]",
    "test_mutual_exclusion_and_tokens_many_tasks[row]",
    "test_watchdog_keeps_lease_several_ttls[lock]",
    "test_watchdog_false_expires_and_extend[auto-noscript]",
    "test_tampered_lease_spares_rest_of_renewal_batch[lua-wrong-type]",
    "test_paused_holder_cut_off_and_stale_write_refused[row]",
    "test_waiter_interrupted_as_holder_releases_never_leaks[redis-tx-timeout]",
    "test_waiter_interrupted_as_holder_releases_never_leaks[mysql-row-timeout]",
    "test_loss_detected_when_key_tampered[auto-noscript-wrong-type]",
}


#: test_coordination.py: the tests that found a defect (since fixed) stay in the default
#: run; the others pin promises the contract suites also check on this path (slow tier)
COORDINATION_DEFAULT = {
    "test_killed_lua_waiter_is_not_handed_the_lock",
    "test_missing_renewal_command_is_not_silent",
    "test_revoked_holder_learns_it_and_waiters_get_it",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in known_defects(items, "adversarial_issue15", KNOWN_DEFECTS):
        base, _, params = item.name.partition("[")
        if ((base in SLOW_OFF and params.startswith("off")) or item.name in SLOW_IDS
                or slow_but(item, "test_coordination.py", COORDINATION_DEFAULT)):
            item.add_marker(pytest.mark.slow)
