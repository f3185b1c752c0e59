"""The chapter contract: where each chapter's runs are defined, for its notebooks, `--plan` and other chapters.

Every chapter `<slug>` (and the book-level notebooks, chapter `book`) has one library package,
`circuitbook.experiments.<slug>`, of one shape (CONTRIBUTING.md, "Adding a chapter"):

    runs.py      config builders and run functions (each takes the notebook's `cfg`), and
                 `notebook_runs(cfg) -> {role: run}`: every run the notebook `cfg.notebook` trains or reads
    evaluate.py  its evaluation callbacks (`training.Evaluator` subclasses)
    measure.py   its measurements: pure functions of models, runs and metrics, with known-answer tests
    records.py   what its notebooks record and tabulate

A notebook's training cell calls `notebook_runs(cfg)`; `circuitbook build --plan` calls the same function
inside `training.planning()` (so the plan enumerates the very runs, with the very keys, the notebooks
train); another chapter's notebook reads them with `chapter_runs(...)`, which resolves that chapter's
parameters and calls its registry - it never imports the other chapter's package, and its `needs:`
names the notebook (`assign_add/02_training`), so the build orders and caches it after that one.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from . import params


def package(chapter: str) -> ModuleType:
    """The chapter's library package, `circuitbook.experiments.<chapter>`."""
    params.chapter_dir(chapter)  # an unknown chapter: ParameterError naming the chapters
    return importlib.import_module(f"circuitbook.experiments.{chapter}")


def notebook_runs(cfg) -> dict:
    """Every run the notebook of `cfg` (its resolved Params) trains or reads, by role: its chapter's registry."""
    registry = getattr(package(cfg.chapter), "notebook_runs", None)
    if registry is None:
        raise TypeError(f"circuitbook.experiments.{cfg.chapter} has no notebook_runs(cfg): every chapter's package "
                        "defines its runs there (CONTRIBUTING.md, 'Adding a chapter')")
    return registry(cfg)


def chapter_params(chapter: str, notebook: str, profile: str, **overrides):
    """Another chapter's notebook parameters at `profile` (with `overrides`), resolved and validated as that
    notebook resolves them: what a reader needs to rebuild the task its runs were trained on."""
    return params.resolve(chapter, notebook, profile, overrides)


def chapter_runs(chapter: str, notebook: str, profile: str, **overrides) -> dict:
    """Another chapter's runs, as its notebook `chapter/notebook` trains them at `profile` (with `overrides`):
    that notebook's parameters resolved and its chapter's registry called (a cached run is loaded, a missing
    one trained). The reading notebook lists `chapter/notebook` under `needs:`."""
    return notebook_runs(chapter_params(chapter, notebook, profile, **overrides))
