"""The lazy engine, protocol-free, on trio: four floors, each a package (docs/architecture.md).

``fetch`` (chunks: the fetcher, its queue, blob I/O, the chunk cache, the residency) is the lowest;
``fs`` (what the kernel sees) and ``trace`` (what was read, and what to read first) stand on it and
know nothing of each other; ``background`` (prefetch, box CPU, the snapshot gate, materialization) is
the top.  tests/unit/test_layers.py holds the floors and which modules run in worker threads only.
"""
