"""Driving the step loop: LLM, AsyncEngine, the engine core, its process and channel, deltas."""
