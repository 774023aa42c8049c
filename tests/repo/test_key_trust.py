"""Keys under attack and races (issue 46): concurrent removals, planted key objects.

* two ``key remove`` at once, each removing the other's key, never leave the
  repository without a key;
* key objects planted by a bucket writer without the key cannot make opening
  the repository slow or large: their size, their KDF parameters and how many
  are tried are bounded, and cheap checks come before any KDF.
"""

from __future__ import annotations

import base64
import json
import secrets
import types
from pathlib import Path

import pytest

from ogrefs.errors import OgrefsError
from ogrefs.repo import Repository
from ogrefs.repo.keys import KDF_BUDGET, MAX_KEY_BYTES, MAX_SCRYPT_WORK, Secret, WrongPassword, list_keys, remove_key
from ogrefs.store import open_store
from ogrefs.store.faults import FaultyStore

pytestmark = pytest.mark.timeout(120)
MiB = 1024 * 1024
A, B = Secret(b"passphrase of box A", "scrypt"), Secret(b"passphrase of box B", "scrypt")


def _two_keys(tmp_path: Path) -> tuple[str, str, str]:
    """A file repository whose keys open with A and with B: (url, A's key id, B's key id)."""
    url = f"file://{tmp_path}/repo"
    repo_a = Repository.init(url, cache_root=tmp_path / "cache", secret=A)
    key_b = repo_a.add_key(B)["id"]
    return url, repo_a.key_id or "", key_b


class _OtherBoxRemovesFirst(FaultyStore):
    """Box B's whole ``key remove A`` runs just before box A's delete of B's key reaches the store."""

    def __init__(self, inner, key_a: str, key_b: str) -> None:
        super().__init__(inner)
        self.key_a, self.key_b, self.raced = key_a, key_b, False

    def delete(self, key: str) -> None:
        if key == f"keys/{self.key_b}" and not self.raced:
            self.raced = True
            remove_key(self.inner, self.key_a, current=self.key_b)
        self.inner.delete(key)


def test_two_key_removals_at_once_leave_a_key_that_opens(tmp_path):
    """A removes B while B removes A (both saw two keys).  Before the fix: both succeeded, 0 key objects
    were left and the repository could never be opened again."""
    url, key_a, key_b = _two_keys(tmp_path)
    repo = Repository.open(url, cache_root=tmp_path / "cache", secret=A)
    store = _OtherBoxRemovesFirst(repo.store, key_a, key_b)
    with pytest.raises(OgrefsError, match="not removed"):
        remove_key(store, key_b, current=key_a)
    assert store.raced
    assert [k["id"] for k in list_keys(repo.store)] == [key_b]  # B's removal of A stands; A's was undone
    assert Repository.open(url, cache_root=tmp_path / "cache2", secret=B).key_id == key_b


def test_a_key_removal_without_a_race_still_removes(tmp_path):
    url, key_a, key_b = _two_keys(tmp_path)
    repo = Repository.open(url, cache_root=tmp_path / "cache", secret=A)
    remove_key(repo.store, key_b, current=key_a)
    assert [k["id"] for k in list_keys(repo.store)] == [key_a]
    with pytest.raises(OgrefsError, match="last key"):
        remove_key(repo.store, key_a, current=secrets.token_hex(8))


def _planted(n: int = 2**15, r: int = 8, p: int = 1, label: str = "") -> tuple[str, dict]:
    """A key object as a bucket writer without the key makes one: right shape, random wrapping."""
    key_id = secrets.token_hex(8)
    b64 = lambda k: base64.b64encode(secrets.token_bytes(k)).decode()  # noqa: E731
    return key_id, {"id": key_id, "kdf": "scrypt", "n": n, "r": r, "p": p, "salt": b64(16), "nonce": b64(12),
                    "data": b64(80), "label": label, "host": "attacker", "created": 0}


def _plant(store, *objects: tuple[str, dict]) -> None:
    for key_id, params in objects:
        store.put(f"keys/{key_id}", json.dumps(params).encode())


class _ScryptSpy:
    """Stands in for cryptography's Scrypt: records (n, r, p) of each derivation; derives for real only with
    ``real`` salts (the repository's own key), else returns random bytes at once (a wrong key, quickly)."""

    def __init__(self, real_scrypt, real_salts: set[bytes]) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.real_scrypt, self.real_salts = real_scrypt, real_salts

    def __call__(self, salt: bytes, length: int, n: int, r: int, p: int):
        self.calls.append((n, r, p))
        if salt in self.real_salts:
            return self.real_scrypt(salt=salt, length=length, n=n, r=r, p=p)
        return types.SimpleNamespace(derive=lambda value: secrets.token_bytes(length))


@pytest.fixture
def scrypt_spy(tmp_path, monkeypatch):
    """(url, A's key id, the spy) for a repository with key A; every scrypt derivation goes through the spy."""
    from cryptography.hazmat.primitives.kdf import scrypt

    url = f"file://{tmp_path}/repo"
    repo = Repository.init(url, cache_root=tmp_path / "cache", secret=A)
    (own,) = list_keys(repo.store)
    spy = _ScryptSpy(scrypt.Scrypt, {base64.b64decode(own["salt"])})
    monkeypatch.setattr(scrypt, "Scrypt", spy)
    return url, repo.key_id, spy


def _open(url: str, tmp_path: Path, secret: Secret, store=None) -> Repository:
    return Repository.open(url, cache_root=tmp_path / "cache", secret=secret, store=store)


def test_planted_keys_cannot_demand_a_large_kdf(tmp_path, scrypt_spy):
    """Key objects asking scrypt for 1 GiB (n 2^20, r 8) or 4 GiB (r 32), or shaped wrong (a short wrapped
    key, an id that is not their name): never derived; the repository opens, a wrong passphrase fails.
    Before the fix: each was derived (1 GiB and ~10 s per object and open)."""
    url, key_a, spy = scrypt_spy
    short_id, short = _planted()
    short["data"] = base64.b64encode(b"x" * 10).decode()
    misnamed_id, misnamed = _planted()
    store = open_store(url)
    _plant(store, _planted(n=2**20), _planted(n=2**20, r=32), (short_id, short), (secrets.token_hex(8), misnamed))
    assert _open(url, tmp_path, A).key_id == key_a
    with pytest.raises(WrongPassword):
        _open(url, tmp_path, Secret(b"not the passphrase", "scrypt"))
    assert spy.calls and all(128 * n * r <= 128 * MiB and n * r * p <= MAX_SCRYPT_WORK for n, r, p in spy.calls)
    assert len(spy.calls) <= 1 + 2  # ours with the right passphrase; ours with the wrong one (+ nothing planted)


def test_many_planted_keys_bound_the_work_of_an_open_and_say_so(tmp_path, scrypt_spy):
    """300 planted key objects of our shape: an open derives at most KDF_BUDGET's worth and says why it
    stopped.  Before the fix: all 300 were derived (~0.1 s each) on every open."""
    url, _key_a, spy = scrypt_spy
    _plant(open_store(url), *(_planted() for _ in range(300)))
    with pytest.raises(WrongPassword, match="planted"):
        _open(url, tmp_path, Secret(b"not the passphrase", "scrypt"))
    assert 0 < sum(n * r * p for n, r, p in spy.calls) <= KDF_BUDGET


def test_a_box_that_opened_before_tries_its_key_first(tmp_path, scrypt_spy):
    """300 planted key objects listed before ours (S3 lists by name: a planter picks names that sort first):
    a box that opened the repository before derives once and opens; a fresh box gives up with the reason."""
    url, key_a, spy = scrypt_spy
    store = open_store(url)
    first = ["0" * 10 + key_id[10:] for key_id, _ in (_planted() for _ in range(300))]  # before any id of ours
    _plant(store, *((key_id, {**_planted()[1], "id": key_id}) for key_id in first))
    spy.calls.clear()
    assert _open(url, tmp_path, A).key_id == key_a  # this box's cache opened it at init
    assert len(spy.calls) == 1
    with pytest.raises(WrongPassword, match="planted"):
        Repository.open(url, cache_root=tmp_path / "fresh-box", secret=A, store=_SortedList(store))


class _SortedList(FaultyStore):
    """Lists in name order, as S3 does."""

    def list(self, prefix: str = ""):
        return iter(sorted(self.inner.list(prefix)))


class _KeyGets(FaultyStore):
    """Records the size of every key object a get returns."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.sizes: list[int] = []

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        if key.startswith("keys/"):
            self.sizes.append(len(data))
        return data


def test_an_oversized_key_object_is_not_read(tmp_path):
    """A 4 MiB key object (a label of 4 MiB): not read, the repository opens.  Before the fix: read whole on
    every open (a 1 GiB one costs 1 GiB)."""
    url = f"file://{tmp_path}/repo"
    Repository.init(url, cache_root=tmp_path / "cache", secret=A)
    store = _KeyGets(open_store(url))
    _plant(store.inner, _planted(label="x" * (4 * MiB)))
    assert _open(url, tmp_path, A, store=store).key_id
    assert store.sizes and max(store.sizes) <= MAX_KEY_BYTES
