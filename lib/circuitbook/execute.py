"""Executing one notebook with papermill: parameters in, an executed notebook and marked results out.

`execute()` runs a notebook in a fresh kernel with the profile (and overrides) as papermill
parameters, marks its results file `ok` or `failed`, and writes the executed notebook with the digest
of those results in its metadata (`context.check_record` checks that chain). The build and the
Ray cluster's notebook tasks both call it.
"""
from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import nbformat

from . import context
from .runs import repo_root

if TYPE_CHECKING:
    from .book import Notebook


class BuildError(RuntimeError):
    """A notebook failed, or the book could not be rendered."""


def execute(nb: Notebook, profile: str, dest: Path, overrides: dict | None = None, log=print,
            label: str | None = None, env: dict | None = None) -> float:
    """Execute one notebook with papermill into `dest`; return seconds. Raises BuildError.
    env: extra environment variables for the kernel (a Ray build's cluster address)."""
    import papermill as pm

    root = repo_root()
    label = label or context.results_label(profile, overrides or {})
    execution = uuid.uuid4().hex
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{execution[:8]}.running.ipynb")
    dest.parent.mkdir(parents=True, exist_ok=True)
    parameters = {"profile": profile}
    if overrides:
        parameters["params"] = overrides
    env_before = dict(os.environ)
    os.environ.setdefault("CIRCUITBOOK_ROOT", str(root))
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    os.environ[context.LABEL_ENV] = label
    os.environ[context.EXECUTION_ENV] = execution
    os.environ.update(env or {})
    t0 = time.time()
    try:
        pm.execute_notebook(str(root / nb.path), str(tmp), parameters=parameters, kernel_name="python3",
                            cwd=str((root / nb.path).parent), progress_bar=False, log_output=False,
                            start_timeout=300)  # a loaded machine can take long to start a kernel
    except pm.PapermillExecutionError as e:
        index, first_line = _failing_cell(tmp, root / nb.path)
        _finish_failed(tmp, dest)
        context.mark(nb.chapter, nb.name, label, "failed", f"{e.ename}: {e.evalue}", execution)
        raise BuildError(f"notebook {nb.path} failed at cell {index} (In [{e.exec_count}]: {first_line!r}) "
                         f"with {e.ename}: {e.evalue}") from None
    except Exception as e:  # kernel died, bad parameters cell, ...
        _finish_failed(tmp, dest)
        context.mark(nb.chapter, nb.name, label, "failed", f"{type(e).__name__}: {e}", execution)
        raise BuildError(f"notebook {nb.path} could not be executed: {type(e).__name__}: {e}") from None
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    results = context.mark(nb.chapter, nb.name, label, "ok", "", execution)
    seconds = time.time() - t0
    _strip_metadata(tmp, context.results_digest(results))
    os.replace(tmp, dest)
    return seconds


def _failing_cell(executed: Path, source: Path) -> tuple[int | str, str]:
    """(index of the failing cell in the source notebook, its first line)."""
    try:
        failed = next(c for c in nbformat.read(executed, as_version=4).cells
                      if c.cell_type == "code" and any(o.get("output_type") == "error" for o in c.outputs))
        sources = [c.source for c in nbformat.read(source, as_version=4).cells]
        index = sources.index(failed.source) if failed.source in sources else "?"
        return index, (failed.source.strip().splitlines() or [""])[0][:80]
    except (StopIteration, OSError, ValueError):
        return "?", "?"


def _finish_failed(tmp: Path, dest: Path) -> None:
    """Keep the partial output (papermill put its error banner at the top)."""
    if tmp.exists():
        try:
            nb = nbformat.read(tmp, as_version=4)
        except Exception:  # noqa: BLE001 - a notebook torn by the failure: show the source instead
            tmp.unlink()
            return
        banner = nbformat.v4.new_markdown_cell(
            "```{error}\nThis notebook **failed** during this build; the outputs below stop at the failing "
            "cell and are not a result.\n```")
        nb.cells.insert(0, banner)
        nbformat.write(nb, dest)
        tmp.unlink()


def _strip_metadata(path: Path, results_sha256: str) -> None:
    """Drop papermill's per-cell timing noise; keep outputs. The parameters papermill injects are
    bookkeeping: their cell is folded like the notebook's own parameters cell (`hide-input`). The
    digest of the results this execution recorded goes into the notebook's metadata, which ties the
    results file to the notebook that produced it (`context.check_record`)."""
    nb = nbformat.read(path, as_version=4)
    nb.metadata["circuitbook"] = {"results_sha256": results_sha256}
    for cell in nb.cells:
        cell.metadata.pop("papermill", None)
        cell.metadata.pop("execution", None)
        tags = cell.metadata.get("tags", [])
        if "injected-parameters" in tags and "hide-input" not in tags:
            cell.metadata["tags"] = [*tags, "hide-input"]
    nbformat.write(nb, path)
