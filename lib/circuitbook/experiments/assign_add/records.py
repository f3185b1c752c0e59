"""What the chapter's notebooks record and tabulate: phase tables and records, the pace caveat, sweep
tables, and the reasons a value could not be measured."""
from __future__ import annotations

import math
from dataclasses import asdict
from typing import Sequence

import numpy as np
import pandas as pd

from ...training import Run
from ...analysis import curves
from .measure import HARD_POOLS, detect_phases, hard_final_accuracy, phase_tolerances

# The knobs that set how fast training moves: step numbers compare with the paper's only when all
# of them have the paper's values.
SCHEDULE_KNOBS = ("d_model", "d_mlp", "batch_size", "lr", "weight_decay", "train_fraction", "two_var_ratio",
                  "cooldown_steps")


RELEASED_SEED = -1  # the seed column of a released run's metrics (`training.ReleasedRun`): no seed of ours


def member_label(seed) -> str:
    """How a table header or legend names one member: "seed 42", or "the release" for a released run's one
    model (whose metrics carry seed -1: the book never drew its seed)."""
    return "the release" if int(seed) == RELEASED_SEED else f"seed {int(seed)}"


def run_settings(cfg) -> pd.DataFrame:
    """02's first table: what the page evaluates. The book's run: its training settings and the evaluation's
    sizes. A released run: what the release is (its folder, checkpoints, steps, final model and how its step
    was found) and the evaluation's sizes and pair split; the book's training settings do not describe it."""
    from ...models.loading import read_release

    evaluation = {"pool_size": cfg.pool_size, "probe_size": cfg.probe_size, "eval_seed": cfg.get("eval_seed"),
                  "pair_split": cfg.get("pair_split")}
    path = cfg.get("checkpoint_path")
    if not path:
        shown = ("d_model", "d_mlp", "steps", "batch_size", "lr", "weight_decay", "seeds", "eval_every")
        return pd.Series({**{k: cfg.get(k) for k in shown}, **evaluation}, name=cfg.profile).to_frame()
    release = read_release(path)
    steps = [s for s, f in release.files.items() if f != release.final]
    final = (f"{release.final.name}, step {release.final_step:,} ({release.final_step_source})" if release.final
             else f"the last step file, step {release.final_step:,}")
    about = {"release": release.name, "step checkpoints": f"{release.n_step_files:,}",
             "checkpoint steps": f"{steps[0]:,} to {steps[-1]:,}" if steps else "none", "final model": final}
    return pd.Series({**about, **evaluation}, name="released run").astype(str).to_frame()


def why_if_missing(values, why: str) -> str | None:
    """`why` when every value is NaN (so the scorecard says `not measured: why`), else None."""
    values = values if isinstance(values, (list, tuple, np.ndarray, pd.Series)) else [values]
    return why if all(math.isnan(float(v)) for v in values) else None


def schedule_deviations(cfg, paper: dict) -> list[str]:
    """The knobs that set the pace of training (`SCHEDULE_KNOBS`) whose value differs from the
    paper's: when any does, step numbers are not the paper's step numbers."""
    return [f"{k} {cfg.get(k)!r} (paper: {paper[k]!r})" for k in SCHEDULE_KNOBS
            if k in paper and cfg.get(k) != paper[k]]


def phase_settings(cfg) -> dict:
    """What `detect_phases` needs of a notebook's Params: the window (`phase_window`; None: 1/20 of the run)
    and the sequences behind each point of the curves (`pool_size`, `probe_size`), which set the sampling
    error within which two windows' rises cannot be told apart."""
    return {"window": cfg.get("phase_window"), "pool_size": cfg.pool_size, "probe_size": cfg.probe_size}


def phases_table(metrics: pd.DataFrame, window: float | None = None, pool_size: int | None = None,
                 probe_size: int | None = None) -> pd.DataFrame:
    """`detect_phases` of every member, one row per member (index: member), with its seed."""
    rows = []
    for member in sorted(metrics.member.unique()):
        seed = metrics.loc[metrics.member == member, "seed"].iloc[0] if "seed" in metrics else member
        phases = detect_phases(metrics, member, window, pool_size=pool_size, probe_size=probe_size)
        rows.append({"member": int(member), "seed": int(seed), **asdict(phases)})
    return pd.DataFrame(rows).set_index("member")


NO_JUMP = "no jump detected (no window after the addition phase in which the variable accuracy rises by 0.2)"


NO_REFINEMENT = "no refinement detected (no window after the jump in which the hard cases rise by 0.2)"


def phase_records(phases: pd.DataFrame, metrics: pd.DataFrame, pace: Sequence[str] = ()) -> dict:
    """What 02_training records for AA-1..AA-3: {key: (one value per seed, why or None)}.

    phases: `phases_table`; pace: `schedule_deviations` of the run. When the run does not train at
    the paper's pace, the timed keys (`aa2_jump_step`, `aa3_refine_step`) are NaN with that reason
    and their values in the run's own steps go to `*_run`. A key whose every seed is NaN says why.
    """
    window = phases.window.to_numpy(float)
    timing_why = ("step numbers are not the paper's at this pace: " + "; ".join(pace)) if pace else None

    def seeds(values, why=None, timed=False):
        values = [float(v) for v in values]
        if timed and pace:
            return [math.nan] * len(values), timing_why
        return values, (why_if_missing(values, why) if why else None)

    return {
        "aa1_zero_var_acc_at_var_half": seeds(phases.zero_at_var_half, "the variable accuracy never reached 0.5"),
        "aa1_step_gap": seeds(phases.variable_step - phases.addition_step,
                              "the 0-var or the variable accuracy never reached 0.9"),
        "aa1_addition_step": seeds(phases.addition_step),
        "aa1_variable_step": seeds(phases.variable_step),
        "aa2_jump_step": seeds(phases.jump_step, NO_JUMP, timed=True),
        "aa2_jump_step_run": seeds(phases.jump_step, NO_JUMP),
        "aa2_jump_share": seeds(phases.jump_share),
        "aa2_qk_lag_windows": seeds((phases.qk_step - phases.jump_step).abs() / window, NO_JUMP),
        "aa2_bound_lag_windows": seeds((phases.bound_step - phases.jump_step).abs() / window, NO_JUMP),
        "aa2_routing_step_run": seeds(phases.routing_step),
        "aa3_refine_rise": seeds(phases.refine_rise, NO_JUMP),
        "aa3_refine_step": seeds(phases.refine_step, NO_REFINEMENT, timed=True),
        "aa3_refine_step_run": seeds(phases.refine_step, NO_REFINEMENT),
        "aa3_hard_final_min_acc": seeds(hard_final_accuracy(metrics)),
    }


def _lag_interval(lo: float, hi: float, jump: float, window: float) -> list[float]:
    """The range of |t - jump| / window over t in [lo, hi]."""
    if any(math.isnan(v) for v in (lo, hi, jump)):
        return [math.nan, math.nan]
    near = 0.0 if lo <= jump <= hi else min(abs(lo - jump), abs(hi - jump))
    return [near / window, max(abs(lo - jump), abs(hi - jump)) / window]


def phase_intervals(phases: pd.DataFrame, metrics: pd.DataFrame, pool_size: int | None,
                    probe_size: int | None) -> dict:
    """The sampling intervals of the values `phase_records` records whose draw of the pools or probes could move
    them across a threshold, one [lo, hi] per seed (for `cb.record(..., interval=...)`):
    aa2_bound_lag_windows (the bound value's half-way step between the crossings of its stage's middle minus
    and plus its sampling error, `analysis.curves.stage_half_way`), aa2_jump_share (the jump's rise plus and
    minus the variable accuracy's sampling error), aa3_hard_final_min_acc (the Wilson interval of each hard
    pool's final accuracy at `pool_size` sequences, the lowest of the lower and of the upper ends).
    Empty without pool_size / probe_size."""
    if not pool_size or not probe_size:
        return {}
    tol = phase_tolerances(pool_size, probe_size)
    out = {"aa2_bound_lag_windows": [_lag_interval(r.bound_lo, r.bound_hi, r.jump_step, r.window)
                                     for r in phases.itertuples()]}
    shares = []
    for r in phases.itertuples():
        after = r.jump_rise / r.jump_share if r.jump_share and not math.isnan(r.jump_share) else math.nan
        shares.append([max(0.0, (r.jump_rise - tol["variable"]) / after), (r.jump_rise + tol["variable"]) / after]
                      if after > 0 else [math.nan, math.nan])
    out["aa2_jump_share"] = shares
    last = metrics[metrics.step == metrics.step.max()].set_index("member").sort_index()
    ends = [[curves.binomial_interval(float(row[f"acc_{p}"]), pool_size) for p in HARD_POOLS]
            for _, row in last.loc[phases.index].iterrows()]
    out["aa3_hard_final_min_acc"] = [[min(lo for lo, _ in e), min(hi for _, hi in e)] for e in ends]
    return out


def pace_phrase(pace: Sequence[str]) -> str:
    """The sentence the text quotes about whether step numbers compare with the paper's."""
    if not pace:
        return "This run trains at the paper's pace, so its step numbers are compared with the paper's."
    return ("This run does not train at the paper's pace (" + "; ".join(pace) + "), so its step numbers are not "
            "the paper's: the scorecard records the timing parts of AA-2 and AA-3 as not measured and judges the rest.")


def sweep_table(run: Run, members: pd.DataFrame, step: int | None = None) -> pd.DataFrame:
    """Members joined with their metrics at `step` (default: the last evaluation)."""
    m = run.metrics()
    step = m.step.max() if step is None else step
    return members.merge(m[m.step == step].drop(columns=["seed"]), on="member")
