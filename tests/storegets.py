"""A store wrapper for tests of fetches several at a time: GETs under one prefix, counted while in flight."""

from __future__ import annotations

import threading
from typing import Callable

from ogrefs.store import FaultyStore


class GetsUnder(FaultyStore):
    """GETs of keys under ``prefix`` first call ``before(key)`` (which may wait, sleep or raise); ``gets``,
    ``in_flight`` and ``most_in_flight`` count them."""

    def __init__(self, inner, prefix: str, before: Callable[[str], None] = lambda key: None) -> None:
        super().__init__(inner)
        self.prefix, self.before = prefix, before
        self.lock = threading.Lock()
        self.gets = self.in_flight = self.most_in_flight = 0

    def get(self, key: str) -> bytes:
        if not key.startswith(self.prefix):
            return super().get(key)
        with self.lock:
            self.gets += 1
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            self.before(key)
            return super().get(key)
        finally:
            with self.lock:
                self.in_flight -= 1
