"""Chapter `assign_add`: the experiments of "Assign and Add" (Exoo, Bietti, Sous; arXiv 2605.31497).

The chapter contract's four modules (CONTRIBUTING.md, "Adding a chapter"), re-exported here so that a
notebook reads `ea.detect_phases`, `ea.main_run`, ... whatever module defines them:

    runs.py      config builders, run functions and `notebook_runs(cfg)`, the registry of every run
    evaluate.py  the evaluation callbacks and the progress measures they log (in the runs' keys)
    measure.py   phases, attention roles, residual cosines, MLP grids, QK gradients (AA-2 .. AA-12)
    records.py   phase records, sweep tables, the pace caveat
"""
from ...analysis.baselines import random_directions_block
from ...tasks.assign_add import N_VARS, PAIR_SPLITS, SEQ_LEN
from ...training import ComposedRun, ReleasedRun
from .. import public_names
from . import evaluate, measure, records, runs

__all__ = ["random_directions_block", "N_VARS", "PAIR_SPLITS", "SEQ_LEN", "ComposedRun", "ReleasedRun",
           *public_names(globals(), evaluate, measure, runs, records)]
