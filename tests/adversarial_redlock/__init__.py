"""Adversarial tests of the Redlock backend, written from README.md, SPEC.md,
docs/redlock.md and docs/backends/index.md alone (never from the implementation)."""
