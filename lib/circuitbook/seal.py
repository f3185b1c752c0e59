"""Seals: the results this store stands behind.

A results record the build (or `circuitbook run` / `release`) marks `ok` is sealed when it is stored
(`build._store_execution`): an HMAC-SHA256, keyed by a secret the store keeps, over the record's canonical JSON
without its seal, and the SHA-256 of its executed notebook. Grading, `recorded_values` and the build's cache accept
a record only with a seal that verifies by this store's key (`context.check_record`): a record edited by hand (with
every digest beside it recomputed), copied from another store, or whose executed notebook was changed is not graded.

Keys. `<runs>/.keys/seal.key`: 32 random bytes, made on first use (O_EXCL, mode 0600), never replaced: a damaged
key file is an error naming it. `$CIRCUITBOOK_SEAL_KEY` (64 hex digits) replaces it: the key a GPU visit seals
with. `circuitbook visit-key` makes a key under `<runs>/.keys/visits/<id>.key` and prints it for the command that
starts the visit; `import-results` accepts results sealed by a visit key (or by this store's own key: an export of
this store) and seals them again by this store's key, keeping the provenance they were sealed with there
(`provenance()`). Nothing under `.keys/` ever travels: archives carry results, notebooks and metrics only.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import platform
import re
import subprocess
import time
import uuid
from pathlib import Path

from .runs import DamagedRunError, canonical_json, repo_root, runs_root

KEY_ENV = "CIRCUITBOOK_SEAL_KEY"
KEY_BYTES = 32
FIELD = "seal"  # where a record carries its seal: {"key": key id, "hmac": hex}
_HEX_KEY = re.compile(r"[0-9a-fA-F]{64}")


class SealError(DamagedRunError):
    """A key that cannot be used (damaged, unreadable, malformed); the message names it."""


# ---------------------------------------------------------------- keys

def keys_dir() -> Path:
    return runs_root() / ".keys"


def key_file() -> Path:
    return keys_dir() / "seal.key"


def visits_dir() -> Path:
    return keys_dir() / "visits"


def key_id(key: bytes) -> str:
    """The name a key goes by in records and file names: the first 16 hex digits of its SHA-256."""
    return hashlib.sha256(key).hexdigest()[:16]


def parse_hex_key(text: str) -> bytes:
    """A key given as 64 hexadecimal digits (what `circuitbook visit-key` prints)."""
    if not isinstance(text, str) or not _HEX_KEY.fullmatch(text.strip()):
        raise ValueError(f"a seal key is 64 hexadecimal digits (32 bytes), as `circuitbook visit-key` prints; got "
                         f"{len(str(text))} characters")
    return bytes.fromhex(text.strip())


def store_key(create: bool = False) -> bytes | None:
    """The key this store seals and grades with: $CIRCUITBOOK_SEAL_KEY, else <runs>/.keys/seal.key (made
    here when `create` and missing; None when missing and not `create`)."""
    if os.environ.get(KEY_ENV):
        try:
            return parse_hex_key(os.environ[KEY_ENV])
        except ValueError as e:
            raise SealError(f"${KEY_ENV}: {e}") from None
    path = key_file()
    if path.exists() or path.is_symlink():
        return _read_key(path, "the store's seal key")
    return _create(path, os.urandom(KEY_BYTES)) if create else None


def known_keys() -> dict[str, bytes]:
    """{key id: key} of every key whose seal this store accepts on import: its own and its visits'."""
    keys = {}
    own = store_key()
    if own is not None:
        keys[key_id(own)] = own
    folder = visits_dir()
    for path in sorted(folder.glob("*.key")) if folder.is_dir() else []:
        key = _read_key(path, "the visit key")
        keys[key_id(key)] = key
    return keys


def new_visit_key() -> bytes:
    """A fresh key for a GPU visit, kept under <runs>/.keys/visits/<id>.key so that its results import here."""
    key = os.urandom(KEY_BYTES)
    _create(visits_dir() / f"{key_id(key)}.key", key)
    return key


def _read_key(path: Path, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SealError(f"{what} {path} cannot be read ({e.strerror or e})") from None
    if len(data) != KEY_BYTES:
        raise SealError(f"{what} {path} is damaged ({len(data)} bytes, not {KEY_BYTES}); it is never replaced, since "
                        "results sealed by it would no longer be graded: restore it, or remove it to start over "
                        "(every result it sealed is then executed again)")
    return data


def _create(path: Path, key: bytes) -> bytes:
    """Write a key file readable by its owner only, complete or not at all: a temporary file created with
    O_EXCL, linked to its name (which fails if another process made the key first: then that key is used)."""
    keys_dir().mkdir(parents=True, exist_ok=True, mode=0o700)
    path.parent.mkdir(exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(key)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return _read_key(path, "the seal key")
    finally:
        tmp.unlink(missing_ok=True)
    return key


# ---------------------------------------------------------------- seals

def seal_of(record: dict, notebook_sha256: str, key: bytes) -> str:
    """HMAC-SHA256 by `key` of the record's canonical JSON without its seal, a newline, and the SHA-256 of
    its executed notebook."""
    body = {k: v for k, v in record.items() if k != FIELD}
    message = (canonical_json(body) + "\n" + notebook_sha256).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def apply(record: dict, notebook_sha256: str, key: bytes) -> dict:
    """The record sealed by `key` (a new dict; any earlier seal is replaced)."""
    out = {k: v for k, v in record.items() if k != FIELD}
    out[FIELD] = {"key": key_id(key), "hmac": seal_of(out, notebook_sha256, key)}
    return out


def verify(record: dict, notebook_sha256: str, keys: dict[str, bytes]) -> str | None:
    """None if the record's seal verifies by one of `keys` ({key id: key}); else why not, in words."""
    s = record.get(FIELD)
    if not isinstance(s, dict) or not isinstance(s.get("key"), str) or not isinstance(s.get("hmac"), str):
        return "not sealed"
    key = keys.get(s["key"])
    if key is None:
        return f"sealed by an unknown key {s['key']}"
    if not hmac.compare_digest(seal_of(record, notebook_sha256, key), s["hmac"]):
        return f"sealed by key {s['key']}, but the seal does not verify (edited after it was sealed)"
    return None


# ---------------------------------------------------------------- provenance

def provenance(seconds: float, key: bytes) -> dict:
    """What a sealed record says about where it was produced: the machine, the environment as installed
    (`book.environment_verdict`), the commit, when, how long it took, and the key that sealed it there."""
    from . import book

    return {"machine": machine(), "environment": book.environment_verdict(), "commit": commit(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "seconds": round(float(seconds), 1), "sealed_by": key_id(key)}


def machine() -> str:
    """`host (GPU name)` on a machine with CUDA, else `host (CPU model)`."""
    what = None
    try:
        import torch

        if torch.cuda.is_available():
            what = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - no torch, no driver: describe the CPU
        what = None
    if what is None:
        try:
            lines = Path("/proc/cpuinfo").read_text().splitlines()
            what = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
        except (OSError, StopIteration):
            what = platform.processor() or platform.machine() or "unknown CPU"
    return f"{platform.node() or 'unknown host'} ({what})"


def commit() -> str:
    """`<git HEAD> (clean)` or `(dirty)` of the book's checkout; $CIRCUITBOOK_COMMIT in a copy without its git
    history (a GPU visit's working tree, given by whoever sent it); `unknown (not a git checkout)` elsewhere."""
    root = repo_root()
    if os.environ.get("CIRCUITBOOK_COMMIT") and not (root / ".git").exists():
        given = os.environ["CIRCUITBOOK_COMMIT"].strip()
        return given if given.endswith(")") else f"{given} (as given)"

    def git(*args):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)

    try:
        top = git("rev-parse", "--show-toplevel")
        head = git("rev-parse", "HEAD")
        if top.returncode or head.returncode or Path(top.stdout.strip()).resolve() != root.resolve():
            return "unknown (not a git checkout)"
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (git not available)"
    return f"{head.stdout.strip()[:12]} ({'dirty' if dirty else 'clean'})"
