"""Tier 1: pure functions and the memory store; no repository on disk, no kernel mount, no server."""
