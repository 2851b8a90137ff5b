"""Backends that generate text: our engine workers, or any OpenAI-compatible upstream."""
