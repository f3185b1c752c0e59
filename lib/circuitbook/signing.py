"""Signatures that anyone with the checkout can verify: who published a result (`publish`).

A store that publishes holds a private Ed25519 key (`<runs>/.keys/publisher.ed25519`, created on first use,
never packed, exported or published). Its public key is listed in `published/publishers.json`, which is in
git: adding a key is a commit a reviewer sees. A published folder's index is signed with the private key;
a reader verifies the signature against the listed keys, and every file against the index's SHA-256. So a
published result edited by hand, even with every digest recomputed, no longer verifies, and is not graded.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path

from .runs import runs_root

KEY_FILE = "publisher.ed25519"
PUBLISHERS = "publishers.json"


class SignatureError(RuntimeError):
    """A signature, a key or a list of keys that cannot be used; the message names the file."""


def key_id(public: bytes) -> str:
    return hashlib.sha256(public).hexdigest()[:16]


def _keys_dir() -> Path:
    return runs_root() / ".keys"


def private_key(create: bool = True):
    """This store's publishing key (Ed25519); created once (O_EXCL, mode 0600) when `create`."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = _keys_dir() / KEY_FILE
    if not path.exists():
        if not create:
            raise SignatureError(f"{path}: this store has no publishing key")
        path.parent.mkdir(parents=True, exist_ok=True)
        from cryptography.hazmat.primitives import serialization

        raw = Ed25519PrivateKey.generate().private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                                         serialization.NoEncryption())
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # another process made it first: use theirs
        else:
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
    raw = path.read_bytes()
    if len(raw) != 32:
        raise SignatureError(f"{path} is damaged ({len(raw)} bytes, an Ed25519 key has 32); it is not replaced, since "
                             "results it signed are published: restore it, or move it away to make a new key")
    return Ed25519PrivateKey.from_private_bytes(raw)


def public_bytes(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def sign(data: bytes, key=None) -> dict:
    """{key: id, signature: hex} of `data` by this store's key."""
    key = key or private_key()
    return {"key": key_id(public_bytes(key)), "signature": key.sign(data).hex()}


def read_publishers(path: Path) -> dict[str, bytes]:
    """{key id: public key} listed in publishers.json ({} if there is none)."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        keys = {kid: bytes.fromhex(entry["ed25519"]) for kid, entry in data["keys"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise SignatureError(f"{path} is not a list of publishers ({type(e).__name__}: {e})") from None
    for kid, pub in keys.items():
        if len(pub) != 32 or key_id(pub) != kid:
            raise SignatureError(f"{path}: key {kid} is not the id of its Ed25519 public key")
    return keys


def add_publisher(path: Path, key=None) -> str | None:
    """List this store's public key in publishers.json if it is not there; return its id if added."""
    key = key or private_key()
    pub = public_bytes(key)
    kid = key_id(pub)
    data = json.loads(path.read_text()) if path.exists() else {"format": 1, "keys": {}}
    if kid in data["keys"]:
        return None
    data["keys"][kid] = {"ed25519": pub.hex(), "added": time.strftime("%Y-%m-%d"), "host": platform.node()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return kid


def verify(data: bytes, signature: dict, publishers: dict[str, bytes], where: str) -> str:
    """The id of the listed key whose signature `signature` is over `data`; SignatureError otherwise."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if not isinstance(signature, dict) or not isinstance(signature.get("signature"), str):
        raise SignatureError(f"{where}: no signature")
    kid = signature.get("key")
    if kid not in publishers:
        raise SignatureError(f"{where}: signed by key {kid!r}, which publishers.json does not list")
    try:
        Ed25519PublicKey.from_public_bytes(publishers[kid]).verify(bytes.fromhex(signature["signature"]), data)
    except (InvalidSignature, ValueError):
        raise SignatureError(f"{where}: its signature does not verify (edited after it was published?)") from None
    return kid
