"""An in-process store for unit tests: a dict behind a lock.

``memory://name`` URLs resolve to process-global named instances so that two
``open_store`` calls in one test see the same objects, the way two opens of a
directory or a bucket would.

Locking: each MemoryStore owns ``_lock``, which guards ``_objects`` (the
dict).  Values are immutable ``bytes``, so readers copy nothing and can
slice outside the lock.  The module-level ``_registry_lock`` guards
``_registry`` (name -> store).  No lock is held while calling out.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from ogrefs.store.base import NotFound, ShortRead, Store, check_range, validate_key, validate_prefix

__all__ = ["MemoryStore", "named_memory_store", "forget_memory_stores"]


class MemoryStore(Store):
    """Keys and bytes in a dict; behaves like the other backends, errors included."""

    def __init__(self, name: str = "") -> None:
        self.url = f"memory://{name}"
        self._lock = threading.Lock()
        self._objects: dict[str, bytes] = {}
        self._written: dict[str, float] = {}  # key -> time.time() of its last put

    def get(self, key: str) -> bytes:
        validate_key(key)
        with self._lock:
            data = self._objects.get(key)
        if data is None:
            raise NotFound(f"{self.url}/{key}: no such object")
        return data

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        check_range(offset, length)
        data = self.get(key)
        if offset + length > len(data) or offset > len(data):
            raise ShortRead(f"{self.url}/{key}: range {offset}+{length} is past the end "
                            f"of the object ({len(data)} bytes)")
        return data[offset:offset + length]

    def put(self, key: str, data: bytes) -> None:
        validate_key(key)
        blob = bytes(data)  # a caller's bytearray must not change under us
        with self._lock:
            self._objects[key] = blob
            self._written[key] = time.time()

    def modified(self, key: str) -> float:
        validate_key(key)
        with self._lock:
            if key not in self._objects:
                raise NotFound(f"{self.url}/{key}: no such object")
            return self._written[key]

    def exists(self, key: str) -> bool:
        validate_key(key)
        with self._lock:
            return key in self._objects

    def list(self, prefix: str = "") -> Iterator[str]:
        validate_prefix(prefix)
        with self._lock:
            keys = [k for k in self._objects if k.startswith(prefix)]
        return iter(keys)

    def delete(self, key: str) -> None:
        validate_key(key)
        with self._lock:
            self._objects.pop(key, None)
            self._written.pop(key, None)


_registry_lock = threading.Lock()
_registry: dict[str, MemoryStore] = {}


def named_memory_store(name: str) -> MemoryStore:
    """The process-global store called ``name``, created empty on first use."""
    with _registry_lock:
        store = _registry.get(name)
        if store is None:
            store = _registry[name] = MemoryStore(name)
        return store


def forget_memory_stores() -> None:
    """Drop every named store (tests that want a clean slate call this)."""
    with _registry_lock:
        _registry.clear()
