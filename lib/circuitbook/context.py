"""The notebook being executed: which chapter, notebook and profile, which runs.

`load_params()` opens a context; `train()` adds the runs it returns, and
`note_release()` a released run the notebook evaluates instead, `note_deviation()`
a deviation from the paper found at run time; `record()`
writes into the context's results file. The file carries the notebook's
inputs (`book.notebook_inputs`), so the scorecard grades a result only against
the code that produced it, and a status: `running` until the build (or
`circuitbook run`) that executed the notebook marks it `ok` or `failed`. A
result that is not `ok` is never graded.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from . import log
from .runs import DamagedRunError, atomic_write_json, canonical_json, read_json, runs_root
from .settings import check_label

LABEL_ENV = "CIRCUITBOOK_RESULTS_LABEL"  # set by the build / `circuitbook run` for the kernel
EXECUTION_ENV = "CIRCUITBOOK_EXECUTION_ID"
STATUSES = ("running", "ok", "failed")

_current: dict | None = None


def results_label(profile: str, overrides: dict) -> str:
    """Results of a run with overrides never stand in for the profile's own: `PROFILE+<hash>`."""
    if not overrides:
        return profile
    return f"{profile}+{hashlib.sha256(canonical_json(overrides).encode()).hexdigest()[:8]}"


def label_profile(label: str) -> str:
    return label.split("+", 1)[0]


def results_path(chapter: str, notebook: str, label: str) -> Path:
    return runs_root() / "results" / check_label(label) / chapter / f"{notebook}.json"


def notebook_source(chapter: str, notebook: str) -> str:
    """The notebook's path in the book, relative to its root (`chapters/x/02_y.ipynb`, `book/tour.ipynb`)."""
    folder = "book" if chapter == "book" else f"chapters/{chapter}"
    return f"{folder}/{notebook}.ipynb"


def executed_notebook_path(chapter: str, notebook: str, label: str) -> Path:
    """Where the build keeps the executed notebook whose run wrote the results under `label`."""
    return runs_root() / "executed" / check_label(label) / notebook_source(chapter, notebook)


def log_path(chapter: str, notebook: str, label: str) -> Path:
    """The log of a notebook's executions under `label` (what the library said while it ran)."""
    return runs_root() / "logs" / check_label(label) / chapter / f"{notebook}.log"


def results_digest(data: dict) -> str:
    """SHA-256 of a results record as written (canonical JSON): the executed notebook carries it, so a
    results file edited after the execution no longer matches the notebook that produced it."""
    return hashlib.sha256(canonical_json(data).encode()).hexdigest()


def begin(params) -> None:
    from . import book

    global _current
    label = os.environ.get(LABEL_ENV) or results_label(params.profile, params.overrides)
    inputs = book.notebook_inputs(params.chapter, params.notebook, params.profile, params.overrides)
    _current = {
        "chapter": params.chapter, "notebook": params.notebook, "profile": params.profile, "label": label,
        "overrides": params.overrides, "params": dict(params), "runs": [], "inputs": inputs,
        "input_hash": book.inputs_hash(inputs), "execution": os.environ.get(EXECUTION_ENV, ""),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "status": "running", "values": {},
    }
    if _current["execution"]:  # executed by the build: the library's lines go to the log, not the page
        log.to_file(log_path(params.chapter, params.notebook, label))
        log.info(f"{params.chapter}/{params.notebook} at {label}, execution {_current['execution'][:8]}")
    _write()


def current() -> dict | None:
    return _current


def note_run(run) -> None:
    if _current is not None:
        ref = {"name": run.dir.name, "key": run.key, "path": str(run.path)}
        if ref not in _current["runs"]:
            _current["runs"].append(ref)
            _write()


def note_release(name: str, path: str, evaluated: str) -> None:
    """Say that this notebook evaluates a released run (weights from outside the book's store):
    its name, where it is and what of it was evaluated. The scorecard shows this on the row
    instead of the profile's training deviations (`params.deviations(..., release=True)`)."""
    if _current is not None:
        release = {"name": name, "path": path, "evaluated": evaluated}
        if _current.get("release") != release:
            _current["release"] = release
            _write()


def note_deviation(text: str) -> None:
    """Say how this execution differs from the paper in a way found only at run time (the data held
    fewer samples than asked for, say): kept in the results record's `deviations_found` (once per
    text) and listed after the profile's deviations on the notebook's scorecard rows and its chapter
    page. Without a notebook context (a plan, a library call) there is nothing to note into."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"note_deviation(): the text must be a non-empty str, got {text!r}")
    if _current is not None and text not in _current.setdefault("deviations_found", []):
        _current["deviations_found"].append(text)
        _write()


def deviations_found(results: dict | None) -> list[str]:
    """The deviations a results record noted at run time (`note_deviation`), [] for none."""
    found = (results or {}).get("deviations_found")
    return [t for t in found if isinstance(t, str)] if isinstance(found, list) else []


def set_value(key: str, value, run_key: str | None, why: str | None = None) -> None:
    if _current is None:
        raise RuntimeError("record() needs a context: call circuitbook.load_params(...) first")
    entry = {"value": value, "run": run_key}
    if why:
        entry["why"] = why
    _current["values"][key] = entry
    _write()


def _write() -> None:
    atomic_write_json(results_path(_current["chapter"], _current["notebook"], _current["label"]), _current)


class DamagedResultsError(DamagedRunError):
    """A results file that exists but cannot be read as one."""


def read_results(chapter: str, notebook: str, label: str) -> dict | None:
    """The recorded results, None if there are none; DamagedResultsError (naming the file) if damaged."""
    path = results_path(chapter, notebook, label)
    if not path.exists():
        return None
    try:
        data = read_json(path)
    except DamagedRunError as e:
        raise DamagedResultsError(f"results file {path} is damaged ({e}); re-execute {chapter}/{notebook}") from None
    if not (isinstance(data, dict) and isinstance(data.get("values"), dict) and data.get("status") in STATUSES):
        raise DamagedResultsError(f"results file {path} is damaged (not a results record); "
                                  f"re-execute {chapter}/{notebook}")
    return data


def provenance_problem(chapter: str, notebook: str, label: str, data: dict) -> str | None:
    """None if the results record `data` is the one its executed notebook was produced with; else what
    is wrong, naming the file. The build records the results' digest in the executed notebook's
    metadata and the notebook's SHA-256 in its cache record (`build._store_execution`), so editing the
    results, the notebook or its recorded digest breaks the chain."""
    executed = executed_notebook_path(chapter, notebook, label)
    record = executed.with_suffix(".json")
    if not executed.exists() or not record.exists():
        return (f"its executed notebook {executed} (or its cache record) is missing, so the results file "
                f"{results_path(chapter, notebook, label)} cannot be checked against what the notebook showed")
    data_bytes = executed.read_bytes()
    try:
        recorded = read_json(record).get("sha256")
    except (DamagedRunError, AttributeError):
        recorded = None
    if recorded != hashlib.sha256(data_bytes).hexdigest():
        return f"the executed notebook {executed} does not match the SHA-256 its cache record {record} holds"
    try:
        meta = json.loads(data_bytes).get("metadata", {}).get("circuitbook", {})
    except ValueError:
        return f"the executed notebook {executed} is not readable"
    if meta.get("results_sha256") != results_digest(data):
        return (f"the results file {results_path(chapter, notebook, label)} does not match its executed notebook "
                f"{executed} (edited after the execution?)")
    return None


def mark(chapter: str, notebook: str, label: str, status: str, error: str = "", execution: str = "") -> dict:
    """Set the status of a notebook's results after the build ran it; return the record as written.

    Only a results file begun by this execution is marked `ok`: one left by an earlier
    execution (the notebook never reached load_params this time) is marked failed.
    """
    try:
        data = read_results(chapter, notebook, label)
    except DamagedResultsError:
        data = None
    if data is None or (execution and data.get("execution") != execution):
        data = {"chapter": chapter, "notebook": notebook, "profile": label_profile(label), "label": label,
                "values": {}, "runs": [], "execution": execution}
        if status == "ok":
            status, error = "failed", "the notebook never called circuitbook.load_params()"
    data["status"] = status
    data["error"] = error
    data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    atomic_write_json(results_path(chapter, notebook, label), data)
    return data
