"""Fixtures of the issue-12 adversarial tests (coordination: holders, scan, revocation,
elections; waiting across processes): every backend row of ``tests/scenarios.py`` whose
class declares the capability, on the real servers ``tests/conftest.py`` starts."""

from __future__ import annotations

import os

import pytest

from aiolock import Capability

from .._children import known_defects
from ..conftest import capability_fixtures
from ..scenarios import Scenario

holders_row, holders_url, hlocks = capability_fixtures("holders_row", "holders_url", "hlocks",
                                                       Capability.HOLDERS)
revoke_row, revoke_url, rlocks = capability_fixtures("revoke_row", "revoke_url", "rlocks",
                                                     Capability.REVOKE)
scan_row, scan_url, slocks = capability_fixtures("scan_row", "scan_url", "slocks", Capability.SCAN)
elect_row, elect_url, elocks = capability_fixtures("elect_row", "elect_url", "elocks",
                                                   Capability.ELECTION)


# Defects these tests found that are still open: test id (as pytest shows it, without the
# file) -> the one-line symptom. Each is marked xfail(strict=True): the suite stays green,
# the defect visible, and a fix turns the entry into an error to delete.
KNOWN_DEFECTS: dict[str, str] = {
}

# Each test runs by default on these backends only (those where it found a defect, and a
# few where it guards the promise cheaply); AIOLOCK_ADV12_ALL=1 runs every backend.
KEEP: dict[str, set[str]] = {
    "test_any_1024_char_data_round_trips": {"redis", "mysql"},
    "test_data_over_1024_refused_with_valueerror": {"memory"},
    "test_nul_in_data": {"mysql", "zookeeper"},
    "test_holder_record_fields": {"redis", "zookeeper"},
    "test_odd_prefixes_match_literally": {"redis", "mysql", "zookeeper"},
    "test_scan_lists_every_kind_once": {"redis", "zookeeper"},
    "test_scan_while_names_churn": {"redis"},
    "test_scan_prefix_surrogate_and_types": {"redis", "mysql"},
    "test_revoked_body_cancelled_then_token_increases": {"memcached"},
    "test_revoked_release_does_not_free_next_holder": {"redis"},
    "test_revoke_hands_over_to_waiter_with_higher_token": {"redis", "zookeeper"},
    "test_revoke_races_acquire_and_release": {"redis-sentinel"},
    "test_revoke_every_reader_and_permit": {"redis", "zookeeper"},
    "test_one_leader_terms_increase_under_churn": {"redis"},
    "test_cancelled_campaign_leaves_no_phantom_leader": {"zookeeper"},
    "test_proclaim_after_revocation_raises": {"redis", "zookeeper", "memcached", "redlock"},
    "test_observe_ends_on_current_leader": {"memcached"},
    "test_decorated_campaign_and_lock_reentered": {"redis"},
    "test_killed_leader_replaced_stopped_leader_cancelled": {"redis"},
    "test_lease_granted_after_a_wait_longer_than_ttl_is_live": {"mysql-row"},
    "test_campaign_granted_after_a_wait_longer_than_ttl_is_live": {"mysql-row"},
    "test_revoke_elect_ls_exit_codes": {"redis"},
    "test_handed_over_lock_shows_the_new_holder": {"redis"},
    "test_paused_lone_leader_seen_vacant": {"zookeeper"},
    "test_at_most_one_leader_across_processes": {"redlock"},
    "test_lone_waiting_process_not_starved_by_busy_process": {"redis-cluster", "redis-sentinel"},
    "test_cli_revoke_every_kind_of_the_name": {"redis"},
    "test_proclaim_data_limits_and_round_trip": {"mysql"},
    "test_revoke_skips_cancelled_waiter": {"redis"},
    "test_revoking_some_leases_of_a_renewal_batch_spares_the_others": {"redlock"},
    "test_permit_and_write_granted_after_a_long_wait_are_live": set(),
    "test_same_task_acquires_again_after_revocation": {"redis"},
}
_ALL = os.environ.get("AIOLOCK_ADV12_ALL") == "1"


def _backend(item: pytest.Item) -> str | None:
    """The backend row id an item runs on (any parameter that is a scenario row)."""
    callspec = getattr(item, "callspec", None)
    for value in (callspec.params.values() if callspec else ()):
        if isinstance(value, Scenario):
            return value.id
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in known_defects(items, "adversarial_issue12", KNOWN_DEFECTS):
        keep = KEEP.get(item.name.partition("[")[0])
        backend = _backend(item)
        if not _ALL and keep is not None and backend is not None and backend not in keep:
            item.add_marker(pytest.mark.skip(reason="other backends: AIOLOCK_ADV12_ALL=1"))
