"""API keys: hashing and records, the per-replica cache, the unknown-key throttle, the keys CLI."""
