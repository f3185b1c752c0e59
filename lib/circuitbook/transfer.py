"""Results that travel: executed notebooks and recorded results packed on one machine, imported on another.

`export_results(label, out_dir)` packs, from this run store, every notebook's results file under `label`
(each checked as grading checks it, `context.check_record`: a record this store would not grade is left out,
named), its executed notebook and its cache record, the metrics (not the weights) of the runs those results
name, and any extra files (benchmark results, logs) into gzip tar archives of at most MAX_ARCHIVE_BYTES each;
every archive is complete in itself, with a manifest (`circuitbook-export.json`) holding the SHA-256 of each
file. A notebook's three files always travel in the same archive. Archives are written under temporary names and
renamed when complete; the archives already in `out_dir` are replaced only then. No key ever travels.

`import_results(archives)` checks everything before it writes anything: each archive's members are plain files
under the known folders, within MAX_MEMBER_BYTES each and MAX_TOTAL_BYTES in all (read with bounded reads), each
file matches the manifest's digest, each notebook is one of this book's, each results record passes
`context.check_record` against the archive's executed notebook and cache record, and each `ok` record is sealed
by a key this store knows (a visit key of `<runs>/.keys/visits/`, or its own): otherwise the whole import is
refused, naming the file. It then places the executed notebooks and results in this run store, each `ok` record
sealed again by this store's key with the provenance it arrived with, so that a build at the label's profile uses
them as its cache. A result whose inputs (notebook, parameters, library code, upstream notebooks, files its
parameters name) differ from the current sources, or that was recorded in an undeclared environment, is imported
as `stale: ...`, never graded; its notebook is shown under a stale banner. A stale, failed or unfinished import
never replaces a current local result. Nothing is written outside the store, except GPU benchmark results whose
names and contents are allowed (BENCHMARK_NAME) into the checkout's benchmarks/results/.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import re
import tarfile
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from . import book, context, params, seal
from .build import executed_path
from .book import book_notebooks
from .runs import atomic_write_bytes, atomic_write_json, repo_root, runs_root

FORMAT = 1
MANIFEST = "circuitbook-export.json"
MAX_ARCHIVE_BYTES = 15 * 1024 * 1024  # under the 16 MiB a GPU machine's $OUT returns per file
FOLDERS = ("executed", "results", "metrics", "benchmarks", "logs")  # what an archive may hold
MAX_MEMBER_BYTES = 64 * 2 ** 20  # one member, uncompressed
MAX_TOTAL_BYTES = 512 * 2 ** 20  # every member of every archive of one import, uncompressed
MAX_MEMBERS = 10_000
MAX_BENCHMARK_BYTES = 2 ** 20
BENCHMARK_NAME = re.compile(r"[a-z0-9_]+_cuda[a-z0-9_]*\.(json|txt)")  # a GPU's results, placed in the checkout


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

def notebook_units(label: str, left_out: list[str] | None = None) -> list[Unit]:
    """One unit per notebook of the book with results under `label`: results, executed notebook, record.
    A record this store would not grade (`context.check_record`: unsealed, edited, damaged) does not travel:
    it is named in `left_out` with the reason."""
    units = []
    for nb in book_notebooks():
        results_file = context.results_path(nb.chapter, nb.name, label)
        if not results_file.exists():
            continue
        try:
            results = context.read_results(nb.chapter, nb.name, label)
            problem = context.check_record(nb.chapter, nb.name, label, results)
        except context.DamagedResultsError as e:
            problem = str(e)
        if problem:
            if left_out is not None:
                left_out.append(f"{nb.label} ({problem})")
            continue
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
            if not isinstance(ref, dict) or not all(isinstance(ref.get(k), str) for k in ("name", "key")):
                continue
            ident = (ref["name"], ref["key"])
            folder = runs_root() / ref["name"] / ref["key"]
            if ident in seen or not folder.is_dir() or runs_root() not in folder.resolve().parents:
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
    than max_bytes compressed) is left out and named in the summary and the last manifest. With no
    notebook to export, nothing in out_dir is touched. Archives are written under temporary names and
    renamed when all are complete (a full disk leaves the earlier archives as they were, and no partial one).
    """
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", label):
        raise TransferError(f"label {label!r}: use letters, digits, '.', '_', '+' or '-'")
    left_out: list[str] = []
    nb_units = notebook_units(label, left_out)
    if not nb_units:
        return {"archives": [], "notebooks": [], "left_out": left_out}
    extra_units = []
    for arcname, path in (extra or {}).items():
        if PurePosixPath(arcname).parts[0] not in ("benchmarks", "logs"):
            raise TransferError(f"extra file {arcname!r} must go under benchmarks/ or logs/")
        extra_units.append(Unit({arcname: Path(path).read_bytes()}))
    units = nb_units + extra_units + metrics_units(label, nb_units)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = {"format": FORMAT, "label": label, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "source": {"host": platform.node(), **(source or {})}}
    tag = f"{os.getpid()}.{uuid.uuid4().hex[:8]}"
    temporary = lambda n: out_dir / f".circuitbook-results-{label}-{n}.tar.gz.{tag}.partial"  # noqa: E731
    written: list[Path] = []
    try:
        written = _write_archives(units, base, temporary, max_bytes, max_archives, left_out)
        too_big = [a for a in written if a.stat().st_size > max_bytes + 1024 * 1024]
        for a in too_big:  # one unit alone compressed past the limit: it cannot travel
            left_out.append(f"{a.name.split('.tar.gz')[0].lstrip('.')}.tar.gz ({a.stat().st_size / 2 ** 20:.1f} MiB "
                            f"compressed)")
            a.unlink()
        written = [a for a in written if a not in too_big]
        archives = [out_dir / f"circuitbook-results-{label}-{n}.tar.gz" for n in range(1, len(written) + 1)]
        for old in out_dir.glob(f"circuitbook-results-{label}-*.tar.gz"):
            if old not in archives:
                old.unlink()
        for tmp, final in zip(written, archives):
            os.replace(tmp, final)
    finally:
        for tmp in out_dir.glob(f".circuitbook-results-{label}-*.tar.gz.{tag}.partial"):
            tmp.unlink(missing_ok=True)
    return {"archives": archives, "notebooks": [u.notebook["notebook"] for u in nb_units], "left_out": left_out}


def _write_archives(units: list[Unit], base: dict, name, max_bytes: int, max_archives: int,
                    left_out: list[str]) -> list[Path]:
    archives: list[Path] = []
    writer = None
    try:
        for unit in units:
            if writer is not None and writer.compressed() + unit.size > max_bytes:
                archives.append(writer.close(base, []))
                writer = None
            if writer is None:
                if len(archives) >= max_archives:
                    left_out += list(unit.files)
                    continue
                writer = _Writer(name(len(archives) + 1))
            writer.add(unit)
        if writer is not None:
            archives.append(writer.close(base, left_out))
            writer = None
    finally:
        if writer is not None:
            writer.abandon()
    return archives


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
        self.raw.flush()
        os.fsync(self.raw.fileno())
        self.raw.close()
        return self.path

    def abandon(self) -> None:
        """A write failed (a full disk): close what can be closed; the caller removes the file."""
        for f in (self.tar, self.raw):
            try:
                f.close()
            except (OSError, ValueError):
                pass


# ---------------------------------------------------------------- import

@dataclass
class Imported:
    label: str = ""
    current: list[str] = field(default_factory=list)
    stale: dict[str, list[str]] = field(default_factory=dict)  # notebook -> why
    failed: list[str] = field(default_factory=list)
    kept_local: list[str] = field(default_factory=list)  # imports not placed over a current local result
    files: list[Path] = field(default_factory=list)  # benchmark results placed in the checkout
    not_placed: list[tuple[str, str]] = field(default_factory=list)  # GPU benchmark files kept in the store only
    metrics: int = 0


class _Budget:
    """The uncompressed bytes one import may read, over all its archives."""

    def __init__(self):
        self.left = MAX_TOTAL_BYTES


def _read_archive(path: Path, budget: _Budget) -> tuple[dict, dict[str, bytes]]:
    """(manifest, arcname -> bytes) of one archive, every member checked before it is read (plain files under
    the known folders, at most MAX_MEMBER_BYTES each and MAX_TOTAL_BYTES in all, read with bounded reads);
    TransferError names the problem."""
    if not path.is_file():
        raise TransferError(f"{path}: no such file")
    files = {}
    try:
        with tarfile.open(path, mode="r:gz") as tar:
            while (m := tar.next()) is not None:
                _check_member(path, m, files, budget)
                data = tar.extractfile(m).read(MAX_MEMBER_BYTES + 1)
                if len(data) != m.size:
                    raise TransferError(f"{path}: member {m.name!r} is truncated (damaged archive)")
                files[m.name] = data
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
    if not isinstance(digests, dict) or set(digests) != set(files):
        extra, missing = sorted(set(files) - set(digests)), sorted(set(digests) - set(files))
        raise TransferError(f"{path}: the manifest and the archive disagree (unlisted: {extra[:3]}, missing: {missing[:3]})")
    for name, data in files.items():
        if _sha(data) != digests[name]:
            raise TransferError(f"{path}: {name} does not match its SHA-256 in the manifest (damaged)")
    if not isinstance(manifest.get("notebooks") or [], list) or \
            not all(isinstance(e, dict) for e in manifest.get("notebooks") or []):
        raise TransferError(f"{path}: {MANIFEST} lists its notebooks in a form this circuitbook does not read")
    return manifest, files


def _check_member(path: Path, m: tarfile.TarInfo, files: dict, budget: _Budget) -> None:
    name = PurePosixPath(m.name)
    if len(files) >= MAX_MEMBERS:
        raise TransferError(f"{path}: more than {MAX_MEMBERS} members; nothing was imported")
    if not m.isfile():
        raise TransferError(f"{path}: member {m.name!r} is not a plain file (links and folders are refused)")
    if name.is_absolute() or ".." in name.parts or str(name) != m.name.strip("/") or m.name.startswith("/"):
        raise TransferError(f"{path}: member {m.name!r} has an unsafe path")
    if m.name != MANIFEST and name.parts[0] not in FOLDERS:
        raise TransferError(f"{path}: member {m.name!r} is outside {', '.join(FOLDERS)}")
    if m.name in files:
        raise TransferError(f"{path}: member {m.name!r} appears twice")
    if m.size > MAX_MEMBER_BYTES:
        raise TransferError(f"{path}: {m.name} is {m.size / 2 ** 20:.1f} MiB; a member may be at most "
                            f"{MAX_MEMBER_BYTES / 2 ** 20:.0f} MiB; nothing was imported")
    if m.size > budget.left:
        raise TransferError(f"{path}: {m.name} takes the archives past {MAX_TOTAL_BYTES / 2 ** 20:.1f} MiB "
                            "uncompressed, the most one import reads; nothing was imported")
    budget.left -= m.size


def _check_notebook(path: Path, entry: dict, files: dict[str, bytes], label: str, known: dict,
                    keys: dict) -> dict:
    """Everything about one notebook's unit that must hold before it is placed; returns its parsed results."""
    where = f"{path}: {entry.get('notebook')}"
    nb = known.get(entry.get("notebook"))
    if nb is None:
        raise TransferError(f"{where} is not a notebook of this book ({len(known)} notebooks in _toc.yml)")
    expected = f"results/{label}/{nb.chapter}/{nb.name}.json"
    if entry.get("results") != expected or expected not in files:
        raise TransferError(f"{where}: its results file is missing (expected {expected})")
    try:
        results = context.parse_record(files[expected])
    except ValueError as e:
        raise TransferError(f"{where}: {expected} is not JSON ({e})") from None
    if not isinstance(results, dict) or not isinstance(results.get("values"), dict) \
            or results.get("status") not in context.STATUSES:
        raise TransferError(f"{where}: {expected} is not a results record")
    executed = entry.get("executed")
    if executed and (executed != f"executed/{label}/{nb.path}" or executed not in files):
        raise TransferError(f"{where}: its executed notebook is missing")
    record = None
    if entry.get("record"):
        try:
            record = json.loads(files[entry["record"]])
        except (KeyError, ValueError):
            raise TransferError(f"{where}: its cache record is missing or not JSON") from None
    if results.get("status") == "ok":
        inputs = results.get("inputs")
        if not isinstance(inputs, dict) or book.inputs_hash(inputs) != results.get("input_hash"):
            raise TransferError(f"{where}: its recorded input hash is not the hash of its recorded inputs (tampered "
                                "or damaged); nothing was imported")
        if not executed or not isinstance(record, dict):
            raise TransferError(f"{where}: a finished result travels with its executed notebook and cache record; "
                                "they are missing")
        if record.get("input_hash") != results.get("input_hash"):
            raise TransferError(f"{where}: the executed notebook's record and its results name different inputs")
    problem = context.check_record(nb.chapter, nb.name, label, results, where=expected, keys=keys,
                                   executed=files[executed] if executed else None, cache=record)
    if problem:
        raise TransferError(f"{where}: {problem}; nothing was imported")
    return results


def import_results(archives: list[Path], log=print, benchmarks_dir: Path | None = None) -> Imported:
    """Check every archive, then place their contents in this run store (see the module docstring).

    Run metrics, logs and benchmark results go under <runs>/imported/; a GPU's benchmark results whose names
    match BENCHMARK_NAME, of JSON or text within MAX_BENCHMARK_BYTES, also go to benchmarks_dir (default: the
    checkout's benchmarks/results/); any other `*cuda*` benchmark file is named in `not_placed`."""
    if not archives:
        raise TransferError("name at least one archive (circuitbook-results-LABEL-N.tar.gz)")
    budget = _Budget()
    read = [(Path(a), *_read_archive(Path(a), budget)) for a in archives]
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
    keys = seal.known_keys()
    plan = []  # (notebook, entry, files, results)
    seen: set[str] = set()
    for path, manifest, files in read:
        for entry in manifest.get("notebooks") or []:
            results = _check_notebook(path, entry, files, label, known, keys)
            if entry["notebook"] in seen:
                raise TransferError(f"{path}: {entry['notebook']} is in more than one archive")
            seen.add(entry["notebook"])
            plan.append((known[entry["notebook"]], entry, files, results))
    # everything verified: write, in the book's order (a notebook's upstreams are placed before it)
    order = list(known)
    out = Imported(label=label)
    for nb, entry, files, results in sorted(plan, key=lambda p: order.index(p[0].label)):
        _place(nb, entry, files, results, label, out)
    _place_extras(read, label, out, benchmarks_dir)
    return out


def _why_stale(nb, results: dict, label: str) -> list[str]:
    """Why a results record is not current here ([] if it is): `book.stale_reasons`, or parameters that are
    no longer valid or name files the book does not read."""
    try:
        current = book.notebook_inputs(nb.chapter, nb.name, context.label_profile(label), results.get("overrides") or {})
    except params.ParameterError as e:
        return [f"its parameters are no longer valid ({e})"]
    return book.stale_reasons(results, current)


def _place(nb, entry: dict, files: dict, results: dict, label: str, out: Imported) -> None:
    ok = results.get("status") == "ok"
    changed = _why_stale(nb, results, label) if ok else []
    if (changed or not ok) and _local_is_current(nb, label):
        out.kept_local.append(nb.label)
        return
    target = executed_path(label, nb)
    record = target.with_suffix(".json")
    record.unlink(missing_ok=True)
    if entry.get("executed"):
        atomic_write_bytes(target, files[entry["executed"]])
    else:
        target.unlink(missing_ok=True)
    if ok:  # sealed again by this store, its provenance as it arrived
        results = seal.apply(results, _sha(files[entry["executed"]]), seal.store_key(create=True))
        atomic_write_json(context.results_path(nb.chapter, nb.name, label), results)
    else:
        atomic_write_bytes(context.results_path(nb.chapter, nb.name, label), files[entry["results"]])
    if entry.get("executed") and entry.get("record"):
        atomic_write_bytes(record, files[entry["record"]])
    if not ok:
        out.failed.append(nb.label)
    elif changed:
        out.stale[nb.label] = changed
    else:
        out.current.append(nb.label)


def _place_extras(read, label: str, out: Imported, benchmarks_dir: Path | None) -> None:
    """Run metrics, logs and benchmark results: under <runs>/imported/; allowed GPU results also into the checkout."""
    for path, manifest, files in read:
        for name, data in files.items():
            parts = PurePosixPath(name).parts
            if parts[0] == "metrics":
                atomic_write_bytes(runs_root() / "imported" / name, data)
                out.metrics += 1
            elif parts[0] in ("logs", "benchmarks"):
                atomic_write_bytes(runs_root() / "imported" / label / name, data)
            if parts[0] == "benchmarks" and "cuda" in parts[-1]:
                why = _benchmark_problem(parts, data)
                if why:
                    out.not_placed.append((parts[-1], why))
                    continue
                dest = (benchmarks_dir or repo_root() / "benchmarks" / "results") / parts[-1]
                atomic_write_bytes(dest, data)
                out.files.append(dest)


def _benchmark_problem(parts: tuple, data: bytes) -> str | None:
    """Why a GPU benchmark file may not go into the checkout, or None."""
    if len(parts) != 2 or not BENCHMARK_NAME.fullmatch(parts[-1]):
        return f"its name is not {BENCHMARK_NAME.pattern} directly under benchmarks/"
    if len(data) > MAX_BENCHMARK_BYTES:
        return f"{len(data) / 2 ** 20:.1f} MiB, over the {MAX_BENCHMARK_BYTES / 2 ** 20:.0f} MiB a result may take"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8 text"
    if parts[-1].endswith(".json"):
        try:
            json.loads(text)
        except ValueError:
            return "not JSON"
    elif any(not (c.isprintable() or c in "\n\r\t") for c in text):
        return "not plain text"
    return None


def _local_is_current(nb, label: str) -> bool:
    """Whether this store holds a result of `nb` under `label` that it would grade now."""
    try:
        local = context.read_results(nb.chapter, nb.name, label)
    except context.DamagedResultsError:
        return False
    if not local or local.get("status") != "ok" or context.check_record(nb.chapter, nb.name, label, local):
        return False
    return not _why_stale(nb, local, label)
