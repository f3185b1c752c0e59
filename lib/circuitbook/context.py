"""The notebook being executed: which chapter, notebook and profile, which runs.

`load_params()` opens a context; `train()` adds the runs it returns;
`record()` writes into the context's results file.
"""
from __future__ import annotations

import time
from pathlib import Path

from .runs import atomic_write_json, read_json, runs_root

_current: dict | None = None


def results_label(profile: str, overrides: dict) -> str:
    """Results of a run with overrides never stand in for the profile's own."""
    return profile if not overrides else f"{profile}+custom"


def results_path(chapter: str, notebook: str, label: str) -> Path:
    return runs_root() / "results" / label / chapter / f"{notebook}.json"


def begin(params) -> None:
    global _current
    label = results_label(params.profile, params.overrides)
    _current = {
        "chapter": params.chapter, "notebook": params.notebook, "profile": params.profile, "label": label,
        "overrides": params.overrides, "params": dict(params), "runs": [],
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "status": "running", "values": {},
    }
    _write()


def current() -> dict | None:
    return _current


def note_run(run) -> None:
    if _current is not None:
        ref = {"name": run.dir.name, "key": run.key, "path": str(run.path)}
        if ref not in _current["runs"]:
            _current["runs"].append(ref)
            _write()


def set_value(key: str, value, run_key: str | None) -> None:
    if _current is None:
        raise RuntimeError("record() needs a context: call circuitbook.load_params(...) first")
    _current["values"][key] = {"value": value, "run": run_key}
    _write()


def _write() -> None:
    atomic_write_json(results_path(_current["chapter"], _current["notebook"], _current["label"]), _current)


def read_results(chapter: str, notebook: str, label: str) -> dict | None:
    path = results_path(chapter, notebook, label)
    return read_json(path) if path.exists() else None


def mark(chapter: str, notebook: str, label: str, status: str, error: str = "") -> None:
    """Set the status of a notebook's results after the build ran it."""
    data = read_results(chapter, notebook, label) or {"chapter": chapter, "notebook": notebook, "profile": label,
                                                      "label": label, "values": {}, "runs": []}
    data["status"] = status
    data["error"] = error
    atomic_write_json(results_path(chapter, notebook, label), data)
