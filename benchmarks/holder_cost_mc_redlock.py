"""Uncontended acquisitions/s on Memcached and Redlock: this tree vs another (e.g. main
before holder records), in the same run, alternating which goes first, on private
servers (tests/mc_server.py; three tests/servers.py redis-servers for Redlock).

    python benchmarks/holder_cost_mc_redlock.py --baseline /work/main [--runs 3] [--seconds 3]

Each pass is a subprocess with ``PYTHONPATH`` set to one tree (``pg_holder_cost.one_pass``:
``acquire`` + ``release`` of one lock with a 40-character ``data`` record). Prints each
pass, then per backend the median and range of each tree and the cost of this tree.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def main() -> int:
    sys.path.insert(0, str(HERE))
    from benchmarks._common import tree_comparison_args
    from benchmarks.pg_holder_cost import one_pass
    from tests.mc_server import MemcachedServer
    from tests.servers import RedisServer

    args = tree_comparison_args(__doc__ or "")

    servers = [MemcachedServer().start(), *(RedisServer().start() for _ in range(3))]
    try:
        urls = {"memcached": servers[0].url,
                "redlock": "redlock://" + ",".join(f"127.0.0.1:{s.port}" for s in servers[1:])}
        trees = (("baseline", args.baseline), ("this", str(HERE)))
        rates: dict[tuple[str, str], list[float]] = {}
        for run in range(args.runs):
            for backend, url in urls.items():
                for label, tree in trees if run % 2 == 0 else trees[::-1]:  # no order bias
                    rate = one_pass(tree, url, args.seconds)
                    rates.setdefault((backend, label), []).append(rate)
                    print(f"run {run + 1} {backend:9} {label:8} {rate:8.0f} acquisitions/s", flush=True)
        for backend in urls:
            medians = {}
            for label, _ in trees:
                got = rates[(backend, label)]
                medians[label] = statistics.median(got)
                print(f"{backend:9} {label:8} median {medians[label]:.0f}/s, "
                      f"range {min(got):.0f}-{max(got):.0f}")
            print(f"{backend:9} cost of this tree vs baseline (medians): "
                  f"{1 - medians['this'] / medians['baseline']:+.1%}")
    finally:
        for server in servers:
            server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
