"""Chapter `assign_add`: the experiments of "Assign and Add" (Exoo, Bietti, Sous; arXiv 2605.31497).

Everything the chapter's notebooks share lives here, so that every notebook gets the same
runs by calling the same function with the same Params:

Runs
    `model_config`, `train_config`, `make_task` build the configs from a notebook's Params;
    `main_run(cfg)` trains (or loads) the paper's model with `ProgressEvaluator` as its
    evaluation callback; `f_sweep(cfg)` / `r_sweep(cfg)` train the data-threshold sweeps as
    ensembles (one member per (value, seed), one task per member).

Detection rules (documented, never typed in)
    `crossing_step`   first step at which a curve reaches a level (linear interpolation);
    `steepest_rise`   centre of the window of fixed width (in steps) over which a curve rises
                      most, optionally only after a given step;
    `detect_phases`   the three phases of training from the accuracy curves and the routing
                      score (see its docstring);
    `threshold`       smallest sweep value at which mean accuracy reaches a level (interpolated).

Measurements (all on a `ToyTransformer`, so an external checkpoint works the same way)
    `routing_score`        layer-1 attention of each assigned number token to the variable just
                           before it (AA-2 progress measure, AA-10);
    `bound_attention`      layer-2 attention of `=` to the value token bound to each variable
                           operand (AA-11);
    `variable_qk_matrix`   the layer-2 QK bilinear form between variable embeddings as layer 2
                           sees them (after the layer-1 OV circuit), with
                           `diagonal_argmax_fraction` and `template_cosine` (AA-11);
    `residual_cosines`     cosine of the residual stream before the layer-2 MLP between variable
                           and constant additions with the same values (AA-8);
    `mlp_preactivation_grid` layer-2 MLP pre-activations over all (n, m) (AA-9, with
                           `circuitbook.analysis.fourier`);
    `probe_accuracy`       closed-form ridge linear probes;
    `qk_gradient`          -dL/dW_QK of layer 2 and its variable block (AA-12).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import pandas as pd
import torch

from ..train import Ensemble, Run, TrainConfig, _tensor_digest, pool_accuracy
from ..train import train as _train_run
from ..models.loading import load_transformer_lens_checkpoint
from ..models.toy import ToyConfig, ToyTransformer
from ..tasks.assign_add import (N_VARS, POOL_NAMES, PREFIX_LEN, SEQ_LEN, TWO_VAR_LEFT, TWO_VAR_RIGHT,
                                NOT_LEFT, AssignAddTask)
from ..tasks.base import Batch

MEASURES_VERSION = 1  # bump when ProgressEvaluator's measures change meaning (it is part of the run key)
VAR_POOLS = ("one_var_train", "two_var_train")  # "variable accuracy": training pairs and positions
HARD_POOLS = ("one_var_var_restricted", "two_var_var_restricted_one", "two_var_var_restricted_two")
TWO_VAR_POOLS = ("two_var_train", "two_var_add_restricted", "two_var_var_restricted_one",
                 "two_var_var_restricted_two")
SWEEP_SEED_STRIDE = 1000  # member seed = seed * stride + value index; init from seed only


# =============================================================================
# Configs and runs
# =============================================================================

def model_config(cfg, d_model: int | None = None, d_mlp: int | None = None) -> ToyConfig:
    """The paper's architecture: 2 layers, 1 head, d_head = d_model, no biases, no LayerNorm,
    no layer-1 MLP, learned positions, 74 input tokens, 59 outputs. Width from Params."""
    return ToyConfig(d_vocab=74, n_ctx=SEQ_LEN, d_model=int(d_model or cfg.d_model), n_layers=2, n_heads=1,
                     d_mlp=int(d_mlp or cfg.d_mlp), mlp=(False, True), bias=False, d_vocab_out=59)


def train_config(cfg) -> TrainConfig:
    """AdamW (betas 0.9, 0.999), constant lr, fresh batches each step; schedule from Params."""
    return TrainConfig(steps=cfg.steps, batch_size=cfg.batch_size, seeds=(cfg.seed,), lr=cfg.lr,
                              weight_decay=cfg.weight_decay, eval_every=cfg.eval_every,
                              checkpoint_every=cfg.checkpoint_every, log_checkpoints=cfg.log_checkpoints)


def make_task(cfg, train_fraction: float | None = None, two_var_ratio: float | None = None) -> AssignAddTask:
    f = cfg.train_fraction if train_fraction is None else train_fraction
    r = cfg.get("two_var_ratio") if two_var_ratio is None else two_var_ratio
    return AssignAddTask(train_fraction=f, two_var_ratio=r, split_seed=cfg.split_seed)


def eval_pools(task: AssignAddTask, size: int, seed: int = 1) -> dict[str, Batch]:
    """The nine pools plus the exact held-out 0-var set (`heldout_zero_var`), pool seed `seed`."""
    pools = task.eval_pools(size=size, seed=seed)
    pools["heldout_zero_var"] = task.heldout_zero_var(seed=seed)
    return {k: v for k, v in pools.items() if len(v.labels)}


def main_run(cfg, progress: bool | None = None) -> "Run | ComposedRun":
    """The book's run of the paper's model (cached in the artifact store).

    With `cooldown_steps` > 0 (a scale-down option; the paper keeps the learning rate constant) the
    run continues for that many steps at `cooldown_lr`, as a fork of the main run's last checkpoint;
    the two are returned as one `ComposedRun`.
    """
    task = make_task(cfg)
    evaluate = ProgressEvaluator(task, pool_size=cfg.pool_size, probe_size=cfg.probe_size)
    run = _train_run("assign_add/main", model_config(cfg), task, train_config(cfg), evaluate=evaluate,
                     progress=progress)
    if not cfg.get("cooldown_steps"):
        return run
    tc = replace(train_config(cfg), steps=cfg.steps + cfg.cooldown_steps, lr=cfg.cooldown_lr, log_checkpoints=0)
    cooldown = _train_run("assign_add/main_cooldown", model_config(cfg), task, tc, evaluate=evaluate,
                          fork_from=(run, cfg.steps), progress=progress)
    return ComposedRun(run, cooldown)


class ComposedRun:
    """A run and its continuation (a fork from the run's last checkpoint) read as one run:
    metrics, checkpoints and models over the whole span; `train_config` is the continuation's
    (its `steps` is the final step)."""

    def __init__(self, first: Run, second: Run):
        self.first, self.second = first, second
        self.model_config = second.model_config
        self.train_config = second.train_config
        self.dir, self.key, self.path = second.dir, second.key, second.path
        self.boundary = first.train_config.steps
        self.manifest = {"train_seconds": round(first.manifest.get("train_seconds", 0)
                                                + second.manifest.get("train_seconds", 0), 2)}

    def __repr__(self):
        return f"ComposedRun({self.first!r} -> {self.second!r} from step {self.boundary})"

    @property
    def n_members(self) -> int:
        return self.second.n_members

    def metrics(self) -> pd.DataFrame:
        a, b = self.first.metrics(), self.second.metrics()
        return pd.concat([a, b[b.step > self.boundary]], ignore_index=True)

    def checkpoint_steps(self) -> list[int]:
        return sorted(set(self.first.checkpoint_steps()) | set(self.second.checkpoint_steps()))

    def model(self, member: int = 0, step: int | None = None) -> ToyTransformer:
        step = self.train_config.steps if step is None else step
        return (self.first if step <= self.boundary else self.second).model(member, step)


def load_model(cfg, step: int | None = None) -> tuple[ToyTransformer, str, "Run | ComposedRun | None"]:
    """The model a notebook analyses: the external checkpoint at `cfg.checkpoint_path` when it is
    set (read with `load_transformer_lens_checkpoint`, config inferred from the weights), else the
    book's main run at `step` (default: final). Returns (model, description, run or None)."""
    path = cfg.get("checkpoint_path")
    if path:
        model = load_transformer_lens_checkpoint(path, None)
        c = model.cfg
        return model, (f"external checkpoint {path} (d_model {c.d_model}, d_mlp {c.d_mlp}, "
                       f"{c.n_layers} layers)"), None
    run = main_run(cfg)
    step = run.train_config.steps if step is None else step
    return run.model(0, step), f"the book's own run {run.dir.name}/{run.key}, step {step}", run


# =============================================================================
# Attention measurements
# =============================================================================

@torch.no_grad()
def attention_patterns(model: ToyTransformer, tokens: torch.Tensor, batch_size: int = 1024) -> list[torch.Tensor]:
    """Attention patterns of every layer, [B, heads, query, key] each."""
    names = [f"blocks.{i}.attn.hook_pattern" for i in range(model.cfg.n_layers)]
    out = [[] for _ in names]
    for start in range(0, len(tokens), batch_size):
        _, cache = model.run_with_cache(tokens[start:start + batch_size], names_filter=lambda n: n in names,
                                        return_cache_object=False)
        for i, n in enumerate(names):
            out[i].append(cache[n])
    return [torch.cat(x) for x in out]


def value_positions(tokens: torch.Tensor, task: AssignAddTask) -> torch.Tensor:
    """Bool [B, T]: positions of the number token of a prefix assignment `var value`."""
    is_var = (tokens[:, :PREFIX_LEN] >= task.VAR0)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, 1:PREFIX_LEN + 1] = is_var  # the value sits right after its variable
    return mask


def routing_score(pattern0: torch.Tensor, tokens: torch.Tensor, task: AssignAddTask) -> torch.Tensor:
    """Per head: mean layer-1 attention of an assigned number token to the variable right before it.

    pattern0 [B, H, Q, K] (layer 1 = blocks.0). Averaged over every assignment of every sequence.
    1 means a perfect previous-token head on constants; uniform attention gives about 1/(p+1).
    """
    mask = value_positions(tokens, task)
    b, p = mask.nonzero(as_tuple=True)
    return pattern0[b, :, p, p - 1].mean(0)


def bound_attention(pattern1: torch.Tensor, tokens: torch.Tensor, task: AssignAddTask,
                    prefix_share: bool = False) -> torch.Tensor:
    """Per head: mean over sequences with a variable operand of the attention of `=` (last query) in
    layer 2 to the value token(s) bound to the variable operand(s) (summed for 2-var).

    pattern1 [B, H, Q, K] (layer 2 = blocks.1); the last query row is used. prefix_share=True
    divides by the attention `=` puts on the whole prefix (the 12 assignment and PAD positions): the
    share of what `=` reads from the assignments that comes from the bound value(s), leaving out
    the query core, whose constant operand a 1-var sum also needs.
    """
    parsed = task.parse(tokens)
    row = pattern1[:, :, -1]  # [B, H, K]
    if prefix_share:
        row = row / row[:, :, :PREFIX_LEN].sum(-1, keepdim=True).clamp(min=1e-12)
    total = torch.zeros(row.shape[:2])
    has = torch.zeros(len(tokens), dtype=torch.bool)
    for key in ("left_pos", "right_pos"):
        pos = parsed[key]
        ok = pos >= 0
        total[ok] += row[ok, :, pos[ok]]
        has |= ok
    if not has.any():
        return torch.full((row.shape[1],), float("nan"))
    return total[has].mean(0)


def variable_qk_matrix(model: ToyTransformer, task: AssignAddTask, composed: bool = True, head: int = 0,
                       layer: int = 1) -> torch.Tensor:
    """[12, 12] layer-2 attention score between variables: rows the queried variable, columns the
    variable of a key.

    composed=True (the mechanism): both sides are the variable embeddings after the layer-1 OV
    circuit, e_v W_V^1 W_O^1, because that is how a variable reaches layer 2 - at `=` through
    layer-1 attention to the operand token, at an assigned number through its previous-token
    attention to the variable. composed=False uses the raw embeddings e_v. The score is
    x_q W_Q W_K^T x_k / sqrt(d_head), the pre-softmax logit it adds.
    """
    E = model.W_E[task.VAR0:task.VAR0 + N_VARS].detach()
    if composed:
        a0 = model.blocks[0].attn
        E = E @ torch.einsum("hde,hef->df", a0.W_V.detach(), a0.W_O.detach())
    attn = model.blocks[layer].attn
    scale = model.cfg.attn_scale if model.cfg.attn_scale is not None else math.sqrt(model.cfg.head_dim)
    return (E @ attn.W_Q[head].detach()) @ (E @ attn.W_K[head].detach()).T / scale


def diagonal_argmax_fraction(M: torch.Tensor) -> float:
    """Fraction of rows whose largest entry is on the diagonal (1.0 for an identity-like matrix)."""
    M = torch.as_tensor(M)
    return float((M.argmax(1) == torch.arange(M.shape[0])).float().mean())


def double_centre(M: torch.Tensor) -> torch.Tensor:
    M = torch.as_tensor(M, dtype=torch.float64)
    return M - M.mean(0, keepdim=True) - M.mean(1, keepdim=True) + M.mean()


def template_cosine(M: torch.Tensor, template: torch.Tensor | None = None) -> float:
    """Cosine between the double-centred M and the double-centred template (default identity).

    Double centring removes row and column offsets (a constant, a per-query or per-key bias), so
    a*I + b*J + row/column terms scores 1 for a > 0, -1 for a < 0, and a matrix with no diagonal
    structure about 0. NaN if either centred matrix is zero.
    """
    M = double_centre(M)
    T = double_centre(torch.eye(M.shape[0]) if template is None else template)
    denom = M.norm() * T.norm()
    return float((M * T).sum() / denom) if denom > 0 else float("nan")


# =============================================================================
# The main run's evaluation callback
# =============================================================================

class ProgressEvaluator:
    """Evaluation callback of the main run: accuracy of every pool and the progress measures.

    Per member it returns `acc_<pool>` for the nine pools and the exact held-out 0-var set, and
      routing     layer-1 previous-token attention of assigned numbers (`routing_score`),
      bound_1var  layer-2 attention of `=` to the bound value, 1-var sequences (`bound_attention`),
      bound_2var  the same summed over both operands, 2-var sequences,
      qk_diag     `diagonal_argmax_fraction` of the composed `variable_qk_matrix`,
      qk_identity `template_cosine` of that matrix with the identity.
    Its spec() (part of the run key) holds digests of every pool and MEASURES_VERSION.
    """

    def __init__(self, task: AssignAddTask, pool_size: int = 2000, probe_size: int = 512, seed: int = 1):
        self.task = task
        self.pools = eval_pools(task, pool_size, seed)
        self.probe = {"1var": task.eval_pool("one_var_train", probe_size, seed + 1000).tokens,
                      "2var": task.eval_pool("two_var_train", probe_size, seed + 1000).tokens}
        self._acc = pool_accuracy(self.pools)

    def spec(self) -> dict:
        return {"assign_add_progress": MEASURES_VERSION, **self._acc.spec(),
                "probe": {k: _tensor_digest(v) for k, v in self.probe.items()}}

    @torch.no_grad()
    def measures(self, model: ToyTransformer) -> dict[str, float]:
        out = {}
        for kind, tokens in self.probe.items():
            p0, p1 = attention_patterns(model, tokens)
            if kind == "1var":
                out["routing"] = float(routing_score(p0, tokens, self.task).max())
            out[f"bound_{kind}"] = float(bound_attention(p1, tokens, self.task).max())
        qk = variable_qk_matrix(model, self.task)
        out["qk_diag"] = diagonal_argmax_fraction(qk)
        out["qk_identity"] = template_cosine(qk)
        return out

    def __call__(self, ens: Ensemble, step: int) -> dict:
        out = self._acc(ens, step)
        per_member = []
        with torch.random.fork_rng(devices=[]):  # building a member model draws (unused) init weights
            for k in range(ens.n_members):
                per_member.append(self.measures(ens.member(k)))
        for name in per_member[0]:
            out[name] = torch.tensor([m[name] for m in per_member])
        return out


# =============================================================================
# Reading curves: crossings, steepest rises, phases
# =============================================================================

def crossing_step(steps, values, level: float) -> float:
    """First step at which the curve reaches `level`, linearly interpolated between evaluations
    (the first step itself if it already does; NaN if never)."""
    x, y = np.asarray(steps, float), np.asarray(values, float)
    above = np.nonzero(y >= level)[0]
    if len(above) == 0:
        return float("nan")
    i = above[0]
    if i == 0:
        return float(x[0])
    x0, x1, y0, y1 = x[i - 1], x[i], y[i - 1], y[i]
    return float(x0 + (level - y0) / (y1 - y0) * (x1 - x0))


def steepest_rise(steps, values, window: float, after: float | None = None) -> tuple[float, float]:
    """(step, rise): the window of `window` steps over which the curve rises most.

    The curve is linearly interpolated; for each evaluation step t (with t >= after, if given)
    the rise is v(t + window) - v(t); the returned step is the window's centre t + window / 2
    and rise its size. (NaN, NaN) if no window fits.
    """
    x, y = np.asarray(steps, float), np.asarray(values, float)
    order = np.argsort(x)
    x, y = x[order], y[order]
    starts = x[(x + window <= x[-1] + 1e-9) & (x >= (after if after is not None else -np.inf))]
    if len(starts) == 0:
        return float("nan"), float("nan")
    rise = np.interp(starts + window, x, y) - np.interp(starts, x, y)
    i = int(np.argmax(rise))
    return float(starts[i] + window / 2), float(rise[i])


@dataclass(frozen=True)
class Phases:
    """Steps detected from the curves of one member (see `detect_phases`); NaN: not detected."""

    addition_step: float  # 0-var (training pairs) accuracy reaches 0.9
    variable_step: float  # mean 1-var accuracy reaches 0.9
    jump_step: float  # steepest rise of the variable accuracy
    jump_rise: float
    routing_step: float  # layer-1 routing score crosses half-way from its initial to its final value
    refine_step: float  # steepest rise of the hard-case accuracy after the jump
    refine_rise: float
    window: float

    def marks(self) -> dict[str, float]:
        marks = {"addition": self.addition_step, "jump": self.jump_step, "refinement": self.refine_step}
        return {k: v for k, v in marks.items() if not math.isnan(v)}


def detect_phases(metrics: pd.DataFrame, member: int = 0, window: float | None = None,
                  min_rise: float = 0.2, level: float = 0.9) -> Phases:
    """The three phases of training, detected from the evaluation curves of one member.

    - addition: first step where 0-var accuracy on training pairs reaches `level`;
    - jump: centre of the `window` of steepest rise of the variable accuracy (mean of the
      1-var and 2-var training pools, `VAR_POOLS`), with the routing step - where the layer-1
      routing score crosses half-way between its first and final value - for comparison;
    - refinement: centre of the window of steepest rise of the hard-case accuracy (mean of the
      var-restricted pools, `HARD_POOLS`) among windows that start at least one window after the
      jump. A phase whose rise is below `min_rise` is not detected (NaN).
    window defaults to 1/20 of the run (at least two evaluations).
    """
    m = metrics[metrics.member == member].sort_values("step")
    steps = m.step.to_numpy(float)
    if window is None:
        window = max(steps[-1] / 20, 2 * float(np.median(np.diff(steps))) if len(steps) > 1 else 1.0)
    zero = m["acc_zero_var_train"].to_numpy()
    one = m["acc_one_var_train"].to_numpy()
    var = m[[f"acc_{p}" for p in VAR_POOLS]].mean(axis=1).to_numpy()
    hard = m[[f"acc_{p}" for p in HARD_POOLS]].mean(axis=1).to_numpy()
    jump, jump_rise = steepest_rise(steps, var, window)
    if not jump_rise >= min_rise:
        jump = float("nan")
    routing = float("nan")
    if "routing" in m:
        r = m["routing"].to_numpy()
        routing = crossing_step(steps, r, r[0] + 0.5 * (r[-1] - r[0])) if r[-1] > r[0] else float("nan")
    refine, refine_rise = (steepest_rise(steps, hard, window, after=jump + window / 2)
                           if not math.isnan(jump) else (float("nan"), float("nan")))
    if not refine_rise >= min_rise:
        refine = float("nan")
    return Phases(addition_step=crossing_step(steps, zero, level), variable_step=crossing_step(steps, one, level),
                  jump_step=jump, jump_rise=jump_rise, routing_step=routing, refine_step=refine,
                  refine_rise=refine_rise, window=float(window))


def value_at(metrics: pd.DataFrame, column: str, step: float, member: int = 0) -> float:
    """The curve's value at `step` (linear interpolation)."""
    m = metrics[metrics.member == member].sort_values("step")
    return float(np.interp(step, m.step, m[column]))


def checkpoint_before(run: Run, step: float) -> int:
    """The last checkpoint strictly before `step` (the first checkpoint if none)."""
    ckpts = run.checkpoint_steps()
    before = [s for s in ckpts if s < step]
    return before[-1] if before else ckpts[0]


def checkpoint_after(run: Run, step: float) -> int:
    """The first checkpoint at or after `step` (the last checkpoint if none)."""
    ckpts = run.checkpoint_steps()
    after = [s for s in ckpts if s >= step]
    return after[0] if after else ckpts[-1]


def transition_checkpoints(run: Run, phases: Phases) -> dict[str, int]:
    """Checkpoints that bracket the phases: before and after the jump, after the refinement, final."""
    out = {"init": 0}
    if not math.isnan(phases.jump_step):
        out["before jump"] = checkpoint_before(run, phases.jump_step - phases.window / 2)
        out["after jump"] = checkpoint_after(run, phases.jump_step + phases.window / 2)
    if not math.isnan(phases.refine_step):
        out["after refinement"] = checkpoint_after(run, phases.refine_step + phases.window / 2)
    out["final"] = run.train_config.steps
    # keep the order, drop repeats of the same checkpoint
    seen, unique = set(), {}
    for k, v in out.items():
        if v not in seen:
            unique[k], _ = v, seen.add(v)
    return unique


# =============================================================================
# Sweeps (AA-6, AA-7)
# =============================================================================

def sweep_members(values: Sequence[float], seeds: Sequence[int]) -> pd.DataFrame:
    """One row per ensemble member: value, seed, member_seed (= seed * 1000 + value index)."""
    rows = [{"member": i * len(values) + j, "value": float(v), "seed": int(s),
             "member_seed": int(s) * SWEEP_SEED_STRIDE + j}
            for i, s in enumerate(seeds) for j, v in enumerate(values)]
    return pd.DataFrame(rows)


def sweep_init(model: ToyTransformer, member_seed: int) -> None:
    """Members with the same seed start from the same weights, whatever their sweep value."""
    model.init_weights(member_seed // SWEEP_SEED_STRIDE)


class MemberPoolAccuracy:
    """Evaluation callback with one set of pools per member (per-member data): `acc_<name>` [K].

    pools: {name: [Batch for member 0, ..., member K-1]}; batches of different lengths are padded
    and the padding is not counted. A name with several batches per member, given as a tuple of
    lists, is scored on their union.
    """

    def __init__(self, pools: dict[str, list[Batch]]):
        self.pools = pools

    def spec(self) -> dict:
        return {"member_pool_accuracy": {name: [_tensor_digest(b.tokens, b.labels) for b in batches]
                                         for name, batches in self.pools.items()}}

    @torch.no_grad()
    def __call__(self, ens: Ensemble, step: int) -> dict:
        out = {}
        for name, batches in self.pools.items():
            n = max(len(b.labels) for b in batches)
            tokens = torch.stack([_pad(b.tokens, n) for b in batches])
            labels = torch.stack([_pad(b.labels, n) for b in batches])
            keep = torch.stack([torch.arange(n) < len(b.labels) for b in batches]).float()
            pred = torch.cat([ens.logits(tokens[:, i:i + 2048], last_only=True)[:, :, -1].argmax(-1)
                              for i in range(0, n, 2048)], 1)
            out[f"acc_{name}"] = ((pred == labels).float() * keep).sum(1) / keep.sum(1).clamp(min=1)
        return out


def _pad(t: torch.Tensor, n: int) -> torch.Tensor:
    if len(t) == n:
        return t
    if len(t) == 0:
        return torch.zeros((n, *t.shape[1:]), dtype=t.dtype)
    reps = -(-n // len(t))
    return t.repeat(reps, *([1] * (t.dim() - 1)))[:n]


def _union(batches: Sequence[Batch]) -> Batch:
    return Batch(torch.cat([b.tokens for b in batches]), torch.cat([b.labels for b in batches]))


def sweep_evaluator(tasks: Sequence[AssignAddTask], pool_size: int) -> MemberPoolAccuracy:
    """Per member: exact held-out 0-var accuracy, 0-var training-pair accuracy and the 2-var union
    accuracy (the four 2-var pools together)."""
    pools = {"heldout_zero_var": [], "zero_var_train": [], "two_var_union": []}
    for t in tasks:
        pools["heldout_zero_var"].append(t.heldout_zero_var(seed=1))
        pools["zero_var_train"].append(t.eval_pool("zero_var_train", pool_size, 1))
        two = [t.eval_pool(p, pool_size, 1) for p in TWO_VAR_POOLS]
        pools["two_var_union"].append(_union([b for b in two if len(b.labels)]))
    return MemberPoolAccuracy(pools)


def _sweep(cfg, name: str, kind: str) -> tuple[Run, pd.DataFrame]:
    values = cfg.f_values if kind == "f" else cfg.r_values
    members = sweep_members(values, cfg.sweep_seeds)
    tasks = [make_task(cfg, train_fraction=v) if kind == "f" else make_task(cfg, two_var_ratio=v)
             for v in members.value]
    tc = TrainConfig(steps=cfg.sweep_steps, batch_size=cfg.sweep_batch_size,
                            seeds=tuple(members.member_seed), lr=cfg.sweep_lr, weight_decay=cfg.weight_decay,
                            eval_every=cfg.sweep_eval_every, checkpoint_every=None, log_checkpoints=4)
    run = _train_run(name, model_config(cfg, cfg.sweep_d_model, cfg.sweep_d_mlp), tasks, tc,
                       evaluate=sweep_evaluator(tasks, cfg.sweep_pool_size), init_fn=sweep_init)
    return run, members


def f_sweep(cfg) -> tuple[Run, pd.DataFrame]:
    """AA-6: one member per (training-pair fraction f, seed); returns (run, members table)."""
    return _sweep(cfg, "assign_add/f_sweep", "f")


def r_sweep(cfg) -> tuple[Run, pd.DataFrame]:
    """AA-7: one member per (2-var frequency r = #2-var / #0-var, seed) at f = train_fraction."""
    return _sweep(cfg, "assign_add/r_sweep", "r")


def sweep_table(run: Run, members: pd.DataFrame, step: int | None = None) -> pd.DataFrame:
    """Members joined with their metrics at `step` (default: the last evaluation)."""
    m = run.metrics()
    step = m.step.max() if step is None else step
    return members.merge(m[m.step == step].drop(columns=["seed"]), on="member")


def threshold(values, accuracies, level: float = 0.9) -> float:
    """Smallest sweep value at which the mean accuracy (over seeds) reaches `level`.

    Values are grouped and sorted; at the first value whose mean reaches the level the threshold
    is interpolated linearly from the previous value; the smallest value if it already does;
    NaN if none does.
    """
    df = pd.DataFrame({"x": np.asarray(values, float), "y": np.asarray(accuracies, float)})
    g = df.groupby("x").y.mean().sort_index()
    return crossing_step(g.index.to_numpy(), g.to_numpy(), level)


# =============================================================================
# Residual stream, MLP and probes (AA-8, AA-9)
# =============================================================================

def _cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


@torch.no_grad()
def residual_at(model: ToyTransformer, tokens: torch.Tensor, hook: str = "blocks.1.hook_resid_mid",
                position: int = -1) -> torch.Tensor:
    from ..analysis.ace import collect_activations

    return collect_activations(model, tokens, hook, position=position)


def residual_cosines(model: ToyTransformer, task: AssignAddTask, n: int = 1000, seed: int = 0,
                     hook: str = "blocks.1.hook_resid_mid") -> pd.DataFrame:
    """Residual vectors before the layer-2 MLP at `=`: variable vs constant additions.

    For n random pairs (n1, n2) (training pairs) and each variable form - 1-var left (x in a..j),
    1-var right (y in c..l), 2-var (x in c..j, y in c..l, x != y), all training positions - the
    cosine between the variable sequence's vector and the 0-var `+ n1 n2 =` vector of the same
    values (`matched`), the same with the 0-var vector of another random pair (`mismatched`), and
    both after subtracting the mean vector of all these sequences (`*_centred`).
    One row per (form, sequence).
    """
    g = torch.Generator().manual_seed(seed)
    pair = task.train_pairs[torch.randint(len(task.train_pairs), (n,), generator=g)]
    n1, n2 = pair // task.modulus, pair % task.modulus
    left = torch.tensor(TWO_VAR_LEFT)[torch.randint(len(TWO_VAR_LEFT), (n,), generator=g)]
    right_pool = torch.tensor(TWO_VAR_RIGHT)
    right = right_pool[torch.randint(len(right_pool), (n,), generator=g)]
    right = torch.where(right == left, right_pool[(right_pool == 11).nonzero()[0, 0]], right)  # x != y
    left_any = torch.tensor([v for v in range(N_VARS) if v not in NOT_LEFT])[torch.randint(10, (n,), generator=g)]
    const = residual_at(model, task.make_batch(n1, n2, seed=seed).tokens, hook)
    forms = {"1-var left": task.make_batch(n1, n2, left_var=left_any, seed=seed + 1).tokens,
             "1-var right": task.make_batch(n1, n2, right_var=right, seed=seed + 2).tokens,
             "2-var": task.make_batch(n1, n2, left_var=left, right_var=right, seed=seed + 3).tokens}
    acts = {k: residual_at(model, t, hook) for k, t in forms.items()}
    mean = torch.cat([const, *acts.values()]).mean(0)
    shift = torch.roll(torch.arange(n), 1)  # another pair (pairs repeat only by chance)
    rows = []
    for form, a in acts.items():
        frame = pd.DataFrame({
            "form": form, "n1": n1.numpy(), "n2": n2.numpy(),
            "matched": _cosine(a, const).numpy(), "mismatched": _cosine(a, const[shift]).numpy(),
            "matched_centred": _cosine(a - mean, const - mean).numpy(),
            "mismatched_centred": _cosine(a - mean, const[shift] - mean).numpy()})
        rows.append(frame)
    return pd.concat(rows, ignore_index=True)


@torch.no_grad()
def mlp_preactivation_grid(model: ToyTransformer, task: AssignAddTask, n_layouts: int = 4, seed: int = 0,
                           hook: str = "blocks.1.mlp.hook_pre") -> torch.Tensor:
    """Layer-2 MLP pre-activations at `=` for every 0-var sum `+ n m =`, as [N, N, d_mlp]
    (axis 0 = n, axis 1 = m), averaged over `n_layouts` random prefixes (distractors, padding)."""
    N = task.modulus
    n, m = torch.meshgrid(torch.arange(N), torch.arange(N), indexing="ij")
    total = 0
    for s in range(n_layouts):
        tokens = task.make_batch(n.flatten(), m.flatten(), seed=seed + s).tokens
        total = total + residual_at(model, tokens, hook)
    return (total / n_layouts).reshape(N, N, -1)


def probe_accuracy(X_train, y_train, X_test, y_test, n_classes: int | None = None, ridge: float = 1e-3) -> float:
    """Accuracy of a closed-form ridge-regression probe onto one-hot labels (argmax decoding).

    Features are standardised with the training mean and std; ridge is relative to the mean
    eigenvalue of the training Gram matrix.
    """
    X_train, X_test = torch.as_tensor(X_train, dtype=torch.float64), torch.as_tensor(X_test, dtype=torch.float64)
    y_train, y_test = torch.as_tensor(y_train).long(), torch.as_tensor(y_test).long()
    k = n_classes or int(max(y_train.max(), y_test.max())) + 1
    mu, sd = X_train.mean(0), X_train.std(0).clamp(min=1e-8)
    A = torch.cat([(X_train - mu) / sd, torch.ones(len(X_train), 1, dtype=torch.float64)], 1)
    B = torch.cat([(X_test - mu) / sd, torch.ones(len(X_test), 1, dtype=torch.float64)], 1)
    Y = torch.nn.functional.one_hot(y_train, k).double()
    gram = A.T @ A
    lam = ridge * gram.diagonal().mean()
    W = torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=torch.float64), A.T @ Y)
    return float(((B @ W).argmax(1) == y_test).double().mean())


@torch.no_grad()
def variable_probe_data(model: ToyTransformer, task: AssignAddTask, tokens: torch.Tensor,
                        hook: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(activations, variable id) at every assigned number token: what a probe for "which variable
    is this number bound to" reads at `hook`."""
    acts = residual_at(model, tokens, hook, position="all")  # [B, T, D]
    mask = value_positions(tokens, task)
    b, p = mask.nonzero(as_tuple=True)
    return acts[b, p], tokens[b, p - 1] - task.VAR0


# =============================================================================
# Gradient theory (AA-12)
# =============================================================================

def qk_gradient(model: ToyTransformer, tokens: torch.Tensor, labels: torch.Tensor, layer: int = 1,
                batch_size: int = 1024) -> torch.Tensor:
    """-dL/dW_QK [heads, d_model, d_model] for the layer's bilinear query-key form.

    The scores are s(q, k) = x_q W_QK x_k^T / scale with W_QK = W_Q W_K^T, so treating W_QK as the
    parameter, dL/dW_QK = sum over sequences and (query, key) of dL/ds * x_q^T x_k / scale, with
    x the residual entering the layer. L is the training loss (mean cross-entropy at the last
    position). Factor-free: it is the direction gradient descent on a merged W_QK would take.
    """
    hook_x, hook_s = f"blocks.{layer}.hook_resid_pre", f"blocks.{layer}.attn.hook_attn_scores"
    scale = model.cfg.attn_scale if model.cfg.attn_scale is not None else math.sqrt(model.cfg.head_dim)
    H, d = model.cfg.n_heads, model.cfg.d_model
    total = torch.zeros(H, d, d, dtype=torch.float64)
    for start in range(0, len(tokens), batch_size):
        tok, lab = tokens[start:start + batch_size], labels[start:start + batch_size]
        store = {}

        def keep_x(x, hook):
            store["x"] = x.detach()

        def keep_s(s, hook):
            s.retain_grad()
            store["s"] = s

        logits = model.run_with_hooks(tok, fwd_hooks=[(hook_x, keep_x), (hook_s, keep_s)])
        loss = torch.nn.functional.cross_entropy(logits[:, -1].float(), lab, reduction="sum") / len(tokens)
        model.zero_grad(set_to_none=True)
        loss.backward()
        ds = store["s"].grad.nan_to_num(0.0).double()  # [B, H, Q, K]
        x = store["x"].double()
        total += torch.einsum("bhqk,bqd,bke->hde", ds, x, x) / scale
    model.zero_grad(set_to_none=True)
    return -total


def qk_basis(model: ToyTransformer, task: AssignAddTask) -> tuple[torch.Tensor, list[str]]:
    """Rows of the embedding basis the QK forms are read in: every raw token embedding (74) and
    the 12 variable embeddings after the layer-1 OV circuit (`v'`), unit-normalised."""
    E = model.W_E.detach().double()
    a0 = model.blocks[0].attn
    moved = E[task.VAR0:task.VAR0 + N_VARS] @ torch.einsum("hde,hef->df", a0.W_V.detach(), a0.W_O.detach()).double()
    basis = torch.cat([E, moved])
    names = task.token_names() + [f"{v}'" for v in task.token_names()[task.VAR0:]]
    return basis / basis.norm(dim=1, keepdim=True).clamp(min=1e-12), names


def qk_in_basis(M: torch.Tensor, model: ToyTransformer, task: AssignAddTask) -> tuple[torch.Tensor, list[str]]:
    """A bilinear form M [d, d] (e.g. -dL/dW_QK of one head) read in `qk_basis` on both sides."""
    basis, names = qk_basis(model, task)
    return basis @ M.double() @ basis.T, names


def variable_block(M_basis: torch.Tensor, task: AssignAddTask) -> torch.Tensor:
    """The (moved variable) x (moved variable) block [12, 12] of a form read in `qk_basis`."""
    start = task.vocab_size
    return M_basis[start:start + N_VARS, start:start + N_VARS]


def block_energy(M_basis: torch.Tensor, task: AssignAddTask) -> pd.DataFrame:
    """Root-mean-square entry of each block of a form read in `qk_basis` (query group x key group):
    groups numbers, symbols (+ = PAD), variables, moved variables."""
    N, V = task.modulus, task.vocab_size
    groups = {"numbers": range(0, N), "symbols": range(N, task.VAR0), "variables": range(task.VAR0, V),
              "moved variables": range(V, V + N_VARS)}
    M = M_basis.abs()
    return pd.DataFrame({kg: {qg: float(M[list(qi)][:, list(ki)].pow(2).mean().sqrt()) for qg, qi in groups.items()}
                         for kg, ki in groups.items()})


@torch.no_grad()
def variable_directions(model: ToyTransformer, task: AssignAddTask, tokens: torch.Tensor,
                        layer: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """How the residual stream entering `layer` encodes variables, at the query and at the keys.

    query [12, d]: mean residual at `=` of the 1-var sequences whose operand is variable v, minus
    the mean over the 1-var sequences with an operand on the same side (see below); key [12, d]: mean residual at an assigned number token bound to v,
    minus the mean over all assigned numbers. Subtracting the means removes what every query (or
    key) shares, so a bilinear form read along these directions shows only how it depends on the
    variables. Variables that never occur get zero rows.
    """
    x = residual_at(model, tokens, f"blocks.{layer}.hook_resid_pre", position="all").double()  # [B, T, d]
    parsed = task.parse(tokens)
    mask = value_positions(tokens, task)
    b, p = mask.nonzero(as_tuple=True)
    key = _cond_means(x[b, p], tokens[b, p - 1] - task.VAR0)
    # queries: centred within each side (left / right operand), then averaged over the sides a
    # variable occurs on - in training a, b are only left operands and k, l only right ones, so
    # centring over both sides at once would mix "which side" into "which variable"
    sums, counts = torch.zeros(N_VARS, x.shape[-1], dtype=torch.float64), torch.zeros(N_VARS, 1)
    for seq_type, side in ((1, "left_var"), (2, "right_var")):
        rows = parsed["seq_type"] == seq_type
        if rows.any():
            labels = parsed[side][rows]
            sums += _cond_means(x[rows, -1], labels)
            counts += torch.bincount(labels, minlength=N_VARS)[:, None].clamp(max=1)
    return sums / counts.clamp(min=1), key


def _cond_means(X: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[12, d]: mean of X over each label minus the mean of X (zero rows for absent labels)."""
    out = torch.zeros(N_VARS, X.shape[1], dtype=torch.float64)
    for v in range(N_VARS):
        if (labels == v).any():
            out[v] = X[labels == v].mean(0) - X.mean(0)
    return out


def read_form(M: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """query M key^T: a bilinear form [d, d] read along query [n, d] and key [m, d] directions."""
    return query.double() @ M.double() @ key.double().T
