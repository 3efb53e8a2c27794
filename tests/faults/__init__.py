"""The fault harness: every backend driven through injected faults, with a fencing checker.

``python -m tests.faults --quick`` (CI, about a minute) or ``--long`` (>= 100,000 fenced
acquisitions per backend); ``./test.sh faults [args]`` does the same after setup. See
docs/faults.md for what each figure means. Modules: ``harness`` (orchestrator),
``worker`` / ``checker`` / ``probe`` (the processes), ``proxy`` (our TCP proxy),
``analysis`` (figures), ``report`` (the table), ``backends`` (per-backend knowledge).
"""
