"""URL query options on every backend (issue 15): an option given twice is refused with
ValueError naming it (never one of the values kept silently), and in the Redis family
an option with an empty value is refused too (redis-py would drop it silently).

Every row of ``tests/scenarios.py`` is built from its ``bad_url`` (an unreachable
server): the URLs are only parsed, nothing is connected.
"""

from __future__ import annotations

from typing import Any

import pytest

import aiolock
from aiolock._validate import query_pairs

from .scenarios import SCENARIOS, SECRET, Scenario

#: an option each scheme takes in its query, and two values it accepts
_OPTION: dict[str, tuple[str, str, str]] = {
    "zookeeper": ("acl", "open", "creator"),
    "redlock": ("drift_factor", "0.01", "0.02"),
}
_DEFAULT_OPTION = ("connect_timeout", "1", "2")
#: schemes that take no query at all: any query is refused (without naming the option)
_NO_QUERY = {"memory", "memcached"}
#: rows whose backend does not use aiolock._validate.query_pairs yet: the test is expected
#: to fail (strict: delete the entry once it passes)
PENDING: dict[str, str] = {}


def _rows() -> list[Any]:
    rows = []
    for scenario in {s.bad_url: s for s in reversed(SCENARIOS)}.values():  # etcd-cluster = etcd
        param = scenario.param()
        if scenario.id in PENDING:
            param = pytest.param(scenario, id=scenario.id, marks=[
                *param.marks, pytest.mark.xfail(reason=PENDING[scenario.id], strict=True)])
        rows.append(param)
    return rows


def _base(scenario: Scenario) -> str:
    return "memory://x" if scenario.bad_url is None else scenario.bad_url.format(1, 2, 3)


def _with(url: str, query: str) -> str:
    return url + ("&" if "?" in url else "?") + query


def _scheme(url: str) -> str:
    return url.partition("://")[0]


@pytest.mark.parametrize("values", ["different", "same"])
@pytest.mark.parametrize("scenario", _rows())
async def test_repeated_query_option_refused(scenario: Scenario, values: str) -> None:
    """``?opt=a&opt=b`` (or ``a`` twice): ValueError naming ``opt``, no password shown;
    the same option given once is accepted (the URL builds)."""
    base = _base(scenario)
    name, first, second = _OPTION.get(_scheme(base), _DEFAULT_OPTION)
    if _scheme(base) not in _NO_QUERY:
        locks = aiolock.connect(_with(base, f"{name}={first}"))  # built, not connected
        await locks.aclose()
    again = second if values == "different" else first
    with pytest.raises(ValueError) as err:
        aiolock.connect(_with(base, f"{name}={first}&{name}={again}"))
    message = str(err.value)
    assert SECRET not in message
    if _scheme(base) not in _NO_QUERY:
        assert name in message and "more than once" in message, message


def test_repeated_option_of_sentinel_own_query_refused() -> None:
    """``db`` and ``password`` are redis+sentinel's own query options (not redis-py's)."""
    url = "redis+sentinel://127.0.0.1:1/mymaster?db=1&db=2"
    with pytest.raises(ValueError, match="db"):
        aiolock.connect(url)
    with pytest.raises(ValueError, match="password") as err:
        aiolock.connect(f"redis+sentinel://127.0.0.1:1/m?password={SECRET}&password=x")
    assert SECRET not in str(err.value)


def test_repeated_node_option_of_redlock_refused() -> None:
    """An option of the redlock nodes (passed on to each ``redis://``) given twice."""
    with pytest.raises(ValueError, match="client_name") as err:
        aiolock.connect(f"redlock://:{SECRET}@127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"
                        "?client_name=a&client_name=b")
    assert SECRET not in str(err.value)


REDIS_FAMILY = [
    "redis://127.0.0.1:1/0",
    "rediss://127.0.0.1:1/0",
    "unix:///tmp/aiolock-none.sock",
    "redis+cluster://127.0.0.1:1,127.0.0.1:2",
    "redis+sentinel://127.0.0.1:1/mymaster",
    "redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3",
]


@pytest.mark.parametrize("query", ["client_name=", "connect_timeout=", "prefix=", "bogus=",
                                   "client_name"])
@pytest.mark.parametrize("url", REDIS_FAMILY, ids=_scheme)
def test_redis_family_refuses_empty_value(url: str, query: str) -> None:
    """An empty value is refused (redis-py drops it: the option would run on its
    default); an unknown option is refused as unknown, with the accepted ones."""
    with pytest.raises(ValueError) as err:
        aiolock.connect(_with(url, query))
    message = str(err.value)
    assert query.rstrip("=") in message, message
    if query == "bogus=":
        assert "accepted" in message or "unknown" in message, message


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0", "redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"])
def test_redis_empty_value_messages_say_what_is_accepted(url: str) -> None:
    with pytest.raises(ValueError, match=r"seconds > 0|number"):
        aiolock.connect(_with(url, "request_timeout="))
    if url.startswith("redis:"):
        with pytest.raises(ValueError, match="on, off, auto"):
            aiolock.connect(_with(url, "scripting="))


def test_redlock_ssl_value_checked() -> None:
    base = "redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"
    with pytest.raises(ValueError, match="ssl"):
        aiolock.connect(_with(base, "ssl=maybe"))
    with pytest.raises(ValueError, match="ssl"):
        aiolock.connect(_with(base, "ssl="))
    for flag, scheme in (("true", "rediss"), ("0", "redis")):
        backend = aiolock.connect(_with(base, f"ssl={flag}")).backend
        assert all(n.url.startswith(f"{scheme}://") for n in backend.nodes)  # type: ignore[attr-defined]


def test_query_pairs() -> None:
    assert query_pairs("", "u") == {}
    assert query_pairs("a=1&b=&c&d=%20x+y", "u") == {"a": "1", "b": "", "c": "", "d": " x y"}
    with pytest.raises(ValueError, match=r"a, b given more than once in redis://h/0") as err:
        query_pairs("a=1&a=1&b=2&b=3&a=4", "redis://h/0")
    assert "1" not in str(err.value).replace("given", "")  # no value shown
