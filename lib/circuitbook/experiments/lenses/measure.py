"""The lenses chapter's measurements: other papers' tools (all from `analysis/`) pointed at the book's models.
Pure functions of models, runs and metrics; known answers in `tests/test_experiments_lenses.py`.

    ACE on Assign and Add (01)   assign_add_pool, core_trajectory, crystallization, final_cores, core_pairs
    Fourier meets ACE (02)       zero_var_tokens, grid_lens, fourier_core_trajectory, settle_steps
    IMIR progress measures (03)  progress_trajectory, metric_at, order_of_rises, alpha_vs_routing, burst_times
    Leading terms (04)           lr_segments, seta_at, decay_at, first_batches, initial_terms,
                                 leading_term_trajectory, agreement_summary
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import pandas as pd
import torch

from ...analysis import ace, fourier
from ...analysis import loss_position_terms as lpt
from ...analysis.baselines import compare_cores
from ...analysis.compare import contained_share
from ...analysis.curves import crossing_step, half_way_step, settled_from
from ...analysis.induction import induction_measures, positional_score
from ...analysis.readout import ace_final, core_dimensions, final_hook
from ...models.toy import ToyTransformer
from ...tasks.assign_add import N_VARS, AssignAddTask
from ...tasks.base import Batch, derive_seed

ACE_POOLS = ("zero_var_train", "one_var_train", "two_var_train")  # the training distribution's three kinds of query


# --------------------------------------------------------------------------- ACE on Assign and Add (01)
def assign_add_pool(task: AssignAddTask, size: int, seed: int = 0) -> Batch:
    """`size` training-pair sequences, a third of each kind (0-var, 1-var, 2-var): the inputs ACE reads.
    Every answer 0..58 occurs in a pool of a few thousand (the class-mean operator needs each one)."""
    per = -(-size // len(ACE_POOLS))
    pools = [task.eval_pool(name, per, seed) for name in ACE_POOLS]
    return Batch(torch.cat([p.tokens for p in pools])[:size], torch.cat([p.labels for p in pools])[:size])


def core_at(model: ToyTransformer, tokens: torch.Tensor, labels: torch.Tensor, n_classes: int,
            definition: ace.CoreDefinition) -> dict:
    """ACE at the last residual stream at the last position (`=`), the dimensions `definition` reads off it
    (`readout.core_dimensions`, chance 1 / n_classes) and, in the energy-rank core, the class-mean shift
    operator c -> c + 1 of the answers (`ace.class_mean_operator`): the share of its eigenvalues within
    sin(pi / n_classes) of the unit circle (NaN when some answer does not occur in `labels`)."""
    out = core_dimensions(model, tokens, labels, definition, chance=1 / n_classes)
    core, inputs = out["core"], out["inputs"]
    if len(torch.unique(labels)) == n_classes:
        op = ace.class_mean_operator(core, inputs.activations, labels, n_classes)
        out["circle_share"] = ace.unit_circle_share(op.eigenvalues, ace.unit_circle_tolerance(n_classes))
        out["class_mean_r2"] = op.r2
    else:
        out["circle_share"], out["class_mean_r2"] = float("nan"), float("nan")
    return out


def core_trajectory(run, member: int, steps: Sequence[int], tokens: torch.Tensor, labels: torch.Tensor,
                    n_classes: int, definition: ace.CoreDefinition) -> pd.DataFrame:
    """`core_at` at each checkpoint step of one member: step, rank, sufficient / necessary / core dimension,
    clean accuracy, circle share."""
    rows = []
    for step in steps:
        res = core_at(run.model(member, step), tokens, labels, n_classes, definition)
        rows.append({"step": int(step), "member": member, **{k: res[k] for k in (
            "rank", "sufficient_dim", "necessary_dim", "necessary_k", "core_dim", "clean_acc", "circle_share")}})
    return pd.DataFrame(rows)


def crystallization(traj: pd.DataFrame, start: float, event: float) -> dict:
    """AC-5's reading of one member's core trajectory around an event (Assign and Add's jump): at the first
    checkpoint at or after `event`, the core dimension over its largest value at the checkpoints from `start`
    (the addition step) up to the event, and the sufficient and bare necessary dimensions over the core
    dimension there. NaN (with `why`) when the event or the window before it has no checkpoint.

    The conventions are AC-5's: a ratio with an infinite numerator is inf (no finite core: not low-dimensional
    or not necessary), an infinite denominator over a finite numerator gives 0."""
    t = traj.sort_values("step")
    out = {"dim_ratio": math.nan, "sufficient_over_core": math.nan, "necessary_over_core": math.nan,
           "core_dim_at_event": math.nan, "max_before": math.nan, "event_step": math.nan, "why": None}
    if math.isnan(event) or math.isnan(start):
        return {**out, "why": "no event step (the jump or the addition step was not detected)"}
    after = t[t.step >= event]
    before = t[(t.step >= start) & (t.step < event)]
    if after.empty or before.empty:
        return {**out, "why": f"no checkpoint {'after the event' if after.empty else 'between the addition step and the event'}"}
    at = after.iloc[0]
    core, top = float(at["core_dim"]), float(before["core_dim"].max())

    def ratio(a, b):
        if math.isinf(a):
            return math.inf
        return 0.0 if math.isinf(b) else a / b

    return {"dim_ratio": ratio(core, top), "sufficient_over_core": ratio(float(at["sufficient_dim"]), core),
            "necessary_over_core": ratio(float(at["necessary_k"]), core), "core_dim_at_event": core,
            "max_before": top, "event_step": float(at["step"]), "why": None}


def final_cores(run, tokens: torch.Tensor, definition: ace.CoreDefinition) -> list[tuple[ace.AceCore, torch.Tensor]]:
    """(energy-rank core, final residual activations) of every member's final model on the same tokens."""
    out = []
    for k in range(run.n_members):
        model = run.model(k)
        core, inputs = ace_final(model, tokens, position=-1, definition=definition)
        out.append((core, inputs.activations))
    return out


def core_pairs(cores: Sequence[tuple[ace.AceCore, torch.Tensor]], names: Sequence[str]) -> pd.DataFrame:
    """Every pair of members: `baselines.compare_cores` (overlap and CCA, each beside its random baseline)."""
    rows = []
    for i in range(len(cores)):
        for j in range(i + 1, len(cores)):
            (ca, aa), (cb_, ab) = cores[i], cores[j]
            rows.append({"pair": f"{names[i]} vs {names[j]}", "ranks": f"{ca.rank}, {cb_.rank}",
                         **compare_cores(ca, aa, cb_, ab, seed=1000 * i + j)})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- Fourier meets ACE (02)
def zero_var_tokens(task: AssignAddTask, seed: int = 0) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """tokens(n, m) of the 0-var sums `+ n m =` (one random prefix of distractors per pair, seeded)."""
    return lambda n, m: task.make_batch(n, m, seed=seed).tokens


def modular_tokens(task) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """tokens(a, b) of a ModularAddition task's input (`a b`, or `a b =`), in the order of task.all."""
    p = task.p

    def make(a, b):
        return task.all.tokens[a * p + b]

    return make


@dataclass(frozen=True)
class GridLens:
    """What the Fourier and ACE lenses see of one model on the grid of all operand pairs (n, m)."""

    key_frequencies: list[int]  # AA-9's fit of the last layer's MLP pre-activations
    fourier: torch.Tensor | None  # [D, 2K] the answer's directions at those frequencies in the last residual
    core: ace.AceCore  # ACE's energy-rank core of the last residual
    core_in_fourier: float  # contained_share(core, fourier)
    random_share: float  # dim(fourier) / D: what a random subspace of the core's size would give


def grid_lens(model: ToyTransformer, make_tokens, modulus: int, definition: ace.CoreDefinition,
              power_fraction: float) -> GridLens:
    """The key frequencies of the last MLP's pre-activations over every pair (AA-9's `summarise_grid`), the
    answer's Fourier directions at those frequencies in the last residual (`answer_fourier_subspace`), ACE's
    core there on the same inputs, and how much of the core lies inside the Fourier directions."""
    last = model.cfg.n_layers - 1
    mlp = fourier.collect_grid_activations(model, make_tokens, f"blocks.{last}.mlp.hook_pre", modulus)
    keys = fourier.summarise_grid(mlp, power_fraction, n_random=1).key_frequencies
    resid = fourier.collect_grid_activations(model, make_tokens, final_hook(model.cfg), modulus)
    n, m = torch.meshgrid(torch.arange(modulus), torch.arange(modulus), indexing="ij")
    tokens = make_tokens(n.flatten(), m.flatten())
    core, _ = ace_final(model, tokens, position=-1, definition=definition)
    if not keys:
        return GridLens(keys, None, core, math.nan, math.nan)
    F = fourier.answer_fourier_subspace(resid, keys)
    return GridLens(keys, F, core, contained_share(core, F), F.shape[1] / core.dim)


def fourier_core_trajectory(run, member: int, steps: Sequence[int], make_tokens, modulus: int,
                            definition: ace.CoreDefinition, power_fraction: float) -> pd.DataFrame:
    """`grid_lens` at each checkpoint of one member, and the share of each checkpoint's core inside the final
    checkpoint's core (how far the core has settled): step, key frequencies, core rank, core in Fourier,
    core in final core."""
    lenses = {int(s): grid_lens(run.model(member, s), make_tokens, modulus, definition, power_fraction) for s in steps}
    final = lenses[max(lenses)]
    rows = [{"step": s, "member": member, "key_frequencies": tuple(g.key_frequencies), "rank": g.core.rank,
             "core_in_fourier": g.core_in_fourier, "random_share": g.random_share,
             "core_in_final_core": contained_share(g.core, final.core)} for s, g in sorted(lenses.items())]
    return pd.DataFrame(rows)


def settle_steps(traj: pd.DataFrame, share: float) -> dict:
    """When the two lenses settle along one member's trajectory: the key frequencies (the first checkpoint from
    which the set equals the final one) and the core (the first from which at least `share` of the core lies in
    the final core), and their gap as a fraction of the last checkpoint's step."""
    t = traj.sort_values("step")
    final = t.iloc[-1]["key_frequencies"]
    keys = settled_from(t.step, [k == final for k in t.key_frequencies])
    core = settled_from(t.step, t.core_in_final_core >= share)
    return {"keys_settle": keys, "core_settle": core, "gap": abs(keys - core) / float(t.step.max())}


def median(values) -> float:
    v = [float(x) for x in values if not (isinstance(x, float) and math.isnan(x))]
    return float(np.median(v)) if v else math.nan


# --------------------------------------------------------------------------- IMIR progress measures (03)
def progress_trajectory(run, member: int, steps: Sequence[int], task: AssignAddTask) -> pd.DataFrame:
    """IMIR's progress measures of one member at each checkpoint step (`analysis.induction`): alpha~ (layer-1
    previous-token attention of the positions), beta~ on the twelve variable tokens (layer 2's match through
    layer 1's OV), gamma~ on the number tokens (copy to the output), and the placebo `alpha2` (the same
    positional score two tokens back)."""
    match = list(range(task.VAR0, task.VAR0 + N_VARS))
    copy = list(range(task.modulus))
    rows = []
    for step in steps:
        model = run.model(member, int(step))
        rows.append({"step": int(step), "member": member, **induction_measures(model, match, copy),
                     "alpha2": positional_score(model, 2)})
    return pd.DataFrame(rows)


def metric_at(metrics: pd.DataFrame, member: int, column: str, steps: Sequence[float]) -> np.ndarray:
    """One member's logged `column`, linearly interpolated at `steps` (NaN outside its evaluations)."""
    m = metrics[metrics.member == member].dropna(subset=[column]).sort_values("step")
    x, y = m.step.to_numpy(float), m[column].to_numpy(float)
    s = np.asarray(steps, float)
    out = np.interp(s, x, y) if len(x) else np.full(len(s), np.nan)
    return np.where((s < x.min()) | (s > x.max()), np.nan, out) if len(x) else out


def order_of_rises(traj: pd.DataFrame, total: float | None = None) -> dict:
    """LN-6 on one member's trajectory: the half-way steps of gamma~, beta~ and alpha~
    (`curves.half_way_step`) and the leads (t_beta - t_gamma) / T and (t_alpha - t_beta) / T, T the last
    step (or `total`). A lead is NaN (with `why`) where one of its two measures does not rise."""
    t = traj.sort_values("step")
    T = float(total if total is not None else t.step.max())
    times = {k: half_way_step(t.step, t[k]) for k in ("gamma", "beta", "alpha")}
    flat = [k for k, v in times.items() if math.isnan(v)]
    why = f"{', '.join(k + '~' for k in flat)} does not end above its start" if flat else None
    return {"t_gamma": times["gamma"], "t_beta": times["beta"], "t_alpha": times["alpha"],
            "gamma_beta_lead": (times["beta"] - times["gamma"]) / T,
            "beta_alpha_lead": (times["alpha"] - times["beta"]) / T, "why": why}


def _spearman(a, b) -> float:
    s = pd.DataFrame({"a": a, "b": b}).dropna()
    if len(s) < 3 or s.a.nunique() < 2 or s.b.nunique() < 2:
        return math.nan
    return float(s.a.corr(s.b, method="spearman"))


def alpha_vs_routing(traj: pd.DataFrame, metrics: pd.DataFrame, member: int, column: str = "routing",
                     total: float | None = None) -> dict:
    """LN-7 on one member: Spearman's rank correlation over the checkpoints of alpha~ with the logged
    `column` (interpolated at the checkpoints, `metric_at`), and |t_half(alpha~) - t_half(column)| / T
    (alpha~'s half-way step over the checkpoints, the column's over every evaluation); the same two for
    the placebo `alpha2`. T: the last checkpoint's step (or `total`)."""
    t = traj.sort_values("step")
    T = float(total if total is not None else t.step.max())
    logged = metric_at(metrics, member, column, t.step)
    m = metrics[metrics.member == member].dropna(subset=[column]).sort_values("step")
    t_col = half_way_step(m.step, m[column])
    out = {"t_routing": t_col}
    for name, key in (("", "alpha"), ("placebo_", "alpha2")):
        out[f"{name}spearman"] = _spearman(t[key].to_numpy(float), logged)
        out[f"{name}gap"] = abs(half_way_step(t.step, t[key]) - t_col) / T
    return out


def burst_times(metrics: pd.DataFrame, members: pd.DataFrame, column: str, level: float) -> pd.DataFrame:
    """LN-8: per member, the first step at which `column` reaches `level` (`curves.crossing_step`,
    interpolated; censored at the last evaluation when never: `reached` False); per seed the speed-up
    t(1) / t(b_max), NaN (with `why`) when neither reaches the level or the seed lacks b = 1 or a larger b.
    Returns one row per seed: seed, t_b<b> and reached_b<b> for every b, speedup, bound, why."""
    rows = []
    bmax = int(members.b.max())
    for seed, group in members.groupby("seed", sort=False):
        row, t = {"seed": int(seed)}, {}
        for _, mem in group.iterrows():
            m = metrics[metrics.member == mem.member].dropna(subset=[column]).sort_values("step")
            cross = crossing_step(m.step, m[column], level)
            reached = not math.isnan(cross)
            t[int(mem.b)] = (cross if reached else float(m.step.max()), reached)
            row[f"t_b{int(mem.b)}"], row[f"reached_b{int(mem.b)}"] = t[int(mem.b)]
        row["speedup"], row["bound"], row["why"] = math.nan, "", None
        if 1 not in t or bmax <= 1:
            row["why"] = "needs b = 1 and a larger b"
        elif not (t[1][1] or t[bmax][1]):
            row["why"] = f"neither b = 1 nor b = {bmax} reached 1-var accuracy {level:g}"
        else:
            row["speedup"] = t[1][0] / t[bmax][0] if t[bmax][0] > 0 else math.inf
            row["bound"] = ("at least" if not t[1][1] else "at most" if not t[bmax][1] else "")
        rows.append(row)
    return pd.DataFrame(rows)


# ------------------------------------------------------------------- Leading terms in the first steps (notebook 04)
def lr_segments(run, member: int = 0) -> list[tuple[float, float, float]]:
    """(last step, lr, weight decay) of each constant-rate stretch of a run, in order: a composed run's first run
    up to its boundary, then its continuation (the last stretch ends at inf)."""
    parts = [run.first, run.second] if hasattr(run, "first") and hasattr(run, "second") else [run]
    out, end = [], 0
    for i, r in enumerate(parts):
        tc = r.train_config
        end = end + tc.steps if i < len(parts) - 1 else math.inf
        out.append((end, float(tc.per_member("lr")[member]), float(tc.per_member("weight_decay")[member])))
    return out


def _steps_in(segments, step: int):
    start = 0
    for end, lr, wd in segments:
        n = max(0, min(step, end) - start)
        yield n, lr, wd
        start = end


def seta_at(segments, step: int) -> float:
    """s * eta at `step`: the summed learning rate of the steps before it."""
    return float(sum(n * lr for n, lr, _ in _steps_in(segments, step)))


def decay_at(segments, step: int) -> float:
    """prod_t (1 - eta_t lambda) over the steps before `step`: AdamW's decay of the initialisation."""
    return float(np.prod([(1 - lr * wd) ** n for n, lr, wd in _steps_in(segments, step)]))


def first_batches(task, run, member: int, n_batches: int) -> Batch:
    """The training batches of a member's first `n_batches` steps, concatenated (the trainer's data seed
    derive_seed("data", seed) and batch size; a fixed dataset's first epoch is its whole training split)."""
    first = run.first if hasattr(run, "first") else run
    tc = first.train_config
    seed = derive_seed("data", tc.seeds[member])
    batches = [task.train_batch(s, tc.batch_size, seed) for s in range(n_batches)]
    return Batch(torch.cat([b.tokens for b in batches]), torch.cat([b.labels for b in batches]))


@dataclass(frozen=True)
class InitialTerms:
    """The leading terms of one member's first steps: corpus maps, the initial model's maps, the weights at 0,
    and the targets of both agreements with their permutation baselines (on the compared tokens)."""

    maps: torch.Tensor  # [T, V, K] position_label_maps of the batches the first steps drew
    G: torch.Tensor  # [T, d, K] mean_input_jacobian of the initial model
    unembed_term: torch.Tensor  # [d, K]
    ids: torch.Tensor  # the tokens compared (varying_ids)
    W_E0: torch.Tensor
    W_U0: torch.Tensor
    embed_target: torch.Tensor  # [len(ids), d]
    embed_bases: list
    unembed_bases: list


def initial_terms(model0: ToyTransformer, sample: Batch, n_classes: int, jacobian_size: int, n_perm: int,
                  seed: int = 0) -> InitialTerms:
    """`InitialTerms` of the initial model on the sequences `sample` (the maps on all of them, the Jacobian and
    the unembedding's input on `jacobian_size` of them, drawn with `seed`; n_perm baseline targets each)."""
    V = model0.cfg.d_vocab
    maps = lpt.position_label_maps(sample.tokens, sample.labels, V, n_classes)
    pick = torch.randperm(len(sample.tokens), generator=torch.Generator().manual_seed(seed))[:jacobian_size]
    x, y = sample.tokens[pick], sample.labels[pick]
    G = lpt.mean_input_jacobian(model0, x)
    term = lpt.unembedding_term(lpt.unembedding_input(model0, x), y, n_classes)
    ids = lpt.varying_ids(sample.tokens, V)
    return InitialTerms(maps, G, term, ids, model0.W_E.detach().double().clone(),
                        model0.W_U.detach().double().clone(), lpt.embedding_term(maps, G)[ids],
                        [b[ids] for b in lpt.permuted_embedding_terms(maps, G, n_perm, seed)],
                        lpt.permuted_unembedding_terms(term, n_perm, seed))


def leading_term_trajectory(run, member: int, terms: InitialTerms, steps: Sequence[int], segments,
                            z: float) -> pd.DataFrame:
    """At each checkpoint after step 0: the embedding's and the unembedding's decayed displacement against their
    leading terms (cosine, permutation baseline, z, agrees) and whether both agree."""
    rows = []
    for step in sorted(int(s) for s in steps if s > 0):
        model = run.model(member, step)
        decay = decay_at(segments, step)
        dE = lpt.decayed_displacement(model.W_E.detach(), terms.W_E0, decay)[terms.ids]
        dU = lpt.decayed_displacement(model.W_U.detach(), terms.W_U0, decay)
        e = lpt.agreement_with(dE, terms.embed_target, terms.embed_bases, z)
        u = lpt.agreement_with(dU, terms.unembed_term, terms.unembed_bases, z)
        rows.append({"step": step, "member": member, "seta": seta_at(segments, step),
                     **{f"embed_{k}": v for k, v in e.items()}, **{f"unembed_{k}": v for k, v in u.items()},
                     "agrees": bool(e["agrees"] and u["agrees"])})
    return pd.DataFrame(rows)


def agreement_summary(traj: pd.DataFrame) -> dict:
    """One member's trajectory read for LN-9 and LN-10: its first checkpoint's values, the span of agreement and
    the first checkpoint without it (s * eta; `loss_position_terms.agreement_span`)."""
    t = traj.sort_values("step")
    first = t.iloc[0]
    out = {k: float(first[k]) for k in ("seta", "embed_cosine", "embed_base_mean", "embed_z", "unembed_cosine",
                                        "unembed_base_mean", "unembed_z")}
    out["first_seta"] = out.pop("seta")
    return {**out, **lpt.agreement_span(t.seta.tolist(), t.agrees.tolist())}
