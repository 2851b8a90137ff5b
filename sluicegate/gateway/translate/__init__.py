"""Translations between the canonical chat model and the wire formats of other APIs."""
