"""The ``aiolock`` command: ``run``, ``elect``, ``status``, ``ls``, ``top``, ``revoke`` and ``demo``.

``aiolock run [--url URL] [--ttl S] [--timeout S] NAME -- COMMAND...`` holds the lock
while COMMAND runs and exits with its status; the child gets ``AIOLOCK_TOKEN``. Exit
75 (EX_TEMPFAIL) if the lock was not acquired in time, 76 if the lease was lost (the
child is stopped first), 69 (EX_UNAVAILABLE) if the server cannot be reached, 77
(EX_NOPERM) if it refused the credentials or a permission, 70 (EX_SOFTWARE) for any other
aiolock error, 2 for usage errors (a bad URL or option). Errors are one line on stderr,
never a traceback. Once COMMAND ran, ``run`` exits with COMMAND's status even if the
release then fails (it says so on stderr): a retry wrapper must not run it twice.
``aiolock elect [--url URL] [--ttl S] [--timeout S] [--data D] NAME -- COMMAND...`` runs
COMMAND while this process leads the election NAME, with the exit codes of ``run``.
``aiolock ls [--json] [PREFIX]`` lists held names, ``aiolock top [--interval S] [PREFIX]``
shows them live (``q`` quits); ``aiolock revoke NAME`` force-releases
every holder of NAME (exit 0 if something was held, 1 if nothing was).
``--url`` defaults to ``$AIOLOCK_URL``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Sequence

from ._cli_ops import list_held, revoke
from ._connect import connect
from ._lease import Lease
from .errors import AccessDenied, BackendUnavailable, LockError, LockTimeout

__all__ = [
    "EXIT_DENIED", "EXIT_ERROR", "EXIT_LOST", "EXIT_NOT_ACQUIRED", "EXIT_UNAVAILABLE", "main",
]

EXIT_NOT_ACQUIRED = 75
EXIT_LOST = 76
EXIT_UNAVAILABLE = 69
EXIT_DENIED = 77
EXIT_ERROR = 70
#: Seconds between SIGTERM and SIGKILL when stopping a child whose lease was lost.
STOP_GRACE = 5.0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiolock", description="Distributed locks for asyncio, from the command line."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    url_help = "lock server URL (default: $AIOLOCK_URL)"
    run = sub.add_parser("run", help="hold a lock while a command runs")
    run.add_argument("--url", help=url_help)
    run.add_argument("--ttl", type=float, default=30.0, help="lease length, seconds (30)")
    run.add_argument("--timeout", type=float, default=None,
                     help="seconds to wait for the lock (default: forever)")
    run.add_argument("name", help="lock name")
    run.add_argument("cmd", nargs="*", help="-- COMMAND [ARGS...]")
    status = sub.add_parser("status", help="show who holds a lock")
    status.add_argument("--url", help=url_help)
    status.add_argument("name", help="lock name")
    elect = sub.add_parser("elect", help="run a command while this process leads an election")
    elect.add_argument("--url", help=url_help)
    elect.add_argument("--ttl", type=float, default=10.0, help="leadership lease, seconds (10)")
    elect.add_argument("--timeout", type=float, default=None,
                       help="seconds to wait for the leadership (default: forever)")
    elect.add_argument("--data", default="", help="the leader's data (e.g. host:port)")
    elect.add_argument("name", help="election name")
    elect.add_argument("cmd", nargs="*", help="-- COMMAND [ARGS...]")
    ls = sub.add_parser("ls", help="list held names with holders, tokens, time left")
    ls.add_argument("--url", help=url_help)
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    ls.add_argument("prefix", nargs="?", default="", help="only names starting with this")
    top = sub.add_parser("top", help="a live view of the held names (q quits)")
    top.add_argument("--url", help=url_help)
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (1)")
    top.add_argument("prefix", nargs="?", default="", help="only names starting with this")
    revoke = sub.add_parser("revoke", help="force-release every holder of a name")
    revoke.add_argument("--url", help=url_help)
    revoke.add_argument("name", help="lock (or rwlock, semaphore, election) name")
    demo = sub.add_parser("demo", help="watch workers contend, crash and get fenced")
    demo.add_argument("--url", help="lock server URL (default: the embedded memory://)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``aiolock`` console script."""
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # everything after the first '--' is the command, options before it may come in any
    # order (``aiolock elect NAME --data X -- CMD``)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    if cut < len(argv):
        args.cmd = [*getattr(args, "cmd", []), *argv[cut + 1:]]
    try:
        if args.command == "demo":
            from .demo import run_demo

            return asyncio.run(run_demo(args.url))
        url = args.url or os.environ.get("AIOLOCK_URL")
        if not url:
            parser.error(f"{args.command}: no lock server given: pass --url URL or set AIOLOCK_URL "
                         "(e.g. redis://localhost:6379/0)")
        if args.command == "status":
            return asyncio.run(_status(url, args.name))
        if args.command == "ls":
            return asyncio.run(list_held(url, args.prefix, as_json=args.json))
        if args.command == "revoke":
            return asyncio.run(revoke(url, args.name))
        if args.command == "top":
            from ._top import run_top

            return asyncio.run(run_top(url, args.prefix, args.interval))
        cmd = args.cmd
        if not cmd:
            parser.error(f"{args.command}: give the command after '--', e.g. "
                         f"aiolock {args.command} NAME -- make deploy")
        if args.command == "elect":
            return asyncio.run(_run(url, args.name, args.ttl, args.timeout, cmd, data=args.data,
                                    elect=True))
        return asyncio.run(_run(url, args.name, args.ttl, args.timeout, cmd))
    except ValueError as exc:
        print(f"aiolock: {exc}", file=sys.stderr)
        return 2
    except BackendUnavailable as exc:
        print(f"aiolock: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except AccessDenied as exc:
        print(f"aiolock: {exc}", file=sys.stderr)
        return EXIT_DENIED
    except LockError as exc:
        print(f"aiolock: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except ImportError as exc:  # a backend's optional dependency is missing
        print(f"aiolock: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


async def _status(url: str, name: str) -> int:
    async with connect(url) as locks:
        info = await locks.status(name)
    if info.held:
        left = f"{info.ttl_left:.1f}s" if info.ttl_left is not None else "unknown"
        print(f"{name}: held, token {info.token}, time left {left}")
        for h in info.held_by:
            since = "" if h.since is None else f", for {h.since:.1f}s"
            task = f" task {h.task}" if h.task else ""
            data = f" data {h.data!r}" if h.data else ""
            print(f"  holder {h.host} pid {h.pid}{task}{data}{since}")
    else:
        print(f"{name}: free (last token {info.last_token if info.last_token is not None else '-'})")
    return 0


async def _run(
    url: str, name: str, ttl: float, timeout: float | None, cmd: list[str], *, data: str = "",
    elect: bool = False,
) -> int:
    async with connect(url) as locks:
        lock = (locks.election(name, ttl=ttl, on_lost="raise").campaign(data=data) if elect
                else locks.lock(name, ttl=ttl, on_lost="raise", data=data))
        try:
            lease = await lock.acquire(timeout=timeout)
        except LockTimeout:
            print(f"aiolock: {name!r} was not acquired within {timeout}s", file=sys.stderr)
            return EXIT_NOT_ACQUIRED
        env = dict(os.environ, AIOLOCK_TOKEN=str(lease.token), AIOLOCK_NAME=name)
        try:
            # its own process group, so stopping it also stops what it started
            child = await asyncio.create_subprocess_exec(*cmd, env=env, start_new_session=True)
        except OSError as exc:
            await lease.release()
            print(f"aiolock: cannot run {cmd[0]!r}: {exc}", file=sys.stderr)
            return 127
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):  # pass signals on to the child
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, _signal_group, child, sig)
        waiting = asyncio.ensure_future(child.wait())
        lost = asyncio.ensure_future(lease.wait_lost())
        try:
            await asyncio.wait({waiting, lost}, return_when=asyncio.FIRST_COMPLETED)
            if not waiting.done() and lease.lost:
                print(f"aiolock: lease on {name!r} lost; stopping the command", file=sys.stderr)
                await _stop(child, waiting)
                return EXIT_LOST
            code = await waiting
        finally:
            lost.cancel()
            if waiting.done() and not waiting.cancelled():
                await _release_after(lease, name)
            else:
                await lease.release()
        return code if code >= 0 else 128 - code


async def _release_after(lease: Lease, name: str) -> None:
    """Release once COMMAND has run: a failure is reported, not turned into our exit
    status (the command's own status stands; the lease expires by its ttl)."""
    try:
        await lease.release()
    except LockError as exc:
        print(f"aiolock: the command ran, but releasing {name!r} failed ({exc}); "
              "the lease expires by its ttl", file=sys.stderr)


def _signal_group(child: asyncio.subprocess.Process, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, sig)


async def _stop(child: asyncio.subprocess.Process, waiting: asyncio.Future[int]) -> None:
    """SIGTERM the child's process group; SIGKILL it after STOP_GRACE seconds."""
    _signal_group(child, signal.SIGTERM)
    try:
        await asyncio.wait_for(asyncio.shield(waiting), STOP_GRACE)
    except TimeoutError:
        _signal_group(child, signal.SIGKILL)
        await waiting
    _signal_group(child, signal.SIGKILL)  # anything it left behind in its group


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
