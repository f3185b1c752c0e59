"""What the chapter's notebooks record and tabulate: claim-value dicts, tables and short summaries.

    Markov chains (02)   markov_claim_values, operator_diagnostic, eigen_label, seed_summary, compare_setups
    grokking (03)        grokking_summary, final_frequencies, column_values
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd

from ...analysis.ace import dim_value
from ...tasks.markov import MarkovChain
from .measure import MarkovMember, _num, eigen_frequencies, matched_eig_errors, state_conditional_operator


# --------------------------------------------------------------------------- Markov chains
def eigen_label(value: complex) -> str:
    """'0.75+0.25i' or '0.50': a short label of an eigenvalue."""
    value = complex(value)
    return f"{value.real:.2f}{value.imag:+.2f}i" if abs(value.imag) > 1e-9 else f"{value.real:.2f}"


def operator_diagnostic(members: Sequence[MarkovMember], chain: MarkovChain) -> pd.DataFrame:
    """Per member, the relative error of each non-unit eigenvalue of P in the plain operator fit and in
    the state-mean fit (`state_conditional_operator`), and the share of the core's variance that the
    current state does not explain."""
    ref = chain.eigenvalues()[1:]
    rows = []
    for m in members:
        diag, frac = state_conditional_operator(m.op_coords, m.states, chain.n_states)
        for name, op in (("plain fit", m.operator), ("state-mean fit", diag)):
            ok = len(op.eigenvalues) >= len(ref)
            errors = matched_eig_errors(op.eigenvalues, ref) if ok else np.full(len(ref), np.nan)
            rows.append({"seed": m.seed, "fit": name, "not explained by the current state": frac,
                         **{f"error at {eigen_label(e)}": float(err) for e, err in zip(ref.numpy(), errors)}})
    return pd.DataFrame(rows)


def markov_claim_values(chain: MarkovChain, members: Sequence[MarkovMember], pairs: pd.DataFrame) -> dict:
    """The AC-1..AC-4 measurements of one setup: per-seed lists (one value per member) or scalars
    over the pairs of members (`markov_pairs`). Dimensions use the definition the members were analysed with."""
    ceiling = chain.ceiling_accuracy()
    pair_means = {k: float(pairs[k].mean()) for k in
                  ("overlap", "random_overlap", "cca_top", "cca_top3_min", "cca_top3_mean", "cca_mean",
                   "cca_mean_leading", "random_cca_top", "random_cca_top3_min", "random_cca_mean")}
    pair_means["overlap_mean"] = pair_means.pop("overlap")
    return {
        "acc_over_ceiling": [m.accuracy / ceiling for m in members],
        "max_weight_cosine": float(pairs["weight_cosine"].abs().max()),
        "init_weight_cosine": float(pairs["init_weight_cosine"].abs().max()),
        "core_dim": [float(m.core.rank) for m in members],
        "sufficient_dim": [dim_value(m.validation.sufficient_dim) for m in members],
        "necessary_dim": [dim_value(m.validation.necessary_dim) for m in members],
        "keep_at_rank": [m.validation.keep[m.core.rank - 1] / m.validation.clean for m in members],
        "remove_at_rank": [m.validation.remove[m.core.rank - 1] for m in members],
        "fourth_share": [m.direction_share(chain.n_states) for m in members],
        "common_mode_share": [m.common_mode_share for m in members],
        "centred_rank": [float(m.centred_rank) for m in members],
        **pair_means,
        "slow_pair_error": [m.slow_error for m in members],
        "fast_mode_error": [m.fast_error for m in members],
    }


def seed_summary(value) -> str:
    """'median (min to max)' of a per-seed list, or the scalar itself, as short text."""
    if isinstance(value, (list, tuple, np.ndarray)):
        v = np.asarray(value, dtype=float)
        finite = v[~np.isnan(v)]
        if finite.size == 0:
            return "nan"
        text = f"{np.median(finite):.4g} ({finite.min():.4g} to {finite.max():.4g})"
        return text + (f", {int(np.isnan(v).sum())} not measured" if np.isnan(v).any() else "")
    return f"{float(value):.4g}"


def compare_setups(values: dict[str, dict], keys: dict[str, str]) -> pd.DataFrame:
    """One row per measurement, one column per setup: `seed_summary` of each setup's value.

    values: setup -> `markov_claim_values` dict; keys: measurement name -> the key it is recorded under.
    """
    rows = [{"measurement": name, "recorded as": key, **{setup: seed_summary(v[name]) for setup, v in values.items()}}
            for name, key in keys.items()]
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- grokking
def grokking_summary(traj: pd.DataFrame, times: pd.DataFrame, tau_grok: float) -> pd.DataFrame:
    """Per member, the core before, at and after grokking (AC-5, AC-6).

    traj: `core_trajectory` rows of one run (all members); times: `grokking_times` of that run; tau_grok:
    the run's grokking point (`joint_crossing`, when every member has grokked). "before" is every trajectory
    checkpoint in [the member's tau_mem, tau_grok) (every one before tau_grok if none), "at grokking" the
    first checkpoint at or after tau_grok, "final" the last one. Without a grokking point every row holds
    NaNs. The core dimension is the paper's, max(energy rank, necessary dimension).
    """
    rows = []
    for _, tm_row in times.iterrows():
        m, tm = int(tm_row["member"]), tm_row["tau_mem"]
        t = traj[traj.member == m].sort_values("step")
        row = {"member": m, "seed": int(tm_row["seed"]), "tau_mem": tm, "tau_grok": tm_row["tau_grok"]}
        if math.isnan(tau_grok) or t.empty or not (t.step >= tau_grok).any():
            rows.append(row)
            continue
        pre = t[(t.step >= (0 if math.isnan(tm) else tm)) & (t.step < tau_grok)]
        if pre.empty:
            pre = t[t.step < tau_grok]
        post, final = t[t.step >= tau_grok].iloc[0], t.iloc[-1]
        nan = float("nan")
        row.update({"grok checkpoint": int(post.step),
                    "core dim before (max)": float(pre["core_dim"].max()) if len(pre) else nan,
                    "core dim at grokking": float(post["core_dim"]),
                    "rank before (max)": float(pre["rank"].max()) if len(pre) else nan,
                    "rank at grokking": float(post["rank"]),
                    "keep ratio at grokking": float(post["keep_ratio_at_rank"]),
                    "remove acc at grokking": float(post["remove_acc_at_rank"]),
                    "circle share before (median)": float(pre["unit_circle_share"].median()) if len(pre) else nan,
                    "circle share at grokking": float(post["unit_circle_share"]),
                    "circle share final": float(final["unit_circle_share"]),
                    "deviation before (median)": float(pre["unit_circle_deviation"].median()) if len(pre) else nan,
                    "deviation at grokking": float(post["unit_circle_deviation"]),
                    "deviation final": float(final["unit_circle_deviation"]),
                    "necessary k at grokking": _num(post["necessary_k"]),
                    "necessary at grokking": _num(post["necessary_dim"]), "necessary final": _num(final["necessary_dim"]),
                    "sufficient at grokking": _num(post["sufficient_dim"]),
                    "sufficient final": _num(final["sufficient_dim"]), "rank final": float(final["rank"])})
        if "alt_rank" in post:
            row.update({"alt rank at grokking": _num(post["alt_rank"]),
                        "alt sufficient at grokking": _num(post["alt_sufficient_dim"]),
                        "alt necessary at grokking": _num(post["alt_necessary_dim"])})
        rows.append(row)
    return pd.DataFrame(rows)


def column_values(frame: pd.DataFrame, column: str, **where) -> list[float]:
    """frame[column] as a list of floats (one per row, e.g. per seed), on the rows where every
    `where` column equals its value; non-numbers become nan, and a missing column gives one nan per row."""
    rows = frame
    for key, value in where.items():
        rows = rows[rows[key] == value]
    if column not in rows:
        return [float("nan")] * len(rows)
    return [float(v) for v in pd.to_numeric(rows[column], errors="coerce")]


def final_frequencies(traj: pd.DataFrame, p: int) -> pd.DataFrame:
    """Per member, at its last trajectory checkpoint: the eigenvalue angles in units of 2 pi / p and
    their largest distance to an integer."""
    rows = []
    for _, r in traj.sort_values("step").groupby("member").tail(1).iterrows():
        k = eigen_frequencies(r["eigenvalues"], p)
        rows.append({"member": int(r["member"]), "step": int(r["step"]), "angle x p / 2 pi": np.round(k, 2).tolist(),
                     "frequencies": sorted({int(v) for v in np.round(k)}),
                     "largest distance to an integer": float(np.abs(k - np.round(k)).max())})
    return pd.DataFrame(rows)
