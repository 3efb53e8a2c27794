"""``aiolock top`` in a real pseudo-terminal (tmux, ``capture-pane``), as a person sees it
(docs/operations.md, "aiolock top: a live view"), on every row that declares
``Capability.SCAN``: each held name with its kind, token, waiters, a lease bar and its
holders (host:pid, task, data, held for); the recent changes (a name gone, a token that
changed); redrawn in place every ``--interval``; ``q`` quits with exit 0."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import aiolock

from ..scenarios import Scenario
from ..servers import RedisServer
from .conftest import (
    TOP_SECRET,
    C,
    Term,
    cli,
    cli_rows,
    no_traceback,
    on_screen_rows,
    passwords,
    prefix,
    row_lines,
    with_password,
)

INTERVAL = 0.3
#: a change must show within a refresh or two, plus one listing's time on a slow backend
SHOWS_WITHIN = 2 * INTERVAL + 3.0


def bar(line: str) -> bool:
    return "█" in line or "░" in line


def first_line(screen: str) -> str:
    lines = screen.splitlines()
    return lines[0] if lines else ""


@on_screen_rows(C.SCAN)
async def test_top_live_view(
    scenario: Scenario, backend_url: str, term: Callable[..., Term], tmp_path: Path
) -> None:
    p = prefix()
    t = term(170, 45)
    me = f"{socket.gethostname()}:{os.getpid()}"
    caps = scenario.capabilities
    t.top(tmp_path / "status", "--url", backend_url, "--interval", str(INTERVAL), p)
    async with aiolock.connect(backend_url) as locks, aiolock.connect(backend_url) as other:
        await t.wait(lambda s: "q quits" in s, "the header")
        lease = await locks.lock(p + "orders:42", ttl=20, data="request 7f3a").acquire(timeout=10)
        waiter = asyncio.create_task(locks.lock(p + "orders:42", ttl=20).acquire())
        held = {p + "orders:42": "lock"}
        extra: list[aiolock.Lease] = []
        if C.SEMAPHORE in caps:
            sem = locks.semaphore(p + "gpu-slots", 4, ttl=20, data="job 17")
            extra += [await asyncio.create_task(sem.acquire(timeout=10)) for _ in range(2)]
            held[p + "gpu-slots"] = "semaphore"
        if C.ELECTION in caps:
            extra.append(
                await locks.election(p + "scheduler", ttl=20).campaign(data="host-a:8080").acquire(timeout=10)
            )
            held[p + "scheduler"] = "election"
        outside = await other.lock("zz" + p, ttl=20).acquire(timeout=10)

        lock_row = re.compile(rf"{re.escape(p)}orders:42\s+lock\s+{lease.token}\s+1\s")

        def all_shown(s: str) -> bool:  # the WAIT column and the header count the waiter
            return (
                all(row_lines(s, n) for n in held)
                and f"{len(held)} held" in first_line(s)
                and "1 waiting" in first_line(s)
                and any(
                    "request 7f3a" in line and lock_row.match(line) for line in row_lines(s, p + "orders:42")
                )
            )

        screen = await t.wait(all_shown, "every held name, one waiter", within=15)
        (row,) = row_lines(screen, p + "orders:42")
        assert " lock " in row, screen
        assert f" {lease.token} " in row, screen
        assert bar(row) and re.search(r"\d+(\.\d+)?s", row), screen  # the bar, the time left
        assert me in row, screen
        assert lease.holder.task and lease.holder.task in row, screen
        assert "1 waiting" in first_line(screen), screen
        assert "zz" + p not in screen
        if p + "gpu-slots" in held:
            rows = [line for line in screen.splitlines() if "'job 17'" in line or "job 17" in line]
            assert len(rows) == 2, screen  # both permits' holders
            assert " semaphore " in row_lines(screen, p + "gpu-slots")[0], screen
        if p + "scheduler" in held:
            (erow,) = row_lines(screen, p + "scheduler")
            assert " election " in erow and "host-a:8080" in erow and me in erow, screen
            assert f" {extra[-1].token} " in erow, screen

        # refreshed in place (checked below): the header's clock moves, on the first line
        stamp = re.search(r"updated (\d\d:\d\d:\d\d)", first_line(screen))
        assert stamp, screen
        t_stamp = time.monotonic()

        # revoked (by the command): the name goes, or changes hands to the waiter
        ran = await cli("revoke", "--url", backend_url, p + "orders:42", timeout=40)
        assert ran.code == 0, ran
        screen = await t.wait(
            lambda s: any(
                p + "orders:42" in line
                and str(lease.token) in line
                and ("gone" in line or "->" in line or "changed" in line)
                for line in s.splitlines()
                if not line.startswith(p)
            ),
            "the revocation among the recent changes",
            within=SHOWS_WITHIN + 20 / 3,
        )
        with contextlib.suppress(asyncio.CancelledError, aiolock.LockError):
            waiter.cancel()
            got = await waiter
            await got.release()
        with contextlib.suppress(aiolock.LockError):
            await lease.release()

        # a release: gone from the table within a refresh or two, listed as a change
        if p + "scheduler" in held:
            victim = extra[-1]
            vname = victim.name
            t0 = time.monotonic()
            await victim.release()
            await t.wait(
                lambda s: (
                    not row_lines(s, vname)
                    and any(vname in line and "gone" in line for line in s.splitlines())
                ),
                f"{vname} gone",
                within=SHOWS_WITHIN,
            )
            assert time.monotonic() - t0 < SHOWS_WITHIN
        for e in extra[:-1]:
            await e.release()
        await outside.release()
        await t.wait(lambda s: not any(row_lines(s, n) for n in held), "an empty table")

        def moved(s: str) -> bool:
            again = re.search(r"updated (\d\d:\d\d:\d\d)", first_line(s))
            return bool(again) and again.group(1) != stamp.group(1)

        later = await t.wait(
            moved, "the header's clock moving", within=max(0.5, 2.5 - (time.monotonic() - t_stamp))
        )
        assert "aiolock top" in first_line(later) and later.count("q quits") == 1, later

        t.keys("q")
        t0 = time.monotonic()
        assert await t.wait_exit(5) == 0
        assert time.monotonic() - t0 < 3
    final = t.screen()
    no_traceback(final)


@on_screen_rows(C.SCAN)
async def test_top_token_change_and_expiry(
    scenario: Scenario, backend_url: str, term: Callable[..., Term], tmp_path: Path
) -> None:
    """A name taken again by another holder shows its new token and data; a lease that
    runs out unrenewed is reported as expired (its time had run out)."""
    p = prefix()
    t = term(170, 40)
    t.top(tmp_path / "status", "--url", backend_url, "--interval", str(INTERVAL), p)
    async with aiolock.connect(backend_url) as locks, aiolock.connect(backend_url) as other:
        await t.wait(lambda s: "q quits" in s, "the header")
        first = await locks.lock(p + "hands", ttl=20, data="first-holder").acquire(timeout=10)
        await t.wait(
            lambda s: any("first-holder" in line for line in row_lines(s, p + "hands")), "the first holder"
        )
        await first.release()
        second = await other.lock(p + "hands", ttl=20, data="second-holder").acquire(timeout=10)
        assert second.token > first.token
        screen = await t.wait(
            lambda s: (
                any(
                    "second-holder" in line and f" {second.token} " in line
                    for line in row_lines(s, p + "hands")
                )
                and any(
                    p + "hands" in line
                    and str(first.token) in line
                    and ("gone" in line or "->" in line or "changed" in line)
                    for line in s.splitlines()
                    if not line.startswith(p + "hands ")
                )
            ),
            "the new holder and the change",
            within=SHOWS_WITHIN,
        )
        assert not any("first-holder" in line for line in row_lines(screen, p + "hands")), screen

        # a whole number of seconds: etcd's leases are whole seconds
        short = await locks.lock(p + "short", ttl=2.0, watchdog=False, data="unrenewed").acquire(timeout=10)
        await t.wait(lambda s: bool(row_lines(s, p + "short")), "the short lease")
        within = scenario.dead_holder(2.0) + SHOWS_WITHIN + 1
        screen = await t.wait(
            lambda s: (
                not row_lines(s, p + "short")
                and any(p + "short" in line and "gone" in line for line in s.splitlines())
            ),
            "the expired lease gone",
            within=within,
        )
        (change,) = [line for line in screen.splitlines() if p + "short" in line and "gone" in line]
        assert "expired" in change, change
        if not scenario.id.startswith("etcd"):
            # its time had run out: the listing can tell (etcd reports the time left of its
            # whole-second leases in whole seconds, 0.5 s too long at the end: it cannot)
            assert "released" not in change, change
        with contextlib.suppress(aiolock.LockError):
            await short.release()
        await second.release()
        t.keys("q")
        assert await t.wait_exit(5) == 0


@on_screen_rows(C.SCAN)
async def test_top_many_names_short_then_narrow_terminal(
    scenario: Scenario, backend_url: str, term: Callable[..., Term], tmp_path: Path
) -> None:
    """More names than fit: the header stays on the first line (redrawn in place, not
    scrolled), the count is right; resized to 60 columns it keeps running; q quits."""
    p = prefix()
    n = 25
    t = term(170, 12)
    t.top(tmp_path / "status", "--url", backend_url, "--interval", str(INTERVAL), p)
    async with aiolock.connect(backend_url) as locks:
        leases = await asyncio.gather(
            *(
                locks.lock(f"{p}n{i:02d}-" + "w" * 40, ttl=20, data=f"d{i}").acquire(timeout=15)
                for i in range(n)
            )
        )
        screen = await t.wait(lambda s: f"{n} held" in s, f"{n} held", within=20)
        await asyncio.sleep(3 * INTERVAL)
        screen = t.screen()
        assert "aiolock top" in first_line(screen) and f"{n} held" in first_line(screen), screen
        assert screen.count("q quits") == 1, screen
        assert len(screen.splitlines()) <= 12, screen
        assert any(line.startswith(f"{p}n") for line in screen.splitlines()), screen
        t.run("resize-window", "-t", t.session, "-x", "60", "-y", "15")
        await asyncio.sleep(3 * INTERVAL)
        screen = t.screen()
        assert t.exit_code() is None, screen
        no_traceback(screen)
        assert "aiolock" in first_line(screen), screen
        assert any(line.startswith(p[:4]) for line in screen.splitlines()), screen
        assert all(len(line) <= 60 for line in screen.splitlines()), screen
        t.keys("q")
        assert await t.wait_exit(5) == 0
        for lease in leases:
            await lease.release()


async def _odd_names_shown(
    backend_url: str, term: Callable[..., Term], tmp_path: Path, names: dict[str, str]
) -> None:
    p = prefix()
    names = {p + n: d for n, d in names.items()}
    t = term(170, 30)
    t.top(tmp_path / "status", "--url", backend_url, "--interval", str(INTERVAL), p)
    async with aiolock.connect(backend_url) as locks:
        leases = [await locks.lock(n, ttl=20, data=d).acquire(timeout=10) for n, d in names.items()]
        try:
            screen = await t.wait(lambda s: all(row_lines(s, n) for n in names), "every odd name")
            for n, d in names.items():
                (line,) = row_lines(screen, n)
                assert d in line or repr(d) in line, (n, d, screen)  # data is shown quoted
            assert f"{len(names)} held" in first_line(screen), screen
            t.keys("q")
            assert await t.wait_exit(5) == 0
        finally:
            for lease in leases:
                await lease.release()
        no_traceback(t.screen())


@on_screen_rows(C.SCAN)
async def test_top_shows_non_ascii_names_and_data(
    scenario: Scenario, backend_url: str, term: Callable[..., Term], tmp_path: Path
) -> None:
    """Names and data with non-ASCII (accented, Cyrillic, CJK) and LIKE/glob characters
    are shown as they are."""
    await _odd_names_shown(
        backend_url, term, tmp_path, {"naïve-ключ-名前": "données ✓", "a\\b%_*?": "x%_*\\y"}
    )


# Found: top rendered names and holder data as rich markup ('[bold]x[/bold]' showed as
# 'x'; '[/]' made it exit 1 with a MarkupError traceback). Fixed since.
@on_screen_rows(C.SCAN)
async def test_top_shows_markup_like_names_and_data_literally(
    scenario: Scenario, backend_url: str, term: Callable[..., Term], tmp_path: Path
) -> None:
    """Names are any string (README): one that looks like rich markup (``[bold]``, a lone
    ``[/]``) is shown as it is, never interpreted, never fatal (no traceback)."""
    await _odd_names_shown(
        backend_url,
        term,
        tmp_path,
        {"[bold]x[/bold]": "[red]d[/red]", "[/]": "[/]", "l": "[link=http://x]l[/link]"},
    )


async def test_q_quits_promptly_and_ctrl_c_exits_130(
    redis_server: RedisServer, term: Callable[..., Term], tmp_path: Path
) -> None:
    """q quits at once even with a long --interval (exit 0); Ctrl-C exits 130 without a
    traceback."""
    t = term(120, 20)
    t.top(tmp_path / "q", "--url", redis_server.url, "--interval", "10", prefix())
    await t.wait(lambda s: "aiolock top" in s, "the header")
    await asyncio.sleep(0.5)
    t.keys("q")
    t0 = time.monotonic()
    assert await t.wait_exit(5) == 0
    assert time.monotonic() - t0 < 2.0, time.monotonic() - t0

    c = term(120, 20)
    c.top(tmp_path / "c", "--url", redis_server.url, "--interval", "0.5", prefix())
    await c.wait(lambda s: "aiolock top" in s, "the header")
    c.keys("C-c")
    assert await c.wait_exit(5) == 130
    no_traceback(c.screen())


@pytest.mark.parametrize("interval", ["0", "-1", "abc", "nan", ""])
async def test_bad_interval_is_a_usage_error(interval: str, redis_server: RedisServer) -> None:
    ran = await cli("top", "--url", redis_server.url, "--interval", interval, timeout=15)
    assert ran.code == 2, ran
    no_traceback(ran.err + ran.out)


def secret_url(scenario: Scenario, backend_url: str, request: pytest.FixtureRequest) -> str:
    """The row's URL with a password in it that the server accepts (skip where we have
    none): PostgreSQL trusts loopback (the password is never asked), MySQL has its own,
    ZooKeeper's digest takes any, Redis the password-protected server of issue 13."""
    if scenario.id in ("postgres", "postgres-row"):
        return with_password(backend_url, urlsplit(backend_url).username or "postgres", TOP_SECRET)
    if scenario.id in ("mysql", "mysql-row"):
        assert passwords(backend_url), backend_url
        return backend_url
    if scenario.id == "zookeeper":
        return with_password(backend_url, "advtop", TOP_SECRET)
    if scenario.id == "redis":
        from ..adversarial_issue13.conftest import SECRET as PW

        server = request.getfixturevalue("pw_redis")
        return f"redis://:{PW}@127.0.0.1:{server.port}/0"
    pytest.skip(f"no password-protected server for {scenario.id}")


@pytest.mark.parametrize(
    "scenario",
    [s for s in cli_rows(C.SCAN) if s.values[0].id in ("redis", "postgres", "mysql", "zookeeper")],
    indirect=True,
)
async def test_password_never_shown(
    scenario: Scenario,
    backend_url: str,
    term: Callable[..., Term],
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """No screen of top, no ls / ls --json / revoke output shows the URL's password."""
    url = secret_url(scenario, backend_url, request)
    (pw,) = passwords(url)
    p = prefix()
    t = term(200, 30)
    t.top(tmp_path / "status", "--url", url, "--interval", str(INTERVAL), p)
    async with aiolock.connect(url) as locks:
        lease = await locks.lock(p + "held", ttl=20, data="visible-data").acquire(timeout=10)
        screen = await t.wait(lambda s: bool(row_lines(s, p + "held")), "the held name")
        assert pw not in screen, screen
        runs = await asyncio.gather(
            cli("ls", "--url", url, p),
            cli("ls", "--json", "--url", url, p),
            cli("revoke", "--url", url, p + "held"),
            cli("revoke", "--url", url, p + "nothing"),
        )
        assert [r.code for r in runs] == [0, 0, 0, 1], runs
        for r in runs:
            assert pw not in r.out + r.err, r
        await t.wait(
            lambda s: not row_lines(s, p + "held"), "the revoked name gone", within=SHOWS_WITHIN + 20 / 3
        )
        assert pw not in t.screen()
        t.keys("q")
        assert await t.wait_exit(5) == 0
        with contextlib.suppress(aiolock.LockError):
            await lease.release()
    assert pw not in t.screen()
