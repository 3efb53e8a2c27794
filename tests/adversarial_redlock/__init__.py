"""Adversarial tests of the Redlock backend, written from README.md, SPEC.md,
docs/redlock.md and docs/backends/index.md alone (never from the implementation).

In the default run: the ones that failed on the code before the late-answer repair and
the late-grant token fixes (a node always slower than the majority never got a lease
back) and the late-grant token checks; the rest found nothing and are in the slow tier.
"""
