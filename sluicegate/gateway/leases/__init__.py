"""Crash-safe settlement: the leases each admission leaves, this replica's book, the reaper."""
