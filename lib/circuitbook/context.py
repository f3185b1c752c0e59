"""The notebook being executed: which chapter, notebook and profile, which runs.

`load_params()` opens a context; `train()` adds the runs it returns, and
`note_release()` a released run the notebook evaluates instead, `note_deviation()`
a deviation from the paper found at run time; `record()`
writes into the context's results file. The file carries the notebook's
inputs (`book.notebook_inputs`), so the scorecard grades a result only against
the code that produced it, and a status: `running` until the build (or
`circuitbook run`) that executed the notebook marks it `ok` or `failed`. A
result that is not `ok` is never graded. An `ok` result is sealed when the
build stores it (`circuitbook.seal`), and everything that reads a record
(grading, `recorded_values`, the build's cache, import, export) checks it with
one function, `check_record`.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from pathlib import Path

from . import book, log, seal
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
    return book.results_file(chapter, notebook, label)


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
    """SHA-256 of a results record as its execution wrote it (`book.results_digest`: without the seal and
    provenance added when it is stored): the executed notebook carries it, so a results file edited after
    the execution no longer matches the notebook that produced it."""
    return book.results_digest(data)


def begin(params) -> None:
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


def set_value(key: str, value, run_key: str | None, why: str | None = None, interval=None) -> None:
    if _current is None:
        raise RuntimeError("record() needs a context: call circuitbook.load_params(...) first")
    entry = {"value": value, "run": run_key}
    if why:
        entry["why"] = why
    if interval is not None:  # the value's sampling interval [lo, hi] (one per seed for a list): claims.record
        entry["interval"] = interval
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
        data = parse_record(path.read_bytes())
    except (OSError, ValueError) as e:
        raise DamagedResultsError(f"results file {path} is damaged ({path} is unreadable: {e}); re-execute "
                                  f"{chapter}/{notebook}") from None
    if not (isinstance(data, dict) and isinstance(data.get("values"), dict) and data.get("status") in STATUSES):
        raise DamagedResultsError(f"results file {path} is damaged (not a results record); "
                                  f"re-execute {chapter}/{notebook}")
    return data


class _Overflow(float):
    """A number literal too large for a float (`1e400`): record() never writes one (an infinity it records
    is written `Infinity`), so it is no measured value."""


def _float_literal(text: str) -> float:
    value = float(text)
    return value if math.isfinite(value) else _Overflow(value)


def parse_record(data: bytes | str) -> dict:
    """A results record from its JSON, as every reader parses it: `Infinity` and `NaN` are what record()
    writes for infinite and unmeasured values; a literal like `1e400` stays marked as no number."""
    return json.loads(data, parse_float=_float_literal)


ENTRY_KEYS = {"value", "run", "why", "interval"}
RECORD_TYPES = {"overrides": dict, "params": dict, "inputs": dict, "runs": list, "release": dict,
                "provenance": dict}


def check_record(chapter: str, notebook: str, label: str, data: dict, *, executed: bytes | None = None,
                 cache: dict | None = None, keys: dict | None = None, where=None) -> str | None:
    """The one check every reader of a results record runs (grading, `recorded_values`, the build's cache,
    import, export): None if the record may be used, else what is wrong, naming the file.

    Every record must be the record of this chapter, notebook and label (a copy from another label is not
    one) and hold only numbers (finite, or NaN for not measured), text or non-empty lists of numbers. A
    record marked `ok` must also be the one its executed notebook was produced with (the notebook carries
    its digest and matches its cache record's SHA-256) and carry a seal that verifies by this store's key
    (`keys=None`) or, on import, by one of `keys`. executed, cache: the executed notebook's bytes and its
    cache record when they are not the store's (an archive's); where: the record's name in messages."""
    where = where or results_path(chapter, notebook, label)
    problem = _shape_problem(chapter, notebook, label, data, where)
    if problem or data.get("status") != "ok":
        return problem
    nb_name = rec_name = None
    if executed is None:
        nb_name = executed_notebook_path(chapter, notebook, label)
        rec_name = nb_name.with_suffix(".json")
        if not nb_name.exists() or not rec_name.exists():
            return (f"its executed notebook {nb_name} (or its cache record) is missing, so the results file "
                    f"{where} cannot be checked against what the notebook showed")
        executed = nb_name.read_bytes()
        try:
            cache = read_json(rec_name)
        except DamagedRunError:
            cache = None
    notebook_text = f"the executed notebook {nb_name}" if nb_name else "the executed notebook"
    sha = hashlib.sha256(executed).hexdigest()
    if not isinstance(cache, dict) or cache.get("sha256") != sha:
        return f"{notebook_text} does not match its cache record's SHA-256" + (f" ({rec_name})" if rec_name else "")
    try:
        meta = json.loads(executed).get("metadata", {}).get("circuitbook", {})
    except (ValueError, AttributeError):
        return f"{notebook_text} is not readable"
    if not isinstance(meta, dict) or meta.get("results_sha256") != results_digest(data):
        return (f"the results file {where} does not match its executed notebook{' ' + str(nb_name) if nb_name else ''}"
                " (edited after the execution?)")
    return _seal_problem(data, sha, keys, where)


def _seal_problem(data: dict, notebook_sha: str, keys: dict | None, where) -> str | None:
    if keys is None:  # grading here: only this store's own key
        own = seal.store_key()
        why = seal.verify(data, notebook_sha, {seal.key_id(own): own} if own else {})
        return (f"the results file {where} is not sealed by this store (edited by hand, or copied from another "
                "store or label)") if why else None
    why = seal.verify(data, notebook_sha, keys)
    if why is None:
        return None
    if why.startswith("sealed by an unknown key"):
        return (f"{where} is {why} (neither this store's nor a visit key of {seal.visits_dir()}: run "
                "`circuitbook visit-key` here and start the visit with the key it prints)")
    return f"{where} is not sealed by a key this store knows ({why})"


def _shape_problem(chapter: str, notebook: str, label: str, data: dict, where) -> str | None:
    """A record of another chapter, notebook or label, or holding values of the wrong kind: what is wrong."""
    fields = (data.get("chapter"), data.get("notebook"), data.get("label"))
    if fields != (chapter, notebook, label):
        want = f"at {label}" if fields[:2] == (chapter, notebook) else f"{chapter}/{notebook} at {label}"
        return (f"the results file {where} records {fields[0]}/{fields[1]} at {fields[2]}, not {want} (copied from "
                "another label or notebook?)")
    for name, kind in RECORD_TYPES.items():
        if data.get(name) is not None and not isinstance(data[name], kind):
            return f"the results file {where} holds {name} that is not a {kind.__name__}"
    for key, entry in data["values"].items():
        problem = entry_problem(key, entry)
        if problem:
            return f"results file {where} holds {problem}"
    return None


def _number(x) -> bool:
    """A number a results value may be: a float or int as record() writes it (NaN for not measured, an
    infinity written `Infinity`, as algorithmic_cores records "no dimension suffices"), never a bool or a
    literal too large for a float."""
    return isinstance(x, (int, float)) and not isinstance(x, (bool, _Overflow))


def entry_problem(key: str, entry) -> str | None:
    """What is wrong with one recorded entry {value, run, why, interval}, in words, or None."""
    if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_]\w*", key) or not isinstance(entry, dict) \
            or "value" not in entry or set(entry) - ENTRY_KEYS:
        return f"an entry {key!r} that is not {{value, run, why, interval}}"
    value = entry["value"]
    if not (isinstance(value, str) or _number(value) or (isinstance(value, list) and value
                                                          and all(_number(v) for v in value))):
        return f"a value of {key} that is not a number, text or list of numbers"
    run = entry.get("run")
    if not (run is None or isinstance(run, str) or (isinstance(run, list) and all(isinstance(r, str) for r in run))):
        return f"a run of {key} that is not a run key, a list of them or null"
    if entry.get("why") is not None and not isinstance(entry["why"], str):
        return f"a why of {key} that is not text"
    interval = entry.get("interval")
    if interval is None:
        return None
    per_seed = isinstance(value, list) and isinstance(interval, list) and len(interval) == len(value) \
        and all(isinstance(i, list) for i in interval)
    if not (all(_interval_ok(i) for i in interval) if per_seed else _interval_ok(interval)):
        return (f"an interval of {key} that is not two numbers [lo, hi] with lo <= hi (one such pair per seed for a "
                "list of values)")
    return None


def _interval_ok(interval) -> bool:
    return (isinstance(interval, list) and len(interval) == 2 and all(_number(v) for v in interval)
            and (all(math.isnan(v) for v in interval)
                 or (not any(math.isnan(v) for v in interval) and interval[0] <= interval[1])))


def seal_stored(chapter: str, notebook: str, label: str, seconds: float) -> dict:
    """Seal the `ok` record of an execution the build just stored (its executed notebook in place) by this
    store's key, with its provenance: what `build._store_execution` calls. Returns the record."""
    data = read_results(chapter, notebook, label)
    executed = executed_notebook_path(chapter, notebook, label).read_bytes()
    key = seal.store_key(create=True)
    data = {**data, "provenance": seal.provenance(seconds, key)}
    data = seal.apply(data, hashlib.sha256(executed).hexdigest(), key)
    atomic_write_json(results_path(chapter, notebook, label), data)
    return data


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
