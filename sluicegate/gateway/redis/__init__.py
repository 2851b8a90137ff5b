"""The request path's own Redis connection and command batching."""
