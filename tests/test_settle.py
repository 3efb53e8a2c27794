"""The pure rule behind ``status()``/``scan()``/``leader()`` reading a grant half made
(``aiolock/_settle.py``): what counts as in progress, and the bounded re-reading."""

from __future__ import annotations

import time

from aiolock import Holder
from aiolock._settle import SETTLE, in_progress, settled
from aiolock.abc import LockInfo

HOLDER = Holder("h", 1, "t", "d")


def test_in_progress_is_an_exclusive_hold_without_token_or_record() -> None:
    assert in_progress(LockInfo("n", True, family="lock"), holders=False)  # no token yet
    assert in_progress(LockInfo("n", True, token=3, family="elect"), holders=True)  # no record
    assert not in_progress(LockInfo("n", True, token=3, family="elect"), holders=False)
    assert not in_progress(LockInfo("n", True, token=3, held_by=(HOLDER,)), holders=True)
    assert not in_progress(LockInfo("n", False), holders=True)
    for family in ("rw", "sem"):  # readers and permits have no token of their own
        assert not in_progress(LockInfo("n", True, held_by=(HOLDER,), family=family), holders=True)


async def test_settled_reads_again_until_whole_and_no_longer_than_settle() -> None:
    answers = iter([None, None, 7])
    reads = 0

    async def read() -> int | None:
        nonlocal reads
        reads += 1
        return next(answers)

    assert await settled(read, lambda got: got is None) == 7 and reads == 3

    async def never() -> None:
        return None

    started = time.monotonic()
    assert await settled(never, lambda got: got is None) is None  # reported as seen
    assert SETTLE <= time.monotonic() - started < SETTLE + 0.5
