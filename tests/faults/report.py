"""The fixed-width table of figures (rows) per backend (columns), and its JSON form."""

from __future__ import annotations

from typing import Any

from .backends import BACKENDS
from .harness import Config, Result

__all__ = ["ROWS", "table", "to_json"]

#: (figure key, row label, section)
ROWS: list[tuple[str, str, str]] = [
    ("stale_accepted", "stale-token accesses accepted", "safety"),
    ("stale_rejected", "  stale accesses rejected (>0: bit)", "info"),
    ("token_order", "token dups / regressions vs time", "safety"),
    ("lost_updates", "lost updates (counter RMW)", "safety"),
    ("superseded", "acted on a superseded lease", "safety"),
    ("overlaps", "overlapping holds/terms (mono clock)", "safety"),
    ("after_resume", "actions after SIGSTOP resume", "safety"),
    ("leaked", "locks leaked / cancelled acquires", "safety"),
    ("held_not_owned", "held-not-owned / cancelled releases", "safety"),
    ("desyncs", "connection desyncs / nonce echoes", "safety"),
    ("restart_no_aof", "server restart without AOF", "safety"),
    ("kill_takeover", "kill -9: lock taken over, max", "liveness"),
    ("handoff_p99", "release->next holder p50 / p99", "liveness"),
    ("lapses", "lease lapses / fault-free 10xTTL holds", "liveness"),
    ("stalls", "stalls > TTL detected / expired", "liveness"),
    ("timeouts", "acquire timeout overshoot max (50ms)", "liveness"),
    ("stop_takeover", "  SIGSTOP: taken over during pause", "info"),
    ("server_fault_gap", "  server fault: next grant, max", "info"),
    ("fenced", "fenced acquisitions (writes)", "run"),
    ("faults", "faults injected", "run"),
]

LABEL = 38
CELL = 22


def _cell(fig: Any) -> str:
    text = str(fig.text)
    if fig.status == "FAIL":
        text = "FAIL " + text
    elif fig.status == "n/a" and not text.startswith("n/a"):
        text = "n/a " + text
    return text


def table(results: list[Result], cfg: Config, seconds: float) -> str:
    """The report: one column per backend, a legend for marks and bounds."""
    widths = []
    for r in results:
        texts = [_cell(f) for f in r.figures] + [r.backend, r.skipped[:CELL], r.error[:CELL]]
        widths.append(max(CELL, min(48, max(len(t) for t in texts))))
    lines = []
    head = "figure".ljust(LABEL) + "".join(
        r.backend.ljust(w + 2) for r, w in zip(results, widths, strict=True))
    rule = "-" * len(head.rstrip())
    lines += [rule, head, rule]
    section = ""
    for key, label, sec in ROWS:
        if sec != section and sec != "info":
            section = sec
            title = {"safety": "SAFETY (each must be 0)", "liveness": "LIVENESS (bounds below)",
                     "run": "RUN"}[sec]
            lines.append(title)
        cells = []
        any_value = False
        for r, w in zip(results, widths, strict=True):
            fig = next((f for f in r.figures if f.key == key), None)
            if r.skipped:
                text = "skipped"
            elif r.error:
                text = "ERROR"
            elif fig is None:
                text = "-"
            else:
                text = _cell(fig)
                any_value = True
            cells.append(text[:w].ljust(w + 2))
        if key == "restart_no_aof" and not any_value:
            continue
        lines.append(("  " + label).ljust(LABEL) + "".join(cells))
    lines.append(rule)
    bounds = []
    for r in results:
        fig = next((f for f in r.figures if f.key == "kill_takeover"), None)
        if fig is not None:
            bounds.append(f"{r.backend} {fig.detail['bound_label']}")
    lines.append("kill -9 bounds: " + "; ".join(bounds))
    notes = []
    for r in results:
        sup = next((f for f in r.figures if f.key == "superseded"), None)
        if sup is not None and sup.detail.get("why"):
            notes.append(f"{r.backend}: n/a = {sup.detail['why']}")
        spec = BACKENDS.get(r.backend)
        if spec is not None and spec.not_injected and not r.skipped:
            notes.append(f"{r.backend}: not injected: {spec.not_injected}")
        if r.skipped:
            notes.append(f"{r.backend}: skipped: {r.skipped}")
        if r.error:
            notes.append(f"{r.backend}: error: {r.error}")
    lines += notes
    mode = f"{cfg.mode} election" if cfg.election else cfg.mode
    lines.append(f"mode {mode}, seed {cfg.seed}, ttl {cfg.ttl:g}s, {cfg.procs} procs x {cfg.tasks} tasks "
                 f"on {cfg.locks} {'elections' if cfg.election else 'locks'}, {seconds:.0f}s in all; "
                 + ", ".join(f"{r.backend} {r.seconds:.0f}s" for r in results))
    failed = [f"{r.backend}:{f.key}" for r in results for f in r.failed()]
    errors = [r.backend for r in results if r.error]
    lines.append("RESULT: " + ("FAIL " + " ".join(failed + errors) if failed or errors else "all figures ok"))
    return "\n".join(lines)


def to_json(results: list[Result], cfg: Config, seconds: float) -> dict[str, Any]:
    """Everything in the table, machine-readable (for tests/test_faults_quick.py)."""
    return {
        "mode": cfg.mode, "election": cfg.election, "seed": cfg.seed, "ttl": cfg.ttl, "seconds": seconds,
        "backends": {
            r.backend: {
                "skipped": r.skipped, "error": r.error, "seconds": r.seconds,
                "figures": {f.key: {"value": f.value, "text": f.text, "status": f.status,
                                    "detail": f.detail} for f in r.figures},
            } for r in results
        },
    }
