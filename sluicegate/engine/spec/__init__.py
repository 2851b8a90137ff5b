"""Speculative decoding: what proposes draft tokens (plain Python, no devices)."""
