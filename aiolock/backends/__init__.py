"""Backend drivers. Each module imports its client library lazily (on first use)."""
