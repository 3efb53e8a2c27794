"""Fixtures of the load tests (README.md, SPEC.md and docs/ only): multi-process churn on
the non-Redis server backends while busy loops keep the 2-core machine saturated.

Tests that found a defect stay in the default run (an open one is xfail(strict=True)
with its symptom, in ``KNOWN_DEFECTS``); the rest are in the slow tier.
"""

from __future__ import annotations

import pytest

from .._children import known_defects

#: test id (as pytest shows it, without the file) -> the one-line symptom of an open defect
KNOWN_DEFECTS: dict[str, str] = {
}

#: tests (by name, without parameters; or full ids) that found a defect: default run
DEFAULT: set[str] = set()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in known_defects(items, "adversarial_load_other", KNOWN_DEFECTS):
        if item.name not in DEFAULT and item.name.partition("[")[0] not in DEFAULT:
            item.add_marker(pytest.mark.slow)
