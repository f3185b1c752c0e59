"""Chapter `algorithmic_cores`: "Transformers converge to invariant algorithmic cores"
(Schiffman, arXiv 2602.22600), reimplemented from the chapter's spec in PAPERS.md.

Everything the chapter's notebooks share lives here, so that every notebook gets the same runs
by calling the same function with the same Params.

Definitions (all notebooks)
    `ace.PAPER` and `ace.BOOK` say what the core, "sufficient" and "necessary" mean (the paper's
    choices, judged on the scorecard, and the book's first choices, shown beside them).
Planted system (notebook 01)
    `planted_system`      a latent linear system with known core and known operator, embedded in a
                          larger activation space with distracting directions; `PlantedModel` reads
                          it out through a hook, so the whole ACE pipeline runs on it;
                          `PlantedSystem.predicted_core` is the exact answer when nuisance directions
                          correlate with the latents by chance.
Readout-side validation (all toy-model notebooks)
    `final_residual`      activations of the last residual stream and the readout after it;
    `validate_readout`    keep / remove / flip for every rank k, evaluated by re-running only the
                          readout (final LayerNorm + unembedding) on the intervened activations,
                          which gives exactly `ace.validate_core` at that hook, thousands of times faster.
Markov chains (notebook 02, AC-1..AC-4)
    `markov_setup`, `train_markov` (setups "paper": post-LN with dropout, and "book": pre-LN; the evaluation
    callback `tasks.markov.next_token_accuracy` lives with the task, so that editing this module retrains nothing),
    `markov_model_analysis`, `markov_member_analysis`, `markov_pairs`, `markov_claim_values`,
    `operator_diagnostic`, `eig_relative_error`, `matched_eig_errors`, `random_subspace_overlap`,
    `random_projection_cca`.
Grokking (notebook 03, AC-5..AC-7)
    `grokking_setup`, `train_grokking`, `choose_fork_step`, `auto_fork_step`, `train_wd0_branch`,
    `modular_core_at`, `core_trajectory`, `shift_operator`, `unit_circle_deviation`,
    `grokking_summary`, `dimension_growth`, `eigen_frequencies`.
Delay law (notebook 04, AC-8)
    `first_crossing`, `grokking_times`, `fit_power_law_or_none` (from `analysis.curves`),
    `per_seed_exponents`, `train_omega_sweep`, `train_p_sweep`.
Agreement in a language model (notebook 05, AC-9)
    `agreement_margin`, `layer_cores`, `flip_effect`, `greedy_generate`, `first_verb_number`,
    `spearman_alignment`, `agreement_model_analysis`.

Steps and epochs: the training loop counts optimizer steps. With a fixed training set of n
examples and batch B there are ceil(n / B) steps per epoch (`FixedDataset.steps_per_epoch`); a
batch >= n is full-batch training (one step per epoch). `epochs_to_steps` converts.
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

from ..analysis import ace
from ..analysis.compare import cca, projector_overlap, weight_cosine
from ..analysis.curves import fit_power_law_or_none
from ..models.toy import ToyConfig, ToyTransformer
from ..tasks.base import Batch
from ..tasks.markov import MarkovChain, MarkovSequences, next_token_accuracy
from ..tasks.modular import ModularAddition
from ..training import Run, TrainConfig, pool_accuracy
from ..training import train as _train


def set_threads(n: int | None) -> int:
    """torch.set_num_threads(n) unless n is None; returns the number of threads in use.

    Small models run op by op in microseconds; with several OpenMP threads on a CPU that other
    processes keep busy, every op waits for its threads, so one thread is much faster there.
    None keeps torch's default.
    """
    if n is not None:
        torch.set_num_threads(int(n))
    return torch.get_num_threads()


def centred_logits(logits: torch.Tensor) -> torch.Tensor:
    """Logits minus their mean (a common shift changes no prediction): the book's task outputs."""
    return logits - logits.mean(-1, keepdim=True)


def with_threshold(definition: ace.CoreDefinition, energy_threshold: float | None) -> ace.CoreDefinition:
    """`definition` with another energy threshold (None keeps its own)."""
    return definition if energy_threshold is None else replace(definition, energy_threshold=float(energy_threshold))


def epochs_to_steps(epochs: int, n_train: int, batch_size: int) -> int:
    """Optimizer steps of `epochs` passes over n_train examples at batch_size (ceil per epoch)."""
    return int(epochs) * max(1, -(-int(n_train) // int(batch_size)))


def dim_value(dim: int | None) -> float:
    """A sufficient or necessary dimension as a number: inf when no k qualified (no core that small
    or that large does the job), never NaN (NaN would read as "not measured")."""
    return math.inf if dim is None else float(dim)


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


# --------------------------------------------------------------------------- readout-side validation
def final_hook(model_cfg: ToyConfig) -> str:
    return f"blocks.{model_cfg.n_layers - 1}.hook_resid_post"


def readout(model: ToyTransformer, resid: torch.Tensor) -> torch.Tensor:
    """Logits from the last residual stream: final LayerNorm (pre-LN models only) and unembedding."""
    x = resid.to(model.W_U.dtype)
    if model.cfg.normalization == "LN":
        x = model.ln_final(x)
    return model.unembed(x)


def affine_readout(model: ToyTransformer) -> bool:
    """Whether the readout after the last residual stream is affine (no final LayerNorm)."""
    return model.cfg.normalization != "LN"


def final_residual(model: ToyTransformer, tokens: torch.Tensor, position: int | str = -1,
                   batch_size: int = 4096) -> torch.Tensor:
    """Activations of the last residual stream: [N, D] at one position, [N, pos, D] for 'all'."""
    return ace.collect_activations(model, tokens, final_hook(model.cfg), position=position, batch_size=batch_size)


@torch.no_grad()
def validate_readout(model: ToyTransformer, resid: torch.Tensor, labels: torch.Tensor, core: ace.AceCore,
                     chance: float, ks: Sequence[int] | None = None, modes: Sequence[str] = ace.INTERVENTIONS,
                     definition: ace.CoreDefinition = ace.BOOK, energy_rank: int | None = None) -> ace.CoreValidation:
    """`ace.validate_core` at the last residual stream, computed from its activations.

    resid [..., D] are the clean activations at `final_hook` (every position that is scored);
    labels [...] the targets. Intervening there changes nothing upstream, so the intervened
    logits are just `readout(intervened resid)`. keep / remove act about core.mu (definition.centered)
    or about the origin (the paper's), flip always about core.mu; modes not listed score NaN.
    """
    ks = list(range(1, core.rank + 1)) if ks is None else [int(k) for k in ks]
    if not ks or any(not 1 <= k <= core.rank for k in ks):
        raise ValueError(f"ks={ks!r} is not allowed; expected integers in [1, rank={core.rank}]")
    bad = [m for m in modes if m not in ace.INTERVENTIONS]
    if bad:
        raise ValueError(f"modes {bad} are not allowed; expected some of {ace.INTERVENTIONS}")
    h = resid.reshape(-1, resid.shape[-1]).float()
    y = labels.reshape(-1)
    Q, mu = core.Q.float(), core.mu.float()
    origin = mu if definition.centered else torch.zeros_like(mu)

    def acc(x):
        return (readout(model, x).argmax(-1) == y).float().mean().item()

    clean = acc(h)
    if affine_readout(model):
        scores = _affine_scores(model, h, y, Q, mu, origin, ks, modes)
    else:
        scores = {m: [acc(ace.apply_intervention(h, Q[:, :k], mu if m == "flip" else origin, m)) if m in modes
                      else float("nan") for k in ks] for m in ace.INTERVENTIONS}
    return ace.core_validation(ks, clean, scores, chance, definition, energy_rank)


def readout_jacobians(model: ToyTransformer, resid: torch.Tensor, outputs: str = "centred",
                      chunk: int = 8192) -> torch.Tensor:
    """d task outputs / d resid for every row of resid [N, D] -> [N, n_out, D]; outputs "raw" or
    "centred" logits.

    At the last residual stream only the readout (final LayerNorm, unembedding) lies downstream, so
    the Jacobian of the task outputs is the readout's Jacobian, computed per row with torch.func
    (the same numbers `ace.collect_ace_inputs` gets by back-propagating through the whole model).
    """
    from torch.func import jacrev, vmap

    if outputs not in ace.OUTPUTS:
        raise ValueError(f"outputs={outputs!r} is not allowed; expected one of {ace.OUTPUTS}")
    post = centred_logits if outputs == "centred" else (lambda z: z)

    def f(h):
        return post(readout(model, h[None])[0])

    with torch.no_grad():
        if affine_readout(model):  # one Jacobian for every row
            return jacrev(f)(resid[0].float()).expand(resid.shape[0], -1, -1)
        out = [vmap(jacrev(f))(resid[i:i + chunk].float()) for i in range(0, resid.shape[0], chunk)]
    return torch.cat(out)


@torch.no_grad()
def _affine_scores(model, h, y, Q, mu, origin, ks, modes) -> dict[str, list[float]]:
    """keep / remove / flip accuracies for every k when the readout is affine (no final LayerNorm).

    logits(h) = h W_U + b_U, so with z = (h - o) Q and u_j = q_j W_U the intervened logits are rank-one
    updates: keep_k = logits(o) + sum_{j<=k} z_j u_j, remove_k = logits(h) - sum_{j<=k} z_j u_j, with o the
    origin of keep / remove; flip_k = logits(h) - 2 sum_{j<=k} z'_j u_j with z' = (h - mu) Q. One pass over
    k instead of one readout per k.
    """
    W = model.W_U.float()
    U = Q.T @ W  # [K, n_out]
    z = (h - origin) @ Q  # [N, K]
    zf = (h - mu) @ Q
    full = readout(model, h)
    base = readout(model, origin[None])
    part = torch.zeros_like(full)
    part_f = torch.zeros_like(full)
    wanted = set(ks)
    scores = {m: {} for m in ace.INTERVENTIONS}
    for j in range(max(ks)):
        part += z[:, j:j + 1] * U[j]
        part_f += zf[:, j:j + 1] * U[j]
        if j + 1 not in wanted:
            continue
        for m, logits in (("keep", base + part), ("remove", full - part), ("flip", full - 2 * part_f)):
            scores[m][j + 1] = (logits.argmax(-1) == y).float().mean().item() if m in modes else float("nan")
    return {m: [v[k] for k in ks] for m, v in scores.items()}


def ace_final(model: ToyTransformer, tokens: torch.Tensor, position: int | str = -1,
              definition: ace.CoreDefinition = ace.BOOK, rank: int | None = None, batch_size: int = 4096):
    """(core, inputs) of ACE at the last residual stream, with the definition's task outputs (raw or
    centred logits) and energy threshold (unless `rank` fixes the rank).

    With position='all' every position of every sequence is a sample (sequence-major rows).
    """
    acts = final_residual(model, tokens, position=position, batch_size=batch_size)
    n_pos = acts.shape[1] if position == "all" else 1
    acts = acts.reshape(-1, acts.shape[-1])
    inputs = ace.AceInputs(activations=acts, jacobians=readout_jacobians(model, acts, definition.outputs),
                           n_sequences=tokens.shape[0], n_positions=n_pos)
    core = ace.extract_core(inputs.activations, inputs.jacobians, energy_threshold=definition.energy_threshold,
                            rank=rank)
    return core, inputs


def validation_ks(model: ToyTransformer, core: ace.AceCore, n_modes: int) -> list[int]:
    """The ranks k to validate: every ACE mode when the readout is affine (each k costs a rank-one
    update), else up to 2 r + 4 (each k costs one readout through the final LayerNorm)."""
    top = n_modes if affine_readout(model) else min(n_modes, 2 * core.rank + 4)
    return list(range(1, top + 1))


# --------------------------------------------------------------------------- Markov chains
# The setups of the Markov experiment: the paper's model and definitions (judged), and two of the book's
# first choices (shown beside them). "paper": PyTorch's default encoder layer (post-LN, dropout in training)
# with PyTorch's default initialisation, ACE on the raw logits at the energy threshold of the notebook (0.999
# in the paper), uncentred keep / remove, the paper's sufficient / necessary dimensions. "normal_init": the
# same layer and definitions with the book's first initialisation (every W_* ~ N(0, 1/d_model), zero biases),
# which changes the readout's common mode. "book": pre-LN with a final LayerNorm, no dropout, the book's
# initialisation, ACE on the centred logits at 0.99, mean ablations, the book's tolerances.
MARKOV_SETUPS = ("paper", "normal_init", "book")
_MARKOV_LAYERS = {"paper": dict(normalization="postLN", init="pytorch"),
                  "normal_init": dict(normalization="postLN", init="normal"),
                  "book": dict(normalization="LN", init="normal")}


@dataclass
class MarkovExperiment:
    setup: str
    chain: MarkovChain
    task: MarkovSequences
    model_config: ToyConfig
    train_config: TrainConfig
    definition: ace.CoreDefinition
    run: Run | None = None


def _check_setup(setup: str) -> None:
    if setup not in MARKOV_SETUPS:
        raise ValueError(f"setup={setup!r} is not allowed; expected one of {MARKOV_SETUPS}")


def markov_setup(cfg, setup: str = "paper") -> MarkovExperiment:
    """Chain, data, model and training configs from a notebook's Params (see profiles.yml)."""
    _check_setup(setup)
    chain = MarkovChain.circulant(cfg.markov_states, cfg.markov_stay)
    task = MarkovSequences(chain, n_train=cfg.markov_n_train, n_test=cfg.markov_n_test, length=cfg.markov_length,
                           data_seed=0)
    layer = _MARKOV_LAYERS[setup]
    dropout = cfg.markov_dropout if layer["normalization"] == "postLN" else 0.0
    model_cfg = ToyConfig(d_vocab=chain.n_states, n_ctx=cfg.markov_length - 1, d_model=cfg.markov_d_model,
                          n_layers=1, n_heads=cfg.markov_n_heads, d_mlp=cfg.markov_d_mlp, dropout=dropout, **layer)
    definition = ace.BOOK if setup == "book" else with_threshold(ace.PAPER, cfg.energy_threshold)
    steps = epochs_to_steps(cfg.markov_epochs, len(task), cfg.markov_batch)
    train_cfg = TrainConfig(steps=steps, batch_size=cfg.markov_batch, seeds=tuple(cfg.markov_seeds), lr=cfg.markov_lr,
                            weight_decay=0.0, eval_every=max(1, steps // 20), log_checkpoints=8)
    return MarkovExperiment(setup, chain, task, model_cfg, train_cfg, definition)


def train_markov(cfg, setup: str = "paper") -> MarkovExperiment:
    """Train (or load) one setup's Markov ensemble: one member per seed, one shared training set."""
    exp = markov_setup(cfg, setup)
    test = exp.task.test
    n_eval = min(len(test.tokens), cfg.markov_eval_sequences)
    evaluate = next_token_accuracy({"train": Batch(exp.task.tokens[:n_eval], exp.task.labels[:n_eval]),
                                    "test": Batch(test.tokens[:n_eval], test.labels[:n_eval])})
    name = "algorithmic_cores/markov" if setup == "paper" else f"algorithmic_cores/markov_{setup}"
    exp.run = _train(name, exp.model_config, exp.task, exp.train_config, evaluate=evaluate)
    return exp


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


def markov_member_analysis(exp: MarkovExperiment, member: int, n_sequences: int = 500) -> MarkovMember:
    """`markov_model_analysis` of one trained member on the held-out test sequences."""
    test = exp.task.test
    return markov_model_analysis(exp.run.model(member), exp.chain, test.tokens, test.labels, n_sequences,
                                 exp.definition, member=member, seed=exp.train_config.seeds[member])


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


def random_subspace_overlap(dim: int, rank_a: int, rank_b: int, n_draws: int = 500, seed: int = 0) -> float:
    """Mean projector overlap of two independent uniformly random subspaces of R^dim (ranks rank_a, rank_b)."""
    gen = torch.Generator().manual_seed(seed)
    vals = [projector_overlap(torch.randn(dim, rank_a, generator=gen, dtype=torch.float64),
                              torch.randn(dim, rank_b, generator=gen, dtype=torch.float64)) for _ in range(n_draws)]
    return float(np.mean(vals))


CCA_LEADING = 3  # the paper summarises CCA by its top 3 canonical correlations


def cca_summary(res, leading: int = CCA_LEADING) -> dict[str, float]:
    """A CCA result as the paper reports it and beside it: the top correlation, the smallest and the mean of
    the leading `leading` ones (the paper's top 3), and the mean over every direction."""
    rho = np.asarray(res.correlations, dtype=float)
    lead = rho[:leading]
    return {"cca_top": float(rho[0]), "cca_top3_min": float(lead.min()), "cca_top3_mean": float(lead.mean()),
            "cca_mean": float(rho.mean())}


def random_projection_cca(acts_a: torch.Tensor, acts_b: torch.Tensor, rank_a: int, rank_b: int,
                          n_draws: int = 20, seed: int = 0) -> dict[str, float]:
    """The CCA baseline of random subspaces: `cca_summary` averaged over n_draws pairs of random subspaces
    of ranks rank_a, rank_b, the two models' activations projected on them, same inputs."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.as_tensor(acts_a, dtype=torch.float64)
    b = torch.as_tensor(acts_b, dtype=torch.float64)
    draws = []
    for _ in range(n_draws):
        Ra = torch.linalg.qr(torch.randn(a.shape[1], rank_a, generator=gen, dtype=torch.float64)).Q
        Rb = torch.linalg.qr(torch.randn(b.shape[1], rank_b, generator=gen, dtype=torch.float64)).Q
        draws.append(cca_summary(cca(a @ Ra, b @ Rb)))
    return {k: float(np.mean([d[k] for d in draws])) for k in draws[0]}


def markov_pairs(exp: MarkovExperiment, members: Sequence[MarkovMember]) -> pd.DataFrame:
    """Every pair of runs: projector overlap of the cores and CCA of the core coordinates on the same
    inputs (`cca_summary`: the top correlation, the smallest and the mean of the top 3, the mean over every
    direction), each beside its random-subspace baseline (random subspaces of the cores' own ranks in the
    same width), and the cosine of the weight matrices after training and at initialisation (the random-init
    baseline). cca_mean_leading: the mean CCA of the first n_states - 1 core directions only."""
    rows = []
    lead = exp.chain.n_states - 1
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
                         "weight_cosine": weight_cosine(weight_matrices(exp.run.model(a.member)),
                                                        weight_matrices(exp.run.model(b.member))).overall,
                         "init_weight_cosine": weight_cosine(weight_matrices(exp.run.model(a.member, step=0)),
                                                             weight_matrices(exp.run.model(b.member, step=0))).overall})
    return pd.DataFrame(rows)


def markov_claim_values(exp: MarkovExperiment, members: Sequence[MarkovMember], pairs: pd.DataFrame) -> dict:
    """The AC-1..AC-4 measurements of one setup: per-seed lists (one value per member) or scalars
    over the pairs of members. Dimensions use the setup's definition (`exp.definition`)."""
    ceiling = exp.chain.ceiling_accuracy()
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
        "fourth_share": [m.direction_share(exp.chain.n_states) for m in members],
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
@dataclass
class GrokkingExperiment:
    task: ModularAddition
    model_config: ToyConfig
    train_config: TrainConfig
    run: Run | None = None
    branch: Run | None = None
    fork_step: int | None = None


# The modular-addition blocks. "paper": the authors' model, the input `a b` (no `=` token) read at the last
# position, each layer PyTorch's default post-LN encoder layer (dropout in training, PyTorch's default
# initialisation). "book": the book's first choice, `a b =`, biases, learned positions, a ReLU MLP, no
# LayerNorm, no dropout, weights N(0, 1/d_model) (the usual grokking setups).
MODULAR_BLOCKS = ("paper", "book")


def _check_block(block: str) -> None:
    if block not in MODULAR_BLOCKS:
        raise ValueError(f"block={block!r} is not allowed; expected one of {MODULAR_BLOCKS}")


def modular_task(p: int, train_fraction: float, block: str = "paper") -> ModularAddition:
    """The modular-addition data of a block: `a b` for the paper's, `a b =` for the book's."""
    _check_block(block)
    return ModularAddition(p=p, train_fraction=train_fraction, split_seed=0, equals_token=block == "book")


def modular_model_config(p: int, n_layers: int, d_model: int, n_heads: int, d_mlp: int, block: str = "paper",
                         dropout: float = 0.1) -> ToyConfig:
    """The grokking transformer of a block (`MODULAR_BLOCKS`): (a + b) mod p at the last position.
    dropout: the paper block's (the book's has none)."""
    _check_block(block)
    if block == "book":
        return ToyConfig(d_vocab=p + 1, n_ctx=3, d_model=d_model, n_layers=n_layers, n_heads=n_heads, d_mlp=d_mlp,
                         d_vocab_out=p, normalization=None)
    return ToyConfig(d_vocab=p, n_ctx=2, d_model=d_model, n_layers=n_layers, n_heads=n_heads, d_mlp=d_mlp,
                     d_vocab_out=p, normalization="postLN", dropout=dropout, init="pytorch")


def grokking_setup(cfg) -> GrokkingExperiment:
    task = modular_task(cfg.grok_p, cfg.grok_train_fraction, cfg.grok_block)
    model_cfg = modular_model_config(cfg.grok_p, cfg.grok_layers, cfg.grok_d_model, cfg.grok_heads, cfg.grok_d_mlp,
                                     cfg.grok_block, cfg.grok_dropout)
    steps = epochs_to_steps(cfg.grok_epochs, len(task), cfg.grok_batch)
    every = epochs_to_steps(cfg.grok_checkpoint_every_epochs, len(task), cfg.grok_batch)
    train_cfg = TrainConfig(steps=steps, batch_size=cfg.grok_batch, seeds=tuple(cfg.grok_seeds), lr=cfg.grok_lr,
                            weight_decay=cfg.grok_wd, eval_every=max(1, min(every, steps // 100)),
                            checkpoint_every=every, log_checkpoints=12)
    return GrokkingExperiment(task, model_cfg, train_cfg)


def modular_evaluate(task: ModularAddition):
    return pool_accuracy({"train": task.train, "test": task.test})


def train_grokking(cfg) -> GrokkingExperiment:
    """Train (or load) the grokking ensemble (weight decay cfg.grok_wd), one member per seed."""
    exp = grokking_setup(cfg)
    exp.run = _train("algorithmic_cores/grokking", exp.model_config, exp.task, exp.train_config,
                     evaluate=modular_evaluate(exp.task))
    return exp


def first_crossing(steps, values, threshold: float = 0.99) -> float:
    """The first step at which values >= threshold (nan if never)."""
    steps, values = np.asarray(steps, dtype=float), np.asarray(values, dtype=float)
    order = np.argsort(steps, kind="stable")
    hit = np.nonzero(values[order] >= threshold)[0]
    return float(steps[order][hit[0]]) if hit.size else float("nan")


def grokking_times(metrics: pd.DataFrame, threshold: float = 0.99, train: str = "acc_train",
                   test: str = "acc_test") -> pd.DataFrame:
    """Per member: tau_mem (first step with train accuracy >= threshold), tau_grok (first step with
    test accuracy >= threshold) and delay = tau_grok - tau_mem (nan where a time was never reached)."""
    rows = []
    for member, g in metrics.groupby("member", sort=True):
        tm = first_crossing(g["step"], g[train], threshold)
        tg = first_crossing(g["step"], g[test], threshold)
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


def choose_fork_step(exp: GrokkingExperiment, fork_epoch: int | None, member_times: pd.DataFrame) -> int:
    """The checkpoint the weight-decay-0 branch forks from: the last checkpoint at or before
    `fork_epoch` (the paper's 900), or `auto_fork_step` when fork_epoch is None."""
    if fork_epoch is None:
        return auto_fork_step(exp.run, member_times)
    target = epochs_to_steps(fork_epoch, len(exp.task), exp.train_config.batch_size)
    ckpts = exp.run.checkpoint_steps()
    return max([s for s in ckpts if 0 < s <= target] or [ckpts[1]])


def train_wd0_branch(exp: GrokkingExperiment, fork_step: int) -> GrokkingExperiment:
    """Fork every member at `fork_step` and continue with weight decay 0 to the same final step."""
    tc = replace(exp.train_config, weight_decay=0.0)
    exp.fork_step = fork_step
    exp.branch = _train("algorithmic_cores/grokking_wd0", exp.model_config, exp.task, tc,
                        evaluate=modular_evaluate(exp.task), fork_from=(exp.run, fork_step))
    return exp


def unit_circle_deviation(eigenvalues) -> float:
    """mean_i | |lambda_i| - 1 |: 0 when every eigenvalue lies on the unit circle."""
    eig = torch.as_tensor(eigenvalues)
    return float((eig.abs() - 1).abs().mean())


def unit_circle_share(eigenvalues, tol: float) -> float:
    """The share of eigenvalues within `tol` of the unit circle, | |lambda| - 1 | <= tol."""
    eig = torch.as_tensor(eigenvalues)
    return float(((eig.abs() - 1).abs() <= tol).double().mean()) if eig.numel() else float("nan")


def unit_circle_tolerance(p: int) -> float:
    """sin(pi / p): the paper's tolerance for an eigenvalue on the unit circle (half the chord between
    neighbouring p-th roots of unity)."""
    return math.sin(math.pi / p)


def class_mean_operator(core: ace.AceCore, activations: torch.Tensor, labels: torch.Tensor, p: int
                        ) -> ace.CoreOperator:
    """The paper's AC-6 operator: the shift c -> c + 1 of the per-answer mean core coordinates.

    m_c = mean of the core coordinates over the inputs with answer c; A is the least-squares fit of
    m_{c+1} = A m_c around the cycle c = 0, 1, ..., p - 1, 0 (no intercept: with every answer equally
    often, the means average to the core's origin). At most p - 1 core directions are used, so that the
    p transitions determine A.
    """
    z = core.coordinates(activations)[:, :max(1, min(core.rank, p - 1))]
    y = torch.as_tensor(labels).long()
    if y.shape[0] != z.shape[0] or y.min() < 0 or y.max() >= p or len(torch.unique(y)) != p:
        raise ValueError(f"labels must give every answer 0..{p - 1} for the {z.shape[0]} activations")
    means = torch.stack([z[y == c].mean(0) for c in range(p)])
    return ace.fit_core_operator(torch.cat([means, means[:1]]), intercept=False)


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
    tokens, labels = task.all.tokens, task.all.labels
    core, inputs = ace_final(model, tokens, position=-1, definition=definition, batch_size=4096)
    n_modes = core.sigma.numel()
    top = min(n_modes, max_rank or n_modes)
    full = ace.extract_core(inputs.activations, inputs.jacobians, rank=top)
    val = validate_readout(model, inputs.activations, labels, full, chance=1 / task.p, modes=("keep", "remove"),
                           definition=definition, energy_rank=core.rank)
    k = min(core.rank, full.rank)
    bare = ace.necessary_dimension(val.ks, val.remove, val.necessary_level)  # the smallest k, not raised to r
    return {"rank": core.rank, "sufficient_dim": dim_value(val.sufficient_dim),
            "necessary_dim": dim_value(val.necessary_dim), "necessary_k": dim_value(bare),
            "core_dim": max(float(core.rank), dim_value(val.necessary_dim)), "clean_acc": val.clean,
            "keep_acc_at_rank": val.keep[k - 1], "remove_acc_at_rank": val.remove[k - 1],
            "keep_ratio_at_rank": val.keep[k - 1] / max(val.clean, 1e-12), "validation": val, "core": core,
            "inputs": inputs}


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


def sweep_model_config(p: int, cfg) -> ToyConfig:
    return modular_model_config(p, 1, cfg.sweep_d_model, cfg.sweep_heads, cfg.sweep_d_mlp, cfg.sweep_block,
                                cfg.sweep_dropout)


def train_omega_sweep(cfg) -> tuple[Run, pd.DataFrame]:
    """The weight-decay sweep at p = cfg.sweep_omega_p: one ensemble, one member per (omega, seed).

    Returns the run and a member table (member, seed_index, omega)."""
    task = modular_task(cfg.sweep_omega_p, cfg.sweep_train_fraction, cfg.sweep_block)
    members = [(w, s) for w in cfg.sweep_omegas for s in cfg.sweep_omega_seeds]
    seeds = tuple(1000 * s + i for i, (w, s) in enumerate(members))  # distinct seeds per member
    steps = cfg.sweep_omega_steps
    tc = TrainConfig(steps=steps, batch_size=cfg.sweep_omega_batch, seeds=seeds, lr=cfg.sweep_omega_lr,
                     weight_decay=tuple(w for w, _ in members), eval_every=cfg.sweep_eval_every, log_checkpoints=0)
    run = _train("algorithmic_cores/omega_sweep", sweep_model_config(task.p, cfg), task, tc,
                 evaluate=modular_evaluate(task))
    table = pd.DataFrame({"member": range(len(members)), "omega": [w for w, _ in members],
                          "seed_index": [s for _, s in members]})
    return run, table


def train_p_sweep(cfg) -> dict[int, Run]:
    """The modulus sweep at weight decay cfg.sweep_p_omega, full batch, learning rate cfg.sweep_p_lr:
    one ensemble (seeds cfg.sweep_p_seeds) per p."""
    runs = {}
    for p in cfg.sweep_ps:
        task = modular_task(p, cfg.sweep_train_fraction, cfg.sweep_block)
        tc = TrainConfig(steps=cfg.sweep_p_steps, batch_size=len(task), seeds=tuple(cfg.sweep_p_seeds),
                         lr=cfg.sweep_p_lr, weight_decay=cfg.sweep_p_omega, eval_every=cfg.sweep_eval_every,
                         log_checkpoints=0)
        runs[p] = _train(f"algorithmic_cores/p_sweep_{p}", sweep_model_config(p, cfg), task, tc,
                         evaluate=modular_evaluate(task))
    return runs


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
    from ..tasks.agreement import encode_prompts, filter_prompts

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


# --------------------------------------------------------------------------- grokking summaries
def pick_steps(steps: Sequence[int], n: int) -> list[int]:
    """At most n of the given steps, evenly spread over their index (first and last always kept)."""
    steps = sorted(set(int(s) for s in steps))
    if len(steps) <= n:
        return steps
    return sorted({steps[int(round(i))] for i in np.linspace(0, len(steps) - 1, n)})


def joint_crossing(metrics: pd.DataFrame, column: str = "acc_test", threshold: float = 0.99) -> float:
    """The first evaluated step at which *every* member's `column` is >= threshold (nan if none): the
    paper's grokking point, the first checkpoint where all models reach 0.99 test accuracy."""
    wide = metrics.pivot_table(index="step", columns="member", values=column).sort_index()
    hit = wide.index[(wide >= threshold).all(axis=1).to_numpy()]
    return float(hit[0]) if len(hit) else float("nan")


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


def _num(x) -> float:
    return float("nan") if x is None or pd.isna(x) else float(x)


def eigen_frequencies(eigenvalues, p: int) -> np.ndarray:
    """|angle| x p / (2 pi) of each eigenvalue, sorted: integers k for the rotations e^{+-2 pi i k / p}
    of a Fourier-feature algorithm."""
    return np.sort(np.abs(np.angle(np.asarray(eigenvalues)))) * p / (2 * np.pi)


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
