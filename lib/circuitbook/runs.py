"""The artifact store: where runs live, how they are keyed, written and trusted.

A run directory is `<root>/<name>/<key>/`. The key hashes the resolved config
together with the version of the code that produced it, so changing either
gives a new run. Weights are safetensors (never unpickled), metrics JSON
lines, results JSON. Every write is atomic (temporary file, then rename).
A run is complete only when its `manifest.json` says so and every file it
lists still has the recorded size and SHA-256; anything else is partial or
damaged and is recomputed, never silently used.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors.torch import load, save_file

RUNS_ENV = "CIRCUITBOOK_RUNS"
ROOT_ENV = "CIRCUITBOOK_ROOT"
MANIFEST = "manifest.json"
PACKAGE_DIR = Path(__file__).resolve().parent


class DamagedRunError(RuntimeError):
    """A stored file does not match what its manifest or marker recorded."""


def repo_root() -> Path:
    """The book's root: $CIRCUITBOOK_ROOT, else the checkout holding this package."""
    if os.environ.get(ROOT_ENV):
        return Path(os.environ[ROOT_ENV]).resolve()
    candidate = PACKAGE_DIR.parents[1]  # lib/circuitbook -> repo
    if (candidate / "_toc.yml").exists():
        return candidate
    for parent in [Path.cwd(), *Path.cwd().parents]:
        if (parent / "_toc.yml").exists():
            return parent
    raise RuntimeError(f"cannot find the book's root (a folder with _toc.yml); set {ROOT_ENV}")


def runs_root() -> Path:
    """Where runs are stored: $CIRCUITBOOK_RUNS, else <repo>/runs."""
    env = os.environ.get(RUNS_ENV)
    return Path(env).expanduser().resolve() if env else repo_root() / "runs"


# ---------------------------------------------------------------- hashing

def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=_json_default)


def _json_default(obj):
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, tuple):
        return list(obj)
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"cannot serialise {type(obj).__name__} into a run config")


def hash_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


CORE_SOURCES = ("models/toy.py", "train.py", "tasks/base.py")


def code_version(objects: Iterable = ()) -> str:
    """Hash of the library sources that determine what a training run computes.

    The core (the model, the training loop, the batch protocol) plus the
    modules that define `objects` (the task, the evaluation callback, ...)
    when they live in this package. Other modules are left out on purpose:
    adding a chapter's task or editing a figure must not retrain every model.
    """
    files = {PACKAGE_DIR / rel for rel in CORE_SOURCES}
    for obj in objects:
        files.update(_package_sources(obj))
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(f.relative_to(PACKAGE_DIR).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _package_sources(obj) -> set[Path]:
    """Source files inside this package that define obj's class or function."""
    import inspect

    out = set()
    for target in (obj, type(obj)):
        try:
            path = Path(inspect.getsourcefile(target)).resolve()
        except (TypeError, OSError):
            continue
        if path.is_relative_to(PACKAGE_DIR):
            out.add(path)
    return out


# ---------------------------------------------------------------- atomic writes

def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True, default=_json_default) + "\n").encode())


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """Write safetensors atomically; return the file's SHA-256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp, metadata=metadata)
        digest = sha256_file(Path(tmp))
        os.replace(tmp, path)
        return digest
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def load_tensors(path: Path, sha256: str | None = None) -> dict[str, torch.Tensor]:
    """Load safetensors into memory, checking the digest first when one is given.

    The bytes are read and copied rather than memory-mapped: a mapped file that
    is later truncated or replaced would crash the process (SIGBUS).
    """
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DamagedRunError(f"{path} is unreadable: {e}") from e
    if sha256 is not None:
        actual = hashlib.sha256(data).hexdigest()
        if actual != sha256:
            raise DamagedRunError(f"{path} is damaged: SHA-256 {actual[:12]} != recorded {sha256[:12]}")
    try:
        return load(data)
    except Exception as e:  # truncated or garbled header
        raise DamagedRunError(f"{path} is damaged: {e}") from e


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DamagedRunError(f"{path} is unreadable: {e}") from e


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSON-lines file; a torn last line (crash mid-write) is dropped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            break
    return rows


# ---------------------------------------------------------------- run directories

class RunDir:
    """One run's folder and the rules for trusting what is in it."""

    def __init__(self, path: Path, name: str, key: str):
        self.path, self.name, self.key = path, name, key

    def __repr__(self):
        return f"RunDir({self.path})"

    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST

    def file(self, rel: str) -> Path:
        return self.path / rel

    def manifest(self) -> dict:
        return read_json(self.manifest_path)

    def check_complete(self) -> tuple[bool, str]:
        """(complete, why not). Verifies sizes and digests of every listed file."""
        if not self.manifest_path.exists():
            return False, "no manifest (never finished)"
        try:
            manifest = self.manifest()
        except DamagedRunError as e:
            return False, f"manifest damaged ({e})"
        if not isinstance(manifest, dict) or manifest.get("status") != "complete" or "files" not in manifest:
            return False, "manifest does not say complete"
        for rel, info in manifest["files"].items():
            problem = _file_problem(self.path / rel, info)
            if problem:
                return False, f"{rel} {problem}"
        return True, ""

    def finalize(self, files: Iterable[str], extra: dict | None = None) -> None:
        listing = {}
        for rel in files:
            p = self.path / rel
            listing[rel] = {"size": p.stat().st_size, "sha256": _cached_sha(p)}
        atomic_write_json(self.manifest_path, {"status": "complete", "key": self.key, "name": self.name,
                                               "files": listing, **(extra or {})})

    def wipe(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    @contextlib.contextmanager
    def lock(self):
        """Exclusive lock so two processes never write the same run."""
        locks = self.path.parents[len(self.name.split("/"))] / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / f"{self.name.replace('/', '__')}.{self.key}.lock", "w") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"waiting for another process writing {self.path} ...", flush=True)
                fcntl.flock(f, fcntl.LOCK_EX)
            yield


_sha_cache: dict[tuple[str, int, int], str] = {}


def _cached_sha(path: Path) -> str:
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _sha_cache:
        _sha_cache[key] = sha256_file(path)
    return _sha_cache[key]


def _file_problem(path: Path, info: dict) -> str:
    if not path.exists():
        return "is missing"
    size = path.stat().st_size
    if size != info.get("size"):
        return f"has {size} bytes, manifest says {info.get('size')} (truncated or overwritten)"
    if _cached_sha(path) != info.get("sha256"):
        return "does not match its recorded SHA-256 (corrupted)"
    return ""


class Store:
    """The artifact store rooted at `root` (default: `runs_root()`)."""

    def __init__(self, root: Path | str | None = None):
        self.root = Path(root).resolve() if root is not None else runs_root()

    def key(self, config: dict) -> str:
        return hash_text(canonical_json(config))[:16]

    def run_dir(self, name: str, config: dict) -> RunDir:
        _check_name(name)
        key = self.key(config)
        return RunDir(self.root / name / key, name, key)

    def open_complete(self, rundir: RunDir) -> bool:
        """True if the run is complete and intact; a damaged complete run is wiped."""
        complete, why = rundir.check_complete()
        if complete:
            return True
        if rundir.manifest_path.exists():
            warnings.warn(f"run {rundir.path} is damaged: {why}; recomputing it", stacklevel=3)
            print(f"[circuitbook] run {rundir.path} is damaged: {why}; recomputing it", flush=True)
            rundir.wipe()
        return False


def _check_name(name: str) -> None:
    parts = name.split("/")
    if not name or any(p in ("", ".", "..") or not all(c.isalnum() or c in "-_." for c in p) for p in parts):
        raise ValueError(f"run name {name!r} must be slash-separated parts of letters, digits, '-', '_' or '.'")
