"""Usage accounting: events on a Redis stream, the flusher into PostgreSQL, prices."""
