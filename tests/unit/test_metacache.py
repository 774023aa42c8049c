"""BoundedCache: the vfs's memory of catalog answers stays within its bound, oldest out first."""

from __future__ import annotations

from ogrefs.lazy.fs.metacache import BoundedCache


def test_the_oldest_entries_go_first_and_the_weight_stays_within_the_bound():
    c: BoundedCache[int, str] = BoundedCache(10)
    for k in range(5):
        c.put(k, f"v{k}", 2)
    assert c.weight == 10 and [c.get(k) for k in range(5)] == ["v0", "v1", "v2", "v3", "v4"]
    c.put(5, "v5", 3)  # needs 3: the two oldest (2 + 2) go
    assert c.get(0) is None and c.get(1) is None and c.get(2) == "v2" and c.get(5) == "v5"
    assert c.weight == 9 and len(c) == 4


def test_a_key_put_again_is_replaced_and_an_entry_over_the_bound_is_not_kept():
    c: BoundedCache[str, int] = BoundedCache(4)
    c.put("a", 1, 3)
    c.put("a", 2, 1)
    assert c.get("a") == 2 and c.weight == 1
    c.put("huge", 9, 5)
    assert c.get("huge") is None and c.get("a") == 2 and c.weight == 1
