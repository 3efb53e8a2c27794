"""The open finding of this suite (xfail, not strict; the suite is in the slow tier)."""

from __future__ import annotations

import pytest

FOUND = {
    "test_observer_sees_since_from_the_win_as_leadership_changes[etcd]": (
        "etcd: observe() yields the new leader read after its grant but before its record "
        "says how long it queued (since ~1.0 s, the wait), and yields nothing after: the "
        "rewrite keeps its token and data, which observe() compares (7 of 7 runs)"),
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "adversarial_since" in str(item.path) and item.name in FOUND:
            item.add_marker(pytest.mark.xfail(strict=False, reason=FOUND[item.name]))
