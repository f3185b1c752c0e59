"""Results that travel: executed notebooks and recorded results packed on one machine, imported on another.

`export_results(label, out_dir)` packs, from this run store, every notebook's results file under `label`,
its executed notebook and its cache record, the metrics (not the weights) of the runs those results
name, and any extra files (benchmark results, logs) into gzip tar archives of at most
MAX_ARCHIVE_BYTES each; every archive is complete in itself, with a manifest (`circuitbook-export.json`)
holding the SHA-256 of each file. A notebook's three files always travel in the same archive.

`import_results(archives)` checks everything before it writes anything: each archive's members are
plain files under the known folders, each file matches the manifest's digest, each results file's input
hash is the hash of the inputs it records, each executed notebook matches its record, each notebook is
one of this book's. It then places the executed notebooks and results in this run store, so that a
build at the label's profile uses them as its cache. A result whose inputs (notebook, parameters,
library code, upstream notebooks) differ from the current sources is imported too, but is `stale:
...` on the scorecard, never graded, and its notebook is not used as a cached execution (a build with
`--no-execute` shows it under a stale banner). A stale import never replaces a current local result.
"""
from __future__ import annotations

import hashlib
import io
import json
import platform
import re
import tarfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from . import book, context, params
from .build import executed_path
from .book import book_notebooks
from .runs import atomic_write_bytes, repo_root, runs_root

FORMAT = 1
MANIFEST = "circuitbook-export.json"
MAX_ARCHIVE_BYTES = 15 * 1024 * 1024  # under the 16 MiB a GPU machine's $OUT returns per file
FOLDERS = ("executed", "results", "metrics", "benchmarks", "logs")  # what an archive may hold


class TransferError(RuntimeError):
    """An archive that cannot be imported (or exported); nothing was written."""


@dataclass
class Unit:
    """Files that travel together: arcname -> bytes."""

    files: dict[str, bytes]
    notebook: dict | None = None  # the manifest entry of a notebook's unit

    @property
    def size(self) -> int:
        return sum(len(b) for b in self.files.values())


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------- export

def notebook_units(label: str) -> list[Unit]:
    """One unit per notebook of the book with results under `label`: results, executed notebook, record."""
    units = []
    for nb in book_notebooks():
        results_file = context.results_path(nb.chapter, nb.name, label)
        if not results_file.exists():
            continue
        results = json.loads(results_file.read_bytes())
        files = {f"results/{label}/{nb.chapter}/{nb.name}.json": results_file.read_bytes()}
        executed = executed_path(label, nb)
        entry = {"notebook": nb.label, "path": nb.path, "status": results.get("status"),
                 "input_hash": results.get("input_hash"), "results": f"results/{label}/{nb.chapter}/{nb.name}.json",
                 "executed": None, "record": None}
        if executed.exists():
            entry["executed"] = f"executed/{label}/{nb.path}"
            files[entry["executed"]] = executed.read_bytes()
            record = executed.with_suffix(".json")
            if record.exists():
                entry["record"] = f"executed/{label}/{Path(nb.path).with_suffix('.json').as_posix()}"
                files[entry["record"]] = record.read_bytes()
        units.append(Unit(files, entry))
    return units


def metrics_units(label: str, units: list[Unit]) -> list[Unit]:
    """The metrics, configs and manifests (no weights) of every run the notebooks' results name."""
    seen, out = set(), []
    for u in units:
        results = json.loads(u.files[u.notebook["results"]])
        for ref in results.get("runs", []):
            ident = (ref["name"], ref["key"])
            folder = runs_root() / ref["name"] / ref["key"]
            if ident in seen or not folder.is_dir():
                continue
            seen.add(ident)
            files = {f"metrics/{label}/{ref['name']}/{ref['key']}/{name}": (folder / name).read_bytes()
                     for name in ("config.json", "metrics.jsonl", "manifest.json") if (folder / name).exists()}
            if files:
                out.append(Unit(files))
    return out


def export_results(label: str, out_dir: Path, extra: dict[str, Path] | None = None,
                   max_bytes: int = MAX_ARCHIVE_BYTES, max_archives: int = 7, source: dict | None = None) -> dict:
    """Pack label's results into out_dir/circuitbook-results-<label>-N.tar.gz; return a summary.

    extra: arcname (under benchmarks/ or logs/) -> file. Units go in this order: notebooks, extra files,
    run metrics; a unit that fits no archive (more than max_archives would be needed, or it is larger
    than max_bytes compressed) is left out and named in the summary and the last manifest.
    """
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", label):
        raise TransferError(f"label {label!r}: use letters, digits, '.', '_', '+' or '-'")
    nb_units = notebook_units(label)
    extra_units = []
    for arcname, path in (extra or {}).items():
        if PurePosixPath(arcname).parts[0] not in ("benchmarks", "logs"):
            raise TransferError(f"extra file {arcname!r} must go under benchmarks/ or logs/")
        extra_units.append(Unit({arcname: Path(path).read_bytes()}))
    units = nb_units + extra_units + metrics_units(label, nb_units)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob(f"circuitbook-results-{label}-*.tar.gz"):
        old.unlink()
    base = {"format": FORMAT, "label": label, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "source": {"host": platform.node(), **(source or {})}}
    archives: list[Path] = []
    left_out: list[str] = []
    writer = None
    for unit in units:
        if writer is not None and writer.compressed() + unit.size > max_bytes:
            archives.append(writer.close(base, []))
            writer = None
        if writer is None:
            if len(archives) >= max_archives:
                left_out += list(unit.files)
                continue
            writer = _Writer(out_dir / f"circuitbook-results-{label}-{len(archives) + 1}.tar.gz")
        writer.add(unit)
    if writer is not None:
        archives.append(writer.close(base, left_out))
    too_big = [a for a in archives if a.stat().st_size > max_bytes + 1024 * 1024]
    for a in too_big:  # one unit alone compressed past the limit: it cannot travel
        left_out.append(f"{a.name} ({a.stat().st_size / 2 ** 20:.1f} MiB compressed)")
        a.unlink()
    archives = [a for a in archives if a not in too_big]
    return {"archives": archives, "notebooks": [u.notebook["notebook"] for u in nb_units], "left_out": left_out}


class _Writer:
    def __init__(self, path: Path):
        self.path = path
        self.raw = open(path, "wb")
        self.tar = tarfile.open(fileobj=self.raw, mode="w:gz")
        self.digests: dict[str, str] = {}
        self.notebooks: list[dict] = []

    def compressed(self) -> int:
        """Bytes of the archive so far (the compressor's pending output flushed first)."""
        self.tar.fileobj.flush()
        return self.raw.tell()

    def _add_bytes(self, arcname: str, data: bytes) -> None:
        info = tarfile.TarInfo(arcname)
        info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
        self.tar.addfile(info, io.BytesIO(data))

    def add(self, unit: Unit) -> None:
        for arcname, data in unit.files.items():
            self._add_bytes(arcname, data)
            self.digests[arcname] = _sha(data)
        if unit.notebook:
            self.notebooks.append(unit.notebook)

    def close(self, base: dict, left_out: list[str]) -> Path:
        manifest = {**base, "notebooks": self.notebooks, "files": self.digests, "left_out": left_out}
        self._add_bytes(MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
        self.tar.close()
        self.raw.close()
        return self.path


# ---------------------------------------------------------------- import

@dataclass
class Imported:
    label: str = ""
    current: list[str] = field(default_factory=list)
    stale: dict[str, list[str]] = field(default_factory=dict)  # notebook -> what changed
    failed: list[str] = field(default_factory=list)
    kept_local: list[str] = field(default_factory=list)  # stale imports not placed over a current local result
    files: list[Path] = field(default_factory=list)  # benchmark results placed in the checkout
    metrics: int = 0


def _read_archive(path: Path) -> tuple[dict, dict[str, bytes]]:
    """(manifest, arcname -> bytes) of one archive, every member checked; TransferError names the problem."""
    if not path.is_file():
        raise TransferError(f"{path}: no such file")
    try:
        with tarfile.open(path, mode="r:gz") as tar:
            members = tar.getmembers()
            files = {}
            for m in members:
                name = PurePosixPath(m.name)
                if not m.isfile():
                    raise TransferError(f"{path}: member {m.name!r} is not a plain file (links and folders are refused)")
                if name.is_absolute() or ".." in name.parts or str(name) != m.name.strip("/") or m.name.startswith("/"):
                    raise TransferError(f"{path}: member {m.name!r} has an unsafe path")
                if m.name != MANIFEST and name.parts[0] not in FOLDERS:
                    raise TransferError(f"{path}: member {m.name!r} is outside {', '.join(FOLDERS)}")
                if m.name in files:
                    raise TransferError(f"{path}: member {m.name!r} appears twice")
                files[m.name] = tar.extractfile(m).read()
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise TransferError(f"{path}: not a readable circuitbook results archive (gzip tar): {e}") from None
    if MANIFEST not in files:
        raise TransferError(f"{path}: no {MANIFEST} (not made by `circuitbook export-results`)")
    try:
        manifest = json.loads(files.pop(MANIFEST))
    except ValueError as e:
        raise TransferError(f"{path}: {MANIFEST} is not JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise TransferError(f"{path}: {MANIFEST} has format {manifest.get('format') if isinstance(manifest, dict) else '?'}"
                            f"; this circuitbook reads format {FORMAT}")
    digests = manifest.get("files") or {}
    if set(digests) != set(files):
        extra, missing = sorted(set(files) - set(digests)), sorted(set(digests) - set(files))
        raise TransferError(f"{path}: the manifest and the archive disagree (unlisted: {extra[:3]}, missing: {missing[:3]})")
    for name, data in files.items():
        if _sha(data) != digests[name]:
            raise TransferError(f"{path}: {name} does not match its SHA-256 in the manifest (damaged)")
    return manifest, files


def _check_notebook(path: Path, entry: dict, files: dict[str, bytes], label: str, known: dict) -> dict:
    """Everything about one notebook's unit that must hold before it is placed; returns its parsed results."""
    where = f"{path}: {entry.get('notebook')}"
    nb = known.get(entry.get("notebook"))
    if nb is None:
        raise TransferError(f"{where} is not a notebook of this book ({len(known)} notebooks in _toc.yml)")
    expected = f"results/{label}/{nb.chapter}/{nb.name}.json"
    if entry.get("results") != expected or expected not in files:
        raise TransferError(f"{where}: its results file is missing (expected {expected})")
    try:
        results = json.loads(files[expected])
    except ValueError as e:
        raise TransferError(f"{where}: {expected} is not JSON ({e})") from None
    if not isinstance(results, dict) or not isinstance(results.get("values"), dict) \
            or results.get("status") not in context.STATUSES:
        raise TransferError(f"{where}: {expected} is not a results record")
    if (results.get("chapter"), results.get("notebook"), results.get("label")) != (nb.chapter, nb.name, label):
        raise TransferError(f"{where}: {expected} records {results.get('chapter')}/{results.get('notebook')} at "
                            f"{results.get('label')}, not {nb.label} at {label}")
    if results.get("status") == "ok":
        inputs = results.get("inputs")
        if not isinstance(inputs, dict) or book.inputs_hash(inputs) != results.get("input_hash"):
            raise TransferError(f"{where}: its recorded input hash is not the hash of its recorded inputs (tampered "
                                "or damaged); nothing was imported")
    if entry.get("executed"):
        if entry["executed"] != f"executed/{label}/{nb.path}" or entry["executed"] not in files:
            raise TransferError(f"{where}: its executed notebook is missing")
        if entry.get("record"):
            try:
                record = json.loads(files[entry["record"]])
            except (KeyError, ValueError):
                raise TransferError(f"{where}: its cache record is missing or not JSON") from None
            if record.get("sha256") != _sha(files[entry["executed"]]):
                raise TransferError(f"{where}: the executed notebook does not match its cache record's SHA-256")
            if record.get("input_hash") != results.get("input_hash"):
                raise TransferError(f"{where}: the executed notebook's record and its results name different inputs")
    return results


def import_results(archives: list[Path], log=print, benchmarks_dir: Path | None = None) -> Imported:
    """Check every archive, then place their contents in this run store (see the module docstring).

    Run metrics, logs and benchmark results go under <runs>/imported/; benchmark results measured on a
    GPU (`*cuda*`) also go to benchmarks_dir (default: the checkout's benchmarks/results/)."""
    if not archives:
        raise TransferError("name at least one archive (circuitbook-results-LABEL-N.tar.gz)")
    read = [(Path(a), *_read_archive(Path(a))) for a in archives]
    labels = {m.get("label") for _, m, _ in read}
    if len(labels) != 1:
        raise TransferError(f"the archives hold results of different labels ({', '.join(sorted(map(str, labels)))}); "
                            "import one label at a time")
    label = labels.pop()
    if not isinstance(label, str) or not re.fullmatch(r"[A-Za-z0-9_.+-]+", label):
        raise TransferError(f"{read[0][0]}: its label {label!r} is not a results label")
    profile = context.label_profile(label)
    if profile not in params.PROFILES:
        raise TransferError(f"{read[0][0]}: label {label!r} is of profile {profile!r}; profiles: {', '.join(params.PROFILES)}")
    known = {nb.label: nb for nb in book_notebooks()}
    book.compute_hashes(list(known.values()), profile)
    plan = []  # (notebook, entry, files, results)
    seen: set[str] = set()
    for path, manifest, files in read:
        for entry in manifest.get("notebooks") or []:
            results = _check_notebook(path, entry, files, label, known)
            if entry["notebook"] in seen:
                raise TransferError(f"{path}: {entry['notebook']} is in more than one archive")
            seen.add(entry["notebook"])
            plan.append((known[entry["notebook"]], entry, files, results))
    # everything verified: write
    out = Imported(label=label)
    for nb, entry, files, results in plan:
        overrides = results.get("overrides") or {}
        current = nb.inputs if not overrides else book.notebook_inputs(nb.chapter, nb.name, profile, overrides)
        changed = book.what_changed(results.get("inputs"), current) if results.get("status") == "ok" else []
        if changed and _local_is_current(nb, label, current):
            out.kept_local.append(nb.label)
            continue
        atomic_write_bytes(context.results_path(nb.chapter, nb.name, label), files[entry["results"]])
        target = executed_path(label, nb)
        record = target.with_suffix(".json")
        record.unlink(missing_ok=True)
        if entry.get("executed"):
            atomic_write_bytes(target, files[entry["executed"]])
            if entry.get("record"):
                atomic_write_bytes(record, files[entry["record"]])
        if results.get("status") != "ok":
            out.failed.append(nb.label)
        elif changed:
            out.stale[nb.label] = changed
        else:
            out.current.append(nb.label)
    for path, manifest, files in read:
        for name, data in files.items():
            parts = PurePosixPath(name).parts
            if parts[0] == "metrics":
                atomic_write_bytes(runs_root() / "imported" / name, data)
                out.metrics += 1
            elif parts[0] == "logs":
                atomic_write_bytes(runs_root() / "imported" / label / name, data)
            elif parts[0] == "benchmarks":
                atomic_write_bytes(runs_root() / "imported" / label / name, data)
                if "cuda" in parts[-1]:  # a GPU's results belong with the others, to be committed
                    dest = (benchmarks_dir or repo_root() / "benchmarks" / "results") / parts[-1]
                    atomic_write_bytes(dest, data)
                    out.files.append(dest)
    return out


def _local_is_current(nb, label: str, current: dict) -> bool:
    try:
        local = context.read_results(nb.chapter, nb.name, label)
    except context.DamagedResultsError:
        return False
    return bool(local) and local.get("status") == "ok" and not book.what_changed(local.get("inputs"), current)
