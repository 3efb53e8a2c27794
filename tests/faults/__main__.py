"""``python -m tests.faults [--quick | --long] [--election] [--backends a,b] [--seed N] [--json PATH]``.

Prints the table of safety and liveness figures per backend; exits 1 if a safety figure
is not 0 or a liveness bound is missed (2 if a backend could not run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time

from .backends import BACKENDS
from .harness import Config, run
from .report import table, to_json

DEFAULT = ["redis", "redis-aof", "zookeeper", "postgres", "memcached", "zookeeper-3", "redlock",
           "redis-cluster", "redis-sentinel"]


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults", description=__doc__)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="the CI subset (default)")
    group.add_argument("--long", action="store_true", help=">= 100,000 fenced acquisitions per backend")
    parser.add_argument("--backends", default=",".join(DEFAULT),
                        help=f"comma-separated, from: {', '.join(BACKENDS)}")
    parser.add_argument("--election", action="store_true",
                        help="leaders campaign and do fenced writes (backends declaring election)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--target", type=int, help="fenced writes per backend before the workload "
                        "stops (long mode; default 100,000)")
    parser.add_argument("--max-seconds", type=float, help="workload time limit per backend (long mode)")
    parser.add_argument("--parallel", type=int, help="backends at once (quick: 3, long: 1)")
    parser.add_argument("--json", help="also write the figures as JSON here")
    parser.add_argument("--keep", action="store_true", help="keep every run's logs (temp dirs)")
    args = parser.parse_args()
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        parser.error(f"unknown backend(s) {unknown}; choose from {', '.join(BACKENDS)}")
    cfg = Config.long(backends, args.seed) if args.long else Config.quick(backends, args.seed)
    if args.target is not None:
        cfg.target = args.target
    if args.max_seconds is not None:
        cfg.max_seconds = args.max_seconds
    if args.parallel is not None:
        cfg.parallel = args.parallel
    cfg.election = args.election
    logging.basicConfig(level=logging.ERROR)
    started = time.monotonic()
    results = asyncio.run(run(cfg, say=lambda s: print(s, file=sys.stderr, flush=True), keep=args.keep))
    seconds = time.monotonic() - started
    print(table(results, cfg, seconds), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(to_json(results, cfg, seconds), fh, indent=1, default=str)
    if any(r.error for r in results):
        return 2
    return 1 if any(r.failed() for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
