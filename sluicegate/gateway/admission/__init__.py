"""Admission in one Redis round trip: limits, their key names, Lua scripts, replies, speculation."""
