"""The artifact store: where runs live, how they are keyed, written and trusted.

A run directory is `<root>/<name>/<key>/`. The key hashes the resolved config
together with the version of the code that produced it, so changing either
gives a new run. Weights are safetensors (never unpickled), metrics JSON
lines, results JSON. Every write is atomic (temporary file, then rename).
A run is complete only when its `manifest.json` says so and every file it
lists still has the recorded size and SHA-256; anything else is partial or
damaged and is recomputed, never silently used.

The store may live on a filesystem that several hosts share (NFS, a cluster's
parallel filesystem): writes are publish-by-rename, and locks (`LeaseLock`) are
files created with O_EXCL that their holder keeps alive with a heartbeat, never
fcntl/flock, which network filesystems do not reliably honour across hosts.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors.torch import load, save_file

from . import log

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


CORE_SOURCES = ("training/config.py", "training/ensemble.py", "training/loop.py", "tasks/base.py", "tasks/draws.py")


def code_version(objects: Iterable = (), root: Path | None = None) -> str:
    """Hash of the library code that determines what a training run computes.

    The training core (`CORE_SOURCES`: the config, the ensemble and its step, the loop, the batch
    protocol and its random stream) plus the modules that define `objects` (the model's class, the task, the evaluation
    callback, the init function) when they live in this package, and the files such a module names in
    its `RUN_KEY_SOURCES` (code it computes through that lives elsewhere). Nothing else: how a run is chunked,
    planned, scheduled or read back, and every other module, leave its key alone. Each file enters
    through `source_digest`, so comments and docstrings do not count either. `root`: another copy
    of the package (a test edits one).
    """
    root = Path(root) if root is not None else PACKAGE_DIR
    files = {rel for rel in CORE_SOURCES}
    for obj in objects:
        files.update(p.relative_to(PACKAGE_DIR).as_posix() for p in _package_sources(obj))
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(rel.encode())
        h.update(source_digest(root / rel).encode())
    return h.hexdigest()[:16]


def source_digest(path: Path) -> str:
    """SHA-256 of a Python file's code: its text without comments, docstrings and blank lines, so
    editing an explanation never changes a key. Read by `ast` line numbers and `tokenize` comments,
    which are the same across Python versions (the run keys of a GPU machine match this one's)."""
    import ast
    import io
    import tokenize

    text = Path(path).read_text()
    if Path(path).suffix != ".py":  # another language (the samplers' C kernels): its text as it is
        return hashlib.sha256(text.encode()).hexdigest()
    lines = text.splitlines()
    drop: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                and isinstance(body[0].value.value, str):
            drop.update(range(body[0].lineno - 1, body[0].end_lineno))
    cut: dict[int, int] = {}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            cut[tok.start[0] - 1] = tok.start[1]
    kept = []
    for i, line in enumerate(lines):
        if i in drop:
            continue
        line = line[:cut[i]] if i in cut else line
        if line.strip():
            kept.append(line.rstrip())
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()


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
            module = inspect.getmodule(target)
            out.update((PACKAGE_DIR / rel).resolve() for rel in getattr(module, "RUN_KEY_SOURCES", ()))
    return out


# ---------------------------------------------------------------- atomic writes

def _umask() -> int:
    """The process's umask (read, not changed: /proc/self/status where it exists)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        lines = Path("/proc/self/status").read_text().splitlines()
        return int(next(line for line in lines if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _temporary(path: Path) -> tuple[int, str]:
    """A temporary file beside `path` with the mode an ordinary new file gets (mkstemp makes it 0600,
    which other users of a shared store could not read)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(fd, 0o666 & ~_umask())
    return fd, tmp


def atomic_write_bytes(path: Path, data: bytes) -> None:
    fd, tmp = _temporary(path)
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
    fd, tmp = _temporary(path)
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

    def reopen_damaged(self) -> str:
        """Make a complete run whose files no longer verify trainable again, keeping what is intact;
        return what will be recomputed.

        The manifest goes (the run is no longer complete). A damaged checkpoint goes with every later
        one, so training resumes from the last intact checkpoint before it and rewrites the rest (a
        later checkpoint kept would be resumed from, leaving the damaged one sealed into the run).
        Metrics that do not match their digest cannot be trusted row by row: they go, and the run
        trains again from its start. An unreadable manifest names nothing: everything goes.
        """
        try:
            listed = self.manifest()["files"]
        except (DamagedRunError, KeyError, TypeError):
            self.wipe()
            return "recomputing it from the start"
        damaged = [rel for rel, info in listed.items() if _file_problem(self.path / rel, info)]
        ckpt_steps = [_step_of_checkpoint(rel) for rel in damaged if rel.startswith("ckpt/")]
        first_bad = min(ckpt_steps) if ckpt_steps else None
        for f in self.path.glob("ckpt/step_*"):
            if first_bad is not None and _step_of_checkpoint(f.name) >= first_bad:
                f.unlink(missing_ok=True)
        if "metrics.jsonl" in damaged:
            self.file("metrics.jsonl").unlink(missing_ok=True)
        self.manifest_path.unlink(missing_ok=True)
        if "metrics.jsonl" in damaged or not any(self.path.glob("ckpt/step_*.json")):
            return "recomputing it from the start"
        if first_bad is None:
            return "resealing it"
        return f"going on from its last intact checkpoint before step {first_bad}"

    def wipe(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def lock_path(self, part: str = "") -> Path:
        """Where this run's lock lives: <root>/.locks/<name>.<key>[.<part>].lock (outside the run folder,
        which a damaged run wipes)."""
        locks = self.path.parents[len(self.name.split("/"))] / ".locks"
        return locks / f"{self.name.replace('/', '__')}.{self.key}{'.' + part if part else ''}.lock"

    @contextlib.contextmanager
    def lock(self, part: str = ""):
        """Exclusive lock so two processes, on this host or another, never write the same run (or part)."""
        with LeaseLock(self.lock_path(part)).hold() as held:
            yield held


# ---------------------------------------------------------------- locks that hold across hosts

LEASE_ENV = "CIRCUITBOOK_LOCK_LEASE_S"
DEFAULT_LEASE_S = 60.0


def lease_seconds() -> float:
    """$CIRCUITBOOK_LOCK_LEASE_S, else DEFAULT_LEASE_S."""
    from .settings import parse_seconds

    return parse_seconds(os.environ[LEASE_ENV]) if os.environ.get(LEASE_ENV) else DEFAULT_LEASE_S


class LockLost(RuntimeError):
    """Another process judged this lock's holder dead and took the lock over."""


def _host_id() -> str:
    """This machine: hostname and boot id (two containers may share a hostname, never a boot id)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _start_time(pid: int) -> str:
    """A process's start time (field 22 of /proc/PID/stat): with the pid it names one process, never a reused pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


class LeaseLock:
    """An exclusive lock on a shared filesystem: O_EXCL-created generation files and a heartbeat.

    The lock is the highest-numbered file `<path>.<n>`; whoever creates a generation (open with
    O_CREAT|O_EXCL, atomic on local filesystems and on NFSv3+) holds the lock. The holder touches its
    file every `lease / 6` seconds. A waiter takes over when the holder is dead: at once when the holder
    ran on this host and its process is gone, otherwise when the file's modification time has not changed
    for `lease` seconds of the waiter's own clock (so clocks of different hosts are never compared). To
    take over, the waiter creates generation n + 1, which only one waiter can do, then removes the older
    files. A holder that was only paused and finds a newer generation on waking has lost the lock:
    `check()` raises LockLost, and the trainer calls it before each checkpoint and before publishing.
    """

    def __init__(self, path: Path, lease: float | None = None):
        self.path = Path(path)
        self.lease = float(lease) if lease is not None else lease_seconds()
        self.mine: Path | None = None
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._beat: threading.Thread | None = None

    # -- the generation files ----------------------------------------------
    def _generations(self) -> list[tuple[int, Path]]:
        out = []
        for p in self.path.parent.glob(self.path.name + ".*"):
            suffix = p.name[len(self.path.name) + 1:]
            if suffix.isdigit():
                out.append((int(suffix), p))
        return sorted(out)

    def _create(self, gen: int) -> bool:
        path = self.path.with_name(f"{self.path.name}.{gen}")
        info = {"host": _host_id(), "pid": os.getpid(), "start": _start_time(os.getpid()),
                "token": uuid.uuid4().hex, "since": time.time()}
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(info))
            f.flush()
            os.fsync(f.fileno())
        self.mine = path
        return True

    @staticmethod
    def _holder(path: Path) -> dict:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}  # being written, or gone

    def _dead_here(self, holder: dict) -> bool:
        """The holder ran on this host and its process no longer exists."""
        if holder.get("host") != _host_id():
            return False
        pid = int(holder.get("pid", -1))
        return pid <= 0 or _start_time(pid) != holder.get("start")

    # -- acquire and release ---------------------------------------------------
    def try_acquire(self, watch: dict | None = None) -> bool:
        """One attempt; `watch` keeps what this waiter saw of the current holder between attempts."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        gens = self._generations()
        if not gens:
            return self._create(0) and self._start()
        gen, path = gens[-1]
        try:
            mtime = path.stat().st_mtime_ns
        except FileNotFoundError:
            return False  # released just now: try again
        holder = self._holder(path)
        watch = watch if watch is not None else {}
        now = time.monotonic()
        if watch.get("gen") != gen or watch.get("mtime") != mtime:
            watch.update(gen=gen, mtime=mtime, seen=now)
        stale = (holder and self._dead_here(holder)) or now - watch["seen"] >= self.lease
        if not stale:
            return False
        if not self._create(gen + 1):
            return False  # another waiter took it over first
        for _, old in gens:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()
        log.info(f"lock {self.path.name}: its holder ({holder.get('host', '?')}, pid {holder.get('pid', '?')}) "
                 "is gone; taken over")
        return self._start()

    def acquire(self, timeout: float | None = None, poll: float = 0.2) -> None:
        watch: dict = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        said = False
        while not self.try_acquire(watch):
            if not said:
                log.info(f"waiting for {self.path.name}: {self._describe_holder()}")
                said = True
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"lock {self.path} is held by another process")
            time.sleep(poll)

    def _describe_holder(self) -> str:
        """Who holds the lock and how long a waiter may wait for a holder that stopped."""
        gens = self._generations()
        holder = self._holder(gens[-1][1]) if gens else {}
        if not holder:
            return "held by another process"
        host = str(holder.get("host", "?")).split("/")[0]
        since = time.strftime("%H:%M:%S", time.localtime(holder["since"])) if "since" in holder else "?"
        here = holder.get("host") == _host_id()
        takeover = ("at once if that process is gone" if here else
                    f"after {self.lease:g} s without its heartbeat ({LEASE_ENV})")
        return (f"held by pid {holder.get('pid', '?')} on {host}{' (this host)' if here else ''} since {since}; "
                f"it is taken over {takeover}, else this waits until it is released")

    def _start(self) -> bool:
        self._stop.clear()
        self._lost.clear()
        self._beat = threading.Thread(target=self._heartbeat, name=f"lease {self.path.name}", daemon=True)
        self._beat.start()
        return True

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.lease / 6):
            if not self.holds():
                self._lost.set()
                return
            with contextlib.suppress(FileNotFoundError):
                os.utime(self.mine)

    def holds(self) -> bool:
        """True while this process's generation is the newest one."""
        if self.mine is None or not self.mine.exists():
            return False
        gens = self._generations()
        return bool(gens) and gens[-1][1] == self.mine

    def check(self) -> None:
        """Raise LockLost if another process took the lock over (this one was judged dead)."""
        if self.mine is None or self._lost.is_set() or not self.holds():
            raise LockLost(f"lock {self.path} was taken over by another process; this one stops writing")

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        if self.mine is not None and self.holds():
            self.mine.unlink(missing_ok=True)
        self.mine = None

    @contextlib.contextmanager
    def hold(self, timeout: float | None = None):
        self.acquire(timeout)
        try:
            yield self
        finally:
            self.release()


_sha_cache: dict[tuple[str, int, int], str] = {}


def _cached_sha(path: Path) -> str:
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _sha_cache:
        _sha_cache[key] = sha256_file(path)
    return _sha_cache[key]


def _step_of_checkpoint(name: str) -> int:
    """The step of `ckpt/step_00000040.safetensors` (or its .json marker)."""
    return int(Path(name).name.split(".")[0][len("step_"):])


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
        """True if the run is complete and intact. A damaged complete run is reopened for training
        (`RunDir.reopen_damaged`): it goes on from its last intact checkpoint before the damage."""
        complete, why = rundir.check_complete()
        if complete:
            return True
        if rundir.manifest_path.exists():
            how = rundir.reopen_damaged()
            warnings.warn(f"run {rundir.name} ({rundir.key[:8]}) is damaged: {why}; {how}", stacklevel=3)
            log.info(f"run {rundir.name} ({rundir.key[:8]}) is damaged: {why}; {how}")
        return False


def _check_name(name: str) -> None:
    parts = name.split("/")
    if not name or any(p in ("", ".", "..") or not all(c.isalnum() or c in "-_." for c in p) for p in parts):
        raise ValueError(f"run name {name!r} must be slash-separated parts of letters, digits, '-', '_' or '.'")
