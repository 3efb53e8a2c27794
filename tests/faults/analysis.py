"""From the checker's log, the fault events and the probes' results to the figures.

Log records and events are the named tuples of ``records.py``; all times are
``time.monotonic()``.
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .backends import BackendSpec
from .common import percentile
from .records import Access, Acquired, Echo, Ended, Event, Record, Stall

__all__ = ["Figure", "analyze"]


@dataclass
class Figure:
    """One cell of the table: ``status`` is ``ok``, ``FAIL`` or ``n/a`` (the backend
    cannot give this guarantee; the figure is shown, not judged)."""

    key: str
    value: float | None
    text: str
    status: str = "ok"
    detail: dict[str, Any] = field(default_factory=dict)


def _fmt_s(v: float | None) -> str:
    if v is None:
        return "-"
    if math.isinf(v):
        return "never"
    return f"{v * 1000:.0f}ms" if v < 1 else f"{v:.2f}s"


def _grant_index(recs: list[Acquired]) -> tuple[list[float], list[int]]:
    """Grant times (sorted) and the highest token granted up to each."""
    top, prefix = -1, []
    for r in recs:
        top = max(top, r.token)
        prefix.append(top)
    return [r.t_acq for r in recs], prefix


def _overlaps(acq: dict[str, list[Acquired]], accesses: list[Access],
              explained: Callable[[float], bool]) -> tuple[int, int, float]:
    """Holds (election terms) of one name that overlap on the monotonic clock, each from
    its grant to its holder's last check that it still held (before a fenced access):
    (pairs, pairs explained by a forgetting fault, the longest overlap in seconds). A hold
    that never acted is left out: an acquire may return a lease already lost (its holder
    stalled after the server granted it), which its holder never believes in."""
    last: dict[tuple[str, int, int], float] = {}
    for rec in accesses:
        key = (rec.lock, rec.token, rec.pid)
        last[key] = max(last.get(key, rec.t_check), rec.t_check)
    bad = n_a = 0
    worst = 0.0
    for lock, recs in acq.items():
        terms = sorted((r.t_acq, last[(lock, r.token, r.pid)]) for r in recs
                       if (lock, r.token, r.pid) in last)
        for i, (_start, end) in enumerate(terms):
            for later, _end in terms[i + 1:]:
                if later >= end:
                    break
                if explained(later):
                    n_a += 1
                else:
                    bad += 1
                    worst = max(worst, end - later)
    return bad, n_a, worst


def analyze(spec: BackendSpec, ttl: float, log: list[Record], events: list[Event],
            probe: dict[str, Any], holds: dict[str, Any], extra: dict[str, Any]) -> list[Figure]:
    """Every figure of one backend."""
    acq: dict[str, list[Acquired]] = collections.defaultdict(list)
    accesses: list[Access] = []
    ends: dict[str, list[Ended]] = collections.defaultdict(list)
    by_pid_token: dict[tuple[int, int], float] = {}
    stall_expired = stall_detected = 0
    echo_desync = echo_err = echo_n = 0
    for rec in log:
        if isinstance(rec, Acquired):
            acq[rec.lock].append(rec)
            by_pid_token[(rec.pid, rec.token)] = rec.t_acq
        elif isinstance(rec, Access):
            accesses.append(rec)
        elif isinstance(rec, Ended):
            ends[rec.lock].append(rec)
        elif isinstance(rec, Stall):
            stall_expired += rec.expired
            stall_detected += rec.detected
        elif isinstance(rec, Echo):
            echo_n += 1
            if rec.ok is False:
                echo_desync += 1
            elif rec.ok is None:
                echo_err += 1
    for recs in acq.values():
        recs.sort(key=lambda r: r.t_acq)
    forgetting = [ev for ev in events if any(f in ev.kind for f in spec.forgets)]

    def explained(t: float) -> bool:
        return any(ev.t0 - 0.1 <= t <= ev.t1 + ttl + 1.0 for ev in forgetting)

    def restarted(before: float, after: float) -> bool:
        """A forgetting fault lies between two grants: the token counter may have gone
        back at it (a failover without WAIT), so every grant after it can carry a lower
        token than grants before it. The fence rejects those (stale_accepted stays the
        real check); acting on such a lease is what the backend documents, not a bug."""
        return any(before <= ev.t1 + ttl + 1.0 and after >= ev.t0 - 0.1 for ev in forgetting)

    figs: list[Figure] = []

    # -- safety ---------------------------------------------------------------------------
    highest: dict[str, int] = {}
    stale_acc = wrong_rej = rej_w = rej_r = lost_updates = lost_na = writes = reads = 0
    for rec in accesses:
        lock, tok, ok = rec.lock, rec.token, rec.ok
        top = highest.get(lock)
        if ok:
            if top is not None and tok < top:
                stale_acc += 1
            highest[lock] = max(tok, top if top is not None else tok)
        elif top is None or tok >= top:
            wrong_rej += 1
        if rec.kind == "W":
            writes += 1
            if not ok:
                rej_w += 1
            elif rec.read != rec.before:
                # two holders with one token (a failover lost the increment) both pass
                # the fence: inside such a fault's window it is what the backend documents
                if explained(rec.t_check):
                    lost_na += 1
                else:
                    lost_updates += 1
        else:
            reads += 1
            if not ok:
                rej_r += 1
    figs.append(Figure("stale_accepted", stale_acc, str(stale_acc), "ok" if stale_acc == 0 else "FAIL",
                       {"wrongly_rejected": wrong_rej}))
    figs.append(Figure("stale_rejected", rej_w, f"{rej_w} w / {rej_r} r", "ok",
                       {"reads_rejected": rej_r}))

    dups = dups_na = regress = regress_na = 0
    for recs in acq.values():
        counts = collections.Counter(r.token for r in recs)
        seen: set[int] = set()
        for r in recs:  # in grant order: the second grant of a token is the duplicate
            if r.token in seen:
                if explained(r.t_acq):
                    dups_na += 1
                else:
                    dups += 1
            seen.add(r.token)
        tacqs, prefix = _grant_index(recs)
        for r in recs:
            i = bisect.bisect_left(tacqs, r.t_req)
            if i and prefix[i - 1] >= r.token and counts[r.token] == 1:
                if explained(r.t_req):
                    regress_na += 1
                else:
                    regress += 1
    bad = dups + regress
    n_a = dups_na + regress_na
    text = f"{dups} dup / {regress} regr" + (f" (+{n_a} n/a)" if n_a else "")
    figs.append(Figure("token_order", bad, text, "ok" if bad == 0 else "FAIL",
                       {"dups_n_a": dups_na, "regress_n_a": regress_na}))
    text = str(lost_updates) + (f" (+{lost_na} n/a)" if lost_na else "")
    figs.append(Figure("lost_updates", lost_updates, text, "ok" if lost_updates == 0 else "FAIL",
                       {"writes": writes, "n_a": lost_na}))

    superseded = superseded_na = 0
    examples: list[Any] = []
    index = {lock: _grant_index(recs) for lock, recs in acq.items()}
    for rec in accesses:
        tacqs, prefix = index.get(rec.lock, ([], []))
        tc, tok = rec.t_check, rec.token
        i = bisect.bisect_left(tacqs, tc)
        if not i or prefix[i - 1] <= tok:
            continue
        newer = next(r for r in acq[rec.lock][:i] if r.token > tok)
        own = by_pid_token.get((rec.pid, tok))
        if explained(newer.t_acq) or (own is not None and restarted(newer.t_acq, own)):
            superseded_na += 1
        else:
            superseded += 1
            if len(examples) < 3:
                examples.append({"access": rec._asdict(), "newer": newer._asdict()})
    text = str(superseded) + (f" (+{superseded_na} n/a)" if superseded_na else "")
    status = "ok" if superseded == 0 else "FAIL"
    figs.append(Figure("superseded", superseded, text, status,
                       {"n_a": superseded_na,
                        "why": spec.forgets_why if superseded_na + dups_na + regress_na + lost_na else "",
                        "examples": examples}))

    overlaps, overlaps_na, worst_overlap = _overlaps(acq, accesses, explained)
    text = str(overlaps) + (f" (+{overlaps_na} n/a)" if overlaps_na else "")
    figs.append(Figure("overlaps", overlaps, text, "ok" if overlaps == 0 else "FAIL",
                       {"n_a": overlaps_na, "worst": worst_overlap,
                        "terms": sum(len(recs) for recs in acq.values())}))

    after_resume = 0
    for ev in events:
        if ev.kind != "stop":
            continue
        for rec in accesses:
            if rec.pid == ev.pid and rec.t_check >= ev.t1:
                got = by_pid_token.get((rec.pid, rec.token))
                if got is not None and got <= ev.t0:
                    after_resume += 1
    figs.append(Figure("after_resume", after_resume, str(after_resume),
                       "ok" if after_resume == 0 else "FAIL"))

    if probe:  # the fault-free probes ran (not in election mode)
        leaked = probe.get("leaked")
        text = f"{leaked} / {probe.get('attempts', 0)}" if leaked is not None else "-"
        figs.append(Figure("leaked", leaked, text, "ok" if leaked == 0 else "FAIL",
                           {"examples": probe.get("examples", [])}))
        hno = probe.get("held_not_owned")
        figs.append(Figure("held_not_owned", hno, f"{hno} / {probe.get('release_cancelled', 0)}"
                           if hno is not None else "-", "ok" if hno == 0 else "FAIL"))
    desyncs = echo_desync + int(probe.get("desyncs", 0))
    echoes = echo_n - echo_err + int(probe.get("echoes", 0))
    figs.append(Figure("desyncs", desyncs, f"{desyncs} / {echoes}", "ok" if desyncs == 0 else "FAIL",
                       {"echo_errors": echo_err + int(probe.get("echo_errors", 0))}))

    # -- liveness -------------------------------------------------------------------------
    bound, label = spec.kill_bound(ttl)
    takeovers: list[float] = []
    for ev in events:
        if ev.kind != "kill":
            continue
        for lock, _tok in ev.holdings:
            # the first acquisition by another process after the kill, counted when some
            # task was already waiting at the kill (else it says when someone asked)
            recs = acq.get(lock, [])
            after = [r for r in recs if r.t_acq > ev.t0 and r.pid != ev.pid]
            if not any(r.t_req < ev.t0 for r in after):
                if not after:
                    takeovers.append(math.inf)
                continue
            takeovers.append(min(r.t_acq for r in after) - ev.t0)
    worst = max(takeovers) if takeovers else None
    status = "ok" if worst is None or worst <= bound else "FAIL"
    if label.startswith("n/a") and status == "ok":
        status = "n/a"
    kills = sum(1 for ev in events if ev.kind == "kill")
    text = (f"{_fmt_s(worst)} (n={len(takeovers)})" if takeovers
            else "- (nobody waiting)" if kills else "- (no kill)")
    figs.append(Figure("kill_takeover", worst, text, status, {"bound": bound, "bound_label": label,
                                                              "all": takeovers}))

    handoffs: list[float] = []
    for lock, ended in ends.items():
        arecs = acq.get(lock, [])
        tacqs = [r.t_acq for r in arecs]
        for e in ended:
            if e.how != "released":
                continue
            i = bisect.bisect_right(tacqs, e.t_exit)
            if i < len(arecs) and arecs[i].t_req < e.t_done:
                handoffs.append(arecs[i].t_acq - e.t_exit)
    p50, p99 = percentile(handoffs, 0.5), percentile(handoffs, 0.99)
    figs.append(Figure("handoff_p99", p99, f"{_fmt_s(p50)} / {_fmt_s(p99)}", "ok", {"n": len(handoffs)}))

    if holds:
        lapses = holds.get("lapses")
        figs.append(Figure("lapses", lapses, f"{lapses} / {holds.get('holds', 0)}" if lapses is not None
                           else "-", "ok" if lapses == 0 else "FAIL", {"hold_ttl": holds.get("hold_ttl")}))

    exp = stall_expired + int(probe.get("stall_expired", 0))
    det = stall_detected + int(probe.get("stall_detected", 0))
    bodies, bodies_lost = int(probe.get("stall_bodies", 0)), int(probe.get("stall_bodies_lost", 0))
    ok = det == exp and bodies_lost == bodies and (exp > 0 or not probe)
    figs.append(Figure("stalls", det, f"{det} / {exp}", "ok" if ok else "FAIL",
                       {"bodies": bodies, "bodies_lost": bodies_lost, "in_workload": stall_expired}))

    if probe:
        over = probe.get("overshoot_max")
        early = probe.get("overshoot_min", 0.0) < -0.001
        unexpected = int(probe.get("timeout_unexpected", 0))
        ok = over is not None and over <= 0.05 and not early and unexpected == 0
        figs.append(Figure("timeouts", over, f"{_fmt_s(over)} (n={probe.get('timeout_probes', 0)})",
                           "ok" if ok else "FAIL", {"early": early, "unexpected": unexpected}))

    stops = taken = 0
    for ev in events:
        if ev.kind == "stop" and ev.holdings:
            for lock, _tok in ev.holdings:
                stops += 1
                if any(ev.t0 <= r.t_acq <= ev.t1 and r.pid != ev.pid for r in acq.get(lock, [])):
                    taken += 1
    figs.append(Figure("stop_takeover", taken, f"{taken} / {stops}", "ok"))

    # a server-side fault (restart, failover, leader kill): from its start to the next
    # grant of each lock, the worst lock and event (how long the locks were unavailable)
    outages: list[float] = []
    for ev in events:
        if ev.kind not in ("restart", "failover", "killmaster", "leader"):
            continue
        for recs in acq.values():
            nxt = [r.t_acq for r in recs if r.t_acq > ev.t0]
            outages.append(min(nxt) - ev.t0 if nxt else math.inf)
    worst = max(outages) if outages else None
    figs.append(Figure("server_fault_gap", worst,
                       f"{_fmt_s(worst)} (n={len(outages)})" if outages else "-", "ok",
                       {"all": outages}))

    # -- the run --------------------------------------------------------------------------
    fenced = sum(1 for rec in accesses if rec.kind == "W")
    figs.append(Figure("fenced", fenced, f"{fenced:,}", "ok",
                       {"acquisitions": sum(len(v) for v in acq.values())}))
    kinds = collections.Counter(ev.kind.split(":")[0] for ev in events)
    figs.append(Figure("faults", sum(kinds.values()),
                       " ".join(f"{k}{v}" for k, v in sorted(kinds.items())), "ok", dict(kinds)))
    if extra:
        figs.append(Figure(extra["key"], extra.get("value"), extra["text"], extra["status"], extra))
    return figs
