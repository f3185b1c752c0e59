"""The chapter's measurements: pure functions of models, runs and metrics (known answers in
`tests/test_experiments_algorithmic_cores.py`). ACE at the readout and the core's dimensions are `analysis.readout`
(`core_dimensions`), the operator statistics `analysis.ace` (`class_mean_operator`, `unit_circle_*`, `dim_value`),
the random baselines `analysis.baselines`, `pick_steps` `analysis.curves`.

    definitions     with_threshold
    planted system  PlantedSystem, planted_system, PlantedModel (notebook 01)
    Markov chains   MarkovMember, markov_model_analysis, markov_member_analysis, readout_common_mode,
                    matched_eig_errors, eig_relative_error, slow_modes, state_conditional_operator,
                    weight_matrices, markov_pairs (notebook 02)
    grokking        grokking_times, joint_crossing, auto_fork_step, modular_core_at, core_trajectory,
                    shift_operator, eigen_frequencies,
                    dimension_growth (notebook 03)
    delay law       per_seed_exponents, seed_mean_delays, seed_mean_exponent, fit_power_law_or_none (04)
    agreement       agreement_model_analysis, layer_cores, flip_effect, margins, greedy_generate,
                    first_verb_number, spearman_alignment (notebook 05)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
from transformer_lens import HookedRootModule
from transformer_lens.hook_points import HookPoint

from ...analysis import ace
from ...analysis.ace import class_mean_operator, unit_circle_deviation, unit_circle_share, unit_circle_tolerance
from ...analysis.baselines import cca_summary, random_projection_cca, random_subspace_overlap
from ...analysis.compare import cca, projector_overlap, weight_cosine
from ...analysis.curves import crossing_step, fit_power_law_or_none
from ...analysis.readout import ace_final, core_dimensions, final_residual, validate_readout, validation_ks
from ...models.toy import ToyTransformer
from ...tasks.base import Batch
from ...tasks.markov import MarkovChain
from ...tasks.modular import ModularAddition
from ...training import Run


def with_threshold(definition: ace.CoreDefinition, energy_threshold: float | None) -> ace.CoreDefinition:
    """`definition` with another energy threshold (None keeps its own)."""
    return definition if energy_threshold is None else replace(definition, energy_threshold=float(energy_threshold))


# --------------------------------------------------------------------------- planted system
@dataclass
class PlantedSystem:
    """A known answer for ACE.

    Latent z_t in R^r follows z_{t+1} = A z_t + noise (eigenvalues of A known). Activations
    h = offset + U z + V n + W c: U [D, r] the true core, V [D, n_nuisance] large-variance nuisance
    that the outputs ignore, W [D, n_silent] directions the outputs read strongly but along which
    the activations never vary (c constant). logits = h R^T + b with R reading U and W only.
    Labels are the clean argmax, so clean accuracy is 1. With `decorrelated` the nuisance was made
    exactly uncorrelated with z in-sample; otherwise it keeps its chance correlation.
    """

    H: torch.Tensor  # [S * T, D] activations, sequence-major
    Z: torch.Tensor  # [S, T, r] latent states
    U: torch.Tensor  # [D, r] the true core (orthonormal)
    V: torch.Tensor  # [D, n_nuisance]
    W: torch.Tensor  # [D, n_silent]
    A: torch.Tensor  # [r, r]
    readout: torch.Tensor  # [n_classes, D]
    bias: torch.Tensor  # [n_classes]
    labels: torch.Tensor  # [S * T]
    decorrelated: bool = True

    @property
    def eigenvalues(self) -> torch.Tensor:
        eig = torch.linalg.eigvals(self.A)
        return eig[torch.argsort(eig.abs(), descending=True, stable=True)]

    @property
    def jacobians(self) -> torch.Tensor:
        """d logits / d h for every sample: the readout, [N, n_classes, D]."""
        return self.readout.expand(self.H.shape[0], *self.readout.shape)

    def predicted_core(self) -> torch.Tensor:
        """The exact full-rank ACE core, [D, r] orthonormal: span(Cov U).

        Why: with Cov = Lc Lc^T and Obs = Lo Lo^T, Lc U_s S = Cov Lo V_s, so ACE's directions span
        Cov Lo. The readout's rows lie in span(U, W) and Cov W = 0, so span(Cov Lo) = span(Cov U).
        Cov U = U Cov(z) + V Cov(n, z): a nuisance direction that correlates with the latents (by
        chance, in a finite sample) tilts the core toward it, in proportion to its variance.
        """
        Hc = self.H - self.H.mean(0)
        cov = Hc.T @ Hc / (self.H.shape[0] - 1)
        return torch.linalg.qr(cov @ self.U).Q


def planted_system(D: int = 24, n_sequences: int = 200, length: int = 25, rho: float = 0.95,
                   theta: float = math.pi / 6, third: float = 0.6, noise: float = 0.3,
                   nuisance_scale: float = 4.0, n_nuisance: int = 6, n_silent: int = 3, n_classes: int = 4,
                   seed: int = 0, decorrelate: bool = True) -> PlantedSystem:
    """A planted 3-dimensional core with operator eigenvalues rho e^{+-i theta} and `third`.

    decorrelate: remove the nuisance's in-sample correlation with the latents (then ACE's core is
    exactly span(U)); False keeps the chance correlation of a finite sample, as in real data.
    """
    if D < 3 + n_nuisance + n_silent:
        raise ValueError(f"D={D} must be >= 3 + n_nuisance + n_silent = {3 + n_nuisance + n_silent}")
    gen = torch.Generator().manual_seed(seed)
    dt = torch.float64
    basis = torch.linalg.qr(torch.randn(D, D, generator=gen, dtype=dt)).Q
    U, V, W = basis[:, :3], basis[:, 3:3 + n_nuisance], basis[:, 3 + n_nuisance:3 + n_nuisance + n_silent]
    c, s = math.cos(theta), math.sin(theta)
    A = torch.tensor([[rho * c, -rho * s, 0.0], [rho * s, rho * c, 0.0], [0.0, 0.0, third]], dtype=dt)
    # a random similarity transform so that A is not block-diagonal in the planted basis
    M = torch.randn(3, 3, generator=gen, dtype=dt) + 2 * torch.eye(3, dtype=dt)
    A = M @ A @ torch.linalg.inv(M)
    Z = torch.zeros(n_sequences, length + 50, 3, dtype=dt)
    Z[:, 0] = torch.randn(n_sequences, 3, generator=gen, dtype=dt)
    for t in range(1, Z.shape[1]):
        Z[:, t] = Z[:, t - 1] @ A.T + noise * torch.randn(n_sequences, 3, generator=gen, dtype=dt)
    Z = Z[:, 50:]  # burn-in: start near the stationary distribution
    scale = Z.reshape(-1, 3).std(0)
    Z = Z / scale  # unit scale per latent axis: z' = S^-1 z follows S^-1 A S, same eigenvalues
    A = torch.diag(1 / scale) @ A @ torch.diag(scale)
    n = n_sequences * length
    z = Z.reshape(n, 3)
    nuisance = nuisance_scale * torch.randn(n, n_nuisance, generator=gen, dtype=dt)
    if decorrelate:
        design = torch.cat([torch.ones(n, 1, dtype=dt), z], 1)
        nuisance -= design @ torch.linalg.lstsq(design, nuisance).solution  # in-sample: uncorrelated with z, mean 0
    offset = torch.randn(D, generator=gen, dtype=dt)
    H = offset + z @ U.T + nuisance @ V.T
    readout = torch.randn(n_classes, 3, generator=gen, dtype=dt) @ U.T \
        + 5.0 * torch.randn(n_classes, n_silent, generator=gen, dtype=dt) @ W.T
    bias = -(readout @ offset)
    labels = (H @ readout.T + bias).argmax(-1)
    return PlantedSystem(H=H, Z=Z, U=U, V=V, W=W, A=A, readout=readout, bias=bias, labels=labels,
                         decorrelated=decorrelate)


class PlantedModel(HookedRootModule):
    """tokens [B, 1] = sample indices -> activation H[index] (hook `hook_h`) -> linear readout.

    Lets `ace.collect_ace_inputs` and `ace.validate_core` run on the planted system unchanged.
    """

    def __init__(self, system: PlantedSystem):
        super().__init__()
        self.register_buffer("table", system.H.float())
        self.readout = nn.Linear(system.H.shape[1], system.readout.shape[0])
        with torch.no_grad():
            self.readout.weight.copy_(system.readout.float())
            self.readout.bias.copy_(system.bias.float())
        self.hook_h = HookPoint()
        self.setup()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.readout(self.hook_h(self.table[tokens]))


# --------------------------------------------------------------------------- Markov chains
def weight_matrices(model: ToyTransformer) -> dict[str, torch.Tensor]:
    """The weight matrices W_* (LayerNorm gains start at 1 and biases at 0 in every run, so they are
    left out of the weight-cosine comparison: they would look 'similar' by initialisation alone)."""
    return {n: p for n, p in model.named_parameters() if n.rsplit(".", 1)[-1].startswith("W_")}


@dataclass
class MarkovMember:
    member: int
    seed: int
    accuracy: float
    core: ace.AceCore
    validation: ace.CoreValidation
    coords: torch.Tensor  # [S, T, r] core coordinates of the extraction sequences
    activations: torch.Tensor  # [S * T, D] the extraction activations (sequence-major)
    operator: ace.CoreOperator
    eig_errors: np.ndarray  # relative error of each non-unit eigenvalue of P (order of chain.eigenvalues()[1:])
    slow_error: float  # largest error over the slowest non-unit eigenvalues (the 0.75 +- 0.25i pair)
    fast_error: float  # largest error over the others (0.5); nan if there are none
    op_coords: torch.Tensor  # [S, T, n_states - 1] the coordinates the operator was fitted on
    states: torch.Tensor  # [S, T] the current state at each of those positions
    common_mode_share: float = float("nan")  # share of ACE's energy that shifts every logit alike (0: centred)
    centred_rank: int = 0  # energy rank at the same threshold with that mode removed (centred logits' Jacobian)

    def direction_share(self, k: int) -> float:
        """The share of sigma^2 carried by ACE direction k (1-based); nan if there are fewer directions."""
        power = self.core.sigma.pow(2)
        return float(power[k - 1] / power.sum()) if k <= power.numel() else float("nan")


def matched_eig_errors(estimated, reference) -> np.ndarray:
    """|est - ref| / |ref| for each reference eigenvalue, after matching the two sets of (complex)
    eigenvalues optimally (Hungarian assignment on the relative errors; extra estimates are unused)."""
    from scipy.optimize import linear_sum_assignment

    est = np.asarray(torch.as_tensor(estimated).to(torch.complex128))
    ref = np.asarray(torch.as_tensor(reference).to(torch.complex128))
    if est.size < ref.size or ref.size == 0:
        raise ValueError(f"need at least as many estimated ({est.size}) as reference ({ref.size}) eigenvalues")
    cost = np.abs(est[:, None] - ref[None, :]) / np.abs(ref)[None, :]
    rows, cols = linear_sum_assignment(cost)
    out = np.empty(ref.size)
    out[cols] = cost[rows, cols]
    return out


def eig_relative_error(estimated: torch.Tensor, reference: torch.Tensor) -> float:
    """max_i |est_i - ref_i| / |ref_i| after matching the two sets of eigenvalues optimally."""
    return float(matched_eig_errors(estimated, reference).max())


def slow_modes(reference: torch.Tensor) -> np.ndarray:
    """A mask of the slowest reference eigenvalues: those of the largest modulus (to 1e-9)."""
    mod = np.abs(np.asarray(torch.as_tensor(reference).to(torch.complex128)))
    return np.abs(mod - mod.max()) < 1e-9


def markov_model_analysis(model: ToyTransformer, chain: MarkovChain, tokens: torch.Tensor, labels: torch.Tensor,
                          n_sequences: int, definition: ace.CoreDefinition, member: int = 0,
                          seed: int = 0) -> MarkovMember:
    """ACE on one Markov model at its last residual stream, every position a sample.

    The core is extracted on the first n_sequences of `tokens` and validated (keep / remove / flip,
    every k that `validation_ks` allows) on the next n_sequences, so the causal test uses inputs the
    extraction never saw. The operator is fitted on the extraction sequences' core coordinates,
    position t -> t + 1, with an intercept, on the first (n_states - 1) core directions: the
    dynamics of a chain live in the n_states - 1 dimensions orthogonal to the stationary state.
    """
    n = min(n_sequences, len(tokens) // 2)
    if n < 2:
        raise ValueError(f"need at least 4 sequences (2 to extract, 2 to validate); got {len(tokens)}")
    fit_tokens, val_tokens, val_labels = tokens[:n], tokens[n:2 * n], labels[n:2 * n]
    core, inputs = ace_final(model, fit_tokens, position="all", definition=definition)
    val_resid = final_residual(model, val_tokens, position="all")
    n_modes = core.sigma.numel()
    ks = validation_ks(model, core, n_modes)
    full = ace.extract_core(inputs.activations, inputs.jacobians, rank=max(ks))
    validation = validate_readout(model, val_resid, val_labels, full, chance=1 / chain.n_states, ks=ks,
                                  definition=definition, energy_rank=core.rank)
    m = chain.n_states - 1
    op_core = full.truncate(min(m, full.rank))
    coords = op_core.coordinates(inputs.activations).reshape(n, -1, op_core.rank)
    operator = ace.fit_core_operator(coords, intercept=True)
    reference = chain.eigenvalues()[1:]  # drop the eigenvalue 1 (the stationary direction)
    if op_core.rank >= len(reference):
        errors = matched_eig_errors(operator.eigenvalues, reference)
    else:
        errors = np.full(len(reference), float("nan"))
    slow = slow_modes(reference)
    with torch.no_grad():
        acc = (model(val_tokens).argmax(-1) == val_labels).float().mean().item()
    common, centred_rank = readout_common_mode(inputs, definition)
    return MarkovMember(member=member, seed=seed, accuracy=acc, core=core, validation=validation,
                        coords=core.coordinates(inputs.activations).reshape(n, -1, core.rank),
                        activations=inputs.activations, operator=operator, eig_errors=errors,
                        slow_error=float(errors[slow].max()),
                        fast_error=float(errors[~slow].max()) if (~slow).any() else float("nan"),
                        op_coords=coords, states=fit_tokens, common_mode_share=common, centred_rank=centred_rank)


def readout_common_mode(inputs: ace.AceInputs, definition: ace.CoreDefinition) -> tuple[float, int]:
    """(share of ACE's energy along the logits' common mode, energy rank with that mode removed).

    The common mode shifts every logit alike; softmax ignores it, so training never moves it and its energy
    is whatever the initial readout gave it. With raw-logit Jacobians it can take a core direction of its own;
    removing it (the Jacobian of the centred logits, (I - 11^T / n) J) gives the rank at the same threshold
    without it. Definitions on centred logits have no common mode: (0, their own rank).
    """
    J = inputs.jacobians
    centred = J - J.mean(1, keepdim=True)
    rank = ace.extract_core(inputs.activations, centred, energy_threshold=definition.energy_threshold).rank
    if definition.outputs == "centred":
        return 0.0, rank
    return ace.output_mode_share(inputs.activations, J, torch.ones(J.shape[1])), rank


def markov_member_analysis(run, member: int, chain: MarkovChain, test: Batch, definition: ace.CoreDefinition,
                           n_sequences: int = 500) -> MarkovMember:
    """`markov_model_analysis` of one trained member of `run` on the held-out test sequences `test`."""
    return markov_model_analysis(run.model(member), chain, test.tokens, test.labels, n_sequences, definition,
                                 member=member, seed=run.train_config.seeds[member])


def state_conditional_operator(coords: torch.Tensor, states: torch.Tensor, n_states: int
                               ) -> tuple[ace.CoreOperator, float]:
    """A diagnostic of the operator fit: replace each core coordinate by the mean coordinate of its
    current state, then fit the operator again.

    coords [S, T, r], states [S, T]. Returns (the operator of the state means, the fraction of the
    core coordinates' variance that the current state does not explain). If the core encoded only
    the current state the two fits would agree and the fraction would be 0; the remainder (what the
    residual stream carries about earlier states, through attention) is what biases the plain fit.
    """
    z = torch.as_tensor(coords, dtype=torch.float64)
    x = torch.as_tensor(states).long()
    means = torch.stack([z[x == s].mean(0) if (x == s).any() else torch.zeros(z.shape[-1], dtype=z.dtype)
                         for s in range(n_states)])
    zs = means[x]
    centred = z - z.reshape(-1, z.shape[-1]).mean(0)
    frac = float((z - zs).pow(2).sum() / centred.pow(2).sum())
    return ace.fit_core_operator(zs, intercept=True), frac


def markov_pairs(run, members: Sequence[MarkovMember], chain: MarkovChain) -> pd.DataFrame:
    """Every pair of runs: projector overlap of the cores and CCA of the core coordinates on the same
    inputs (`cca_summary`: the top correlation, the smallest and the mean of the top 3, the mean over every
    direction), each beside its random-subspace baseline (random subspaces of the cores' own ranks in the
    same width), and the cosine of the weight matrices after training and at initialisation (the random-init
    baseline). cca_mean_leading: the mean CCA of the first n_states - 1 core directions only."""
    rows = []
    lead = chain.n_states - 1
    for i in range(len(members)):
        for j in range(i + 1, len(members)):
            a, b = members[i], members[j]
            ra, rb = a.core.rank, b.core.rank
            res = cca_summary(cca(a.coords.reshape(-1, ra), b.coords.reshape(-1, rb)))
            leading = cca(a.coords.reshape(-1, ra)[:, :lead], b.coords.reshape(-1, rb)[:, :lead])
            rand = random_projection_cca(a.activations, b.activations, ra, rb, seed=1000 * i + j)
            rows.append({"pair": f"{a.seed} vs {b.seed}", "ranks": f"{ra}, {rb}", "overlap": projector_overlap(a.core, b.core),
                         "random_overlap": random_subspace_overlap(a.core.dim, ra, rb, seed=1000 * i + j),
                         **res, "cca_mean_leading": leading.mean, **{f"random_{k}": v for k, v in rand.items()},
                         "weight_cosine": weight_cosine(weight_matrices(run.model(a.member)),
                                                        weight_matrices(run.model(b.member))).overall,
                         "init_weight_cosine": weight_cosine(weight_matrices(run.model(a.member, step=0)),
                                                             weight_matrices(run.model(b.member, step=0))).overall})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- grokking
def grokking_times(metrics: pd.DataFrame, threshold: float = 0.99, train: str = "acc_train",
                   test: str = "acc_test") -> pd.DataFrame:
    """Per member: tau_mem (first step with train accuracy >= threshold), tau_grok (first step with
    test accuracy >= threshold) and delay = tau_grok - tau_mem (nan where a time was never reached)."""
    rows = []
    for member, g in metrics.groupby("member", sort=True):
        tm = crossing_step(g["step"], g[train], threshold, interpolate=False)
        tg = crossing_step(g["step"], g[test], threshold, interpolate=False)
        rows.append({"member": int(member), "seed": int(g["seed"].iloc[0]), "tau_mem": tm, "tau_grok": tg,
                     "delay": tg - tm})
    return pd.DataFrame(rows)


def auto_fork_step(run: Run, member_times: pd.DataFrame) -> int:
    """A checkpoint between memorisation and grokking for every member: the last checkpoint at or
    before the midpoint of (latest tau_mem, earliest tau_grok); falls back to the last checkpoint
    before the earliest tau_grok, then to the first checkpoint after step 0."""
    ckpts = [s for s in run.checkpoint_steps() if 0 < s < run.train_config.steps]
    tm, tg = member_times["tau_mem"].max(), member_times["tau_grok"].min()
    if not math.isnan(tg):
        target = (tm + tg) / 2 if not math.isnan(tm) and tm < tg else tg - 1
        before = [s for s in ckpts if s <= target]
        if before:
            return before[-1]
        before = [s for s in ckpts if s < tg]
        if before:
            return before[-1]
    return ckpts[0]


def joint_crossing(metrics: pd.DataFrame, column: str = "acc_test", threshold: float = 0.99) -> float:
    """The first evaluated step at which *every* member's `column` is >= threshold (nan if none): the
    paper's grokking point, the first checkpoint where all models reach 0.99 test accuracy."""
    wide = metrics.pivot_table(index="step", columns="member", values=column).sort_index()
    hit = wide.index[(wide >= threshold).all(axis=1).to_numpy()]
    return float(hit[0]) if len(hit) else float("nan")


def shift_sequences(coords: torch.Tensor, p: int) -> torch.Tensor:
    """Core coordinates of all p^2 inputs (ordered a-major, as ModularAddition.all) -> [p, p + 1, r]:
    for each a, the cycle b = 0, 1, ..., p - 1, 0 (the step b -> b + 1 mod p)."""
    grid = coords.reshape(p, p, -1)
    return torch.cat([grid, grid[:, :1]], 1)


def shift_operator(core: ace.AceCore, activations: torch.Tensor, p: int) -> ace.CoreOperator:
    """The linear operator of the shift b -> b + 1 in core coordinates (fitted over every a)."""
    return ace.fit_core_operator(shift_sequences(core.coordinates(activations), p), intercept=True)


def modular_core_at(model: ToyTransformer, task: ModularAddition, definition: ace.CoreDefinition = ace.PAPER,
                    alternative: ace.CoreDefinition | None = None, max_rank: int | None = None) -> dict:
    """ACE of one modular-addition model at its last residual stream (last position), all p^2 inputs.

    Returns, under `definition`: the energy rank r, the sufficient and necessary dimensions (keep /
    remove for every k up to max_rank, default every ACE mode; inf where no k qualifies), the paper's
    core dimension max(r, necessary dimension) and the bare necessary k (not raised to r), keep
    accuracy at r relative to clean, remove accuracy at r; in the r-dimensional core the paper's
    class-mean shift operator (`class_mean_operator`: its eigenvalues and the share within sin(pi/p) of
    the unit circle) and the book's per-input shift operator b -> b + 1 (`shift_operator`: eigenvalues
    and mean distance from the circle). With `alternative`, its rank and dimensions too ("alt_").
    """
    out = _modular_dims(model, task, definition, max_rank)
    core, inputs = out.pop("core"), out.pop("inputs")
    op = shift_operator(core, inputs.activations, task.p)
    means_op = class_mean_operator(core, inputs.activations, task.all.labels, task.p)
    out.update({"eigenvalues": op.eigenvalues, "unit_circle_deviation": unit_circle_deviation(op.eigenvalues),
                "operator_r2": op.r2, "class_mean_eigenvalues": means_op.eigenvalues,
                "unit_circle_share": unit_circle_share(means_op.eigenvalues, unit_circle_tolerance(task.p)),
                "class_mean_r2": means_op.r2, "core": core})
    if alternative is not None:
        alt = _modular_dims(model, task, alternative, max_rank)
        out.update({f"alt_{k}": alt[k] for k in ("rank", "sufficient_dim", "necessary_dim", "core_dim")})
    return out


def _modular_dims(model, task, definition, max_rank) -> dict:
    return core_dimensions(model, task.all.tokens, task.all.labels, definition, chance=1 / task.p,
                           max_rank=max_rank)


def core_trajectory(run: Run, task: ModularAddition, steps: Sequence[int], member: int = 0,
                    definition: ace.CoreDefinition = ace.PAPER,
                    alternative: ace.CoreDefinition | None = None) -> pd.DataFrame:
    """`modular_core_at` at each checkpoint step of one member, with that step's accuracies."""
    metrics = run.metrics()
    rows = []
    for step in steps:
        res = modular_core_at(run.model(member, step), task, definition, alternative)
        m = metrics[(metrics.member == member) & (metrics.step <= step)].sort_values("step").iloc[-1]
        rows.append({"step": int(step), "member": member, "acc_train": m["acc_train"], "acc_test": m["acc_test"],
                     **{k: v for k, v in res.items()
                        if k not in ("validation", "core", "eigenvalues", "class_mean_eigenvalues")},
                     "eigenvalues": res["eigenvalues"].numpy(),
                     "class_mean_eigenvalues": res["class_mean_eigenvalues"].numpy()})
    return pd.DataFrame(rows)

def _num(x) -> float:
    return float("nan") if x is None or pd.isna(x) else float(x)


def eigen_frequencies(eigenvalues, p: int) -> np.ndarray:
    """|angle| x p / (2 pi) of each eigenvalue, sorted: integers k for the rotations e^{+-2 pi i k / p}
    of a Fourier-feature algorithm."""
    return np.sort(np.abs(np.angle(np.asarray(eigenvalues)))) * p / (2 * np.pi)


def dimension_growth(traj: pd.DataFrame, tau_grok: float) -> dict:
    """Necessary-dimension growth and sufficient-dimension ratio from the first checkpoint at or after
    tau_grok (the first checkpoint if tau_grok is nan or never reached) to the last one (AC-7)."""
    t = traj.sort_values("step")
    reached = not math.isnan(tau_grok) and (t.step >= tau_grok).any()
    start = t[t.step >= tau_grok].iloc[0] if reached else t.iloc[0]
    end = t.iloc[-1]

    def ratio(a, b):  # inf / inf and x / nan are undefined; x / inf = 0, inf / x = inf
        a, b = _num(a), _num(b)
        if not b or math.isnan(a) or math.isnan(b) or (math.isinf(a) and math.isinf(b)):
            return float("nan")
        return a / b

    return {"necessary growth": ratio(end["necessary_dim"], start["necessary_dim"]),
            "necessary start": _num(start["necessary_dim"]), "necessary end": _num(end["necessary_dim"]),
            "sufficient ratio": ratio(end["sufficient_dim"], start["sufficient_dim"]),
            "from step": int(start["step"]), "to step": int(end["step"]), "from grokking": reached}


# --------------------------------------------------------------------------- delay law
def per_seed_exponents(times: pd.DataFrame, x: str, y: str = "delay", seed: str = "seed",
                       n_boot: int = 200) -> pd.DataFrame:
    """One power-law fit of y against x per seed (each seed's points across the sweep).

    Rows: seed, exponent (nan where the seed grokked at fewer than 3 sweep points), the number of
    points fitted and the fit's 95% t-interval. The scorecard judges the median over seeds.
    """
    rows = []
    for s, g in times.groupby(seed, sort=True):
        fit = fit_power_law_or_none(g[x], g[y], n_boot=n_boot)
        rows.append({"seed": s, "exponent": fit.exponent if fit else float("nan"),
                     "points": fit.n if fit else int((np.isfinite(g[y]) & (g[y] > 0)).sum()),
                     "ci_low": fit.ci[0] if fit else float("nan"), "ci_high": fit.ci[1] if fit else float("nan")})
    return pd.DataFrame(rows, columns=["seed", "exponent", "points", "ci_low", "ci_high"])


def seed_mean_delays(times: pd.DataFrame, x: str, y: str = "delay") -> pd.DataFrame:
    """Per sweep point x: the mean of y over the seeds that grokked there (finite, positive y), their
    spread (std, min, max) and how many of the point's seeds that is."""
    rows = []
    for value, g in times.groupby(x, sort=True):
        ok = pd.to_numeric(g[y], errors="coerce")
        ok = ok[np.isfinite(ok) & (ok > 0)]
        rows.append({x: float(value), "mean": float(ok.mean()) if len(ok) else float("nan"),
                     "std": float(ok.std()) if len(ok) > 1 else float("nan"),
                     "min": float(ok.min()) if len(ok) else float("nan"),
                     "max": float(ok.max()) if len(ok) else float("nan"),
                     "grokked": int(len(ok)), "seeds": int(len(g))})
    return pd.DataFrame(rows, columns=[x, "mean", "std", "min", "max", "grokked", "seeds"])


def seed_mean_exponent(times: pd.DataFrame, x: str, y: str = "delay", n_boot: int = 200):
    """The paper's AC-8 fit: one power law y ~ c x^alpha through the seed-mean y of each sweep point
    (`seed_mean_delays`); None with fewer than 3 points where some seed grokked."""
    points = seed_mean_delays(times, x, y)
    points = points[points["grokked"] > 0]
    return fit_power_law_or_none(points[x], points["mean"], n_boot=n_boot)


# --------------------------------------------------------------------------- agreement (AC-9)
def agreement_margin(singular_id: int, plural_id: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Task output for ACE: logit(" is") - logit(" are") at the read-out position, [B]."""
    return lambda logits: logits[:, singular_id] - logits[:, plural_id]


@torch.no_grad()
def margins(model, tokens: torch.Tensor, singular_id: int, plural_id: int, fwd_hooks=(),
            batch_size: int = 64) -> torch.Tensor:
    """The last-position margin logit(is) - logit(are) of every prompt, [N]."""
    out = []
    for start in range(0, tokens.shape[0], batch_size):
        logits = ace._logits_of(model.run_with_hooks(tokens[start:start + batch_size], fwd_hooks=list(fwd_hooks)))
        out.append((logits[:, -1, singular_id] - logits[:, -1, plural_id]).float().cpu())
    return torch.cat(out)


def oriented(core: ace.AceCore, activations: torch.Tensor, labels: torch.Tensor) -> ace.AceCore:
    """The same core with each direction's sign chosen so that singular (+1) prompts have the larger
    mean coordinate (a core's sign is arbitrary; this makes coordinates comparable across models)."""
    from dataclasses import replace

    z = core.coordinates(activations)
    lab = torch.as_tensor(labels).double()
    signs = torch.sign((z * lab[:, None]).mean(0))
    signs[signs == 0] = 1
    return replace(core, Q=core.Q * signs)


def layer_cores(model, tokens: torch.Tensor, labels: torch.Tensor, singular_id: int, plural_id: int,
                layers: Sequence[int], energy_threshold: float = 0.99, batch_size: int = 32
                ) -> tuple[dict[int, ace.AceCore], dict[int, int], dict[int, ace.AceInputs]]:
    """ACE at every layer's residual stream output (last position), task output = the margin.

    Returns (1-D cores, energy ranks, inputs) per layer; one forward and one backward pass per
    batch give every layer at once (`ace.collect_ace_inputs_many`).
    """
    hooks = {layer: f"blocks.{layer}.hook_resid_post" for layer in layers}
    inputs = ace.collect_ace_inputs_many(model, tokens, list(hooks.values()), agreement_margin(singular_id, plural_id),
                                         position=-1, batch_size=batch_size)
    cores, ranks, by_layer = {}, {}, {}
    for layer, name in hooks.items():
        inp = inputs[name]
        ranks[layer] = ace.extract_core(inp.activations, inp.jacobians, energy_threshold=energy_threshold).rank
        cores[layer] = oriented(ace.extract_core(inp.activations, inp.jacobians, rank=1), inp.activations, labels)
        by_layer[layer] = inp
    return cores, ranks, by_layer


def flip_effect(model, tokens: torch.Tensor, labels: torch.Tensor, core: ace.AceCore, layer: int,
                singular_id: int, plural_id: int, clean_margins: torch.Tensor | None = None,
                modes: Sequence[str] = ("flip",)) -> dict:
    """Causal effect of intervening with `core` at layer `layer` (last position) on the test prompts.

    flip_rate: fraction of prompts whose preferred verb (sign of the margin) changes; acc_<mode>:
    agreement accuracy under each intervention; clean accuracy for reference.
    """
    hook = f"blocks.{layer}.hook_resid_post"
    clean = margins(model, tokens, singular_id, plural_id) if clean_margins is None else clean_margins
    sign = labels.sign().float()
    out = {"layer": layer, "acc_clean": float((torch.sign(clean) == sign).float().mean())}
    for mode in modes:
        m = margins(model, tokens, singular_id, plural_id,
                    [(hook, ace.intervention_hook(core.Q, core.mu, mode, position=-1))])
        out[f"acc_{mode}"] = float((torch.sign(m) == sign).float().mean())
        if mode == "flip":
            out["flip_rate"] = float((torch.sign(m) != torch.sign(clean)).float().mean())
            out["margin_clean"] = float((clean * sign).mean())
            out["margin_flip"] = float((m * sign).mean())
    return out


@torch.no_grad()
def greedy_generate(model, tokens: torch.Tensor, n_new: int, fwd_hooks=()) -> torch.Tensor:
    """Greedy continuation of one prompt [1, T] by n_new tokens, re-running the whole sequence each
    step (so a hook at a fixed prompt position acts at every step)."""
    seq = tokens.clone()
    for _ in range(n_new):
        logits = ace._logits_of(model.run_with_hooks(seq, fwd_hooks=list(fwd_hooks)))
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True).to(seq.dtype)], 1)
    return seq[:, tokens.shape[1]:]


SINGULAR_VERBS = ("is", "was", "has", "does", "seems", "looks", "remains", "stands", "sits", "lies")
PLURAL_VERBS = ("are", "were", "have", "do", "seem", "look", "remain", "stand", "sit", "lie")


def first_verb_number(text: str, first_clause: bool = False) -> str:
    """'singular' / 'plural' from the first agreeing verb of a continuation, '' if none.

    first_clause: look only before the first sentence or clause break (. ; : ! ? or a newline), so
    that a verb of a new sentence with a new subject does not count.
    """
    if first_clause:
        import re

        text = re.split(r"[.;:!?\n]", text, maxsplit=1)[0]
    for word in text.replace(",", " ").replace(".", " ").split():
        w = word.strip().lower()
        if w in SINGULAR_VERBS:
            return "singular"
        if w in PLURAL_VERBS:
            return "plural"
    return ""


def spearman_alignment(coords: dict[str, pd.Series]) -> pd.DataFrame:
    """Spearman correlation of 1-D core coordinates between every pair of models, on the prompts
    they share (coords: model name -> Series indexed by prompt text)."""
    from scipy.stats import spearmanr

    names = list(coords)
    rows = []
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            a, b = coords[names[i]], coords[names[j]]
            shared = a.index.intersection(b.index)
            rho = spearmanr(a[shared], b[shared]).statistic if len(shared) >= 3 else float("nan")
            rows.append({"model_a": names[i], "model_b": names[j], "n_prompts": len(shared), "spearman": float(rho)})
    return pd.DataFrame(rows, columns=["model_a", "model_b", "n_prompts", "spearman"])


@dataclass
class AgreementResult:
    """ACE of the number-agreement core of one language model (see `agreement_model_analysis`)."""

    name: str
    source: str
    n_layers: int
    n_train: int
    n_test: int
    per_layer: pd.DataFrame  # layer, energy rank, flip rate (train selection subset, test), accuracy under flip
    best_layer: int
    best: dict  # acc_clean, acc_keep, acc_remove, acc_flip, flip_rate at the best layer
    coords: pd.Series  # 1-D core coordinate at the best layer, indexed by test prompt text
    generations: pd.DataFrame  # prompt, clean and flipped continuations, their verb numbers
    gen_flip_rate: float  # among generations whose clean and flipped continuations both have a verb
    n_gen_compared: int = 0  # generations whose clean and flipped continuations both have an agreeing verb
    n_verb_first: int = 0  # test prompts whose clean greedy continuation starts with an agreeing verb
    n_verb_first_bare: int = 0  # the same without the generation context

    @property
    def best_depth(self) -> float:
        """The best layer's relative depth, layer / (n_layers - 1): 0 the first layer, 1 the last."""
        return self.best_layer / max(self.n_layers - 1, 1)


def agreement_model_analysis(loaded, prompts, layer_stride: int = 1, n_generate: int = 6, gen_tokens: int = 6,
                             energy_threshold: float = 0.99, batch_size: int = 32,
                             max_select: int | None = 64, gen_prefix: str = "") -> AgreementResult:
    """The AC-9 pipeline on one model (a `models.pretrained.LoadedModel`).

    1. Keep the prompts this tokenizer encodes one token per word; split train / test (by subject).
    2. ACE at every `layer_stride`-th layer (and the last) on the training prompts, task output the
       margin logit(" is") - logit(" are") at the last position; the 1-D core per layer.
    3. Flip each layer's core: the flip rate is the fraction of prompts whose preferred verb changes.
       The best layer has the highest flip rate on (at most max_select of) the *training* prompts
       (ties: the earliest), so that choosing it does not peek at the test prompts; every layer's
       test flip rate is reported too.
    4. keep / remove / flip at the best layer; the test prompts' core coordinates there.
    5. Greedy open generation (gen_tokens tokens) of n_generate test prompts, clean and with the
       flip applied at the prompt's last position at the best layer. Each test prompt follows a short
       context `gen_prefix` (e.g. two example sentences; without one a small model mostly continues
       the noun phrase instead of producing a verb). The prompts used are those whose clean greedy
       continuation starts with an agreeing verb (all test prompts if none does); gen_flip_rate
       compares the first verb of the first clause of the two continuations.
    """
    from ...tasks.agreement import encode_prompts, filter_prompts

    model, tok = loaded.bridge, loaded.tokenizer
    kept = filter_prompts(tok, list(prompts))
    data = encode_prompts(tok, kept)
    train, test = data.split("train"), data.split("test")
    if len(train) < 4 or len(test) < 2:
        raise ValueError(f"{loaded.name}: too few prompts survive tokenization ({len(train)} train, {len(test)} test)")
    s, p = data.singular_id, data.plural_id
    layers = sorted(set(range(0, loaded.n_layers, layer_stride)) | {loaded.n_layers - 1})
    cores, ranks, _ = layer_cores(model, train.tokens, train.labels, s, p, layers, energy_threshold, batch_size)
    sel = train if max_select is None or len(train) <= max_select else train.subset(max_select)
    clean = margins(model, test.tokens, s, p, batch_size=batch_size)
    clean_sel = margins(model, sel.tokens, s, p, batch_size=batch_size)
    rows = []
    for layer in layers:
        on_train = flip_effect(model, sel.tokens, sel.labels, cores[layer], layer, s, p, clean_margins=clean_sel)
        on_test = flip_effect(model, test.tokens, test.labels, cores[layer], layer, s, p, clean_margins=clean)
        rows.append({"layer": layer, "energy_rank": ranks[layer], "flip_rate_train": on_train["flip_rate"],
                     **{k: v for k, v in on_test.items() if k != "layer"}})
    per_layer = pd.DataFrame(rows)
    best_layer = int(per_layer.loc[per_layer["flip_rate_train"].idxmax(), "layer"])
    best = flip_effect(model, test.tokens, test.labels, cores[best_layer], best_layer, s, p, clean_margins=clean,
                       modes=("keep", "remove", "flip"))
    core = cores[best_layer]
    hook = f"blocks.{best_layer}.hook_resid_post"
    acts = ace.collect_activations(model, test.tokens, hook, position=-1, batch_size=batch_size)
    coords = pd.Series(core.coordinates(acts)[:, 0].numpy(), index=[q.text for q in test.prompts], name=loaded.name)
    # open generation: the test prompts after a short context (gen_prefix), those whose clean greedy
    # continuation starts with an agreeing verb (selected on the clean run only), balanced by number
    gen_tokens_all = test.tokens
    if gen_prefix:
        ids = torch.tensor(tok(gen_prefix.rstrip() + " ", add_special_tokens=False)["input_ids"], dtype=torch.long)
        has_bos = getattr(tok, "bos_token_id", None) is not None and bool((test.tokens[:, 0] == tok.bos_token_id).all())
        head, tail = (test.tokens[:, :1], test.tokens[:, 1:]) if has_bos else (test.tokens[:, :0], test.tokens)
        gen_tokens_all = torch.cat([head, ids.expand(len(test), -1), tail], 1)
    def verb_first(tokens):
        with torch.no_grad():
            first = torch.cat([ace._logits_of(model(tokens[i:i + batch_size]))[:, -1].argmax(-1)
                               for i in range(0, len(tokens), batch_size)])
        return [first_verb_number(tok.decode([int(t)]), first_clause=True) != "" for t in first]

    starts_with_verb = verb_first(gen_tokens_all)
    bare_verb_first = verb_first(test.tokens) if gen_prefix else starts_with_verb
    pool = [i for i in range(len(test)) if starts_with_verb[i]] or list(range(len(test)))
    order = [i for pair in zip([i for i in pool if test.prompts[i].singular],
                               [i for i in pool if not test.prompts[i].singular]) for i in pair]
    order += [i for i in pool if i not in order]
    order = order[:n_generate]
    flip_hook = [(hook, ace.intervention_hook(core.Q, core.mu, "flip", position=gen_tokens_all.shape[1] - 1))]
    gens = []
    for i in order:
        toks = gen_tokens_all[i:i + 1]
        c = tok.decode(greedy_generate(model, toks, gen_tokens)[0])
        f = tok.decode(greedy_generate(model, toks, gen_tokens, flip_hook)[0])
        gens.append({"prompt": test.prompts[i].text, "subject": "singular" if test.prompts[i].singular else "plural",
                     "clean": c, "flipped": f, "clean_verb": first_verb_number(c, first_clause=True),
                     "flipped_verb": first_verb_number(f, first_clause=True)})
    generations = pd.DataFrame(gens, columns=["prompt", "subject", "clean", "flipped", "clean_verb", "flipped_verb"])
    both = generations[(generations.clean_verb != "") & (generations.flipped_verb != "")]
    gen_flip = float((both.clean_verb != both.flipped_verb).mean()) if len(both) else float("nan")
    return AgreementResult(name=loaded.name, source=loaded.source, n_layers=loaded.n_layers, n_train=len(train),
                           n_test=len(test), per_layer=per_layer, best_layer=best_layer, best=best, coords=coords,
                           generations=generations, gen_flip_rate=gen_flip, n_gen_compared=len(both),
                           n_verb_first=int(sum(starts_with_verb)),
                           n_verb_first_bare=int(sum(bare_verb_first)))



# --------------------------------------------------------------------------- Markov: how often seeds agree
@dataclass(frozen=True)
class SeedCore:
    """The paper-definition core of one seed's Markov model, for the survey over many seeds."""

    seed: int
    rank: int  # energy rank of the raw logits' Jacobian at the definition's threshold
    fourth_share: float  # share of sigma^2 in the n_states-th ACE direction (the common mode's, when it counts)
    centred_rank: int  # energy rank with the logits' common mode removed
    core: object  # the ace.Core (its basis for overlaps)


def seed_core(model: ToyTransformer, chain: MarkovChain, tokens: torch.Tensor, definition: ace.CoreDefinition,
              seed: int) -> SeedCore:
    """ACE (no causal validation: the survey reads ranks and subspaces) on one model at its last residual
    stream, every position of `tokens` a sample."""
    core, inputs = ace_final(model, tokens, position="all", definition=definition)
    power = core.sigma.pow(2)
    k = chain.n_states
    share = float(power[k - 1] / power.sum()) if k <= power.numel() else float("nan")
    _, centred = readout_common_mode(inputs, definition)
    return SeedCore(seed=seed, rank=int(core.rank), fourth_share=share, centred_rank=int(centred), core=core)


def random_triple_overlaps(dim: int, rank: int, n_draws: int = 2000, seed: int = 0) -> np.ndarray:
    """Mean pairwise projector overlap of three independent uniformly random `rank`-dimensional subspaces
    of R^dim, `n_draws` times: the baseline a triple of seeds' cores is read against."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_draws):
        q = [torch.randn(dim, rank, generator=gen, dtype=torch.float64) for _ in range(3)]
        out.append(np.mean([projector_overlap(q[i], q[j]) for i, j in ((0, 1), (0, 2), (1, 2))]))
    return np.asarray(out)


def seed_survey(cores: Sequence[SeedCore], threshold: float, target_rank: int, dim: int,
                low_overlap: float = 0.03, n_random: int = 2000) -> dict:
    """How often seeds agree with a claim made on three of them (AC-2 and AC-3 over many seeds).

    Per seed: the share at `target_rank`, of those whose fourth direction carries more than 1 - threshold
    (the share the energy threshold tolerates: above it, the direction counts), and at `target_rank`
    with the common mode removed. Over every triple of seeds: the share of triples all at `target_rank`,
    the median of a triple's mean pairwise projector overlap beside the same for random `target_rank`-
    dimensional subspaces of R^dim (`random_triple_overlaps`), and the share of triples whose mean overlap
    is at most `low_overlap` (seeds' and random)."""
    from itertools import combinations

    if len(cores) < 3:
        raise ValueError(f"a survey of seed triples needs at least 3 seeds; got {len(cores)}")
    ranks = np.array([c.rank for c in cores])
    shares = np.array([c.fourth_share for c in cores])
    pair = {(i, j): projector_overlap(cores[i].core, cores[j].core) for i, j in combinations(range(len(cores)), 2)}
    triples = list(combinations(range(len(cores)), 3))
    means = np.array([np.mean([pair[(a, b)], pair[(a, c)], pair[(b, c)]]) for a, b, c in triples])
    all_target = np.array([all(ranks[list(t)] == target_rank) for t in triples])
    rand = random_triple_overlaps(dim, target_rank, n_random)
    return {"n_seeds": float(len(cores)), "share_at_rank": float(np.mean(ranks == target_rank)),
            "fourth_share_median": float(np.nanmedian(shares)),
            "share_fourth_counted": float(np.mean(shares > 1 - threshold)),
            "share_centred_at_rank": float(np.mean([c.centred_rank == target_rank for c in cores])),
            "n_triples": float(len(triples)), "share_triples_at_rank": float(all_target.mean()),
            "triple_overlap_median": float(np.median(means)),
            "random_triple_overlap_median": float(np.median(rand)),
            "share_triples_low_overlap": float(np.mean(means <= low_overlap)),
            "random_share_low_overlap": float(np.mean(rand <= low_overlap))}
