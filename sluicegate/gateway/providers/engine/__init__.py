"""Our own engines as a provider: requests over Redis Streams, replies, worker liveness and choice."""
