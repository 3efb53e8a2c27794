"""``aiolock ls [--json] [PREFIX]`` against every row that declares ``Capability.SCAN``
(docs/operations.md, "aiolock ls: every held name"): the documented JSON shape, agreement
with ``scan()`` / ``status()``, exact PREFIX filtering with characters that are special to
the backends' own matching (LIKE ``%`` ``_`` ``!``, glob ``*`` ``?`` ``[``, ``\\``, hash tags
``{}``, paths ``/``), odd and non-ASCII names, exit codes, unreachable servers."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from typing import Any

import pytest

import aiolock

from ..scenarios import SECRET, Scenario
from ..servers import free_port
from .conftest import C, cli, cli_rows, no_traceback, on_rows, prefix, rows_without

LS_KEYS = {"name", "kind", "token", "last_token", "ttl_left", "waiters", "holders"}
HOLDER_KEYS = {"host", "pid", "task", "data", "since", "waiting"}
KINDS = {"lock", "rwlock", "semaphore", "election"}


def parse_json_lines(out: str) -> list[dict[str, Any]]:
    rows = []
    for line in out.splitlines():
        if not line.strip():
            continue
        row = json.loads(line)  # every line one JSON object
        assert isinstance(row, dict), line
        rows.append(row)
    return rows


async def hold(make: Any, timeout: float = 10.0) -> aiolock.Lease:
    """``make.acquire()`` in a task of its own (a task may not hold one name twice)."""
    return await asyncio.create_task(make.acquire(timeout=timeout))


@on_rows(C.SCAN)
async def test_ls_json_shape_and_agreement_with_scan_and_status(scenario: Scenario, backend_url: str) -> None:
    """One JSON object per line with exactly the documented keys; one row per held name
    under PREFIX (each kind), nothing else; token, last_token, waiters, holders as
    ``scan()`` and ``status()`` report them; the holder is this process."""
    p = prefix()
    caps = scenario.capabilities
    leases: list[aiolock.Lease] = []
    async with aiolock.connect(backend_url) as locks:
        lock = await hold(locks.lock(p + "lock", ttl=20, data="request 7f3a"))
        leases.append(lock)
        # tasks of the holder's own process waiting: counted on every backend with holders
        waiters = [asyncio.create_task(locks.lock(p + "lock", ttl=20).acquire()) for _ in range(2)]
        kinds = {p + "lock": "lock"}
        if C.RWLOCK in caps:
            rw = locks.rwlock(p + "rw", ttl=20, data="reader")
            leases += [await hold(rw.read()), await hold(rw.read())]
            kinds[p + "rw"] = "rwlock"
        if C.SEMAPHORE in caps:
            sem = locks.semaphore(p + "sem", 3, ttl=20, data="slot")
            leases += [await hold(sem), await hold(sem)]
            kinds[p + "sem"] = "semaphore"
        if C.ELECTION in caps:
            term = await locks.election(p + "elect", ttl=20).campaign(data="host-a:8080").acquire(timeout=10)
            leases.append(term)
            kinds[p + "elect"] = "election"
        # data of the maximum length with quotes, escapes, control and non-ASCII characters
        big = ('é"\\\n\t🔒{}[/]' * 200)[:1024]
        leases.append(await hold(locks.lock(p + "big", ttl=20, data=big)))
        kinds[p + "big"] = "lock"
        # names that contain the prefix but do not start with it
        leases.append(await hold(locks.lock("x" + p, ttl=20)))
        leases.append(await hold(locks.lock(p[:-1], ttl=20)))
        await asyncio.sleep(0.6)  # the waiting count is rewritten at most every 0.2 s
        t0 = time.monotonic()
        ran = await cli("ls", "--json", "--url", backend_url, p, timeout=40)
        elapsed = time.monotonic() - t0
        scanned = {i.name: i async for i in locks.scan(p)}
        status = await locks.status(p + "lock")
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        for lease in leases:
            await lease.release()
    assert ran.code == 0, ran
    no_traceback(ran.err)
    rows = parse_json_lines(ran.out)
    names = [r["name"] for r in rows]
    assert sorted(names) == sorted(kinds), ran.out  # one row per held name, exactly these
    for r in rows:
        assert set(r) == LS_KEYS, r
        assert r["kind"] == kinds[r["name"]], r
        assert isinstance(r["waiters"], int) and r["waiters"] >= 0, r
        assert isinstance(r["ttl_left"], int | float) and 0 < r["ttl_left"] <= 20, r
        assert r["token"] is None or isinstance(r["token"], int), r
        assert r["last_token"] is None or isinstance(r["last_token"], int), r
        assert isinstance(r["holders"], list) and r["holders"], r
        for h in r["holders"]:
            assert set(h) == HOLDER_KEYS, h
            assert h["host"] == socket.gethostname(), h
            assert h["pid"] == os.getpid(), h
            assert isinstance(h["since"], int | float) and -0.5 <= h["since"] < 20 + elapsed, h
        info = scanned[r["name"]]
        assert r["token"] == info.token, (r, info)
        assert r["last_token"] == info.last_token, (r, info)
        assert len(r["holders"]) == len(info.held_by), (r, info)
        assert sorted(h["data"] for h in r["holders"]) == sorted(x.data for x in info.held_by), (r, info)
        assert sorted((h["task"] or "") for h in r["holders"]) == sorted(
            (x.task or "") for x in info.held_by
        ), (r, info)
    by = {r["name"]: r for r in rows}
    a = by[p + "lock"]
    assert a["token"] == lock.token == status.token, (a, status)
    assert a["last_token"] is not None and a["last_token"] >= lock.token, a
    assert [h["data"] for h in a["holders"]] == ["request 7f3a"], a
    assert a["holders"][0]["task"] == lock.holder.task, (a, lock.holder)
    assert a["waiters"] == 2 == status.waiters, (a, status)
    assert a["holders"][0]["waiting"] == 2, a
    assert [h["data"] for h in by[p + "big"]["holders"]] == [big], by[p + "big"]
    if p + "rw" in by:
        assert len(by[p + "rw"]["holders"]) == 2, by[p + "rw"]
    if p + "sem" in by:
        assert len(by[p + "sem"]["holders"]) == 2, by[p + "sem"]
    if p + "elect" in by:
        e = by[p + "elect"]
        assert e["token"] == term.token, (e, term.token)
        assert [h["data"] for h in e["holders"]] == ["host-a:8080"], e


#: (name suffix, the prefixes that must list it, among every name below)
ODD = [
    "a_b",
    "aXb",
    "a%b",
    "a*b",
    "a?b",
    "a[b]",
    "a{b}",
    "a\\b",
    "a!b",
    "ab",
    "a",
    "a/b/c",
    "a.b",
    "a b",
    "ключ-🔒-名前",
    "a\u00e9",
]


@pytest.mark.slow  # (about 25 s of the suite; ./test.sh -m slow)
@on_rows(C.SCAN)
async def test_ls_prefix_is_exact_with_special_characters(scenario: Scenario, backend_url: str) -> None:
    """PREFIX selects exactly the names that start with it, as a string: ``_`` and ``%``
    are not LIKE wildcards, ``*`` ``?`` ``[`` not globs, ``\\`` and ``!`` not escapes,
    ``{``/``/`` not structure; the names come back exactly as given."""
    p = prefix()
    names = [p + s for s in ODD]
    async with aiolock.connect(backend_url) as locks:
        leases = [await hold(locks.lock(n, ttl=20, data=f"d:{n}")) for n in names]
        try:
            # the command line, on a few of them (each is a process)
            checks = [p + "a_", p + "a%", p + "a[", p + "ключ", p + "zz"]
            runs = await asyncio.gather(
                *(cli("ls", "--json", "--url", backend_url, q, timeout=40) for q in checks)
            )
            for q, ran in zip(checks, runs, strict=True):
                assert ran.code == 0, (q, ran)
                got = sorted(r["name"] for r in parse_json_lines(ran.out))
                assert got == sorted(n for n in names if n.startswith(q)), (q, ran.out)
            # scan(), which ls reports, on every prefix
            for q in [p + s for s in ODD] + [
                p + "a*",
                p + "a?",
                p + "a\\",
                p + "a!",
                p + "a{",
                p + "a/",
                p + "a.",
                p + "a ",
            ]:
                got = sorted([i.name async for i in locks.scan(q)])
                assert got == sorted(n for n in names if n.startswith(q)), q
            ran = await cli("ls", "--json", "--url", backend_url, p, timeout=40)
            assert ran.code == 0, ran
            rows = parse_json_lines(ran.out)
            assert sorted(r["name"] for r in rows) == sorted(names), ran.out
            for r in rows:
                assert [h["data"] for h in r["holders"]] == [f"d:{r['name']}"], r
        finally:
            for lease in leases:
                await lease.release()


@on_rows(C.SCAN)
async def test_ls_plain_one_line_per_name(scenario: Scenario, backend_url: str) -> None:
    """Plain ``ls``: one line per held name (even one with a newline or rich-looking
    markup in it), with its kind, token and holder data; nothing outside PREFIX."""
    p = prefix()
    tag = os.urandom(3).hex()
    plain = [p + "alpha", p + "[bold]b" + tag + "[/bold]", p + "ключ-🔒"]
    nl = p + "newline" + tag + "\nFORGED" + tag
    async with aiolock.connect(backend_url) as locks:
        leases = [await hold(locks.lock(n, ttl=20, data=f"data-{i}-{tag}")) for i, n in enumerate(plain)]
        leases.append(await hold(locks.lock(nl, ttl=20, data="nl-data")))
        # holder data with a newline: still one line for its name
        leases.append(await hold(locks.lock(p + "datanl" + tag, ttl=20, data="d1\nDFORGED" + tag)))
        leases.append(await hold(locks.lock("zz" + p, ttl=20, data="outside")))
        try:
            ran = await cli("ls", "--url", backend_url, p, timeout=40)
        finally:
            for lease in leases:
                await lease.release()
    assert ran.code == 0, ran
    no_traceback(ran.err)
    lines = ran.out.splitlines()
    for i, n in enumerate(plain):
        mine = [line for line in lines if line.startswith(n)]
        assert len(mine) == 1, (n, ran.out)
        line = mine[0]
        assert "lock" in line and f"data-{i}-{tag}" in line, (n, ran.out)
        assert str(leases[i].token) in line[len(n) :], (n, ran.out)
    assert "outside" not in ran.out and "zz" + p not in ran.out, ran.out
    # the name with a newline: one line, no forged line starting with its second half
    assert sum("newline" + tag in line for line in lines) == 1, ran.out
    assert not any(line.startswith("FORGED" + tag) for line in lines), ran.out
    assert sum(("datanl" + tag) in line for line in lines) == 1, ran.out
    assert not any(line.startswith("DFORGED" + tag) for line in lines), ran.out


@pytest.mark.parametrize("scenario", rows_without(C.SCAN), indirect=True)
@pytest.mark.parametrize("cmd", [["ls"], ["ls", "--json"], ["top", "--interval", "0.5"]])
async def test_ls_and_top_refused_where_backend_cannot_list(
    scenario: Scenario, backend_url: str, cmd: list[str]
) -> None:
    """Without ``Capability.SCAN``: it says so (one line, stderr) and exits 2."""
    ran = await cli(*cmd, "--url", backend_url, timeout=40)
    assert ran.code == 2, ran
    no_traceback(ran.err + ran.out)
    lines = [line for line in ran.err.splitlines() if line.strip()]
    assert len(lines) == 1, ran.err


def unreachable(scenario: Scenario) -> str:
    assert scenario.bad_url is not None
    return scenario.bad_url.format(free_port(), free_port(), free_port())


# Found: redlock:// with unreachable nodes printed one log line per node before the
# error (4 lines on stderr, not one). Fixed since.
@pytest.mark.parametrize("scenario", cli_rows(C.SCAN), indirect=True)
async def test_unreachable_server_exit_69_one_line_no_password(
    scenario: Scenario, term: Any, tmp_path: Any
) -> None:
    """``ls``, ``ls --json``, ``revoke`` and ``top`` (in a terminal) on an unreachable
    server: exit 69 in bounded time, a message, no traceback, never the URL's password;
    ``ls``/``revoke``: one line on stderr, nothing on stdout."""
    url = unreachable(scenario)
    cmds = [["ls", "--url", url], ["ls", "--json", "--url", url, "p:"]]
    if C.REVOKE in scenario.capabilities:
        cmds.append(["revoke", "--url", url, "some-name"])
    t = term(150, 30)
    t0 = time.monotonic()
    t.top(tmp_path / "status", "--url", url, "--interval", "0.5")
    runs = await asyncio.gather(*(cli(*c, timeout=45) for c in cmds))
    code = await t.wait_exit(30)
    took = time.monotonic() - t0
    screen = t.screen()
    assert code == 69, screen
    no_traceback(screen)
    assert SECRET not in screen, screen
    assert screen.replace("TOP-EXITED", "").strip(), "top: no message at all"
    for c, ran in zip(cmds, runs, strict=True):
        assert ran.code == 69, (c, ran)
        no_traceback(ran.err + ran.out)
        assert SECRET not in ran.err + ran.out, (c, ran)
        assert ran.err.strip(), (c, ran)
        assert ran.out.strip() == "", (c, ran.out)
    assert took < 30, took
    for c, ran in zip(cmds, runs, strict=True):  # last: the known defect of one row
        lines = [line for line in ran.err.splitlines() if line.strip()]
        assert len(lines) == 1, (c, ran.err)


@pytest.mark.parametrize(
    "scenario",
    [s for s in cli_rows(C.SCAN) if s.values[0].id.startswith(("redis", "redlock"))],
    indirect=True,
)
async def test_ls_lists_more_names_than_one_scan_step(scenario: Scenario, backend_url: str) -> None:
    """Redis lists with ``SCAN``, 1,000 keys a step: every held name is listed, however
    many steps the walk takes."""
    p = prefix()
    n = 1100
    async with aiolock.connect(backend_url) as locks:
        leases = await asyncio.gather(
            *(locks.lock(f"{p}{i:04d}", ttl=30).acquire(timeout=20) for i in range(n))
        )
        try:
            ran = await cli("ls", "--json", "--url", backend_url, p, timeout=60)
        finally:
            await asyncio.gather(*(lease.release() for lease in leases))
    assert ran.code == 0, ran
    got = sorted(r["name"] for r in parse_json_lines(ran.out))
    assert got == [f"{p}{i:04d}" for i in range(n)], (len(got), n)


async def test_no_url_says_so_and_exits_2() -> None:
    """Neither ``--url`` nor ``$AIOLOCK_URL``: the commands say clearly (exit 2)."""
    for c in (["ls"], ["ls", "--json"], ["revoke", "x"], ["top"]):
        ran = await cli(*c)
        assert ran.code == 2, (c, ran)
        no_traceback(ran.err + ran.out)
        assert "AIOLOCK_URL" in ran.err or "--url" in ran.err, (c, ran.err)


_ = cli_rows
