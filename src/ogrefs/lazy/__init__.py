"""The lazy engine: fetcher, chunk cache, vfs, traces, prefetch, materialization (trio, protocol-free)."""
