"""Adversarial tests of issue 14 (etcd), written from README.md, SPEC.md and docs/ only."""
