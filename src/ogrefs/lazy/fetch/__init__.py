"""Chunks on their way: the fetcher (one flight per chunk, priorities), its request queue, blob I/O in
worker threads, the chunk cache, the residency (the one owner of where each chunk is now), and the
priority of background threads."""
