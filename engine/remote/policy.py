# stand-in: replaced by branch fleet
"""Routing policies (the stand-in routes round robin whatever is named)."""

__all__ = ["POLICIES"]

POLICIES = ("round_robin", "power_of_two", "cache_aware")
