"""What the lenses notebooks record and tabulate: other notebooks' recorded values read back, per-member
values as the scorecard's per-seed lists, and the table of models by lenses (05)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import pandas as pd

from ... import claims, presentation


def recorded_per_seed(chapter: str, notebook: str, key: str, label: str) -> tuple[list[float], str | None]:
    """(per-seed values, why) of a value another notebook recorded under `label` (a list per seed or one
    number): its values when fresh, else NaNs and why (`claims.recorded_values` says what is missing or stale;
    a value recorded as not measured keeps its own reason)."""
    try:
        values = claims.recorded_values(chapter, notebook, label)
    except claims.NotRecorded as e:
        return [math.nan], str(e)
    if key not in values:
        return [math.nan], f"{chapter}/{notebook} recorded no {key}"
    v = values[key]
    v = [float(x) for x in v] if isinstance(v, list) else [float(v)]
    why = None
    if all(math.isnan(x) for x in v):
        why = claims.recorded_whys(chapter, notebook, label).get(key) or f"{chapter}/{notebook} measured no {key}"
    return v, why


def member_values(rows: Sequence[dict], key: str) -> list[float]:
    """One value per member (the scorecard's per-seed list)."""
    return [float(r[key]) for r in rows]


def first_why(rows: Sequence[dict]) -> str | None:
    """The first reason a member's value is missing, if every member misses it."""
    whys = [r.get("why") for r in rows]
    return whys[0] if whys and all(whys) else None


def seed_value(values: Sequence[float], member: int) -> float:
    """Member `member`'s entry of a per-seed list (one value for every member when only one was recorded;
    NaN when the list has no entry for it)."""
    if len(values) == 1:
        return float(values[0])
    return float(values[member]) if member < len(values) else math.nan


# --------------------------------------------------------------------------- the table of models by lenses (05)
MODELS = ("Assign and Add", "Markov chain", "grokking", "restricted IMIR", "one-hot leading-terms", "language models")
LENSES = ("ACE core", "Fourier key frequencies", "IMIR", "leading terms")


@dataclass(frozen=True)
class Cell:
    """One cell of the table: a value some notebook records (`chapter/notebook`, `key`), or why none applies."""

    model: str
    lens: str
    chapter: str = ""
    notebook: str = ""
    key: str = ""
    not_applicable: str = ""


def _na(model: str, lens: str, why: str) -> Cell:
    return Cell(model, lens, not_applicable=why)


# Which recorded value fills each cell. The values come from the records of the notebooks named here, read
# fresh at build time (`claims.recorded_values`); only the reasons a lens does not apply are written here.
LENS_CELLS = (
    Cell("Assign and Add", "ACE core", "lenses", "01_ace_assign_add", "ln1_core_dim_final"),
    Cell("Assign and Add", "Fourier key frequencies", "assign_add", "04_mechanisms", "aa9_n_key_frequencies"),
    Cell("Assign and Add", "IMIR", "lenses", "03_progress_measures", "ln7_spearman"),
    Cell("Assign and Add", "leading terms", "lenses", "04_leading_terms", "ln9_aa_unembed_cos"),
    Cell("Markov chain", "ACE core", "algorithmic_cores", "02_markov", "ac2_core_dim"),
    _na("Markov chain", "Fourier key frequencies", "one input token per step: there is no grid of two operands to fit"),
    _na("Markov chain", "IMIR", "no in-context structure (a chain of 4 states): the manifold's token and "
                                "position symmetries are not those of this task"),
    Cell("grokking", "ACE core", "algorithmic_cores", "03_grokking", "gk_core_dim_at_grok"),
    Cell("grokking", "Fourier key frequencies", "lenses", "02_fourier_ace", "ln4_gk_n_key_frequencies"),
    _na("grokking", "IMIR", "modular addition of two tokens has no in-context retrieval for the manifold's "
                            "circuits"),
    Cell("grokking", "leading terms", "lenses", "04_leading_terms", "ln9_gk_unembed_cos"),
    Cell("restricted IMIR", "IMIR", "inductive_manifold", "03_two_layer", "im2_captured_fraction"),
    _na("restricted IMIR", "Fourier key frequencies", "block-list tasks have no modular structure"),
    _na("restricted IMIR", "leading terms", "its embeddings are fixed and orthonormal and its value-output maps "
                                            "fixed: the weights the leading terms predict are not trained"),
    Cell("one-hot leading-terms", "leading terms", "leading_terms", "02_training", "lt1_min_cos_output"),
    _na("one-hot leading-terms", "Fourier key frequencies", "natural text has no modular structure"),
    _na("one-hot leading-terms", "IMIR", "one-hot inputs of 3,000 words and no block structure: the manifold's "
                                         "selection matrices are not defined for this corpus"),
    Cell("language models", "ACE core", "algorithmic_cores", "05_agreement", "ac9_flip_rate"),
    Cell("language models", "leading terms", "leading_terms", "05_early_lm", "lt6_embedding_cos"),
    _na("language models", "Fourier key frequencies", "no modular task"),
    _na("language models", "IMIR", "pretrained weights of an unknown training distribution: the manifold is "
                                   "defined by a task's symmetries"),
)


def lens_cells(label: str, cells: Sequence[Cell] = LENS_CELLS) -> pd.DataFrame:
    """Every (model, lens) pair with its kind and text: `measured` (the value its notebook recorded under `label`,
    formatted as the scorecard formats it with its label's unit, the key beside it), `not recorded` (that
    notebook's results are missing or stale: why), `not measured` (recorded as not measurable: why),
    `not applicable` (why the lens has nothing to read) or `not measured in this book`."""
    given = {(c.model, c.lens): c for c in cells}
    rows = []
    for model in MODELS:
        for lens in LENSES:
            cell = given.get((model, lens))
            kind, text = _cell_text(cell, label) if cell else ("not measured in this book", "")
            rows.append({"model": model, "lens": lens, "kind": kind, "text": f"{kind}: {text}" if text and
                         kind != "measured" else (text or kind)})
    return pd.DataFrame(rows)


def lens_table(cells: pd.DataFrame) -> pd.DataFrame:
    """`lens_cells` as the table: models in rows, lenses in columns, in the book's order."""
    table = cells.pivot(index="model", columns="lens", values="text")
    return table.loc[list(MODELS), list(LENSES)].rename_axis(index="model", columns=None)


def _cell_text(cell: Cell, label: str) -> tuple[str, str]:
    if cell.not_applicable:
        return "not applicable", cell.not_applicable
    where = f"{cell.chapter}/{cell.notebook}"
    try:
        values = claims.recorded_values(cell.chapter, cell.notebook, label)
    except claims.NotRecorded as e:
        return "not recorded", str(e)
    if cell.key not in values:
        return "not recorded", f"{where} has no {cell.key}"
    value = values[cell.key]
    finite = [v for v in (value if isinstance(value, list) else [value])
              if not isinstance(v, str) and not math.isnan(float(v))]
    if not finite:
        why = claims.recorded_whys(cell.chapter, cell.notebook, label).get(cell.key, "")
        return "not measured", f"{cell.key}{', ' + why if why else ''}"
    unit = presentation.chapter_labels(cell.chapter).get(cell.key, {}).get("unit", "")
    return "measured", f"{presentation.with_unit(presentation.format_value(value, unit), unit)} ({cell.key})"
