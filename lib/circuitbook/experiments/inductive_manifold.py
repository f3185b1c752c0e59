"""Chapter `inductive_manifold`: "Invariant learning dynamics of transformers in inductive reasoning
tasks" (Musat, Pimentel, Zucchet, Hofmann; arXiv 2607.11875), built from the spec in PAPERS.md
(the paper has no public code and its full text was not available).

What the notebooks share:

Tasks and symmetries (01)       `example_table`, `pvalue_table`, `power_curve`
The manifold, IM-1 (02)         `EnumeratedTask`, `gradient_grid`, `broken_assumptions`,
                                `monte_carlo_outside`, `train_in_and_off_s`
Two layers, IM-2..IM-4 (03)     `recall_task`, `Probe`, `train_restricted_and_full`, `loss_gap`,
                                `crossing_steps`, `train_scaling`, `icl_gradient`,
                                `saturating_delta`, `train_suppression_sweep`, `suppression_table`,
                                `train_burstiness_sweep`, `burstiness_table`, `train_standard`
Initialisation, IM-5 (04)       `three_layer_directions`, `CIRCUITS`, `InitTable`, `init_design`,
                                `train_init_ensemble`, `winners`, `logistic_fit`, `nested_fits`,
                                `paired_gap`, `point_outcomes`, `boundary_sharpness`
Circuit detection, IM-6 (05)    `train_two_hop`, `backward_elimination`, `aiding_split`, `circuit_graph`,
                                `finds_two_hop_circuit`, `random_chain_rate`

Conventions: every training run goes through `circuitbook.train` (ensembles of seeds and sweeps);
the loss is the library's last-position cross-entropy; "unit directions": an IMIRModel's phi and
`IMIRBasis.direction_value` are coefficients on directions of unit Frobenius norm in weight
space, so restricted and unrestricted models are read in the same units.
"""
from __future__ import annotations

import hashlib
import math
from typing import Callable, Mapping, Sequence

import numpy as np
import pandas as pd
import torch

from ..analysis import curves, imir
from ..models.imir import IMIRConfig, IMIRModel
from ..tasks.base import Batch, FixedDataset, derive_seed
from ..tasks.blocklist import KINDS, BlockListTask, rejection_rate, symmetry_test
from ..training import Run, TrainConfig, default_device, train
from ..training import tensor_digest as _tensor_digest


def set_threads(n: int | None) -> int:
    """torch.set_num_threads(n) unless n is None (one thread is fastest for these small models on a busy CPU)."""
    if n is not None:
        torch.set_num_threads(int(n))
    return torch.get_num_threads()


# =============================================================================== 01 tasks and symmetries

def example_tasks(n_pairs: int = 8, n_blocks: int = 4, n_rare: int = 4, f_r: float = 0.25, f_v: float = 0.25,
                  n_fill: int = 2) -> dict[str, BlockListTask]:
    """One task of every kind with the same knobs (k-hop: 2 hops; n-gram: trigrams)."""
    return {kind: BlockListTask(kind, n_pairs=n_pairs, n_rare=n_rare, n_blocks=n_blocks, hops=2, ngram=3,
                                f_r=f_r, f_v=f_v, n_fill=n_fill, bos=True) for kind in KINDS}


def example_table(tasks: Mapping[str, BlockListTask], n: int, seed: int) -> pd.DataFrame:
    rows = []
    for kind, task in tasks.items():
        s = task.sample(n, seed)
        for i in range(n):
            rows.append({"task": kind, "sequence | query -> target": task.describe(s, i),
                         "query chain": "rare" if s.is_rare[i] else ("canonical" if s.canonical[i] else "non-canonical"),
                         "first labels": " ".join(map(str, s.positions[i, :4].tolist()))})
    return pd.DataFrame(rows)


def pvalue_table(cases: Mapping[str, tuple[BlockListTask, str]], n: int, reps: int, first_seed: int = 0) -> pd.DataFrame:
    """p-values of `reps` symmetry tests for each named (task, transform): the combined p-value and,
    in columns p_<feature>, the p-value of every feature's chi-square test."""
    rows = []
    for name, (task, transform) in cases.items():
        for r in range(reps):
            res = symmetry_test(task, transform, n, first_seed + r)
            rows.append({"case": name, "rep": r, "p_value": res["p_value"],
                         **{f"p_{f}": p for f, p in res["feature_p_values"].items()}})
    return pd.DataFrame(rows)


def power_curve(cases: Mapping[str, tuple[BlockListTask, str]], ns: Sequence[int], reps: int,
                alpha: float) -> pd.DataFrame:
    rows = []
    for name, (task, transform) in cases.items():
        for n in ns:
            rows.append({"case": name, "n": n, "rejection_rate": rejection_rate(task, transform, n, reps, alpha)})
    return pd.DataFrame(rows)


# =============================================================================== 02 the manifold (IM-1)

class EnumeratedTask(FixedDataset):
    """The whole distribution of a small task as a fixed training set (full-batch training on it
    is gradient descent on the exact expected loss). Every outcome must be equally likely."""

    def __init__(self, task: BlockListTask, max_outcomes: int = 200_000):
        s, prob = task.enumerate_outcomes(max_outcomes)
        if not torch.allclose(prob, prob[0].expand_as(prob), rtol=1e-9, atol=0):
            raise ValueError(f"EnumeratedTask: the outcomes of {task!r} are not equally likely (use f_r and f_v in "
                             "{0, 1} and zipf = 0), so a plain mean over them is not the expected loss")
        self.task = task
        super().__init__(task.model_inputs(s), s.targets, vocab_size=task.vocab_size, n_outputs=task.n_outputs)

    def spec(self) -> dict:
        return {"enumerated": self.task.spec(), "n": len(self)}


def _grad_outside(model, basis, task, grads=None) -> dict:
    g = grads if grads is not None else imir.expected_gradient(model, task)
    out = basis.outside(g, g.keys())
    return {"outside": out["relative"], "grad_norm": out["total"]}


def gradient_grid(task: BlockListTask, n_layers: int, n_points: int, scale: float, first_seed: int = 0) -> pd.DataFrame:
    """IM-1 numerically: the exact expected gradient at `n_points` random points of S."""
    layout = imir.Layout.from_task(task)
    basis = imir.IMIRBasis.concatenated(layout, n_layers, 1)
    rows = []
    for i in range(n_points):
        seed = first_seed + i
        model = imir.theory_model(layout, n_layers, 1, coords=basis.random_point(seed, scale))
        rows.append({"layers": n_layers, "point": i, **_grad_outside(model, basis, task)})
    return pd.DataFrame(rows)


def broken_assumptions(task: BlockListTask, n_layers: int, scale: float, seed: int = 0,
                       zipf: float = 1.0) -> pd.DataFrame:
    """The exact expected gradient at one point of S when one assumption of Theorem 1 is broken."""
    layout = imir.Layout.from_task(task)
    basis = imir.IMIRBasis.concatenated(layout, n_layers, 1)
    theta = basis.random_point(seed, scale)
    intact = imir.theory_model(layout, n_layers, 1, coords=theta)
    cases = {
        "none (all assumptions hold)": (intact, task),
        "trained value-output maps": (imir.theory_model(layout, n_layers, 1, coords=theta, trained_value_maps=True), task),
        "non-orthonormal embeddings": (imir.theory_model(layout, n_layers, 1, coords=theta,
                                                         token_embedding="gaussian"), task),
        f"token symmetry broken (zipf {zipf:g})": (intact, task.with_knobs(zipf=zipf)),
        "absolute positions (no random offset)": (intact, task.with_knobs(offsets="fixed")),
    }
    rows = [{"layers": n_layers, "broken assumption": name, **_grad_outside(m, basis, t)} for name, (m, t) in cases.items()]
    return pd.DataFrame(rows)


def monte_carlo_outside(task: BlockListTask, n_layers: int, ns: Sequence[int], scale: float, seed: int = 0,
                        reps: int = 3) -> pd.DataFrame:
    """The gradient's part outside S when the expectation is a mean over n sampled sequences."""
    layout = imir.Layout.from_task(task)
    basis = imir.IMIRBasis.concatenated(layout, n_layers, 1)
    model = imir.theory_model(layout, n_layers, 1, coords=basis.random_point(seed, scale))
    rows = []
    for n in ns:
        for r in range(reps):
            g = imir.sampled_gradient(model, task, int(n), seed=1000 * r + int(n))
            rows.append({"layers": n_layers, "n": int(n), "rep": r, **_grad_outside(model, basis, task, g)})
    return pd.DataFrame(rows)


class DistanceProbe:
    """evaluate(ens, step): each member's relative distance of (W_QK, W_U) to S, and its loss on a pool."""

    def __init__(self, basis: imir.IMIRBasis, pool: Batch | None = None):
        self.basis, self.pool = basis, pool

    def spec(self) -> dict:
        return {"distance_probe": imir.asdict(self.basis.layout), "layers": self.basis.n_layers,
                "pool": None if self.pool is None else _tensor_digest(self.pool.tokens, self.pool.labels)}

    @torch.no_grad()
    def __call__(self, ens, step: int) -> dict:
        K = ens.n_members
        dist = torch.tensor([imir.distance_to_s(self.basis, {n: p[k].detach().cpu() for n, p in ens.params.items()})
                             for k in range(K)])
        out = {"distance_to_s": dist}
        if self.pool is not None:
            out["pool_loss"] = _pool_loss(ens, self.pool)
        return out


def _pool_loss(ens, pool: Batch) -> torch.Tensor:
    logits = ens.logits(pool.tokens, last_only=True)[:, :, -1].float()
    return -logits.log_softmax(-1).gather(-1, pool.labels.expand(logits.shape[0], -1)[..., None]).squeeze(-1).mean(-1)


def train_in_and_off_s(task: BlockListTask, n_layers: int, seeds: Sequence[int], steps: int, lr: float, scale: float,
                       off_s_std: float, sampled_batch: int, eval_every: int, name: str = "inductive_manifold/im1"
                       ) -> dict[str, Run]:
    """Full-parameter gradient descent on the theory's model, started at random points of S (one per seed):
    full batch on the enumerated distribution (the exact expected gradient), the same started off S, and
    SGD on sampled batches started in S."""
    layout = imir.Layout.from_task(task)
    data = EnumeratedTask(task)
    basis = imir.IMIRBasis.concatenated(layout, n_layers, 1)
    probe = DistanceProbe(basis, Batch(data.tokens, data.labels))
    cfg = imir.theory_config(layout, n_layers, 1)
    full = TrainConfig(steps=steps, batch_size=len(data), seeds=tuple(seeds), lr=lr, optimizer="sgd",
                       eval_every=eval_every, log_checkpoints=4)
    sampled = TrainConfig(steps=steps, batch_size=sampled_batch, seeds=tuple(seeds), lr=lr, optimizer="sgd",
                          eval_every=eval_every, log_checkpoints=4)
    return {
        "in S, full batch": train(f"{name}/in_s", cfg, data, full, evaluate=probe,
                                  init_fn=imir.TheoryInit(layout, random_scale=scale)),
        "off S, full batch": train(f"{name}/off_s", cfg, data, full, evaluate=probe,
                                   init_fn=imir.TheoryInit(layout, random_scale=scale, off_s_std=off_s_std)),
        "in S, sampled batches": train(f"{name}/in_s_sampled", cfg, task, sampled, evaluate=probe,
                                       init_fn=imir.TheoryInit(layout, random_scale=scale)),
    }


def s_dimensions(layout: imir.Layout, n_layers: int, n_heads: int = 1) -> pd.DataFrame:
    """Coordinates of S per weight matrix against that matrix's number of entries."""
    basis = imir.IMIRBasis.concatenated(layout, n_layers, n_heads)
    rows = []
    for l in range(n_layers):
        n = len(basis.paths[l])
        rows.append({"layers": n_layers, "weight": f"W_QK layer {l + 1}", "paths seen": n,
                     "coordinates": math.prod(basis.qk_shape(l)), "entries": n_heads * basis.D ** 2})
    rows.append({"layers": n_layers, "weight": "W_U", "paths seen": len(basis.paths[n_layers]),
                 "coordinates": math.prod(basis.readout_shape), "entries": basis.D * layout.n_tokens})
    return pd.DataFrame(rows)


# =============================================================================== 03 two layers (IM-2, IM-3, IM-4)

def recall_task(n_pairs: int, n_blocks: int, f_v: float, f_r: float = 0.0, n_rare: int = 0, burstiness: int = 1,
                bos: bool = True) -> BlockListTask:
    return BlockListTask("recall", n_pairs=n_pairs, n_rare=n_rare, n_blocks=n_blocks, f_r=f_r, f_v=f_v,
                         burstiness=burstiness, bos=bos)


def recall_pools(task: BlockListTask, n: int, seed: int = 12345) -> dict[str, Batch]:
    """Evaluation pools of the task's layout: 'icl' (non-canonical or rare queries: only the context
    answers), 'iw' (canonical common queries: the association answers) and 'task' (the task itself)."""
    icl = task.with_knobs(f_v=1.0, f_r=0.0)
    iw = task.with_knobs(f_v=0.0, f_r=0.0)
    return {"icl": icl.batch(icl.sample(n, seed)), "iw": iw.batch(iw.sample(n, seed + 1)),
            "task": task.batch(task.sample(n, seed + 2))}


def member_weights(ens, basis: imir.IMIRBasis, k: int) -> dict[str, torch.Tensor]:
    """(W_QK per layer, W_U) of ensemble member k, for a ToyTransformer or an IMIRModel ensemble."""
    if "phi" in ens.params:
        D = ens.buffers["directions"][k].detach().double().cpu()
        phi = ens.params["phi"][k].detach().double().cpu()
        theta = D * phi if D.dim() == 1 else D @ phi
        return basis.weights(theta)
    names = [f"blocks.{l}.attn.W_QK" for l in range(basis.n_layers)] + ["unembed.W_U"]
    return {n: ens.params[n][k].detach().double().cpu() for n in names}


class Probe:
    """evaluate(ens, step): accuracy on pools, loss on the 'task' pool, and the values of named
    unit directions, for ToyTransformer or IMIRModel ensembles alike."""

    def __init__(self, basis: imir.IMIRBasis, directions: Mapping[str, Mapping[str, float]],
                 pools: Mapping[str, Batch]):
        self.basis, self.pools = basis, dict(pools)
        self.directions = {k: dict(v) for k, v in directions.items()}
        self._units = {}
        for name, d in self.directions.items():
            W = basis.weights(basis.direction_weights(d))
            norm = math.sqrt(sum(w.pow(2).sum().item() for w in W.values()))
            self._units[name] = {n: w / norm for n, w in W.items()}

    def spec(self) -> dict:
        return {"probe": imir.asdict(self.basis.layout), "layers": self.basis.n_layers,
                "directions": self.directions,
                "pools": {k: _tensor_digest(b.tokens, b.labels) for k, b in self.pools.items()}}

    @torch.no_grad()
    def __call__(self, ens, step: int) -> dict:
        out = {}
        for name, pool in self.pools.items():
            logits = ens.logits(pool.tokens, last_only=True)[:, :, -1].float()
            out[f"acc_{name}"] = (logits.argmax(-1) == pool.labels).float().mean(-1)
            if name == "task":
                logp = logits.log_softmax(-1)
                out["loss_task"] = -logp.gather(-1, pool.labels.expand(logits.shape[0], -1)[..., None]).squeeze(-1).mean(-1)
        values = {name: [] for name in self._units}
        for k in range(ens.n_members):
            W = member_weights(ens, self.basis, k)
            for name, unit in self._units.items():
                values[name].append(sum((W[n] * u).sum() for n, u in unit.items()).item())
        out.update({name: torch.tensor(v) for name, v in values.items()})
        return out


def train_restricted_and_full(task: BlockListTask, seeds: Sequence[int], steps: int, lr: float, batch: int,
                              eval_every: int, pool_size: int, name: str = "inductive_manifold/im2") -> dict[str, Run]:
    """The 2-layer, 1-head theory model from zero init, three ways, plain SGD on the same batches:
    'restricted' to (alpha, beta, gamma, delta); 'full S', restricted to every coordinate of S (an
    IMIRModel of the whole manifold: unrestricted training as Theorem 1 says it goes in expectation,
    without the minibatch noise that leaves S); 'unrestricted', every W_QK and W_U entry."""
    layout = imir.Layout.from_task(task)
    basis = imir.IMIRBasis.concatenated(layout, 2, 1)
    dirs = imir.two_layer_directions(basis)
    probe = Probe(basis, dirs, recall_pools(task, pool_size))
    tc = TrainConfig(steps=steps, batch_size=batch, seeds=tuple(seeds), lr=lr, optimizer="sgd", eval_every=eval_every,
                     log_checkpoints=8)
    whole = IMIRConfig(layout.token_classes, layout.association, layout.seq_len, n_layers=2)
    return {"restricted": train(f"{name}/restricted", IMIRConfig.with_directions(layout, dirs), task, tc,
                                evaluate=probe),
            "full S": train(f"{name}/full_s", whole, task, tc, evaluate=probe),
            "unrestricted": train(f"{name}/unrestricted", imir.theory_config(layout, 2, 1), task, tc, evaluate=probe,
                                  init_fn=imir.TheoryInit(layout))}


def loss_gap(restricted: Run, unrestricted: Run, column: str = "loss_task", scale: float | None = None) -> pd.DataFrame:
    """Per seed: the largest |loss_restricted - loss_unrestricted| over the evaluated steps, divided by
    `scale` (default: the loss at step 0, log V at zero init)."""
    a = restricted.metrics().set_index(["seed", "step"])[column]
    b = unrestricted.metrics().set_index(["seed", "step"])[column]
    both = pd.concat({"r": a, "u": b}, axis=1).dropna()
    rows = []
    for seed, g in both.groupby(level="seed"):
        ref = scale if scale is not None else float(g["u"].iloc[0])
        rows.append({"seed": seed, "max_gap": float((g["r"] - g["u"]).abs().max() / ref),
                     "final_restricted": float(g["r"].iloc[-1]), "final_unrestricted": float(g["u"].iloc[-1])})
    return pd.DataFrame(rows)


WEIGHT_NAMES_2 = ("blocks.0.attn.W_QK", "blocks.1.attn.W_QK", "unembed.W_U")


def _flat(weights: Mapping[str, torch.Tensor], names: Sequence[str] = WEIGHT_NAMES_2) -> torch.Tensor:
    return torch.cat([weights[n].detach().double().reshape(-1) for n in names])


def span_columns(basis: imir.IMIRBasis, directions: Mapping[str, Mapping[str, float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(inner, outer): flattened weights of the named directions and of every basis element of S
    (2-layer model), as columns for `analysis.subspace.share_outside`."""
    eye = torch.eye(basis.n_coords, dtype=torch.float64)
    outer = torch.stack([_flat(basis.weights(eye[i])) for i in range(basis.n_coords)], 1)
    inner = torch.stack([_flat(basis.weights(basis.direction_weights(d))) for d in directions.values()], 1)
    return inner, outer


def share_outside_directions(run: Run, task: BlockListTask, n_points: int, n_grad: int | None,
                             seed: int = 0) -> pd.DataFrame:
    """Along each member's trajectory of a run restricted to (alpha, beta, gamma, delta): the share of
    the in-S part of the expected gradient that lies outside the span of the four directions.

    At `n_points` evaluated steps spread over the run the weights are rebuilt from the logged unit
    coordinates, and the gradient of the unrestricted theory model there is estimated twice from
    n_grad fresh sequences each; `analysis.subspace.share_outside` combines the two estimates so
    that sampling noise does not inflate the share (n_grad None: the exact expected gradient of a
    small task's enumerated distribution, used twice)."""
    from ..analysis import subspace

    layout = imir.Layout.from_task(task)
    basis = imir.IMIRBasis.concatenated(layout, 2, 1)
    dirs = imir.two_layer_directions(basis)
    inner, outer = span_columns(basis, dirs)
    metrics = run.metrics()
    rows = []
    for member, g in metrics.groupby("member"):
        g = g.sort_values("step").reset_index(drop=True)
        picks = sorted(set(np.linspace(0, len(g) - 1, min(n_points, len(g))).round().astype(int)))
        for i in picks:
            r = g.iloc[i]
            theta = sum(float(r[d]) * basis.direction_weights(v) / basis.direction_norm(v) for d, v in dirs.items())
            model = imir.theory_model(layout, 2, 1, coords=theta)
            if n_grad is None:
                a = b = _flat(imir.expected_gradient(model, task))
            else:
                a, b = (_flat(imir.sampled_gradient(model, task, n_grad, seed=derive_seed("share", seed, int(r.step), h)))
                        for h in (0, 1))
            out = subspace.share_outside(a, b, inner, outer)
            rows.append({"member": int(member), "seed": int(r.seed), "step": int(r.step), "acc_icl": float(r.acc_icl),
                         **{d: float(r[d]) for d in dirs}, **out})
    return pd.DataFrame(rows)


def crossing_steps(metrics: pd.DataFrame, column: str, threshold: float) -> pd.Series:
    """Per member: the first step at which `column` reaches `threshold` (`analysis.curves.crossing_step`:
    linearly interpolated between evaluations, NaN if never)."""
    return pd.Series({member: curves.crossing_step(g["step"], g[column], threshold)
                      for member, g in metrics.groupby("member")}, name=column, dtype=float)


def train_scaling(ns: Sequence[int], n_pairs: int, seeds: Sequence[int], steps: int, lr: float, batch: int,
                  eval_every: int, pool_size: int, name: str = "inductive_manifold/scaling") -> dict[int, Run]:
    """The predecessor paper's special case: associative recall with N random pairs (f_v = 1, no
    in-weights answer), the restricted 2-layer model from zero init, one run (seeds) per N."""
    out = {}
    for n in ns:
        task = recall_task(max(n_pairs, 2 * n), n, f_v=1.0)
        layout = imir.Layout.from_task(task)
        basis = imir.IMIRBasis.concatenated(layout, 2, 1)
        dirs = imir.two_layer_directions(basis)
        pools = recall_pools(task, pool_size)
        probe = Probe(basis, dirs, {"icl": pools["icl"], "task": pools["task"]})
        tc = TrainConfig(steps=steps, batch_size=batch, seeds=tuple(seeds), lr=lr, optimizer="sgd",
                         eval_every=eval_every, log_checkpoints=0)
        out[n] = train(f"{name}/N{n}", IMIRConfig.with_directions(layout, dirs), task, tc, evaluate=probe)
    return out


def scaling_table(runs: Mapping[int, Run], thresholds: Mapping[str, float]) -> pd.DataFrame:
    """Emergence step of each direction (first crossing of its threshold) and of in-context accuracy."""
    rows = []
    for n, run in runs.items():
        m = run.metrics()
        cross = {col: crossing_steps(m, col, thr) for col, thr in thresholds.items()}
        for member, seed in enumerate(run.train_config.seeds):
            rows.append({"N": n, "seed": seed, **{f"T_{col}": float(cross[col].get(member, np.nan)) for col in cross}})
    return pd.DataFrame(rows)


# -------------------------------------------------------------------- the in-context gradient

def icl_gradient(model: IMIRModel, task: BlockListTask, n: int, seed: int,
                 icl: Sequence[str] = ("alpha", "beta", "gamma"), loss: str = "ce") -> float:
    """Norm of the loss gradient on the unit in-context directions, a mean over n sampled sequences
    (the same sequences for every call with the same seed: ratios cancel most sampling noise)."""
    names = model.direction_names
    for d in icl:
        if d not in names:
            raise ValueError(f"icl_gradient: direction {d!r} is not one of the model's {names}")
    g = imir.sampled_gradient(model, task, n, seed, loss=loss, device=default_device())["phi"]
    idx = [names.index(d) for d in icl]
    return float(g[idx].norm())


def with_direction(model: IMIRModel, name: str, value: float) -> IMIRModel:
    """A copy of an IMIRModel with one direction's phi set to `value`."""
    import copy

    m = copy.deepcopy(model)
    with torch.no_grad():
        m.phi[m.direction_names.index(name)] = value
    return m


def learned_delta(model: IMIRModel, task: BlockListTask, loss: str, p_target: float = 0.99,
                  n: int = 256) -> float:
    """The premise of Theorem 2, 'delta has learned C': the delta (unit direction) at which the
    in-weights circuit alone answers canonical common queries. mse: the least-squares delta
    (the output equals the partner's embedding); ce: the delta at which it gives the partner
    probability p_target (cross-entropy has no finite optimum there)."""
    probe = with_direction(model, "delta", 1.0).double()
    with torch.no_grad():
        probe.phi.zero_()
        probe.phi[probe.direction_names.index("delta")] = 1.0
        s = task.with_knobs(f_r=0.0, f_v=0.0).sample(n, 0)
        logits = probe(task.model_inputs(s), last_only=True)[:, -1]  # linear in delta
    if loss == "mse":
        target = imir.label_targets(imir.Layout.from_task(task), s.targets)
        return float((logits * target).sum() / logits.pow(2).sum())
    if loss != "ce":
        raise ValueError(f"learned_delta: loss={loss!r}; expected 'ce' or 'mse'")
    p = lambda d: float((d * logits).softmax(-1).gather(-1, s.targets[:, None]).mean())
    lo, hi = 0.0, 1.0
    while p(hi) < p_target:
        hi *= 2
        if hi > 1e6:
            raise ValueError(f"learned_delta: p_target={p_target} is not reachable")
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if p(mid) < p_target else (lo, mid)
    return hi


def theory_factor(f_r, f_v):
    """Theorem 2's suppression factor f_r + (1 - f_r) f_v."""
    return np.asarray(f_r) + (1 - np.asarray(f_r)) * np.asarray(f_v)


def calibrated_factor(f_r, f_v):
    """The factor when delta is at its cross-entropy optimum (P(C q) = 1 - f_v) rather than saturated:
    canonical queries still push with weight f_v, so f_r + (1 - f_r) f_v (2 - f_v)."""
    f_r, f_v = np.asarray(f_r), np.asarray(f_v)
    return f_r + (1 - f_r) * f_v * (2 - f_v)


def sweep_members(grid: Sequence[tuple], seeds: Sequence[int]) -> list[tuple]:
    """Members of a sweep ensemble: every grid point with every seed, as (point, seed, member seed)."""
    out = []
    for i, point in enumerate(grid):
        for seed in seeds:
            out.append((point, seed, 1000 * i + seed))
    return out


def train_suppression_sweep(n_pairs: int, n_rare: int, n_blocks: int, grid: Sequence[tuple[float, float]],
                            seeds: Sequence[int], steps: int, lr: float, batch: int, eval_every: int, pool_size: int,
                            name: str = "inductive_manifold/im3") -> tuple[Run, list[tuple]]:
    """One ensemble over (f_r, f_v) x seeds: the restricted 2-layer model from zero init, each member on its own task."""
    members = sweep_members(grid, seeds)
    tasks = [recall_task(n_pairs, n_blocks, f_v=fv, f_r=fr, n_rare=n_rare) for (fr, fv), _, _ in members]
    layout = imir.Layout.from_task(tasks[0])
    basis = imir.IMIRBasis.concatenated(layout, 2, 1)
    dirs = imir.two_layer_directions(basis)
    probe = Probe(basis, dirs, recall_pools(tasks[0], pool_size))
    tc = TrainConfig(steps=steps, batch_size=batch, seeds=tuple(m[2] for m in members), lr=lr, optimizer="sgd",
                     eval_every=eval_every, checkpoint_every=eval_every, log_checkpoints=0)
    return train(name, IMIRConfig.with_directions(layout, dirs), tasks, tc, evaluate=probe), members


QUERY_TYPES = {"rare": (1.0, 0.0), "canonical": (0.0, 0.0), "non-canonical": (0.0, 1.0)}  # (f_r, f_v) of each


def type_weights(f_r: float, f_v: float) -> dict[str, float]:
    """Probability of each kind of queried chain under (f_r, f_v)."""
    return {"rare": f_r, "canonical": (1 - f_r) * (1 - f_v), "non-canonical": (1 - f_r) * f_v}


def icl_gradient_vector(model: IMIRModel, task: BlockListTask, n: int, seed: int, loss: str,
                        icl: Sequence[str] = ("alpha", "beta", "gamma")) -> torch.Tensor:
    """The mean loss gradient on the unit in-context directions over n sampled sequences."""
    g = imir.sampled_gradient(model, task, n, seed, loss=loss, device=default_device())["phi"]
    return g[[model.direction_names.index(d) for d in icl]]


ICL_DIRECTIONS = ("alpha", "beta", "gamma")


def with_point(model: IMIRModel, point: Mapping[str, float] | None) -> IMIRModel:
    """A copy of a restricted model with its in-context directions at `point` ({alpha, beta, gamma};
    None: zero, the start of training). delta is left as it is."""
    import copy

    m = copy.deepcopy(model)
    with torch.no_grad():
        for name in ICL_DIRECTIONS:
            m.phi[m.direction_names.index(name)] = 0.0 if point is None else float(point[name])
    return m


def type_gradients(n_pairs: int, n_rare: int, n_blocks: int, n_grad: int, seed: int, loss: str,
                   p_learned: float = 0.99, point: Mapping[str, float] | None = None) -> tuple[dict, float]:
    """The in-context gradient of the 2-layer model at alpha = beta = gamma = 0 (or at `point`), for each
    kind of queried chain alone (rare, canonical, non-canonical), with delta = 0 and with delta learned
    (`learned_delta`): {(kind, 'delta = 0' | 'delta learned'): gradient vector on (alpha, beta, gamma)},
    and the learned delta.

    The expected gradient of any mixture (f_r, f_v) is the mixture of these with the exact weights
    (`type_weights`): sampling each kind separately removes the noise of a sample's random mix of kinds.
    At zero weights only gamma receives gradient; at a point with alpha, beta, gamma non-zero every
    in-context direction does.
    """
    base = recall_task(n_pairs, n_blocks, f_v=0.0, f_r=0.0, n_rare=n_rare)
    layout = imir.Layout.from_task(base)
    basis = imir.IMIRBasis.concatenated(layout, 2, 1)
    model = IMIRConfig.with_directions(layout, imir.two_layer_directions(basis)).build(0).double()
    d = learned_delta(model, base, loss, p_learned)
    model = with_point(model, point)
    out = {}
    for kind, (fr, fv) in QUERY_TYPES.items():
        task = base.with_knobs(f_r=fr, f_v=fv)
        out[(kind, "delta = 0")] = icl_gradient_vector(model, task, n_grad, seed, loss)
        out[(kind, "delta learned")] = icl_gradient_vector(with_direction(model, "delta", d), task, n_grad, seed, loss)
    return out, d


def suppression_law(grid: Sequence[tuple[float, float]], seeds: Sequence[int], n_pairs: int, n_rare: int,
                    n_blocks: int, n_grad: int, loss: str, p_learned: float = 0.99,
                    points: Sequence[Mapping[str, float] | None] = (None,)) -> pd.DataFrame:
    """Theorem 2: for each in-context point (None: zero weights, the start of in-context learning), each
    (f_r, f_v) and sample seed, the expected in-context gradient with delta learned over the same with
    delta = 0 (no in-weights circuit), each expectation the exact mixture of the per-kind gradients of
    `type_gradients`: the ratio of the norms ('measured') and, per direction d, the ratio of the
    components ('measured_<d>'; NaN where the component is exactly zero, as alpha's and beta's are at
    zero weights)."""
    rows = []
    for p, point in enumerate(points):
        at = {name: 0.0 if point is None else float(point[name]) for name in ICL_DIRECTIONS}
        for seed in seeds:
            per_kind, d = type_gradients(n_pairs, n_rare, n_blocks, n_grad, seed, loss, p_learned, point)
            for fr, fv in grid:
                w = type_weights(fr, fv)
                g = {state: sum(w[k] * per_kind[(k, state)] for k in QUERY_TYPES)
                     for state in ("delta = 0", "delta learned")}
                per_direction = {f"measured_{name}": float(g["delta learned"][i] / g["delta = 0"][i])
                                 if g["delta = 0"][i] != 0 else float("nan") for i, name in enumerate(ICL_DIRECTIONS)}
                rows.append({"point": p, **{f"at_{k}": v for k, v in at.items()}, "f_r": fr, "f_v": fv, "seed": seed,
                             "loss": loss, "theory": float(theory_factor(fr, fv)),
                             "measured": float(g["delta learned"].norm() / g["delta = 0"].norm()),
                             **per_direction, "delta_learned": d})
    return pd.DataFrame(rows)


def train_icl_trajectory(n_pairs: int, n_rare: int, n_blocks: int, seed: int, steps: int, lr: float, batch: int,
                         eval_every: int, pool_size: int, name: str = "inductive_manifold/im3_trajectory") -> Run:
    """The restricted 2-layer model from zero on the pure in-context version of a recall task (every
    query non-canonical: f_v = 1, f_r = 0): its logged (alpha, beta, gamma) are the points along the
    trajectory where the gradient laws are measured beyond zero weights."""
    task = recall_task(n_pairs, n_blocks, f_v=1.0, f_r=0.0, n_rare=n_rare)
    layout = imir.Layout.from_task(task)
    basis = imir.IMIRBasis.concatenated(layout, 2, 1)
    dirs = imir.two_layer_directions(basis)
    probe = Probe(basis, dirs, {"icl": recall_pools(task, pool_size)["icl"]})
    tc = TrainConfig(steps=steps, batch_size=batch, seeds=(seed,), lr=lr, optimizer="sgd", eval_every=eval_every,
                     log_checkpoints=0)
    return train(name, IMIRConfig.with_directions(layout, dirs), task, tc, evaluate=probe)


def trajectory_points(metrics: pd.DataFrame, member: int, fractions: Sequence[float], until: float | None = None,
                      nonzero: Sequence[str] = ("alpha", "beta")) -> list[dict]:
    """The logged (step, alpha, beta, gamma, delta) of one member at the evaluations nearest to
    fraction * until for each fraction (until: a step such as the emergence step; None or NaN: the
    last evaluated step), each step once, leaving out points where a direction of `nonzero` is still
    exactly zero (the start of training)."""
    g = metrics[metrics["member"] == member].sort_values("step")
    if g.empty:
        raise ValueError(f"trajectory_points: no metrics for member {member}")
    end = float(g["step"].max()) if until is None or not np.isfinite(until) else float(until)
    out, seen = [], set()
    for f in fractions:
        r = g.iloc[int(np.abs(g["step"].to_numpy() - f * end).argmin())]
        if int(r["step"]) in seen or any(float(r[d]) == 0 for d in nonzero):
            continue
        seen.add(int(r["step"]))
        out.append({"step": int(r["step"]), **{d: float(r[d]) for d in (*ICL_DIRECTIONS, "delta")}})
    return out


def per_direction_errors(law: pd.DataFrame) -> pd.DataFrame:
    """Per seed and in-context direction: the median and the largest |measured_d / theory - 1| over
    the grid and the points of a `suppression_law` frame (rows where the component is zero left out)."""
    rows = []
    for seed, g in law.groupby("seed"):
        for d in ICL_DIRECTIONS:
            err = relative_error(g[f"measured_{d}"], g["theory"])
            err = err[np.isfinite(err)]
            rows.append({"seed": seed, "direction": d, "median": float(np.median(err)) if len(err) else float("nan"),
                         "max": float(err.max()) if len(err) else float("nan")})
    return pd.DataFrame(rows)


def type_gradient_table(per_kind: Mapping[tuple, torch.Tensor]) -> pd.DataFrame:
    """Norm of each kind's in-context gradient with delta = 0 and learned, relative to the canonical kind at delta = 0."""
    ref = float(per_kind[("canonical", "delta = 0")].norm())
    return pd.DataFrame([{"queried chain": kind, "delta = 0": float(per_kind[(kind, "delta = 0")].norm()) / ref,
                          "delta learned": float(per_kind[(kind, "delta learned")].norm()) / ref}
                         for kind in QUERY_TYPES])


def relative_error(measured, theory) -> np.ndarray:
    return np.abs(np.asarray(measured, float) / np.asarray(theory, float) - 1)


def emergence_table(run: Run, members: Sequence[tuple], columns: Sequence[str], column: str,
                    threshold: float) -> pd.DataFrame:
    """Per member of a sweep: its grid point (named by `columns`), seed and the step at which
    `column` first reaches `threshold`."""
    cross = crossing_steps(run.metrics(), column, threshold)
    return pd.DataFrame([{**dict(zip(columns, point)), "seed": seed, "emergence_step": float(cross.get(k, np.nan))}
                         for k, (point, seed, _) in enumerate(members)])


def train_burstiness_sweep(n_pairs: int, n_blocks: int, bursts: Sequence[int], seeds: Sequence[int], steps: int,
                           lr: float, batch: int, eval_every: int, pool_size: int, f_v: float = 1.0,
                           name: str = "inductive_manifold/im4") -> tuple[Run, list[tuple]]:
    """One ensemble over burstiness b x seeds (restricted 2-layer model, zero init, pure in-context task)."""
    members = sweep_members([(b,) for b in bursts], seeds)
    tasks = [recall_task(n_pairs, n_blocks, f_v=f_v, burstiness=b) for (b,), _, _ in members]
    layout = imir.Layout.from_task(tasks[0])
    basis = imir.IMIRBasis.concatenated(layout, 2, 1)
    dirs = imir.two_layer_directions(basis)
    pools = recall_pools(recall_task(n_pairs, n_blocks, f_v=f_v, burstiness=1), pool_size)
    probe = Probe(basis, dirs, {"icl": pools["icl"]})
    tc = TrainConfig(steps=steps, batch_size=batch, seeds=tuple(m[2] for m in members), lr=lr, optimizer="sgd",
                     eval_every=eval_every, log_checkpoints=0)
    return train(name, IMIRConfig.with_directions(layout, dirs), tasks, tc, evaluate=probe), members


def burstiness_table(run: Run, members: Sequence[tuple], n_pairs: int, n_blocks: int, n_grad: int,
                     acc_threshold: float, f_v: float = 1.0, loss: str = "ce") -> pd.DataFrame:
    """Per member: the in-context gradient at step 0 (zero init; only gamma moves there) and the step at
    which in-context accuracy (b = 1 pool) reaches acc_threshold."""
    metrics = run.metrics()
    cross = crossing_steps(metrics, "acc_icl", acc_threshold)
    rows = []
    for k, ((b,), seed, _) in enumerate(members):
        task = recall_task(n_pairs, n_blocks, f_v=f_v, burstiness=b)
        model = run.model(k, 0).double()
        rows.append({"b": b, "seed": seed, "icl_gradient": icl_gradient(model, task, n_grad, seed=k, loss=loss),
                     "emergence_step": float(cross.get(k, np.nan))})
    return pd.DataFrame(rows)


def burstiness_at_points(run: Run, members: Sequence[tuple], table: pd.DataFrame, n_pairs: int, n_blocks: int,
                         n_grad: int, fractions: Sequence[float], f_v: float = 1.0, loss: str = "ce",
                         nonzero: Sequence[str] = ("alpha", "beta")) -> pd.DataFrame:
    """Theorem 3 beyond zero weights: per seed, points of the trajectory of its smallest-b member (at
    `fractions` of that member's emergence step, `table` from `burstiness_table`; of its last step if
    it never emerged; `trajectory_points`, which leaves out points where `nonzero` directions are
    zero), and at each point the in-context gradient on alpha, beta and gamma for every b (the same
    weights for every b; the same sample seed per b as at step 0)."""
    metrics = run.metrics()
    lowest = min(b for (b,), _, _ in members)
    rows = []
    for seed in sorted({s for _, s, _ in members}):
        k0 = next(k for k, ((b,), s, _) in enumerate(members) if b == lowest and s == seed)
        until = table.loc[(table.b == lowest) & (table.seed == seed), "emergence_step"].iloc[0]
        model = run.model(k0, 0).double()
        for p, point in enumerate(trajectory_points(metrics, k0, fractions, until, nonzero)):
            at = with_direction(with_point(model, point), "delta", point["delta"])
            for k, ((b,), s, _) in enumerate(members):
                if s != seed:
                    continue
                task = recall_task(n_pairs, n_blocks, f_v=f_v, burstiness=b)
                g = icl_gradient_vector(at, task, n_grad, seed=k, loss=loss)
                rows.append({"seed": seed, "point": p, "step": point["step"],
                             **{f"at_{d}": point[d] for d in ICL_DIRECTIONS}, "b": b,
                             **{f"g_{d}": float(g[i]) for i, d in enumerate(ICL_DIRECTIONS)}})
    columns = ["seed", "point", "step", *(f"at_{d}" for d in ICL_DIRECTIONS), "b", *(f"g_{d}" for d in ICL_DIRECTIONS)]
    return pd.DataFrame(rows, columns=columns)


def per_direction_r2(points: pd.DataFrame) -> pd.DataFrame:
    """Per seed, point and in-context direction: R^2 of the line through the origin of the gradient
    component against b (`proportional_fit`) of a `burstiness_at_points` frame."""
    rows = []
    for (seed, p), g in points.groupby(["seed", "point"]):
        for d in ICL_DIRECTIONS:
            rows.append({"seed": seed, "point": p, "direction": d, "r2": proportional_fit(g["b"], g[f"g_{d}"])["r2"]})
    return pd.DataFrame(rows)


def proportional_fit(x, y) -> dict:
    """y = c x through the origin: c and R^2 = 1 - SS_res / SS_tot (SS_tot about the mean of y)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    c = float((x * y).sum() / (x * x).sum())
    ss_res = float(((y - c * x) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return {"c": c, "r2": 1 - ss_res / ss_tot if ss_tot > 0 else float("nan")}


def unit_coordinates(basis: imir.IMIRBasis, params: Mapping[str, torch.Tensor]) -> pd.Series:
    """Every coordinate of the projection on S in units of its unit basis element (theta * ||element||)."""
    theta = basis.coordinates(params) * basis.coordinate_norms()
    return pd.Series(theta.numpy(), index=basis.coordinate_names())


def captured_fraction(basis: imir.IMIRBasis, params: Mapping[str, torch.Tensor],
                      directions: Mapping[str, Mapping[str, float]]) -> float:
    """Share of ||proj_S W||^2 on the named (mutually orthogonal) directions."""
    inside = basis.project(params)
    total = sum(w.pow(2).sum().item() for w in inside.values())
    on = sum(basis.direction_value(params, d) ** 2 for d in directions.values())
    return on / total if total > 0 else float("nan")


def largest_other_coordinates(basis: imir.IMIRBasis, params: Mapping[str, torch.Tensor],
                              directions: Mapping[str, Mapping[str, float]], top: int) -> pd.DataFrame:
    """The `top` largest coordinates (unit elements) that belong to none of the named directions."""
    coords = unit_coordinates(basis, params)
    named = {c for d in directions.values() for c in d}
    other = coords[[n for n in coords.index if n not in named]]
    order = other.abs().sort_values(ascending=False).index[:top]
    return pd.DataFrame({"coordinate": order, "value (unit element)": other[order].to_numpy()})


# -------------------------------------------------------------------- a standard transformer

class ProgressProbe:
    """evaluate(ens, step): alpha~, beta~, gamma~ of each member (standard 2-layer ToyTransformer) and pool accuracy."""

    def __init__(self, pools: Mapping[str, Batch], token_ids: Sequence[int]):
        self.pools, self.token_ids = dict(pools), list(token_ids)

    def spec(self) -> dict:
        return {"progress_probe": self.token_ids,
                "pools": {k: _tensor_digest(b.tokens, b.labels) for k, b in self.pools.items()}}

    @torch.no_grad()
    def __call__(self, ens, step: int) -> dict:
        out = {}
        for name, pool in self.pools.items():
            logits = ens.logits(pool.tokens, last_only=True)[:, :, -1]
            out[f"acc_{name}"] = (logits.argmax(-1) == pool.labels).float().mean(-1)
        vals = [imir.progress_measures(ens.member(k), self.token_ids) for k in range(ens.n_members)]
        for key in ("alpha", "beta", "gamma"):
            out[f"{key}_tilde"] = torch.tensor([v[key] for v in vals])
        return out


def train_standard(n_pairs: int, n_blocks: int, f_v: float, d_model: int, seeds: Sequence[int], steps: int, lr: float,
                   batch: int, eval_every: int, pool_size: int, name: str = "inductive_manifold/standard") -> Run:
    """A standard 2-layer, 1-head attention-only ToyTransformer (learned absolute positions, separate
    W_Q and W_K, random init, AdamW) on associative recall with plain token ids."""
    from ..models.toy import ToyConfig

    task = BlockListTask("recall", n_pairs=n_pairs, n_blocks=n_blocks, f_v=f_v, bos=True, offsets="fixed",
                         input_ids="tokens")
    cfg = ToyConfig(d_vocab=task.vocab_size, n_ctx=task.seq_len, d_model=d_model, n_layers=2, n_heads=1, mlp=False,
                    d_mlp=0, bias=False, normalization=None, positional="learned")
    pools = recall_pools(task, pool_size)
    probe = ProgressProbe({"icl": pools["icl"]}, list(range(task.n_common)))
    tc = TrainConfig(steps=steps, batch_size=batch, seeds=tuple(seeds), lr=lr, eval_every=eval_every,
                     log_checkpoints=0)
    return train(name, cfg, task, tc, evaluate=probe)


# =============================================================================== 04 initialisation picks the winner (IM-5)

def three_layer_directions(basis: imir.IMIRBasis, head: int = 0) -> dict[str, dict[str, float]]:
    """The directions of the three induction circuits a 3-layer, 1-head model can form:
    previous-token in layer a (alpha_a), match in layer b through the layer-a head (beta_ab),
    copy from the layer-b head (gamma_b)."""
    if basis.n_layers != 3:
        raise ValueError(f"three_layer_directions: the basis has {basis.n_layers} layers; expected 3")
    ids = ["I"] + (["I_rare"] if "I_rare" in basis.sel_names else [])
    h = head
    return {"alpha1": {f"L1H{h}|emb|emb|pos1": 1.0},
            "alpha2": {f"L2H{h}|emb|emb|pos1": 1.0},
            "beta12": {f"L2H{h}|emb|L1H{h}|{s}": 1.0 for s in ids},
            "beta13": {f"L3H{h}|emb|L1H{h}|{s}": 1.0 for s in ids},
            "beta23": {f"L3H{h}|emb|L2H{h}|{s}": 1.0 for s in ids},
            "gamma2": {f"U|L2H{h}|{s}": 1.0 for s in ids},
            "gamma3": {f"U|L3H{h}|{s}": 1.0 for s in ids}}


CIRCUITS = {"1->2": ("alpha1", "beta12", "gamma2"), "1->3": ("alpha1", "beta13", "gamma3"),
            "2->3": ("alpha2", "beta23", "gamma3")}


class InitTable:
    """init_fn(model, seed) that sets an IMIRModel's phi from a table {member seed: {direction: value}}."""

    def __init__(self, table: Mapping[int, Mapping[str, float]]):
        self.table = {int(k): {d: float(v) for d, v in row.items()} for k, row in table.items()}

    def spec(self) -> dict:
        blob = repr(sorted((k, sorted(v.items())) for k, v in self.table.items())).encode()
        return {"init_table": hashlib.sha256(blob).hexdigest()[:16], "members": len(self.table)}

    @torch.no_grad()
    def __call__(self, model, seed: int) -> None:
        if int(seed) not in self.table:
            raise ValueError(f"InitTable: no initial values for member seed {seed}")
        model.phi.zero_()
        for name, value in self.table[int(seed)].items():
            model.phi[model.direction_names.index(name)] = value


OTHER_DIRECTIONS = ("beta12", "beta13", "beta23", "gamma2", "gamma3")


def init_design(grid: Sequence[float], base: float, jitter: float, seed: int = 0, slices: int = 1,
                replicates: int = 1) -> pd.DataFrame:
    """Initial coordinates: `slices` draws of the five directions other than alpha1 and alpha2 (each
    base * exp(U(-jitter, jitter))), each crossed with alpha1(0) x alpha2(0) on `grid` x `grid`, each
    initial point trained by `replicates` members that differ only in their data (member seed).

    A slice is a clean 2-d section of initialisation space (its phase diagram has boundaries one can
    measure); the slices make the other five coordinates vary (so the nested fits can tell whether
    they matter); the replicates tell whether the initialisation or the data picks the winner."""
    if slices < 1 or replicates < 1:
        raise ValueError(f"init_design: slices={slices}, replicates={replicates}; both must be >= 1")
    rng = np.random.default_rng(seed)
    rows = []
    for sl in range(slices):
        others = {d: float(base * math.exp(rng.uniform(-jitter, jitter))) for d in OTHER_DIRECTIONS}
        for a2 in grid:
            for a1 in grid:
                point = len(rows) // replicates
                for r in range(replicates):
                    rows.append({"point": point, "slice": sl, "replicate": r, "alpha1": float(a1), "alpha2": float(a2),
                                 **others})
    df = pd.DataFrame(rows)
    df.insert(0, "member_seed", np.arange(len(df)))
    return df


class CircuitProbe:
    """evaluate(ens, step) for an ensemble of restricted IMIRModels: accuracy on a pool of the whole model
    and of each circuit alone (every direction outside it set to zero), per member."""

    def __init__(self, pool: Batch, circuits: Mapping[str, Sequence[str]]):
        self.pool, self.circuits = pool, {k: tuple(v) for k, v in circuits.items()}

    def spec(self) -> dict:
        return {"circuit_probe": self.circuits, "pool": _tensor_digest(self.pool.tokens, self.pool.labels)}

    @torch.no_grad()
    def __call__(self, ens, step: int) -> dict:
        names = ens.member(0).direction_names
        phi = ens.params["phi"]
        out = {"acc_icl": self._accuracy(ens)}
        try:  # every member at once: the ensemble's phi is swapped for a masked copy, then restored
            for c, dirs in self.circuits.items():
                mask = torch.tensor([n in dirs for n in names], dtype=phi.dtype, device=phi.device)
                ens.params["phi"] = phi.detach() * mask
                out[f"solo_{c}"] = self._accuracy(ens)
        finally:
            ens.params["phi"] = phi
        return out

    def _accuracy(self, ens) -> torch.Tensor:
        pred = ens.logits(self.pool.tokens, last_only=True)[:, :, -1].argmax(-1)
        return (pred == self.pool.labels).float().mean(-1)


def train_init_ensemble(task: BlockListTask, design: pd.DataFrame, steps: int, lr: float, batch: int, eval_every: int,
                        pool_size: int, name: str = "inductive_manifold/im5") -> Run:
    """One ensemble: the 3-layer model restricted to the seven circuit directions, each member started
    at its row of `design`, trained by plain SGD on the same task."""
    layout = imir.Layout.from_task(task)
    basis = imir.IMIRBasis.concatenated(layout, 3, 1)
    dirs = three_layer_directions(basis)
    table = {int(r.member_seed): {d: getattr(r, d) for d in dirs} for r in design.itertuples()}
    probe = CircuitProbe(recall_pools(task, pool_size)["icl"], CIRCUITS)
    tc = TrainConfig(steps=steps, batch_size=batch, seeds=tuple(int(s) for s in design.member_seed), lr=lr,
                     optimizer="sgd", eval_every=eval_every, log_checkpoints=0)
    return train(name, IMIRConfig.with_directions(layout, dirs, n_layers=3), task, tc, evaluate=probe,
                 init_fn=InitTable(table))


@torch.no_grad()
def circuit_accuracy(model: IMIRModel, pool: Batch, keep: Sequence[str]) -> float:
    """Accuracy with every direction outside `keep` set to zero (the model is left unchanged)."""
    saved = model.phi.detach().clone()
    for i, name in enumerate(model.direction_names):
        if name not in keep:
            model.phi[i] = 0.0
    pred = model(pool.tokens, last_only=True)[:, -1].argmax(-1)
    model.phi.copy_(saved)
    return float((pred == pool.labels).float().mean())


def winners(run: Run, min_acc: float) -> pd.DataFrame:
    """Per member: the circuit whose accuracy *alone* first reaches min_acc during training (the circuit that
    forms the induction head first); 'mixed' when two reach it at the same evaluation, 'none' when none does.
    Later the other circuits may grow too: cross-entropy keeps rewarding every working circuit."""
    m = run.metrics()
    cross = {c: crossing_steps(m, f"solo_{c}", min_acc) for c in CIRCUITS}
    last = m[m.step == m.step.max()].set_index("member")
    rows = []
    for k in range(run.n_members):
        t = {c: float(cross[c].get(k, np.nan)) for c in CIRCUITS}
        done = sorted((v, c) for c, v in t.items() if not math.isnan(v))
        if not done:
            winner = "none"
        elif len(done) > 1 and done[1][0] == done[0][0]:
            winner = "mixed"
        else:
            winner = done[0][1]
        rows.append({"member_seed": run.train_config.seeds[k], "winner": winner,
                     **{f"step {c}": t[c] for c in CIRCUITS},
                     **{f"final solo {c}": float(last.loc[k, f"solo_{c}"]) for c in CIRCUITS}})
    return pd.DataFrame(rows)


def _softmax_regression(X: np.ndarray, y: np.ndarray, n_classes: int, l2: float) -> np.ndarray:
    from scipy.optimize import minimize

    n, p = X.shape
    Xb = np.hstack([X, np.ones((n, 1))])
    Y = np.eye(n_classes)[y]

    def loss(w):
        W = w.reshape(p + 1, n_classes)
        Z = Xb @ W
        Z -= Z.max(1, keepdims=True)
        logp = Z - np.log(np.exp(Z).sum(1, keepdims=True))
        P = np.exp(logp)
        reg = 0.5 * l2 * (W[:-1] ** 2).sum()
        grad = Xb.T @ (P - Y) / n
        grad[:-1] += l2 * W[:-1]
        return -(Y * logp).sum() / n + reg, grad.ravel()

    res = minimize(loss, np.zeros((p + 1) * n_classes), jac=True, method="L-BFGS-B")
    return res.x.reshape(p + 1, n_classes)


def logistic_fit(features: np.ndarray, labels: Sequence[str], folds: int = 5, l2: float = 1e-3,
                 seed: int = 0, groups: Sequence | None = None) -> dict:
    """Multinomial logistic regression of `labels` on standardised `features`: k-fold cross-validated
    accuracy (and each sample's held-out correctness, `cv_correct`), and the in-sample accuracy of the
    fit on all points. groups: samples of one group (e.g. replicates of one initial point) always
    share a fold, so a fold never tests on a copy of what it trained on."""
    X = np.asarray(features, float)
    X = (X - X.mean(0)) / np.where(X.std(0) > 0, X.std(0), 1.0)
    classes = sorted(set(labels))
    y = np.array([classes.index(c) for c in labels])
    if len(classes) < 2:
        return {"cv_accuracy": 1.0, "train_accuracy": 1.0, "classes": classes, "cv_correct": np.ones(len(y), bool)}
    ids = np.arange(len(y)) if groups is None else np.unique(np.asarray(groups), return_inverse=True)[1]
    rng = np.random.default_rng(seed)
    fold_of = np.empty(ids.max() + 1, int)
    fold_of[rng.permutation(ids.max() + 1)] = np.arange(ids.max() + 1) % folds
    correct = np.zeros(len(y), bool)
    for f in range(folds):
        test = np.flatnonzero(fold_of[ids] == f)
        train_idx = np.flatnonzero(fold_of[ids] != f)
        if len(test) == 0:
            continue
        W = _softmax_regression(X[train_idx], y[train_idx], len(classes), l2)
        correct[test] = (np.hstack([X[test], np.ones((len(test), 1))]) @ W).argmax(1) == y[test]
    W = _softmax_regression(X, y, len(classes), l2)
    train_acc = float(((np.hstack([X, np.ones((len(y), 1))]) @ W).argmax(1) == y).mean())
    return {"cv_accuracy": float(correct.mean()), "train_accuracy": train_acc, "classes": classes,
            "cv_correct": correct}


def paired_gap(correct_a: np.ndarray, correct_b: np.ndarray, groups: Sequence | None = None) -> dict:
    """The accuracy gap mean(b) - mean(a) of two predictors scored on the same samples, and its
    standard error from the per-sample differences (cluster-robust over `groups`, whose samples are
    not independent; with one sample per group it is sd(d) / sqrt(n))."""
    d = np.asarray(correct_b, float) - np.asarray(correct_a, float)
    if d.ndim != 1 or len(d) < 2:
        raise ValueError(f"paired_gap: needs at least two paired samples, got {d.shape}")
    ids = np.arange(len(d)) if groups is None else np.unique(np.asarray(groups), return_inverse=True)[1]
    G = ids.max() + 1
    if G < 2:
        raise ValueError("paired_gap: needs at least two groups")
    sums = np.bincount(ids, weights=d - d.mean(), minlength=G)
    return {"gap": float(d.mean()), "se": float(np.sqrt((sums ** 2).sum() * G / (G - 1)) / len(d))}


def nested_fits(decided: pd.DataFrame, folds: int = 5, seed: int = 0) -> dict:
    """Two nested multinomial logistic fits of the winner (one class of model, the second with more
    features): on each circuit's own initial size (log ||(alpha, beta, gamma)(0)||, three features),
    and on those plus all seven initial coordinates. Folds keep the replicates of an initial point
    together. Returns both cross-validated accuracies and the gap with its standard error."""
    own = own_sizes(decided).to_numpy()
    coords = decided[list(CIRCUIT_DIRECTIONS)].to_numpy()
    labels, groups = list(decided["winner"]), decided["point"].to_numpy()
    a = logistic_fit(own, labels, folds, seed=seed, groups=groups)
    b = logistic_fit(np.hstack([own, coords]), labels, folds, seed=seed, groups=groups)
    gap = paired_gap(a["cv_correct"], b["cv_correct"], groups)
    return {"own_size_acc": a["cv_accuracy"], "nested_acc": b["cv_accuracy"], "gap": gap["gap"], "gap_se": gap["se"],
            "own_size_train_acc": a["train_accuracy"], "nested_train_acc": b["train_accuracy"]}


def point_outcomes(wins: pd.DataFrame) -> pd.DataFrame:
    """Per initial point of a replicated design: its slice and grid position, the winner when every
    replicate has the same single winner ('decided'), else 'undecided' (replicates disagree, or one is
    mixed or none)."""
    rows = []
    for point, g in wins.groupby("point"):
        w = set(g["winner"])
        single = len(w) == 1 and not w & {"mixed", "none"}
        rows.append({"point": point, "slice": int(g["slice"].iloc[0]), "alpha1": float(g["alpha1"].iloc[0]),
                     "alpha2": float(g["alpha2"].iloc[0]), "outcome": next(iter(w)) if single else "undecided",
                     "replicates_agree": len(w) == 1})
    return pd.DataFrame(rows)


def boundary_sharpness(points: pd.DataFrame) -> dict:
    """How sharp the phase boundaries are, on each slice's alpha1 x alpha2 grid: D / (D + U) with U the
    undecided points and D the decided points next to (4-neighbour) a point of another outcome. A
    boundary that falls between two neighbouring grid points, each decided, gives 1; a band of w
    undecided points across it gives about 2 / (2 + w). NaN when no slice has a boundary."""
    decided_at_boundary = undecided = 0
    for _, g in points.groupby("slice"):
        a1, a2 = sorted(g["alpha1"].unique()), sorted(g["alpha2"].unique())
        grid = {(a1.index(r.alpha1), a2.index(r.alpha2)): r.outcome for r in g.itertuples()}
        for (i, j), outcome in grid.items():
            if outcome == "undecided":
                undecided += 1
                continue
            near = [grid.get((i + di, j + dj)) for di, dj in ((1, 0), (-1, 0), (0, 1), (0, -1))]
            decided_at_boundary += any(n is not None and n != outcome for n in near)
    total = decided_at_boundary + undecided
    return {"sharpness": decided_at_boundary / total if total else float("nan"),
            "decided_at_boundary": decided_at_boundary, "undecided": undecided}


CIRCUIT_DIRECTIONS = ("alpha1", "alpha2", *OTHER_DIRECTIONS)


def own_sizes(design: pd.DataFrame) -> pd.DataFrame:
    """log of each circuit's own initial size ||(alpha, beta, gamma)(0)||."""
    return pd.DataFrame({c: np.log(np.sqrt(sum(design[d] ** 2 for d in dirs))) for c, dirs in CIRCUITS.items()})


# =============================================================================== 05 automated circuit detection (IM-6)

PAPER_AIDING_ACCURACY = {"without aiding": 0.59, "with aiding": 0.92}  # IM-6 in PAPERS.md ("about"), for comparison


def two_hop_task(n_pairs: int, n_blocks: int) -> BlockListTask:
    return BlockListTask("khop", hops=2, n_pairs=n_pairs, n_blocks=n_blocks, f_v=1.0, bos=True)


def train_two_hop(task: BlockListTask, n_layers: int, mode: str, seeds: Sequence[int], steps: int, lr: float,
                  batch: int, eval_every: int, pool_size: int, optimizer: str = "sgd", init_std: float = 0.0,
                  name: str = "inductive_manifold/im6") -> Run:
    """The 2-hop model: mode 'imir' trains every coordinate of S (an IMIRModel, cheap), mode 'full'
    every entry of W_QK and W_U of the theory's ToyTransformer (projected on S afterwards)."""
    if mode not in ("imir", "full"):
        raise ValueError(f"train_two_hop: mode={mode!r}; expected 'imir' or 'full'")
    layout = imir.Layout.from_task(task)
    pools = recall_pools(task, pool_size)
    tc = TrainConfig(steps=steps, batch_size=batch, seeds=tuple(seeds), lr=lr, optimizer=optimizer,
                     eval_every=eval_every, log_checkpoints=4)
    evaluate = _AccuracyProbe({"task": pools["task"]})
    if mode == "imir":
        cfg = IMIRConfig(layout.token_classes, layout.association, layout.seq_len, n_layers=n_layers,
                              init_std=init_std)
        return train(f"{name}/imir", cfg, task, tc, evaluate=evaluate)
    return train(f"{name}/full", imir.theory_config(layout, n_layers, 1, init_std=init_std), task, tc,
                 evaluate=evaluate, init_fn=imir.TheoryInit(layout))


class _AccuracyProbe:
    def __init__(self, pools: Mapping[str, Batch]):
        self.pools = dict(pools)

    def spec(self) -> dict:
        return {"accuracy_probe": {k: _tensor_digest(b.tokens, b.labels) for k, b in self.pools.items()}}

    @torch.no_grad()
    def __call__(self, ens, step: int) -> dict:
        out = {}
        for name, pool in self.pools.items():
            logits = ens.logits(pool.tokens, last_only=True)[:, :, -1].float()
            out[f"acc_{name}"] = (logits.argmax(-1) == pool.labels).float().mean(-1)
            logp = logits.log_softmax(-1)
            out[f"loss_{name}"] = -logp.gather(-1, pool.labels.expand(logits.shape[0], -1)[..., None]).squeeze(-1).mean(-1)
        return out


def coordinates_of(run: Run, member: int, layout: imir.Layout) -> torch.Tensor:
    """Flat IMIR coordinates of a trained member (the projection on S for a full model)."""
    model = run.model(member)
    if isinstance(model, IMIRModel):
        return model.theta().detach().double()
    return imir.IMIRBasis.from_model(model, layout).coordinates(dict(model.named_parameters()))


class CoordinateEvaluator:
    """Held-out loss and accuracy of the theory's model at given flat IMIR coordinates (float64)."""

    def __init__(self, layout: imir.Layout, n_layers: int, pool: Batch, device: str | torch.device | None = None):
        cfg = IMIRConfig(layout.token_classes, layout.association, layout.seq_len, n_layers=n_layers)
        self.device = torch.device(device) if device is not None else default_device()
        self.model = cfg.build(seed=None).double().to(self.device)
        self.scale = 1.0 / self.model.directions.double()  # phi = theta * ||basis element||
        self.pool = Batch(pool.tokens.to(self.device), pool.labels.to(self.device))

    @torch.no_grad()
    def __call__(self, theta: torch.Tensor) -> tuple[float, float]:
        self.model.phi.copy_(theta.double().to(self.device) * self.scale)
        logits = self.model(self.pool.tokens, last_only=True)[:, -1]
        logp = logits.log_softmax(-1)
        loss = float(-logp.gather(-1, self.pool.labels[:, None]).mean())
        acc = float((logits.argmax(-1) == self.pool.labels).double().mean())
        return loss, acc

    def gradient(self, theta: torch.Tensor) -> torch.Tensor:
        """d loss / d theta at theta (for ranking removals to first order)."""
        th = theta.double().to(self.device).clone().requires_grad_(True)
        with torch.enable_grad():
            logits = _forward_with_phi(self.model, th * self.scale, self.pool.tokens)
            loss = -logits.log_softmax(-1).gather(-1, self.pool.labels[:, None]).mean()
            (g,) = torch.autograd.grad(loss, th)
        return g.detach().cpu()


def _forward_with_phi(model: IMIRModel, phi: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    from torch.func import functional_call

    params = {"phi": phi}
    buffers = dict(model.named_buffers())
    return functional_call(model, (params, buffers), (tokens,), {"last_only": True})[:, -1]


def backward_elimination(evaluator: CoordinateEvaluator, theta: torch.Tensor, tau: float, screen: int = 16,
                         progress: Callable | None = None) -> dict:
    """Algorithm 1: repeatedly zero the coordinate whose removal raises held-out loss least; stop
    when the cheapest removal would take the loss more than `tau` above the full model's.

    Exact search over every coordinate is quadratic; candidates are screened first: the `screen`
    coordinates with the smallest first-order estimate |theta_k dL/dtheta_k| of their removal cost
    (plus every coordinate that is exactly zero) are evaluated exactly each round, and long runs of
    removals that keep the loss within budget are taken in chunks (doubling while they succeed,
    halving back to single removals when they do not). Returns the surviving mask, the elimination
    order and the loss along it.
    """
    theta = theta.double().clone()
    alive = theta != 0
    base_loss, base_acc = evaluator(theta)
    budget = base_loss + tau
    history = [{"removed": None, "n_alive": int(alive.sum()), "loss": base_loss, "acc": base_acc}]
    chunk = 1
    while alive.sum() > 0:
        current = theta * alive
        g = evaluator.gradient(current)
        cost = (current * g).abs() + 0.5 * current.pow(2)  # first-order estimate plus a small size term
        cost[~alive] = float("inf")
        order = torch.argsort(cost)
        n_alive = int(alive.sum())
        if chunk > 1:
            idx = order[:min(chunk, n_alive)]
            trial = alive.clone()
            trial[idx] = False
            loss, acc = evaluator(theta * trial)
            if loss <= budget:
                alive = trial
                history.append({"removed": [int(i) for i in idx], "n_alive": int(alive.sum()), "loss": loss, "acc": acc})
                chunk *= 2
                continue
            chunk = max(1, chunk // 4)
            continue
        best = None
        for i in order[:min(screen, n_alive)]:
            trial = alive.clone()
            trial[i] = False
            loss, acc = evaluator(theta * trial)
            if best is None or loss < best[1]:
                best = (int(i), loss, acc)
        if best is None or best[1] > budget:
            break
        alive[best[0]] = False
        history.append({"removed": [best[0]], "n_alive": int(alive.sum()), "loss": best[1], "acc": best[2]})
        chunk = 2
        if progress is not None:
            progress(int(alive.sum()))
    final_loss, final_acc = evaluator(theta * alive)
    return {"alive": alive, "theta": theta, "history": pd.DataFrame(history), "base_loss": base_loss,
            "base_acc": base_acc, "loss": final_loss, "acc": final_acc, "budget": budget}


def survivors_table(result: dict, names: Sequence[str]) -> pd.DataFrame:
    alive, theta = result["alive"], result["theta"]
    idx = torch.nonzero(alive).squeeze(1).tolist()
    rows = [] if idx else pd.DataFrame(columns=["coordinate", "kind", "value", "aiding"])
    for i in idx:
        name = names[i]
        kind = "readout" if name.startswith("U|") else "key-query"
        rows.append({"coordinate": name, "kind": kind, "value": float(theta[i]),
                     "aiding": kind == "key-query" and float(theta[i]) < 0})
    return pd.DataFrame(rows) if idx else rows


def aiding_split(evaluator: CoordinateEvaluator, result: dict, names: Sequence[str]) -> dict:
    """Accuracy of the surviving circuit with and without its aiding directions: the key-query
    coordinates with negative values (they lower attention scores: suppress attention)."""
    alive, theta = result["alive"], result["theta"]
    aiding = torch.tensor([n.startswith("L") and float(t) < 0 for n, t in zip(names, theta)]) & alive
    with_loss, with_acc = evaluator(theta * alive)
    without_loss, without_acc = evaluator(theta * (alive & ~aiding))
    return {"acc_with": with_acc, "acc_without": without_acc, "loss_with": with_loss, "loss_without": without_loss,
            "n_aiding": int(aiding.sum()), "n_core": int((alive & ~aiding).sum())}


def finds_two_hop_circuit(names_alive: Sequence[str]) -> bool:
    """Does the set of surviving coordinates contain a complete 2-hop induction path?

    a previous-token coordinate (pos1) in some layer a, a first hop in a layer b > a matching the
    query's token (I) against a key path through layer a, a second hop in a layer c > b whose query
    path goes through layer b, matching (I) against a key path through a previous-token layer, and
    a readout copy (I) from a path ending in layer c.
    """
    def heads(path: str) -> list[int]:
        return [] if path == "emb" else [int(p[1:].split("H")[0]) for p in path.split(">")]

    prev = {int(n.split("|")[0][1:].split("H")[0]) for n in names_alive
            if n.startswith("L") and n.endswith("|pos1") and n.split("|")[1] == "emb" and n.split("|")[2] == "emb"}
    qk = [n.split("|") for n in names_alive if n.startswith("L") and n.split("|")[3] in ("I", "I_rare")]
    readout = [n.split("|") for n in names_alive if n.startswith("U|") and n.split("|")[2] in ("I", "I_rare")]
    for a in prev:
        for lb, qb, kb, _ in qk:
            b = int(lb[1:].split("H")[0])
            if b <= a or qb != "emb" or a not in heads(kb):
                continue
            for lc, qc, kc, _ in qk:
                c = int(lc[1:].split("H")[0])
                if c <= b or b not in heads(qc) or not (set(heads(kc)) & prev):
                    continue
                if any(heads(p) and heads(p)[-1] == c for _, p, _ in readout):
                    return True
    return False


def random_chain_rate(names: Sequence[str], size: int, draws: int = 2000, seed: int = 0) -> float:
    """The baseline of `finds_two_hop_circuit`: the share of `draws` random subsets of `size` of all
    coordinate names that contain a complete 2-hop chain. If it is high, finding a chain among the
    survivors says little about the elimination."""
    names = list(names)
    if not 0 <= size <= len(names):
        raise ValueError(f"random_chain_rate: size={size} must be between 0 and the {len(names)} coordinates")
    rng = np.random.default_rng(seed)
    hits = sum(finds_two_hop_circuit([names[i] for i in rng.choice(len(names), size, replace=False)])
               for _ in range(draws))
    return hits / draws


def circuit_graph(table: pd.DataFrame, n_layers: int):
    """A networkx MultiDiGraph of the surviving circuit: nodes 'emb', 'L{l}H{h}', 'out'; an edge from the last
    head of each key and query path into the head whose coordinate survived, and from the last head of each
    readout path to 'out'. Edges between two nodes are merged per kind (key 'core' or 'aiding'), their label
    listing the side (q: query, k: key) and selection of every coordinate they carry."""
    import networkx as nx

    G = nx.MultiDiGraph()
    G.add_node("emb", layer=0)
    for l in range(1, n_layers + 1):
        G.add_node(f"L{l}H0", layer=l)
    G.add_node("out", layer=n_layers + 1)

    def last(path: str) -> str:
        return "emb" if path == "emb" else path.split(">")[-1]

    sides: dict[tuple, dict[str, list[str]]] = {}

    def add(src: str, dst: str, kind: str, side: str, sel: str) -> None:
        sides.setdefault((src, dst, kind), {}).setdefault(side, []).append(sel)

    for r in table.itertuples():
        parts = r.coordinate.split("|")
        kind = "aiding" if bool(r.aiding) else "core"
        if parts[0] == "U":
            add(last(parts[1]), "out", kind, "", parts[2])
            continue
        head, q, k, sel = parts
        add(last(q), head, kind, "q:", sel)
        add(last(k), head, kind, "k:", sel)
    for (src, dst, kind), by_side in sides.items():
        G.add_edge(src, dst, key=kind, label="; ".join(side + _compact(sels) for side, sels in by_side.items()),
                   aiding=kind == "aiding")
    return G


def _compact(selections: Sequence[str]) -> str:
    """['I', 'pos1', 'pos3', 'I'] -> 'I, pos1,3' (each selection once, shifts merged)."""
    tokens = list(dict.fromkeys(s for s in selections if not s.startswith("pos")))
    shifts = sorted({int(s[3:]) for s in selections if s.startswith("pos")})
    if shifts:
        tokens.append("pos" + ",".join(map(str, shifts)))
    return ", ".join(tokens)


def draw_circuit(ax, G) -> None:
    """Draw `circuit_graph`'s graph: nodes left to right by layer, edges as arcs under them labelled with
    their selections; aiding edges dashed red on deeper arcs."""
    import networkx as nx

    pos = {n: (d["layer"], 0.0) for n, d in G.nodes(data=True)}
    nx.draw_networkx_nodes(G, pos, ax=ax, node_color="#dddddd", node_size=1000)
    nx.draw_networkx_labels(G, pos, ax=ax, font_size=8)
    for kind, color, line, rad in (("core", "0.25", "solid", 0.3), ("aiding", "C3", "dashed", 0.55)):
        edges = [(u, v, k) for u, v, k in G.edges(keys=True) if k == kind]
        if not edges:
            continue
        style = f"arc3,rad={rad}"
        nx.draw_networkx_edges(G, pos, edgelist=edges, ax=ax, connectionstyle=style, arrows=True, style=line,
                               edge_color=color, node_size=1000, width=1.2)
        nx.draw_networkx_edge_labels(G, pos, edge_labels={e: G.edges[e]["label"] for e in edges}, ax=ax,
                                     connectionstyle=style, font_size=6, font_color=color,
                                     bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8})
    span = max((abs(pos[v][0] - pos[u][0]) for u, v in G.edges()), default=1)
    ax.set_xlim(-0.5, max(x for x, _ in pos.values()) + 0.5)
    ax.set_ylim(-0.2 * span - 0.1, 0.2)
    ax.axis("off")
