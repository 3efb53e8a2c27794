"""Fixtures of the adversarial tests of the operator commands ``aiolock ls [--json]``,
``aiolock top`` and ``aiolock revoke``, written from README.md, docs/operations.md and
SPEC.md alone (never from the implementation).

Every test that lists or revokes runs once per row of ``tests/scenarios.py`` that declares
the capability it needs (``SCAN`` / ``REVOKE``), except ``memory://``: its store is not
shared between processes, and the commands are other processes. ``top`` is driven in a
real pseudo-terminal (tmux, ``capture-pane``), as a person would see it.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from aiolock import Capability

from ..adversarial_issue13.conftest import cli, cli_env, pw_redis  # noqa: F401 -- pw_redis: a fixture
from ..adversarial_issue13.test_cli import Tmux
from ..scenarios import SCENARIOS, Scenario

C = Capability

#: a password put in URLs here: no screen, output or error may show it
TOP_SECRET = "TopSekr3t-pw-9q"


def cli_rows(*need: Capability) -> list[Any]:
    """``pytest.param`` of every row another process can reach (not ``memory://``) whose
    backend declares every one of ``need``."""
    return [s.param() for s in SCENARIOS if s.id != "memory" and set(need) <= s.capabilities]


def with_defects(rows: list[Any], defects: dict[str, str]) -> list[Any]:
    """``rows`` with ``xfail(strict=False, reason=...)`` on the row ids in ``defects``."""
    out = []
    for row in rows:
        s: Scenario = row.values[0]
        marks = list(row.marks)
        if s.id in defects:
            marks.append(pytest.mark.xfail(strict=False, reason=defects[s.id]))
        out.append(pytest.param(s, id=row.id, marks=marks))
    return out


def rows_without(capability: Capability) -> list[Any]:
    return [
        s.param()
        for s in SCENARIOS
        if s.id != "memory" and not s.missing and capability not in s.capabilities
    ]


def on_rows(*need: Capability) -> pytest.MarkDecorator:
    """Parametrize the ``scenario`` fixture (tests/conftest.py) over :func:`cli_rows`."""
    return pytest.mark.parametrize("scenario", cli_rows(*need), indirect=True)


#: one row per backend family for the screen tests (``top`` draws what ``scan()`` lists,
#: which the ``ls`` tests check on every row; the screen is the same code on each)
SCREEN_ROWS = ("redis", "redis-nolua", "zookeeper", "postgres", "mysql", "etcd", "redlock")


def on_screen_rows(*need: Capability) -> pytest.MarkDecorator:
    """:func:`on_rows`, one row per backend family (:data:`SCREEN_ROWS`)."""
    rows = [row for row in cli_rows(*need) if row.values[0].id in SCREEN_ROWS]
    return pytest.mark.parametrize("scenario", rows, indirect=True)


def prefix() -> str:
    return f"advtop-{uuid.uuid4().hex[:8]}:"


def no_traceback(text: str) -> None:
    assert "Traceback" not in text, text
    assert 'File "' not in text, text


def passwords(url: str) -> list[str]:
    """The passwords a URL carries (userinfo and ``password=`` query), for 'never shown'."""
    parts = urlsplit(url)
    found = []
    netloc = parts.netloc
    if "@" in netloc:
        userinfo = netloc.rsplit("@", 1)[0]
        if ":" in userinfo and userinfo.split(":", 1)[1]:
            found.append(userinfo.split(":", 1)[1])
    for pair in parts.query.split("&"):
        if pair.startswith("password="):
            found.append(pair.split("=", 1)[1])
    return [p for p in found if len(p) >= 4]


def with_password(url: str, user: str, password: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{host}"))


# ------------------------------------------------------------------ tmux


class Term(Tmux):
    """issue 13's tmux driver (``tests/adversarial_issue13/test_cli.py``) with a chosen
    size and a UTF-8 locale (names with non-ASCII characters)."""

    def __init__(self, width: int = 160, height: int = 45) -> None:
        super().__init__()
        self.session = f"advtop-{uuid.uuid4().hex[:8]}"
        self.sock = f"advtop-{uuid.uuid4().hex[:8]}"
        self.width, self.height = width, height
        self.status: Path | None = None

    def run(self, *args: str) -> str:
        done = subprocess.run(
            ["tmux", "-u", "-L", self.sock, *args],
            capture_output=True,
            text=True,
            timeout=10,
            env={**os.environ, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"},
        )
        return done.stdout

    def start(self, command: str) -> None:
        env = cli_env(TERM="xterm-256color", LANG="C.UTF-8", LC_ALL="C.UTF-8")
        subprocess.run(
            [
                "tmux",
                "-u",
                "-L",
                self.sock,
                "-f",
                "/dev/null",
                "new-session",
                "-d",
                "-s",
                self.session,
                "-x",
                str(self.width),
                "-y",
                str(self.height),
                command,
            ],
            check=True,
            env=env,
            timeout=10,
        )

    def top(self, status: Path, *args: str) -> None:
        """``aiolock top ARGS`` in the pane; its exit status goes to ``status``
        (``EXIT=<code>``) and the pane stays open afterwards."""
        self.status = status
        cmd = " ".join(shlex.quote(a) for a in (sys.executable, "-m", "aiolock", "top", *args))
        # the shell traps SIGINT (a Ctrl-C for top) so that it lives on to record the status;
        # top itself starts with the default disposition (a trap is reset on exec)
        self.start(
            f"trap 'true' INT; {cmd}; echo EXIT=$? > {shlex.quote(str(status))}; echo TOP-EXITED; sleep 60"
        )

    def exit_code(self) -> int | None:
        assert self.status is not None
        if not self.status.exists():
            return None
        text = self.status.read_text().strip()
        if not text.startswith("EXIT="):
            return None
        return int(text[len("EXIT=") :])

    async def wait_exit(self, within: float) -> int:
        deadline = time.monotonic() + within
        while True:
            code = self.exit_code()
            if code is not None:
                return code
            if time.monotonic() > deadline:
                raise AssertionError(f"top did not exit within {within}s:\n{self.screen()}")
            await asyncio.sleep(0.05)

    async def wait(self, check: Callable[[str], bool], what: str, within: float = 15.0) -> str:
        deadline = time.monotonic() + within
        while True:
            screen = self.screen()
            if check(screen):
                return screen
            if self.exit_code() is not None:
                raise AssertionError(f"top exited ({self.exit_code()}) before showing {what}:\n{screen}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the screen never showed {what} within {within}s:\n{screen}")
            await asyncio.sleep(0.1)


@pytest.fixture
def term() -> Iterator[Callable[..., Term]]:
    """``term(width, height)``: a fresh tmux server of our own with one window of that size."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    made: list[Term] = []

    def make(width: int = 160, height: int = 45) -> Term:
        t = Term(width, height)
        made.append(t)
        return t

    yield make
    for t in made:
        t.kill()


def row_lines(screen: str, name: str) -> list[str]:
    """The screen lines that start with ``name`` (the rows of the table)."""
    return [line for line in screen.splitlines() if line.startswith(name + " ") or line == name]


__all__ = [
    "TOP_SECRET",
    "C",
    "Scenario",
    "Term",
    "cli",
    "cli_rows",
    "no_traceback",
    "on_rows",
    "on_screen_rows",
    "with_defects",
    "passwords",
    "prefix",
    "row_lines",
    "rows_without",
    "with_password",
]
