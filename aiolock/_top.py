"""``aiolock top [--url URL] [--interval S] [PREFIX]``: a live terminal view of a backend's locks.

Every ``--interval`` seconds (1 by default) it lists the held names with
``locks.scan(prefix)`` and redraws, in place: each name with its kind, token, waiters, a bar
of the time its lease has left, and its holders (host, pid, task, data, held for how long);
under it, the recent changes it saw between two refreshes -- a name that disappeared
(released, revoked or expired: the listing cannot tell which, except that a lease whose
time ran out meanwhile is called expired) or whose token changed (it changed hands). ``q``
quits (exit 0). A backend without ``Capability.SCAN`` is refused (exit 2), as by
``aiolock ls``, its scriptable twin.

Why rich (``Live``) rather than Textual: the view is one table redrawn on a timer plus one
key, which is exactly what ``rich.live.Live`` does, in the alternate screen, with no app
framework, no event loop of its own to reconcile with asyncio's, and one dependency (that
Textual itself is built on). It draws with plain ANSI sequences, so it works over SSH in
any terminal, needs no mouse, and degrades to a final plain print when the output is not a
terminal. The one key is read here in cbreak mode from stdin (restored on exit).

The bar's full length is the longest time left seen for that name's current token (a
watchdog renews at a third of the ttl, so a healthy lease swings between full and two
thirds); the listing does not carry the ttl itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._cli_ops import FAMILY_NAMES
from ._connect import connect
from .abc import Capability, LockInfo
from .errors import BackendUnavailable

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

    from ._locks import Locks

__all__ = ["TopView", "run_top", "watch"]

#: How many recent changes the view keeps.
RECENT = 8
BAR = 20


@dataclass
class _Seen:
    info: LockInfo
    at: float  # monotonic time of the listing
    full: float  # the longest ttl_left seen for this token


class TopView:
    """What ``top`` shows, and what it remembers between two listings."""

    def __init__(self, url: str, prefix: str = "", interval: float = 1.0) -> None:
        self.url = url
        self.prefix = prefix
        self.interval = interval
        self.seen: dict[tuple[str, str], _Seen] = {}
        self.recent: deque[str] = deque(maxlen=RECENT)
        self.error: str | None = None
        self.updated: float | None = None  # wall clock of the last listing

    def update(self, infos: list[LockInfo], now: float | None = None) -> None:
        """A new listing: remember it and note what changed since the last one."""
        now = time.monotonic() if now is None else now
        stamp = time.strftime("%H:%M:%S")
        current: dict[tuple[str, str], _Seen] = {}
        for info in infos:
            key = (info.family, info.name)
            old = self.seen.get(key)
            left = info.ttl_left or 0.0
            full = left
            if old is not None and old.info.token == info.token:
                full = max(old.full, left)
            elif old is not None and old.info.token is not None and info.token is not None:
                self.recent.appendleft(
                    f"{stamp}  {info.name}  {_kind(info)}  token {old.info.token} -> {info.token}: "
                    f"changed hands, now {_who(info)}"
                )
            current[key] = _Seen(info, now, full)
        for key, old in self.seen.items():
            if key not in current:
                last_left = old.info.ttl_left
                expired = last_left is not None and now - old.at >= last_left
                what = "expired" if expired else "released, revoked or expired"
                token = "" if old.info.token is None else f"token {old.info.token} "
                self.recent.appendleft(
                    f"{stamp}  {old.info.name}  {_kind(old.info)}  {token}gone: {what} (was {_who(old.info)})"
                )
        self.seen = current
        self.error = None
        self.updated = time.time()

    def failed(self, error: str) -> None:
        """A listing failed (the server went away): shown, and the last listing kept."""
        self.error = error

    def render(self) -> RenderableType:
        """The whole screen: a header, the table of held names, the recent changes."""
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        infos = [seen for _, seen in sorted(self.seen.items(), key=lambda kv: kv[0][1])]
        held = len(infos)
        waiting = sum(s.info.waiters for s in infos)
        header = Text.assemble(
            ("aiolock top", "bold"), f"  {self.url}",
            f"  prefix {self.prefix!r}" if self.prefix else "",
            f"  {held} held, {waiting} waiting",
            "  updated " + (time.strftime("%H:%M:%S", time.localtime(self.updated)) if self.updated else "-"),
            f"  every {self.interval:g}s", ("   q quits", "dim"),
        )
        parts: list[RenderableType] = [header]
        if self.error:
            parts.append(Text(f"cannot refresh: {self.error}", style="bold red"))
        table = Table(expand=True, box=None, header_style="bold", pad_edge=False)
        table.add_column("NAME", overflow="fold", ratio=3)
        table.add_column("KIND", no_wrap=True)
        table.add_column("TOKEN", justify="right", no_wrap=True)
        table.add_column("WAIT", justify="right", no_wrap=True)
        table.add_column("LEASE LEFT", no_wrap=True, min_width=BAR + 8)
        table.add_column("HOLDERS (host:pid task data, held for)", overflow="fold", ratio=4)
        for seen in infos:
            info = seen.info
            table.add_row(  # names and data as Text: a str cell is read as rich markup
                Text(info.name), _kind(info), "-" if info.token is None else str(info.token),
                str(info.waiters), _bar(info.ttl_left, seen.full), Text(_holders(info)),
            )
        if not infos:
            table.add_row(Text("(nothing held)", style="dim"), "", "", "", "", "")
        parts += [table, Text(""), Text("Recent changes", style="bold")]
        parts += [Text(line) for line in self.recent] or [Text("(none yet)", style="dim")]
        return Group(*parts)


def _kind(info: LockInfo) -> str:
    return FAMILY_NAMES.get(info.family, info.family)


def _who(info: LockInfo) -> str:
    return ", ".join(f"{h.host}:{h.pid}" + (f" {h.data!r}" if h.data else "") for h in info.held_by) or (
        f"{info.holders} holder(s)"
    )


def _holders(info: LockInfo) -> str:
    if not info.held_by:
        return f"{info.holders} holder(s)"
    lines = []
    for h in info.held_by:
        since = "" if h.since is None else f", {h.since:.1f}s"
        lines.append(f"{h.host}:{h.pid}" + (f" {h.task}" if h.task else "")
                     + (f" {h.data!r}" if h.data else "") + since)
    return "\n".join(lines)


def _bar(left: float | None, full: float) -> RenderableType:
    from rich.text import Text

    if left is None:
        return Text("?", style="dim")
    frac = 0.0 if full <= 0 else max(0.0, min(1.0, left / full))
    filled = round(frac * BAR)
    style = "green" if frac > 0.5 else "yellow" if frac > 0.2 else "red"
    return Text.assemble(("█" * filled, style), ("░" * (BAR - filled), "dim"), f" {left:5.1f}s")


async def watch(
    locks: Locks, view: TopView, console: Console, quit: asyncio.Event, *, screen: bool = True,
) -> int:
    """Refresh ``view`` from ``locks`` every ``view.interval`` seconds on ``console``
    until ``quit`` is set; 0."""
    from rich.live import Live

    with Live(view.render(), console=console, screen=screen, auto_refresh=False,
              redirect_stdout=False, redirect_stderr=False) as live:
        while not quit.is_set():
            try:
                view.update([info async for info in locks.scan(view.prefix)])
            except BackendUnavailable as exc:
                view.failed(str(exc))
            live.update(view.render(), refresh=True)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(view.interval):
                    await quit.wait()
    return 0


@contextlib.contextmanager
def _keys(quit: asyncio.Event) -> Iterator[None]:
    """Set ``quit`` when ``q`` is typed on stdin (in cbreak mode, if it is a terminal)."""
    loop = asyncio.get_running_loop()
    try:
        fd = sys.stdin.fileno()
    except (AttributeError, OSError, ValueError):
        yield  # no stdin: quit with Ctrl-C
        return
    saved = None
    if os.isatty(fd):
        import termios
        import tty

        saved = termios.tcgetattr(fd)
        tty.setcbreak(fd)

    def readable() -> None:
        try:
            data = os.read(fd, 64)
        except OSError:
            data = b""
        if not data:  # end of input: keep running, stop listening
            loop.remove_reader(fd)
        elif b"q" in data.lower():
            quit.set()

    with contextlib.suppress(OSError, ValueError, NotImplementedError):  # e.g. a regular file
        loop.add_reader(fd, readable)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            loop.remove_reader(fd)
        if saved is not None:
            import termios

            termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def run_top(url: str, prefix: str, interval: float) -> int:
    """``aiolock top``: 0 when ``q`` quits, 2 when the backend cannot list its locks."""
    if not interval > 0:
        raise ValueError(f"--interval must be a number of seconds > 0, got {interval}")
    try:
        from rich.console import Console
    except ImportError:
        raise ImportError("aiolock top needs rich: pip install 'aiolock[tui]'") from None
    locks = connect(url)
    if Capability.SCAN not in locks.capabilities:
        await locks.aclose()
        print(f"aiolock: {locks.url} cannot list its locks (no scan); use 'aiolock status NAME'",
              file=sys.stderr)
        return 2
    async with locks:
        quit = asyncio.Event()
        with _keys(quit):
            return await watch(locks, TopView(locks.url, prefix, interval), Console(), quit)
