"""Tier 3: the lazy engine (fetcher, vfs, traces, materializer) driven directly with trio; no kernel mount."""
