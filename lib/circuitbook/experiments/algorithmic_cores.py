"""Chapter `algorithmic_cores`: "Transformers converge to invariant algorithmic cores"
(Schiffman, arXiv 2602.22600), reimplemented from the chapter's spec in PAPERS.md.

Everything the chapter's notebooks share lives here, so that every notebook gets the same runs
by calling the same function with the same Params.

Planted system (notebook 01)
    `planted_system`      a latent linear system with known core and known operator, embedded in a
                          larger activation space with distracting directions; `PlantedModel` reads
                          it out through a hook, so the whole ACE pipeline runs on it.
Readout-side validation (all toy-model notebooks)
    `final_residual`      activations of the last residual stream and the readout after it;
    `validate_readout`    keep / remove / flip for every rank k, evaluated by re-running only the
                          readout (final LayerNorm + unembedding) on the intervened activations,
                          which gives exactly `ace.validate_core` at that hook, thousands of times faster.
Markov chains (notebook 02, AC-1..AC-4)
    `markov_setup`, `train_markov`, `markov_member_analysis`, `markov_pairs`, `eig_relative_error`.
Grokking (notebook 03, AC-5..AC-7)
    `grokking_setup`, `train_grokking`, `auto_fork_step`, `train_wd0_branch`, `modular_core_at`,
    `core_trajectory`, `shift_operator`, `unit_circle_deviation`.
Delay law (notebook 04, AC-8)
    `first_crossing`, `grokking_times`, `fit_power_law`, `train_omega_sweep`, `train_p_sweep`.
Agreement in a language model (notebook 05, AC-9)
    `agreement_margin`, `agreement_metric`, `layer_cores`, `flip_effect`, `greedy_generate`,
    `first_verb_number`, `spearman_alignment`.

Steps and epochs: the training loop counts optimizer steps. With a fixed training set of n
examples and batch B there are ceil(n / B) steps per epoch (`FixedDataset.steps_per_epoch`); a
batch >= n is full-batch training (one step per epoch). `epochs_to_steps` converts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
from transformer_lens import HookedRootModule
from transformer_lens.hook_points import HookPoint

from ..analysis import ace
from ..analysis.compare import cca, projector_overlap, weight_cosine
from ..models.toy import ToyConfig, ToyTransformer
from ..tasks.base import Batch
from ..tasks.markov import MarkovChain, MarkovSequences
from ..tasks.modular import ModularAddition
from ..train import Ensemble, Run, TrainConfig, _tensor_digest, pool_accuracy
from ..train import train as _train

CHANCE_TOL = 0.05  # necessary dimension: remove-accuracy within this of chance
SUFFICIENT_TOL = 0.02  # sufficient dimension: keep-accuracy within this of the clean accuracy


def set_threads(n: int | None) -> int:
    """torch.set_num_threads(n) unless n is None; returns the number of threads in use.

    Small models run op by op in microseconds; with several OpenMP threads on a CPU that other
    processes keep busy, every op waits for its threads (we measured 15-20 ms per tiny einsum), so
    one thread is much faster there. None keeps torch's default.
    """
    if n is not None:
        torch.set_num_threads(int(n))
    return torch.get_num_threads()


def centred_logits(logits: torch.Tensor) -> torch.Tensor:
    """The task outputs for ACE: logits minus their mean (a common shift changes no prediction)."""
    return logits - logits.mean(-1, keepdim=True)


def epochs_to_steps(epochs: int, n_train: int, batch_size: int) -> int:
    """Optimizer steps of `epochs` passes over n_train examples at batch_size (ceil per epoch)."""
    return int(epochs) * max(1, -(-int(n_train) // int(batch_size)))


# --------------------------------------------------------------------------- planted system
@dataclass
class PlantedSystem:
    """A known answer for ACE.

    Latent z_t in R^r follows z_{t+1} = A z_t + noise (eigenvalues of A known). Activations
    h = offset + U z + V n + W c: U [D, r] the true core, V [D, n_nuisance] large-variance nuisance
    that the outputs ignore, W [D, n_silent] directions the outputs read strongly but along which
    the activations never vary (c constant). logits = h R^T + b with R reading U and W only.
    Labels are the clean argmax, so clean accuracy is 1.
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

    @property
    def eigenvalues(self) -> torch.Tensor:
        eig = torch.linalg.eigvals(self.A)
        return eig[torch.argsort(eig.abs(), descending=True, stable=True)]

    @property
    def jacobians(self) -> torch.Tensor:
        """d logits / d h for every sample: the readout, [N, n_classes, D]."""
        return self.readout.expand(self.H.shape[0], *self.readout.shape)


def planted_system(D: int = 24, n_sequences: int = 200, length: int = 25, rho: float = 0.95,
                   theta: float = math.pi / 6, third: float = 0.6, noise: float = 0.3,
                   nuisance_scale: float = 4.0, n_nuisance: int = 6, n_silent: int = 3, n_classes: int = 4,
                   seed: int = 0) -> PlantedSystem:
    """A planted 3-dimensional core with operator eigenvalues rho e^{+-i theta} and `third`."""
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
    design = torch.cat([torch.ones(n, 1, dtype=dt), z], 1)
    nuisance -= design @ torch.linalg.lstsq(design, nuisance).solution  # in-sample: uncorrelated with z, mean 0
    offset = torch.randn(D, generator=gen, dtype=dt)
    H = offset + z @ U.T + nuisance @ V.T
    readout = torch.randn(n_classes, 3, generator=gen, dtype=dt) @ U.T \
        + 5.0 * torch.randn(n_classes, n_silent, generator=gen, dtype=dt) @ W.T
    bias = -(readout @ offset)
    labels = (H @ readout.T + bias).argmax(-1)
    return PlantedSystem(H=H, Z=Z, U=U, V=V, W=W, A=A, readout=readout, bias=bias, labels=labels)


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
    """Logits from the last residual stream: final LayerNorm (if any) and unembedding."""
    x = resid.to(model.W_U.dtype)
    if model.cfg.normalization == "LN":
        x = model.ln_final(x)
    return model.unembed(x)


def final_residual(model: ToyTransformer, tokens: torch.Tensor, position: int | str = -1,
                   batch_size: int = 4096) -> torch.Tensor:
    """Activations of the last residual stream: [N, D] at one position, [N, pos, D] for 'all'."""
    return ace.collect_activations(model, tokens, final_hook(model.cfg), position=position, batch_size=batch_size)


@torch.no_grad()
def validate_readout(model: ToyTransformer, resid: torch.Tensor, labels: torch.Tensor, core: ace.AceCore,
                     chance: float, ks: Sequence[int] | None = None, modes: Sequence[str] = ace.INTERVENTIONS,
                     sufficient_tol: float = SUFFICIENT_TOL, necessary_tol: float = CHANCE_TOL) -> ace.CoreValidation:
    """`ace.validate_core` at the last residual stream, computed from its activations (mean-centred).

    resid [..., D] are the clean activations at `final_hook` (every position that is scored);
    labels [...] the targets. Intervening there changes nothing upstream, so the intervened
    logits are just `readout(intervened resid)`. Interventions are centred at core.mu (mean
    ablations), as in `ace.validate_core(centered=True)`.
    """
    ks = list(range(1, core.rank + 1)) if ks is None else [int(k) for k in ks]
    if not ks or any(not 1 <= k <= core.rank for k in ks):
        raise ValueError(f"ks={ks!r} is not allowed; expected integers in [1, rank={core.rank}]")
    h = resid.reshape(-1, resid.shape[-1]).float()
    y = labels.reshape(-1)
    Q, mu = core.Q.float(), core.mu.float()

    def acc(x):
        return (readout(model, x).argmax(-1) == y).float().mean().item()

    clean = acc(h)
    if model.cfg.normalization is None:
        scores = _affine_scores(model, h, y, Q, mu, ks, modes)
    else:
        scores = {m: [acc(ace.apply_intervention(h, Q[:, :k], mu, m)) if m in modes else float("nan") for k in ks]
                  for m in ace.INTERVENTIONS}
    return ace.CoreValidation(ks=ks, clean=clean, keep=scores["keep"], remove=scores["remove"], flip=scores["flip"],
                             chance=chance,
                             sufficient_dim=ace.sufficient_dimension(ks, scores["keep"], clean, sufficient_tol)
                             if "keep" in modes else None,
                             necessary_dim=ace.necessary_dimension(ks, scores["remove"], chance, necessary_tol)
                             if "remove" in modes else None,
                             centered=True)


def readout_jacobians(model: ToyTransformer, resid: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """d centred_logits / d resid for every row of resid [N, D] -> [N, n_out, D].

    At the last residual stream only the readout (final LayerNorm, unembedding) lies downstream, so
    the Jacobian of the task outputs is the readout's Jacobian, computed per row with torch.func
    (the same numbers `ace.collect_ace_inputs` gets by back-propagating through the whole model).
    """
    from torch.func import jacrev, vmap

    def f(h):
        return centred_logits(readout(model, h[None])[0])

    with torch.no_grad():
        if model.cfg.normalization is None:  # an affine readout: one Jacobian for every row
            return jacrev(f)(resid[0].float()).expand(resid.shape[0], -1, -1)
        out = [vmap(jacrev(f))(resid[i:i + chunk].float()) for i in range(0, resid.shape[0], chunk)]
    return torch.cat(out)


@torch.no_grad()
def _affine_scores(model, h, y, Q, mu, ks, modes) -> dict[str, list[float]]:
    """keep / remove / flip accuracies for every k when the readout is affine (no final LayerNorm).

    logits(h) = h W_U + b_U, so with z = (h - mu) Q and u_j = q_j W_U the intervened logits are rank-one
    updates: keep_k = logits(mu) + sum_{j<=k} z_j u_j, remove_k = logits(h) - sum_{j<=k} z_j u_j,
    flip_k = logits(h) - 2 sum_{j<=k} z_j u_j. One pass over k instead of one readout per k.
    """
    W = model.W_U.float()
    z = (h - mu) @ Q  # [N, K]
    U = Q.T @ W  # [K, n_out]
    full = readout(model, h)
    base = readout(model, mu[None])
    part = torch.zeros_like(full)
    wanted = set(ks)
    scores = {m: [] for m in ace.INTERVENTIONS}
    for j in range(max(ks)):
        part += z[:, j:j + 1] * U[j]
        if j + 1 not in wanted:
            continue
        for m, logits in (("keep", base + part), ("remove", full - part), ("flip", full - 2 * part)):
            scores[m].append((logits.argmax(-1) == y).float().mean().item() if m in modes else float("nan"))
    order = sorted(wanted)
    return {m: [v[order.index(k)] for k in ks] for m, v in scores.items()}


def ace_final(model: ToyTransformer, tokens: torch.Tensor, position: int | str = -1,
              energy_threshold: float = 0.99, rank: int | None = None, batch_size: int = 4096):
    """(core, inputs) of ACE at the last residual stream, task outputs = centred logits.

    With position='all' every position of every sequence is a sample (sequence-major rows).
    """
    acts = final_residual(model, tokens, position=position, batch_size=batch_size)
    n_pos = acts.shape[1] if position == "all" else 1
    acts = acts.reshape(-1, acts.shape[-1])
    inputs = ace.AceInputs(activations=acts, jacobians=readout_jacobians(model, acts),
                           n_sequences=tokens.shape[0], n_positions=n_pos)
    core = ace.extract_core(inputs.activations, inputs.jacobians, energy_threshold=energy_threshold, rank=rank)
    return core, inputs


# --------------------------------------------------------------------------- Markov chains
def next_token_accuracy(pools: dict[str, Batch], prefix: str = "acc_"):
    """An evaluation callback: every-position next-token accuracy of every member on each pool."""

    @torch.no_grad()
    def evaluate(ens: Ensemble, step: int) -> dict:
        out = {}
        for name, batch in pools.items():
            pred = ens.logits(batch.tokens).argmax(-1)  # [K, B, T]
            out[prefix + name] = (pred == batch.labels).float().mean((-1, -2))
        return out

    evaluate.spec = lambda: {"next_token_accuracy": {k: _tensor_digest(b.tokens, b.labels) for k, b in pools.items()},
                             "prefix": prefix}
    return evaluate


@dataclass
class MarkovExperiment:
    chain: MarkovChain
    task: MarkovSequences
    model_config: ToyConfig
    train_config: TrainConfig
    run: Run | None = None


def markov_setup(cfg) -> MarkovExperiment:
    """Chain, data, model and training configs from a notebook's Params (see profiles.yml)."""
    chain = MarkovChain.circulant(cfg.markov_states, cfg.markov_stay)
    task = MarkovSequences(chain, n_train=cfg.markov_n_train, n_test=cfg.markov_n_test, length=cfg.markov_length,
                           data_seed=0)
    model_cfg = ToyConfig(d_vocab=chain.n_states, n_ctx=cfg.markov_length - 1, d_model=cfg.markov_d_model,
                          n_layers=1, n_heads=cfg.markov_n_heads, d_mlp=cfg.markov_d_mlp, normalization="LN")
    steps = epochs_to_steps(cfg.markov_epochs, len(task), cfg.markov_batch)
    train_cfg = TrainConfig(steps=steps, batch_size=cfg.markov_batch, seeds=tuple(cfg.markov_seeds), lr=cfg.markov_lr,
                            weight_decay=0.0, eval_every=max(1, steps // 20), log_checkpoints=8)
    return MarkovExperiment(chain, task, model_cfg, train_cfg)


def train_markov(cfg) -> MarkovExperiment:
    """Train (or load) the Markov ensemble: one member per seed, one shared training set."""
    exp = markov_setup(cfg)
    test = exp.task.test
    n_eval = min(len(test.tokens), cfg.markov_eval_sequences)
    evaluate = next_token_accuracy({"train": Batch(exp.task.tokens[:n_eval], exp.task.labels[:n_eval]),
                                    "test": Batch(test.tokens[:n_eval], test.labels[:n_eval])})
    exp.run = _train("algorithmic_cores/markov", exp.model_config, exp.task, exp.train_config, evaluate=evaluate)
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
    coords: torch.Tensor  # [S, T, r] core coordinates of the analysis sequences
    operator: ace.CoreOperator
    eig_rel_error: float
    op_coords: torch.Tensor  # [S, T, n_states - 1] the coordinates the operator was fitted on
    states: torch.Tensor  # [S, T] the current state at each of those positions


def eig_relative_error(estimated: torch.Tensor, reference: torch.Tensor) -> float:
    """max_i |est_i - ref_i| / |ref_i| after matching the two sets of (complex) eigenvalues optimally.

    Needs len(estimated) >= len(reference); the best-matching subset of `estimated` is used.
    """
    from scipy.optimize import linear_sum_assignment

    est = np.asarray(torch.as_tensor(estimated).to(torch.complex128))
    ref = np.asarray(torch.as_tensor(reference).to(torch.complex128))
    if est.size < ref.size or ref.size == 0:
        raise ValueError(f"need at least as many estimated ({est.size}) as reference ({ref.size}) eigenvalues")
    cost = np.abs(est[:, None] - ref[None, :]) / np.abs(ref)[None, :]
    rows, cols = linear_sum_assignment(cost)
    return float(cost[rows, cols].max())


def markov_member_analysis(exp: MarkovExperiment, member: int, n_sequences: int = 500,
                           energy_threshold: float = 0.99) -> MarkovMember:
    """ACE on one Markov model at its last residual stream, every position a sample.

    The core is extracted on the first n_sequences test sequences and validated (keep / remove /
    flip, every k up to the rank) on the next n_sequences, so the causal test uses inputs the
    extraction never saw. The operator is fitted on the extraction sequences' core coordinates,
    position t -> t + 1, with an intercept, on the first (n_states - 1) core directions: the
    dynamics of a chain live in the n_states - 1 dimensions orthogonal to the stationary state.
    """
    model = exp.run.model(member)
    test = exp.task.test
    n = min(n_sequences, len(test.tokens) // 2)
    fit_tokens, val_tokens, val_labels = test.tokens[:n], test.tokens[n:2 * n], test.labels[n:2 * n]
    core, inputs = ace_final(model, fit_tokens, position="all", energy_threshold=energy_threshold)
    val_resid = final_residual(model, val_tokens, position="all")
    full = ace.extract_core(inputs.activations, inputs.jacobians, rank=min(core.sigma.numel(), 2 * core.rank + 4))
    validation = validate_readout(model, val_resid, val_labels, full, chance=1 / exp.chain.n_states)
    m = exp.chain.n_states - 1
    op_core = full.truncate(min(m, full.rank))
    coords = op_core.coordinates(inputs.activations).reshape(n, -1, op_core.rank)
    operator = ace.fit_core_operator(coords, intercept=True)
    reference = exp.chain.eigenvalues()[1:]  # drop the eigenvalue 1 (the stationary direction)
    err = eig_relative_error(operator.eigenvalues, reference) if op_core.rank >= len(reference) else float("nan")
    with torch.no_grad():
        acc = (model(val_tokens).argmax(-1) == val_labels).float().mean().item()
    return MarkovMember(member=member, seed=exp.train_config.seeds[member], accuracy=acc, core=core,
                        validation=validation, coords=core.coordinates(inputs.activations).reshape(n, -1, core.rank),
                        operator=operator, eig_rel_error=err, op_coords=coords, states=fit_tokens)


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


def markov_pairs(exp: MarkovExperiment, members: Sequence[MarkovMember]) -> pd.DataFrame:
    """Every pair of runs: projector overlap of the cores, CCA of the core coordinates on the
    same inputs, cosine of the weight matrices, and the random-subspace overlap for reference."""
    rows = []
    for i in range(len(members)):
        for j in range(i + 1, len(members)):
            a, b = members[i], members[j]
            D = a.core.dim
            ca = a.coords.reshape(-1, a.core.rank)
            cb = b.coords.reshape(-1, b.core.rank)
            rows.append({"pair": f"{a.seed} vs {b.seed}", "overlap": projector_overlap(a.core, b.core),
                         "random_overlap": math.sqrt(a.core.rank * b.core.rank) / D,
                         "cca_mean": cca(ca, cb).mean, "cca_min": float(cca(ca, cb).correlations.min()),
                         "weight_cosine": weight_cosine(weight_matrices(exp.run.model(a.member)),
                                                        weight_matrices(exp.run.model(b.member))).overall})
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


def modular_model_config(p: int, n_layers: int, d_model: int, n_heads: int, d_mlp: int) -> ToyConfig:
    """The grokking transformer: `a b =` -> (a + b) mod p at the last position; biases, learned
    positions, ReLU MLP, no LayerNorm (as in the usual grokking setups). With LayerNorm and AdamW at
    weight decay 1 our calibration runs showed repeated loss spikes after memorisation (train
    accuracy collapsing to chance and recovering), which blur tau_mem and tau_grok."""
    return ToyConfig(d_vocab=p + 1, n_ctx=3, d_model=d_model, n_layers=n_layers, n_heads=n_heads, d_mlp=d_mlp,
                     d_vocab_out=p, normalization=None)


def grokking_setup(cfg) -> GrokkingExperiment:
    task = ModularAddition(p=cfg.grok_p, train_fraction=cfg.grok_train_fraction, split_seed=0)
    model_cfg = modular_model_config(cfg.grok_p, cfg.grok_layers, cfg.grok_d_model, cfg.grok_heads, cfg.grok_d_mlp)
    steps = epochs_to_steps(cfg.grok_epochs, len(task), cfg.grok_batch)
    every = epochs_to_steps(cfg.grok_checkpoint_every_epochs, len(task), cfg.grok_batch)
    train_cfg = TrainConfig(steps=steps, batch_size=cfg.grok_batch, seeds=tuple(cfg.grok_seeds), lr=cfg.grok_lr,
                            weight_decay=cfg.grok_wd, eval_every=max(1, min(every, steps // 100) // 1),
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


def train_wd0_branch(exp: GrokkingExperiment, fork_step: int) -> GrokkingExperiment:
    """Fork every member at `fork_step` and continue with weight decay 0 to the same final step."""
    from dataclasses import replace

    tc = replace(exp.train_config, weight_decay=0.0)
    exp.fork_step = fork_step
    exp.branch = _train("algorithmic_cores/grokking_wd0", exp.model_config, exp.task, tc,
                        evaluate=modular_evaluate(exp.task), fork_from=(exp.run, fork_step))
    return exp


def unit_circle_deviation(eigenvalues) -> float:
    """mean_i | |lambda_i| - 1 |: 0 when every eigenvalue lies on the unit circle."""
    eig = torch.as_tensor(eigenvalues)
    return float((eig.abs() - 1).abs().mean())


def shift_sequences(coords: torch.Tensor, p: int) -> torch.Tensor:
    """Core coordinates of all p^2 inputs (ordered a-major, as ModularAddition.all) -> [p, p + 1, r]:
    for each a, the cycle b = 0, 1, ..., p - 1, 0 (the step b -> b + 1 mod p)."""
    grid = coords.reshape(p, p, -1)
    return torch.cat([grid, grid[:, :1]], 1)


def shift_operator(core: ace.AceCore, activations: torch.Tensor, p: int) -> ace.CoreOperator:
    """The linear operator of the shift b -> b + 1 in core coordinates (fitted over every a)."""
    return ace.fit_core_operator(shift_sequences(core.coordinates(activations), p), intercept=True)


def modular_core_at(model: ToyTransformer, task: ModularAddition, energy_threshold: float = 0.99,
                    max_rank: int | None = None) -> dict:
    """ACE of one modular-addition model at its last residual stream (last position), all p^2 inputs.

    Returns the energy rank r, the sufficient and necessary dimensions (keep / remove for every k
    up to max_rank, default the activation dimension), keep accuracy at r relative to clean, and
    the shift operator's eigenvalues in the r-dimensional core.
    """
    tokens, labels = task.all.tokens, task.all.labels
    core, inputs = ace_final(model, tokens, position=-1, energy_threshold=energy_threshold, batch_size=4096)
    n_modes = core.sigma.numel()
    full = ace.extract_core(inputs.activations, inputs.jacobians,
                            rank=min(n_modes, max_rank or inputs.activations.shape[1]))
    val = validate_readout(model, inputs.activations, labels, full, chance=1 / task.p, modes=("keep", "remove"))
    k = min(core.rank, full.rank)
    op = shift_operator(core, inputs.activations, task.p)
    return {"rank": core.rank, "sufficient_dim": val.sufficient_dim, "necessary_dim": val.necessary_dim,
            "clean_acc": val.clean, "keep_acc_at_rank": val.keep[k - 1], "remove_acc_at_rank": val.remove[k - 1],
            "keep_ratio_at_rank": val.keep[k - 1] / max(val.clean, 1e-12),
            "eigenvalues": op.eigenvalues, "unit_circle_deviation": unit_circle_deviation(op.eigenvalues),
            "operator_r2": op.r2, "validation": val, "core": core}


def core_trajectory(run: Run, task: ModularAddition, steps: Sequence[int], member: int = 0,
                    energy_threshold: float = 0.99) -> pd.DataFrame:
    """`modular_core_at` at each checkpoint step of one member, with that step's accuracies."""
    metrics = run.metrics()
    rows = []
    for step in steps:
        res = modular_core_at(run.model(member, step), task, energy_threshold)
        m = metrics[(metrics.member == member) & (metrics.step <= step)].sort_values("step").iloc[-1]
        rows.append({"step": int(step), "member": member, "acc_train": m["acc_train"], "acc_test": m["acc_test"],
                     **{k: v for k, v in res.items() if k not in ("validation", "core", "eigenvalues")},
                     "eigenvalues": res["eigenvalues"].numpy()})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- delay law
@dataclass(frozen=True)
class PowerLawFit:
    """log y = log c + exponent * log x (ordinary least squares on the logs).

    ci: the t-based confidence interval of the exponent (level `level`); boot_ci: the percentile
    bootstrap interval from resampling the points.
    """

    exponent: float
    prefactor: float
    ci: tuple[float, float]
    boot_ci: tuple[float, float]
    r2: float
    n: int
    level: float

    def contains(self, value: float) -> bool:
        return self.ci[0] <= value <= self.ci[1]


def fit_power_law(x, y, level: float = 0.95, n_boot: int = 2000, seed: int = 0) -> PowerLawFit:
    """Fit y = c x^exponent on positive, finite points (others are dropped)."""
    from scipy import stats

    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
    lx, ly = np.log(x[ok]), np.log(y[ok])
    n = int(ok.sum())
    if n < 3 or np.unique(lx).size < 2:
        raise ValueError(f"need at least 3 positive points at >= 2 distinct x to fit a power law; got {n}")
    res = stats.linregress(lx, ly)
    tcrit = stats.t.ppf(0.5 + level / 2, n - 2)
    ci = (res.slope - tcrit * res.stderr, res.slope + tcrit * res.stderr)
    rng = np.random.default_rng(seed)
    slopes = []
    for _ in range(n_boot):
        idx = rng.integers(0, n, n)
        if np.unique(lx[idx]).size < 2:
            continue
        slopes.append(np.polyfit(lx[idx], ly[idx], 1)[0])
    lo, hi = np.percentile(slopes, [50 * (1 - level), 50 * (1 + level)])
    return PowerLawFit(exponent=float(res.slope), prefactor=float(np.exp(res.intercept)), ci=(float(ci[0]), float(ci[1])),
                       boot_ci=(float(lo), float(hi)), r2=float(res.rvalue ** 2), n=n, level=level)


def sweep_model_config(p: int, cfg) -> ToyConfig:
    return modular_model_config(p, 1, cfg.sweep_d_model, cfg.sweep_heads, cfg.sweep_d_mlp)


def train_omega_sweep(cfg) -> tuple[Run, pd.DataFrame]:
    """The weight-decay sweep at p = cfg.sweep_omega_p: one ensemble, one member per (omega, seed).

    Returns the run and a member table (member, seed, omega)."""
    task = ModularAddition(p=cfg.sweep_omega_p, train_fraction=cfg.sweep_train_fraction, split_seed=0)
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
        task = ModularAddition(p=p, train_fraction=cfg.sweep_train_fraction, split_seed=0)
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


def agreement_metric(singular_id: int, plural_id: int) -> Callable[[torch.Tensor, torch.Tensor], float]:
    """Agreement accuracy: the sign of the last-position margin matches the label (+1 / -1)."""

    def metric(logits: torch.Tensor, labels: torch.Tensor) -> float:
        margin = logits[:, -1, singular_id] - logits[:, -1, plural_id]
        return (torch.sign(margin).cpu() == labels.cpu().sign()).float().mean().item()

    return metric


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
    n_verb_first: int = 0  # test prompts whose clean greedy continuation starts with an agreeing verb
    n_verb_first_bare: int = 0  # the same without the generation context


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
                           generations=generations, gen_flip_rate=gen_flip, n_verb_first=int(sum(starts_with_verb)),
                           n_verb_first_bare=int(sum(bare_verb_first)))


# --------------------------------------------------------------------------- grokking summaries
def pick_steps(steps: Sequence[int], n: int) -> list[int]:
    """At most n of the given steps, evenly spread over their index (first and last always kept)."""
    steps = sorted(set(int(s) for s in steps))
    if len(steps) <= n:
        return steps
    return sorted({steps[int(round(i))] for i in np.linspace(0, len(steps) - 1, n)})


def grokking_summary(traj: pd.DataFrame, times: pd.DataFrame) -> pd.DataFrame:
    """Per member, the core before, at and after grokking (AC-5, AC-6).

    traj: `core_trajectory` rows of one run (all members); times: `grokking_times` of that run.
    "before" is every trajectory checkpoint in [tau_mem, tau_grok) (every one before tau_grok if
    none), "at grokking" the first checkpoint at or after tau_grok, "final" the last one. Members
    that never grokked get a row with NaNs.
    """
    rows = []
    for _, tm_row in times.iterrows():
        m, tm, tg = int(tm_row["member"]), tm_row["tau_mem"], tm_row["tau_grok"]
        t = traj[traj.member == m].sort_values("step")
        row = {"member": m, "seed": int(tm_row["seed"]), "tau_mem": tm, "tau_grok": tg}
        if math.isnan(tg) or t.empty or not (t.step >= tg).any():
            rows.append(row)
            continue
        pre = t[(t.step >= (0 if math.isnan(tm) else tm)) & (t.step < tg)]
        if pre.empty:
            pre = t[t.step < tg]
        post, final = t[t.step >= tg].iloc[0], t.iloc[-1]
        nan = float("nan")
        row.update({"grok checkpoint": int(post.step),
                    "rank before (max)": float(pre["rank"].max()) if len(pre) else nan,
                    "rank at grokking": float(post["rank"]),
                    "keep ratio at grokking": float(post["keep_ratio_at_rank"]),
                    "remove acc at grokking": float(post["remove_acc_at_rank"]),
                    "deviation before (median)": float(pre["unit_circle_deviation"].median()) if len(pre) else nan,
                    "deviation at grokking": float(post["unit_circle_deviation"]),
                    "deviation final": float(final["unit_circle_deviation"]),
                    "necessary at grokking": _num(post["necessary_dim"]), "necessary final": _num(final["necessary_dim"]),
                    "sufficient at grokking": _num(post["sufficient_dim"]),
                    "sufficient final": _num(final["sufficient_dim"]), "rank final": float(final["rank"])})
        rows.append(row)
    return pd.DataFrame(rows)


def _num(x) -> float:
    return float("nan") if x is None or pd.isna(x) else float(x)


def dimension_growth(traj: pd.DataFrame, tau_grok: float) -> dict:
    """Necessary-dimension growth and sufficient-dimension ratio from the first checkpoint at or after
    tau_grok (the first checkpoint if tau_grok is nan or never reached) to the last one (AC-7)."""
    t = traj.sort_values("step")
    reached = not math.isnan(tau_grok) and (t.step >= tau_grok).any()
    start = t[t.step >= tau_grok].iloc[0] if reached else t.iloc[0]
    end = t.iloc[-1]

    def ratio(a, b):
        a, b = _num(a), _num(b)
        return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")

    return {"necessary growth": ratio(end["necessary_dim"], start["necessary_dim"]),
            "sufficient ratio": ratio(end["sufficient_dim"], start["sufficient_dim"]),
            "from step": int(start["step"]), "to step": int(end["step"]), "from grokking": reached}
