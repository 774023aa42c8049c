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
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import blake3

from ogrefs.errors import EXIT_WRONG_PASSWORD, OgrefsError, UsageError
from ogrefs.store.base import NotFound, Store

SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**15, 8, 1
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

    n, r, p = params.get("n"), params.get("r"), params.get("p")
    # A planted key object must not make us allocate the machine away: scrypt needs 128*n*r bytes.
    if not (isinstance(n, int) and isinstance(r, int) and isinstance(p, int)
            and 2 <= n <= 2**20 and n & (n - 1) == 0 and 1 <= r <= 32 and 1 <= p <= 16):
        raise ValueError("scrypt parameters out of bounds")
    return Scrypt(salt=base64.b64decode(params["salt"]), length=32, n=params["n"], r=params["r"],
                  p=params["p"]).derive(secret.value)


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


def read_keys(store: Store) -> tuple[list[str], list[dict]]:
    """(every key object's name, the parameters of the readable ones).  Blocking (a list, a get per key)."""
    names, out = [], []
    for key in store.list("keys/"):
        names.append(key)
        try:
            params = json.loads(store.get(key))
        except (NotFound, ValueError, RecursionError):
            continue
        if isinstance(params, dict):
            out.append(params)
    return names, out


def add_key(store: Store, master: bytes, secret: Secret, label: str = "") -> dict:
    params = wrap_master(master, secret, label)
    store.put(f"keys/{params['id']}", json.dumps(params, indent=1).encode())
    return params


def open_master(store: Store, secret: Secret, keys: list[dict] | None = None) -> tuple[bytes, str]:
    """The master key and the id of the key object that opened it (``keys``: list_keys's, when read already)."""
    keys = list_keys(store) if keys is None else keys
    if not keys:
        raise OgrefsError(f"{store.url}: repository is marked encrypted but has no keys")
    for params in keys:
        master = _try_unwrap(params, secret)
        if master is not None:
            return master, params["id"]
    what = "key file" if secret.kind == "raw" else "passphrase"
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
    keys = list_keys(store)
    ids = [k["id"] for k in keys]
    key_id = key_by_prefix(ids, key_id)
    if len(ids) == 1:
        raise UsageError("refusing to remove the last key: the repository could never be opened again")
    if key_id == current:
        raise UsageError("refusing to remove the key used to open the repository now; open it with another key")
    store.delete(f"keys/{key_id}")
