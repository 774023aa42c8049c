"""Repository keys: the master key, wrapped by passphrases or raw key files.

The master key is 64 random bytes: 32 for AES-256-GCM, 32 for keyed BLAKE3
chunk ids. It never leaves memory unwrapped. Each ``keys/<id>`` object holds
one wrapping of it, as plain JSON (it must be readable before any key is
known)::

    {"id": ..., "kdf": "scrypt", "n": 32768, "r": 8, "p": 1, "salt": <b64>,
     "nonce": <b64>, "data": <b64 AES-GCM(kek, master)>, "label": ..., "host": ..., "created": ...}

``kdf`` is ``"scrypt"`` for a passphrase and ``"raw"`` for a key file, whose
bytes are turned into the wrapping key with BLAKE3's key derivation mode.
Several keys may exist; any one opens the repository; ``ogrefs key
add/remove/list`` manage them, and the last key cannot be removed.

Anyone who can write to the bucket can plant key objects, and they are read
before any key is known, so opening is bounded against them: an object of
more than ``MAX_KEY_BYTES`` is not read, at most ``MAX_KEY_OBJECTS`` are read,
one that is not shaped like ours (its name is not ``keys/<its id>``, a nonce
or wrapped key of the wrong length, scrypt parameters above ``MAX_SCRYPT_WORK``)
never reaches a KDF, and an open spends at most ``KDF_BUDGET`` of scrypt work
(64 keys of ours) before it says how many keys it did not try.  The key that
opened the repository on this box before is tried first.  A planted key
object costs at most 128 MiB and about 0.5 s, once, instead of 1 GiB and 10 s
each, without limit.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import secrets
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import blake3

from ogrefs.errors import EXIT_WRONG_PASSWORD, OgrefsError, UsageError
from ogrefs.store.base import NotFound, ShortRead, Store

SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**15, 8, 1
#: A key object is about 500 bytes of JSON; a larger one is not read.
MAX_KEY_BYTES = 64 * 1024
#: Key objects read at an open (in parallel, ``_KEY_READERS`` at a time); the rest are named, not read.
MAX_KEY_OBJECTS = 256
_KEY_READERS = 8
#: scrypt needs 128*n*r bytes and time ~ n*r*p: 4x ours (128 MiB, ~0.5 s) at most, or the object is refused.
_OURS = SCRYPT_N * SCRYPT_R * SCRYPT_P
MAX_SCRYPT_WORK = 4 * _OURS
#: The scrypt work one open spends at most: 64 keys with our parameters (~6 s), 16 at the maximum.
KDF_BUDGET = 64 * _OURS
_AAD = b"ogrefs master key v1"


class WrongPassword(OgrefsError):
    """No key object opens with the given passphrase or key file."""

    exit_code = EXIT_WRONG_PASSWORD


@dataclass(frozen=True)
class Secret:
    """What the user gave: a passphrase or the bytes of a key file."""

    value: bytes
    kind: str  # "scrypt" (passphrase) or "raw" (key file)

    @classmethod
    def from_sources(cls, password_file: str | None = None, key_file: str | None = None,
                     ask: Callable[[], str] | None = None) -> "Secret":
        """The secret from a key file, a password file or OGREFS_PASSWORD, else ``ask()`` on a terminal.

        ``ask`` is the command line's prompt: the repository layer never talks to a terminal itself.
        """
        if key_file:
            try:
                data = Path(key_file).read_bytes()
            except OSError as exc:
                raise UsageError(f"cannot read key file {key_file}: {exc.strerror}") from None
            if len(data) < 32:
                raise UsageError(f"key file {key_file} is too short: use at least 32 random bytes")
            return cls(data, "raw")
        if password_file:
            try:
                text = Path(password_file).read_text().rstrip("\n")
            except OSError as exc:
                raise UsageError(f"cannot read password file {password_file}: {exc.strerror}") from None
            except UnicodeDecodeError:
                raise UsageError(f"password file {password_file} is not text") from None
            if not text:
                raise UsageError(f"password file {password_file} is empty: an empty passphrase protects nothing")
            return cls(text.encode(), "scrypt")
        env = os.environ.get("OGREFS_PASSWORD")
        if env:
            return cls(env.encode(), "scrypt")
        if ask is not None and os.isatty(0):
            return cls(ask().encode(), "scrypt")
        raise UsageError("repository is encrypted: set OGREFS_PASSWORD, or use --password-file, --password-command "
                     "or --key-file")


#: Environment variables through which a user hands over a secret (the CLI's options come on top).
SECRET_ENV = ("OGREFS_PASSWORD", "OGREFS_PASSWORD_FILE", "OGREFS_KEY_FILE", "OGREFS_PASSWORD_COMMAND")


def secret_configured(password_file: str | None = None, key_file: str | None = None) -> bool:
    """Whether the user gave a passphrase or key file (so a plaintext config must be refused)."""
    return bool(password_file or key_file or any(os.environ.get(name) for name in SECRET_ENV))


def _kek(secret: Secret, params: dict) -> bytes:
    if secret.kind == "raw":
        return blake3.blake3(secret.value, derive_key_context="ogrefs 2026 raw key file wraps master key").digest()
    from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

    if _scrypt_work(params) is None:
        raise ValueError("scrypt parameters out of bounds")
    return Scrypt(salt=base64.b64decode(params["salt"]), length=32, n=params["n"], r=params["r"],
                  p=params["p"]).derive(secret.value)


def _scrypt_work(params: dict) -> int | None:
    """n*r*p of a key object's scrypt parameters (its cost: memory 128*n*r, time ~n*r*p), or None when they
    are malformed or above ``MAX_SCRYPT_WORK``: a planted key object must not make us allocate the machine."""
    n, r, p = params.get("n"), params.get("r"), params.get("p")
    if not (type(n) is int and type(r) is int and type(p) is int
            and 2 <= n and n & (n - 1) == 0 and 1 <= r and 1 <= p and n * r * p <= MAX_SCRYPT_WORK):
        return None
    return n * r * p


def _b64_len(value: object, lengths: range) -> bool:
    try:
        return isinstance(value, str) and len(base64.b64decode(value, validate=True)) in lengths
    except (binascii.Error, ValueError):
        return False


def _plausible(params: object, name: str) -> bool:
    """Cheap checks before any KDF: shaped as :func:`wrap_master` writes it, stored under its own id."""
    if not (isinstance(params, dict) and isinstance(params.get("id"), str) and name == f"keys/{params['id']}"):
        return False
    if not (_b64_len(params.get("nonce"), range(12, 13)) and _b64_len(params.get("data"), range(80, 81))):
        return False  # AES-GCM of the 64-byte master key: 12-byte nonce, 64 + 16 bytes
    if params.get("kdf") == "raw":
        return True
    return (params.get("kdf") == "scrypt" and _scrypt_work(params) is not None
            and _b64_len(params.get("salt"), range(1, 65)))


def wrap_master(master: bytes, secret: Secret, label: str = "") -> dict:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    if not secret.value:
        raise UsageError("an empty passphrase protects nothing; refusing to wrap the key with it")
    params = {"id": secrets.token_hex(8), "kdf": secret.kind, "label": label, "host": socket.gethostname(),
              "created": time.time()}
    if secret.kind == "scrypt":
        params.update(n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, salt=base64.b64encode(os.urandom(16)).decode())
    nonce = os.urandom(12)
    data = AESGCM(_kek(secret, params)).encrypt(nonce, master, _AAD)
    params.update(nonce=base64.b64encode(nonce).decode(), data=base64.b64encode(data).decode())
    return params


def _try_unwrap(params: dict, secret: Secret) -> bytes | None:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    if params.get("kdf") != secret.kind:
        return None
    try:
        kek = _kek(secret, params)
        master = AESGCM(kek).decrypt(base64.b64decode(params["nonce"]), base64.b64decode(params["data"]), _AAD)
    except (InvalidTag, KeyError, ValueError, TypeError):
        return None
    return master if len(master) == 64 else None


def list_keys(store: Store) -> list[dict]:
    """The key objects' parameters; unreadable ones are left out."""
    return read_keys(store)[1]


def read_keys(store: Store, prefer: str | None = None) -> tuple[list[str], list[dict]]:
    """(every key object's name, the parameters of the plausible ones among the first ``MAX_KEY_OBJECTS``,
    key ``prefer`` first when it is there).

    Blocking: a list, then a size probe and a get per key, ``_KEY_READERS`` at a time.
    """
    names = sorted(store.list("keys/"), key=lambda name: name != f"keys/{prefer}")  # (stable)
    with ThreadPoolExecutor(_KEY_READERS, thread_name_prefix="ogrefs-key-read") as pool:
        read = list(pool.map(lambda name: _read_key(store, name), names[:MAX_KEY_OBJECTS]))
    return names, [params for params in read if params is not None]


def _read_key(store: Store, name: str) -> dict | None:
    """The parameters in key object ``name``, or None when it is gone, too large or not shaped like a key."""
    try:
        store.get_range(name, MAX_KEY_BYTES, 0)  # (a HEAD on S3): succeeds only for an object this long
        return None
    except ShortRead:
        pass
    except NotFound:
        return None
    try:
        body = store.get(name)
        params = json.loads(body) if len(body) <= MAX_KEY_BYTES else None
    except (NotFound, ValueError, RecursionError):
        return None
    return params if _plausible(params, name) else None


def add_key(store: Store, master: bytes, secret: Secret, label: str = "") -> dict:
    params = wrap_master(master, secret, label)
    store.put(f"keys/{params['id']}", json.dumps(params, indent=1).encode())
    return params


def open_master(store: Store, secret: Secret, keys: list[dict] | None = None,
                prefer: str | None = None) -> tuple[bytes, str]:
    """The master key and the id of the key object that opened it (``keys``: list_keys's, when read already;
    ``prefer``: the id of the key that opened the repository on this box before, tried first)."""
    keys = list_keys(store) if keys is None else keys
    keys = sorted(keys, key=lambda params: params.get("id") != prefer)  # (stable: the rest keep their order)
    if not keys:
        raise OgrefsError(f"{store.url}: repository is marked encrypted but has no keys")
    what = "key file" if secret.kind == "raw" else "passphrase"
    budget = KDF_BUDGET
    for i, params in enumerate(keys):
        cost = (_scrypt_work(params) or 0) if params.get("kdf") == secret.kind == "scrypt" else 0
        if cost > budget:
            raise WrongPassword(f"wrong {what}: none of the first {i} of the {len(keys)} keys read opens with it, "
                                f"and an open spends no more scrypt work than {KDF_BUDGET // _OURS} keys of ours "
                                f"take, nor reads more than {MAX_KEY_OBJECTS} (key objects planted in the bucket?)")
        budget -= cost
        master = _try_unwrap(params, secret)
        if master is not None:
            return master, params["id"]
    raise WrongPassword(f"wrong {what}: none of the repository's {len(keys)} keys opens with it")


def key_by_prefix(ids: list[str], key_id: str) -> str:
    """The one id of ``ids`` that ``key_id`` names in full or by a unique prefix (either case)."""
    want = key_id.lower()
    matches = [i for i in ids if i.lower() == want] or [i for i in ids if want and i.lower().startswith(want)]
    if not matches:
        raise UsageError(f"no key {key_id} in the repository (ogrefs key list)")
    if len(matches) > 1:
        raise UsageError(f"key id {key_id!r} is ambiguous: {len(matches)} keys start with it")
    return matches[0]


def remove_key(store: Store, key_id: str, current: str) -> None:
    """Delete key ``key_id``, never leaving the repository without a key that opens it.

    The checks before the delete (not the last key, not the one in use) see a list that a second ``key
    remove`` on another box may be changing at the same moment (A removes B while B removes A: both saw
    two keys).  So the list is read again after the delete: when the key in use (``current``, which is
    known to open the master key) is gone, the deleted object is put back and the removal refused.  Of two
    such races at least the later remover sees its own key gone, so a key always survives (S3 and the file
    store list what was written and deleted before).
    """
    keys = list_keys(store)
    ids = [k["id"] for k in keys]
    key_id = key_by_prefix(ids, key_id)
    if len(ids) == 1:
        raise UsageError("refusing to remove the last key: the repository could never be opened again")
    if key_id == current:
        raise UsageError("refusing to remove the key used to open the repository now; open it with another key")
    name = f"keys/{key_id}"
    body = store.get(name)
    store.delete(name)
    if current not in {k["id"] for k in list_keys(store)}:
        store.put(name, body)
        raise OgrefsError(f"key {key_id} not removed: key {current}, which opened the repository, was removed "
                          "at the same time (another `ogrefs key remove`?); run `ogrefs key list` and try again")
