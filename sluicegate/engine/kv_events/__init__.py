"""KV events: a worker's prefix-cache changes published on Redis, and what readers need to
follow them and to hash a request's blocks as the worker would (docs/kv-events.md)."""
