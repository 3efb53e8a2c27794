"""The fault harness's judgement, on made-up logs: each safety figure must fail when the
log shows the bug it counts, and say n/a only where the backend documents the loss."""

from __future__ import annotations

from tests.faults.analysis import Figure, analyze
from tests.faults.backends import BACKENDS
from tests.faults.records import Access, Acquired, Event, Record

TTL = 1.0


def figures(backend: str, log: list[Record], events: list[Event] | None = None
            ) -> dict[str, Figure]:
    figs = analyze(BACKENDS[backend], TTL, log, events or [], {}, {}, {})
    return {f.key: f for f in figs}


def grant(lock: str, token: int, pid: int, t: float) -> Acquired:
    return Acquired("A", t, lock, token, pid, t - 0.001, t)


def write(lock: str, token: int, pid: int, t: float, ok: bool, read: int = 0, before: int = 0
          ) -> Access:
    return Access("W", t, lock, token, pid, t, ok, read, before)


def test_a_clean_handoff_is_ok() -> None:
    log = [grant("x", 1, 10, 1.0), write("x", 1, 10, 1.1, True),
           grant("x", 2, 11, 2.0), write("x", 2, 11, 2.1, True, 1, 1)]
    figs = figures("redis", log)
    for key in ("stale_accepted", "token_order", "lost_updates", "superseded"):
        assert figs[key].status == "ok" and figs[key].value == 0, figs[key]


def test_stale_write_accepted_fails() -> None:
    log = [grant("x", 1, 10, 1.0), grant("x", 2, 11, 2.0), write("x", 2, 11, 2.1, True),
           write("x", 1, 10, 2.2, True)]
    figs = figures("redis", log)
    assert figs["stale_accepted"].status == "FAIL" and figs["stale_accepted"].value == 1


def test_acting_on_a_superseded_lease_fails_without_a_fault() -> None:
    # pid 10 writes (rejected) after pid 11 got a newer token: the lease was believed too long
    log = [grant("x", 1, 10, 1.0), grant("x", 2, 11, 2.0), write("x", 1, 10, 2.5, False)]
    figs = figures("redis", log)
    assert figs["superseded"].status == "FAIL" and figs["superseded"].value == 1
    assert figs["stale_accepted"].value == 0  # the fence held, the lease still lied


def test_duplicate_token_fails() -> None:
    log = [grant("x", 5, 10, 1.0), grant("x", 5, 11, 2.0)]
    assert figures("redis", log)["token_order"].status == "FAIL"


def test_token_restart_after_a_sentinel_failover_is_na_long_after_the_window() -> None:
    # tokens up to 7 before the failover at t=3..4; the promoted replica's counter
    # restarts at 3, and the restarted leases act (rejected by the fence) 20 s later
    failover = Event("failover", 3.0, 4.0, 0, [], {})
    log = [grant("x", 7, 10, 2.0), write("x", 7, 10, 2.1, True),
           grant("x", 3, 11, 25.0), write("x", 3, 11, 25.1, False)]
    figs = figures("redis-sentinel", log, [failover])
    assert figs["superseded"].status == "ok" and figs["superseded"].value == 0
    assert figs["superseded"].detail["n_a"] == 1
    # the same log on a backend that does not forget: a failure
    assert figures("redis", log, [failover._replace(kind="restart")])["superseded"].status == "FAIL"
    # and on Sentinel with no failover between the two grants: a failure too
    assert figures("redis-sentinel", log)["superseded"].status == "FAIL"


def test_overlapping_terms_fail_and_a_clean_handoff_does_not() -> None:
    # pid 10 checks it still leads at t=2.5, after pid 11 was granted the next term at 2.0
    log = [grant("el", 1, 10, 1.0), write("el", 1, 10, 1.5, True),
           grant("el", 2, 11, 2.0), write("el", 2, 11, 2.1, True, 1, 1), write("el", 1, 10, 2.5, False)]
    figs = figures("postgres", log)
    assert figs["overlaps"].status == "FAIL" and figs["overlaps"].value == 1
    assert abs(figs["overlaps"].detail["worst"] - 0.5) < 1e-9
    assert figures("postgres", log[:-1])["overlaps"].value == 0
    # a term granted (a lower token, reported late) that never acted is not an overlap
    late = [grant("el", 3, 12, 1.0), write("el", 3, 12, 1.5, True), grant("el", 2, 11, 1.2)]
    assert figures("postgres", late)["overlaps"].value == 0
    # inside a fault the backend documents (a dropped connection frees at once): n/a
    restart = Event("restart", 1.9, 2.0, 0, [], {})
    figs = figures("postgres", log, [restart])
    assert figs["overlaps"].status == "ok" and figs["overlaps"].detail["n_a"] == 1
