"""Chapter `assign_add`: the experiments of "Assign and Add" (Exoo, Bietti, Sous; arXiv 2605.31497).

Everything the chapter's notebooks share lives here, so that every notebook gets the same runs
by calling the same function with the same Params. Measurements that any model could be read
with live in `circuitbook.analysis` (`curves`, `attention`, `representations`, `fourier`); this
module knows the task: where the bound value sits, which variables a query names.

Runs
    `main_run(cfg)` trains (or loads) the paper's model as an ensemble of `cfg.seeds` (member 0
    is the model the mechanism pages show) with `ProgressEvaluator` as its evaluation callback;
    `source_run(cfg)` is the run a notebook reads: the main run, or a released training run
    (`CheckpointRun`, a directory of step checkpoints at `cfg.checkpoint_path`);
    `f_sweep(cfg)` / `r_sweep(cfg)` train the data-threshold sweeps as ensembles.

Phases (`detect_phases`, per member; rules in its docstring, never typed in)
    addition, then (searched after it) the variable-accuracy jump and the layer-2 circuit's
    emergence (QK identity, `=` reading the bound value over the other assigned values), the
    layer-1 previous-token head, the refinement.

Measurements (all on a `ToyTransformer`, so an external checkpoint works the same way)
    `routing_score` (AA-10), `bound_over_values_share` (AA-2), `addends_top_share` /
    `addend_targets` / `bound_attention` / `variable_qk_matrix` (AA-11),
    `residual_cosines` (AA-8), `mlp_preactivation_grid` (AA-9), `variable_probe_data`,
    `qk_gradient` / `theory_qk_block` (AA-12).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pandas as pd
import torch

from .. import context
from ..analysis import attention, curves, fourier
from ..analysis.ace import collect_activations
from ..models.loading import load_transformer_lens_checkpoint, read_release
from ..models.toy import ToyConfig, ToyTransformer
from ..runs import atomic_write_json, read_json, runs_root
from ..tasks.assign_add import (N_VARS, NOT_LEFT, NOT_RIGHT, PAIR_SPLITS, PREFIX_LEN, SEQ_LEN, TWO_VAR_LEFT,
                                TWO_VAR_RIGHT, AssignAddTask)
from ..tasks.base import Batch
from ..training import Ensemble, Run, TrainConfig, pool_accuracy, tensor_digest as _tensor_digest
from ..training import train as _train_run

MEASURES_VERSION = 3  # bump when ProgressEvaluator's measures change meaning (it is part of the run key)
VAR_POOLS = ("one_var_train", "two_var_train")  # "variable accuracy": training pairs and positions
HARD_POOLS = ("one_var_var_restricted", "two_var_var_restricted_one", "two_var_var_restricted_two")
ADD_POOLS = ("zero_var_add_restricted", "one_var_add_restricted", "two_var_add_restricted")
TWO_VAR_POOLS = ("two_var_train", "two_var_add_restricted", "two_var_var_restricted_one",
                 "two_var_var_restricted_two")
SWEEP_SEED_STRIDE = 1000  # member seed = seed * stride + value index; init from seed only
# The knobs that set how fast training moves: step numbers compare with the paper's only when all
# of them have the paper's values.
SCHEDULE_KNOBS = ("d_model", "d_mlp", "batch_size", "lr", "weight_decay", "train_fraction", "two_var_ratio",
                  "cooldown_steps")


# =============================================================================
# Configs and runs
# =============================================================================

def model_config(cfg, d_model: int | None = None, d_mlp: int | None = None) -> ToyConfig:
    """The paper's architecture: 2 layers, 1 head, d_head = d_model, no biases, no LayerNorm,
    no layer-1 MLP, learned positions, 74 input tokens, 59 outputs. Width from Params."""
    return ToyConfig(d_vocab=74, n_ctx=SEQ_LEN, d_model=int(d_model or cfg.d_model), n_layers=2, n_heads=1,
                     d_mlp=int(d_mlp or cfg.d_mlp), mlp=(False, True), bias=False, d_vocab_out=59)


def train_config(cfg) -> TrainConfig:
    """AdamW (betas 0.9, 0.999), constant lr, fresh batches each step, one member per seed."""
    return TrainConfig(steps=cfg.steps, batch_size=cfg.batch_size, seeds=tuple(cfg.seeds), lr=cfg.lr,
                       weight_decay=cfg.weight_decay, eval_every=cfg.eval_every,
                       checkpoint_every=cfg.checkpoint_every, log_checkpoints=cfg.log_checkpoints,
                       precision=cfg.get("precision") or "fp32")


def make_task(cfg, train_fraction: float | None = None, two_var_ratio: float | None = None,
              pair_split: str | None = None) -> AssignAddTask:
    """The task of a notebook's Params; a `pair_split` file defines the pairs by itself."""
    split = pair_split or cfg.get("pair_split") or "authors"
    f = cfg.train_fraction if train_fraction is None else train_fraction
    r = cfg.get("two_var_ratio") if two_var_ratio is None else two_var_ratio
    return AssignAddTask(train_fraction=f if split in PAIR_SPLITS else None, two_var_ratio=r,
                         split_seed=cfg.split_seed, pair_split=split)


def eval_pools(task: AssignAddTask, size: int, seed: int = 1) -> dict[str, Batch]:
    """The nine pools plus the exact held-out 0-var set (`heldout_zero_var`), pool seed `seed`."""
    pools = task.eval_pools(size=size, seed=seed)
    pools["heldout_zero_var"] = task.heldout_zero_var(seed=seed)
    return {k: v for k, v in pools.items() if len(v.labels)}


def main_run(cfg, progress: bool | None = None) -> "Run | ComposedRun":
    """The book's run of the paper's model, one ensemble member per seed (cached in the store).

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
    metrics, checkpoints and models over the whole span; `key` is the continuation's (its
    weights are the final model's)."""

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


def check_chapter_model(model: ToyTransformer, where: str) -> ToyTransformer:
    """An external model must read this chapter's tokens: 74 inputs, 59 outputs, 16 positions."""
    c = model.cfg
    if c.d_vocab != 74 or c.out_dim != 59 or c.n_ctx < SEQ_LEN:
        raise ValueError(f"{where}: d_vocab {c.d_vocab}, {c.out_dim} outputs and n_ctx {c.n_ctx}; this chapter's "
                         f"tokens need d_vocab 74 (0-58, +, =, PAD, a-l), 59 outputs and n_ctx >= {SEQ_LEN}")
    return model


class CheckpointRun:
    """A released training run, a directory of TransformerLens state dicts whose file names carry
    their step (`checkpoint_step_5301.pth`), with or without a step-less final model
    (`model_state_dict.pth`, the run's last checkpoint: `models.loading.read_release`), read like a
    book run of one member.

    `metrics()` evaluates every checkpoint with the chapter's `ProgressEvaluator` (the pools of
    `task`, i.e. the run's own pair split), so the phase rules and the stage-wise figures run on
    it as on the book's runs. The table is cached under $CIRCUITBOOK_RUNS/external, keyed by the
    files (name, size, modification time) and the evaluator's spec.
    """

    n_members = 1
    key = None  # not a run of the book's store: values measured on it are recorded with run=None

    def __init__(self, directory, task: AssignAddTask, pool_size: int, probe_size: int):
        self.path = Path(directory).expanduser()
        self.release = read_release(self.path)
        self.files = self.release.files
        self.task = task
        self.evaluate = ProgressEvaluator(task, pool_size=pool_size, probe_size=probe_size)
        stat = [(step, f.name, f.stat().st_size, f.stat().st_mtime_ns) for step, f in self.files.items()]
        ident = json.dumps({"files": stat, "evaluator": self.evaluate.spec()}, sort_keys=True)
        self.digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
        self._metrics: pd.DataFrame | None = None

    def __repr__(self):
        return f"CheckpointRun({str(self.path)!r}, {len(self.files)} checkpoints)"

    def checkpoint_steps(self) -> list[int]:
        return list(self.files)

    def model(self, member: int = 0, step: int | None = None) -> ToyTransformer:
        if member != 0:
            raise ValueError(f"member={member} is out of range; a released run has one member (0)")
        step = self.checkpoint_steps()[-1] if step is None else step
        if step not in self.files:
            raise ValueError(f"step={step} is not a checkpoint of {self}; steps: {self.checkpoint_steps()}")
        return check_chapter_model(load_transformer_lens_checkpoint(self.files[step]), str(self.files[step]))

    def metrics(self) -> pd.DataFrame:
        """One row per checkpoint: step, member 0, seed -1, and the evaluator's metrics; no
        `train_loss` (a release's training loss is not in its weights)."""
        if self._metrics is None:
            cache = runs_root() / "external" / f"{self.digest}.json"
            if cache.exists():
                rows = read_json(cache)
            else:
                rows = [{"step": step, "member": 0, "seed": -1, **self.evaluate.evaluate_model(self.model(0, step))}
                        for step in self.files]
                atomic_write_json(cache, rows)
            frame = pd.DataFrame(rows)
            first = ["step", "member", "seed"]
            self._metrics = frame[first + sorted(c for c in frame.columns if c not in first)]
        return self._metrics


def note_release(cfg, evaluated: str) -> None:
    """Tell the results file that this notebook evaluates the released run at `checkpoint_path`
    (its folder or file name, the path, what was evaluated and on which pair split), so its
    scorecard rows say so (`context.note_release`)."""
    path = Path(cfg.checkpoint_path).expanduser().resolve()
    split = cfg.get("pair_split") or "authors"
    split = f"the pairs of {Path(split).name}" if split not in PAIR_SPLITS else f"the {split!r} pair split"
    context.note_release(path.name, str(path), f"{evaluated}, on {split}")


def source_run(cfg) -> "Run | ComposedRun | CheckpointRun":
    """The training run a notebook reads: a released run when `checkpoint_path` is a directory,
    else the book's main run. A single checkpoint file has no history: ValueError."""
    path = cfg.get("checkpoint_path")
    if not path:
        return main_run(cfg)
    if not Path(path).expanduser().exists():
        raise ValueError(f"checkpoint_path {path!r} does not exist; give a directory of step checkpoints "
                         f"(e.g. checkpoint_step_5301.pth)")
    if not Path(path).expanduser().is_dir():
        raise ValueError(f"checkpoint_path {path!r} is a single checkpoint; this notebook reads a training history: "
                         f"give a directory of step checkpoints (e.g. checkpoint_step_5301.pth)")
    run = CheckpointRun(path, make_task(cfg), pool_size=cfg.pool_size, probe_size=cfg.probe_size)
    note_release(cfg, f"{run.release.describe()}; every checkpoint evaluated")
    return run


def load_model(cfg, step: int | None = None) -> tuple[ToyTransformer, str, "Run | ComposedRun | CheckpointRun | None"]:
    """The model a notebook analyses and where it comes from: (model, description, run or None).

    `checkpoint_path` a file: that TransformerLens state dict (config inferred from the weights;
    run None). A directory: its checkpoint at `step` (default: the last, the final model). Unset:
    member 0 of the book's main run at `step` (default: final).
    """
    path = cfg.get("checkpoint_path")
    if path and not Path(path).expanduser().is_dir():
        model = check_chapter_model(load_transformer_lens_checkpoint(path, None), f"checkpoint {path!r}")
        c = model.cfg
        note_release(cfg, f"one checkpoint file (d_model {c.d_model}, d_mlp {c.d_mlp}), no training history")
        return model, f"external checkpoint {path} (d_model {c.d_model}, d_mlp {c.d_mlp}, {c.n_layers} layers)", None
    run = source_run(cfg)
    step = final_step(run) if step is None else step
    if path:
        note_release(cfg, f"{run.release.describe()}; the model at step {step} analysed (and any checkpoint the "
                          f"page names)")
    where = f"released run {path}" if path else f"the book's own run {run.dir.name}/{run.key}, member 0"
    return run.model(0, step), f"{where}, step {step}", run


def final_step(run) -> int:
    return run.checkpoint_steps()[-1]


def final_models(cfg) -> tuple[list[ToyTransformer], str, "Run | ComposedRun | None"]:
    """Every final model a notebook evaluates: one per seed of the book's main run, or the one
    external model (`checkpoint_path`: a file, or a directory's last checkpoint). Returns
    (models, description, the run to record values against: None for external weights)."""
    path = cfg.get("checkpoint_path")
    if path:
        model, source, _ = load_model(cfg)
        return [model], source, None
    run = main_run(cfg)
    return run.models() if hasattr(run, "models") else [run.model(k) for k in range(run.n_members)], \
        f"the book's own run {run.dir.name}/{run.key}, final step, seeds {list(cfg.seeds)}", run


def why_if_missing(values, why: str) -> str | None:
    """`why` when every value is NaN (so the scorecard says `not measured: why`), else None."""
    values = values if isinstance(values, (list, tuple, np.ndarray, pd.Series)) else [values]
    return why if all(math.isnan(float(v)) for v in values) else None


def random_init_model(model: ToyTransformer, seed: int = 0) -> ToyTransformer:
    """A model of the same architecture at a fresh random initialisation: the baseline a claim about
    trained weights must beat."""
    return ToyTransformer(model.cfg, seed=seed).eval()


def schedule_deviations(cfg, paper: dict) -> list[str]:
    """The knobs that set the pace of training (`SCHEDULE_KNOBS`) whose value differs from the
    paper's: when any does, step numbers are not the paper's step numbers."""
    return [f"{k} {cfg.get(k)!r} (paper: {paper[k]!r})" for k in SCHEDULE_KNOBS
            if k in paper and cfg.get(k) != paper[k]]


@torch.no_grad()
def pool_accuracies(model: ToyTransformer, pools: dict[str, Batch], chunk: int = 4096) -> dict[str, float]:
    """Last-position accuracy of one model on each pool."""
    out = {}
    for name, batch in pools.items():
        pred = torch.cat([model(batch.tokens[i:i + chunk], last_only=True)[:, -1].argmax(-1)
                          for i in range(0, len(batch.labels), chunk)])
        out[name] = float((pred == batch.labels).float().mean())
    return out


def accuracy_by_variable_side(model: ToyTransformer, task: AssignAddTask, n: int = 250, seed: int = 3) -> pd.DataFrame:
    """1-var accuracy of each variable on each operand side (n training pairs per cell), with whether
    training holds that cell out (`a`, `b` on the right, `k`, `l` on the left)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for v, name in enumerate(task.token_names()[task.VAR0:]):
        for side in ("left", "right"):
            pair = task.train_pairs[torch.randint(len(task.train_pairs), (n,), generator=g)]
            kw = {"left_var": v} if side == "left" else {"right_var": v}
            batch = task.make_batch(pair // task.modulus, pair % task.modulus, seed=seed + len(rows), **kw)
            held = v in (NOT_RIGHT if side == "right" else NOT_LEFT)
            rows.append({"variable": name, "side": side, "held out": held,
                         "accuracy": pool_accuracies(model, {"cell": batch})["cell"]})
    return pd.DataFrame(rows)


# =============================================================================
# Attention measurements
# =============================================================================

def value_positions(tokens: torch.Tensor, task: AssignAddTask) -> torch.Tensor:
    """Bool [B, T]: positions of the number token of a prefix assignment `var value`."""
    is_var = (tokens[:, :PREFIX_LEN] >= task.VAR0)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, 1:PREFIX_LEN + 1] = is_var  # the value sits right after its variable
    return mask


def bound_targets(tokens: torch.Tensor, task: AssignAddTask) -> torch.Tensor:
    """Bool [B, T]: positions of the value token(s) bound to the query's variable operand(s)."""
    parsed = task.parse(tokens)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    for key in ("left_pos", "right_pos"):
        pos = parsed[key]
        ok = pos >= 0
        mask[ok.nonzero()[:, 0], pos[ok]] = True
    return mask


def routing_score(pattern0: torch.Tensor, tokens: torch.Tensor, task: AssignAddTask) -> torch.Tensor:
    """Per head: mean layer-1 attention of an assigned number token to the variable right before it.

    pattern0 [B, H, Q, K] (layer 1 = blocks.0). Averaged over every assignment of every sequence.
    1 means a perfect previous-token head on constants; uniform attention gives about 1/(p+1).
    """
    b, p = value_positions(tokens, task).nonzero(as_tuple=True)
    return pattern0[b, :, p, p - 1].mean(0)


def bound_attention(pattern1: torch.Tensor, tokens: torch.Tensor, task: AssignAddTask) -> torch.Tensor:
    """Per head: mean over sequences with a variable operand of the attention of `=` (the last
    query) in layer 2 to the value token(s) bound to the variable operand(s), summed for 2-var.
    NaN if no sequence has a variable operand."""
    targets = bound_targets(tokens, task)
    has = targets.any(1)
    if not has.any():
        return torch.full((pattern1.shape[1],), float("nan"))
    row = pattern1[:, :, -1]  # [B, H, K]
    return (row * targets[:, None]).sum(-1)[has].mean(0)


def addend_targets(tokens: torch.Tensor, task: AssignAddTask) -> torch.Tensor:
    """Bool [B, T]: the keys that hold the two addends of the query: the value(s) bound to its
    variable operand(s) and, where an operand is a number, that operand's own token in the query."""
    mask = bound_targets(tokens, task)
    parsed = task.parse(tokens)
    for side, pos in (("left_var", PREFIX_LEN + 1), ("right_var", PREFIX_LEN + 2)):
        mask[:, pos] |= parsed[side] < 0  # a number operand is an addend itself
    return mask


def prefix_keys(tokens: torch.Tensor) -> torch.Tensor:
    """Bool [B, T]: the positions of the prefix (assignments and PADs), before the query core."""
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, :PREFIX_LEN] = True
    return mask


def addends_top_share(pattern1: torch.Tensor, tokens: torch.Tensor, task: AssignAddTask, head: int = 0) -> float:
    """Share of the addends (`addend_targets`: bound value(s) and number operands) that get more
    layer-2 attention from `=` than every other prefix key (distractor values, variable tokens,
    PADs): AA-11's "`=` attends to the constant bound to the queried variable", with the other
    addend, which `=` must read too, not counted as a competitor. Where both addends are read
    equally, both count (`analysis.attention.top_key_share`). A random pattern scores about 1/12."""
    targets = addend_targets(tokens, task)
    return attention.top_key_share(pattern1[:, head, -1], targets, prefix_keys(tokens) & ~targets)


def bound_over_values_share(pattern1: torch.Tensor, tokens: torch.Tensor, task: AssignAddTask,
                            head: int = 0) -> float:
    """Share of bound values that get more layer-2 attention from `=` than every other assigned
    value of the prefix: specific to binding (attention to all the prefix's numbers rises early,
    before `=` tells them apart), so it times AA-2's "`=` starts to attend to the bound value".
    A pattern that spreads over the values at random scores about E[1/k] (k assignments)."""
    targets = bound_targets(tokens, task)
    return attention.top_key_share(pattern1[:, head, -1], targets, value_positions(tokens, task) & ~targets)


ROLES = ("bound value", "other assigned value", "variable token", "PAD", "+", "left operand", "right operand", "=")


def key_roles(tokens: torch.Tensor, task: AssignAddTask) -> np.ndarray:
    """The role (`ROLES`) of every position [B, T] as a key: the bound value(s), other assigned values,
    variable tokens and PADs of the prefix, then the four tokens of the query core."""
    role = np.full(tokens.shape, "PAD", dtype=object)
    role[(tokens >= task.VAR0).numpy()] = "variable token"
    role[value_positions(tokens, task).numpy()] = "other assigned value"
    role[bound_targets(tokens, task).numpy()] = "bound value"
    role[:, PREFIX_LEN:] = ["+", "left operand", "right operand", "="]
    return role


def attention_by_role(pattern1: torch.Tensor, tokens: torch.Tensor, task: AssignAddTask, head: int = 0) -> pd.Series:
    """Mean layer-2 attention of `=` summed over the keys of each role (`key_roles`)."""
    rows, role = pattern1[:, head, -1].double().numpy(), key_roles(tokens, task)
    return pd.Series({name: float((rows * (role == name)).sum(1).mean()) for name in ROLES})


def variable_qk_matrix(model: ToyTransformer, task: AssignAddTask, composed: bool = True, head: int = 0,
                       layer: int = 1) -> torch.Tensor:
    """[12, 12] layer-2 attention score between variables: rows the queried variable, columns the
    variable of a key.

    composed=True (the mechanism): both sides are the variable embeddings after the layer-1 OV
    circuit, e_v W_V^1 W_O^1, because that is how a variable reaches layer 2 - at `=` through
    layer-1 attention to the operand token, at an assigned number through its previous-token
    attention to the variable. composed=False uses the raw embeddings e_v. The score is
    x_q W_Q W_K^T x_k^T / sqrt(d_head), the pre-softmax logit it adds.
    """
    E = model.W_E[task.VAR0:task.VAR0 + N_VARS].detach()
    if composed:
        a0 = model.blocks[0].attn
        E = E @ torch.einsum("hde,hef->df", a0.W_V.detach(), a0.W_O.detach())
    attn = model.blocks[layer].attn
    scale = model.cfg.attn_scale if model.cfg.attn_scale is not None else math.sqrt(model.cfg.head_dim)
    return (E @ attn.W_Q[head].detach()) @ (E @ attn.W_K[head].detach()).T / scale


# =============================================================================
# The main run's evaluation callback
# =============================================================================

class ProgressEvaluator:
    """Evaluation callback of the main run: accuracy of every pool and the progress measures.

    Per member it returns `acc_<pool>` for the nine pools and the exact held-out 0-var set, and
      routing      layer-1 previous-token attention of assigned numbers (`routing_score`, AA-10),
      bound_1var   layer-2 attention of `=` to the bound value, 1-var sequences (`bound_attention`),
      bound_2var   the same summed over both operands, 2-var sequences,
      bound_over_values  share of bound values that `=` reads more than every other assigned value
                   (`bound_over_values_share`, mean of 1- and 2-var: AA-2's timing),
      addends_top  share of addends that `=` reads more than every other prefix key
                   (`addends_top_share`, mean of 1- and 2-var: AA-11 over training),
      qk_diag      `diagonal_argmax_fraction` of the composed `variable_qk_matrix`,
      qk_identity  `template_cosine` of that matrix with the identity.
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
        out, over_values, addends = {}, [], []
        for kind, tokens in self.probe.items():
            p0, p1 = attention.attention_patterns(model, tokens)
            if kind == "1var":
                out["routing"] = float(routing_score(p0, tokens, self.task).max())
            out[f"bound_{kind}"] = float(bound_attention(p1, tokens, self.task).max())
            over_values.append(bound_over_values_share(p1, tokens, self.task))
            addends.append(addends_top_share(p1, tokens, self.task))
        out["bound_over_values"] = float(np.mean(over_values))
        out["addends_top"] = float(np.mean(addends))
        qk = variable_qk_matrix(model, self.task)
        out["qk_diag"] = attention.diagonal_argmax_fraction(qk)
        out["qk_identity"] = attention.template_cosine(qk)
        return out

    def evaluate_model(self, model: ToyTransformer) -> dict[str, float]:
        """The same metrics for one model (a checkpoint of a released run)."""
        acc = pool_accuracies(model, self.pools)
        return {**{f"acc_{k}": v for k, v in acc.items()}, **self.measures(model)}

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
# Phases of training
# =============================================================================

@dataclass(frozen=True)
class Phases:
    """Steps detected from the curves of one member (see `detect_phases`); NaN: not detected."""

    addition_step: float  # 0-var (training pairs) accuracy reaches `level`
    variable_step: float  # the first of the 1-var / 2-var training accuracies reaches `level`
    var_half_step: float  # the first of them reaches 0.5
    zero_at_var_half: float  # 0-var accuracy at var_half_step
    jump_from: float  # where the jump is searched from: the end of the addition phase
    jump_step: float  # centre of the window of steepest rise of the variable accuracy after jump_from
    jump_rise: float  # its rise
    jump_share: float  # its rise / the variable accuracy's rise after jump_from
    qk_step: float  # the layer-2 QK identity cosine is half-way from its first to its last value
    bound_step: float  # the bound value beats the other assigned values in `=`'s attention: half-way
    routing_step: float  # the layer-1 previous-token score is half-way (a prerequisite)
    refine_step: float  # centre of the steepest rise of the hard-case accuracy after the jump
    refine_rise: float
    window: float

    def marks(self) -> dict[str, float]:
        marks = {"addition": self.addition_step, "jump": self.jump_step, "refinement": self.refine_step}
        return {k: v for k, v in marks.items() if not math.isnan(v)}


def default_window(steps) -> float:
    """1/20 of the run, and at least two evaluation intervals."""
    steps = np.sort(np.asarray(steps, float))
    return max(steps[-1] / 20, 2 * float(np.median(np.diff(steps))) if len(steps) > 1 else 1.0)


def detect_phases(metrics: pd.DataFrame, member: int = 0, window: float | None = None,
                  min_rise: float = 0.2, level: float = 0.9) -> Phases:
    """The phases of training, detected from the evaluation curves of one member, in the paper's
    order of events (AA-1: addition first).

    - addition: first step where 0-var accuracy on training pairs reaches `level`; the first of
      the 1-var and 2-var training accuracies reaches `level` at `variable_step` and 0.5 at
      `var_half_step`, where the 0-var accuracy is `zero_at_var_half`;
    - jump: searched after the addition phase (`jump_from` = the addition step; the first step
      when 0-var accuracy never reaches `level`), because once addition is solved a model that adds
      a uniformly chosen assigned value is already right with probability E[1/k], so the variable
      accuracy first rises with addition to that plateau; the jump is the later rise from it.
      Its step is the centre of the `window` of steepest rise of the variable accuracy (mean of
      the 1-var and 2-var training pools, `VAR_POOLS`) among windows starting at or after
      `jump_from`; `jump_share` is that rise over the curve's rise after `jump_from` (its highest
      value after it minus its value there): a sharp jump does most of that learning in one window;
    - the circuit (AA-2), after `jump_from` too: the step at which the share of bound values that
      `=` reads more than every other assigned value (`bound_over_values`, at every evaluation)
      has covered half of its change from `jump_from` to the end, and the step at which the
      layer-2 QK identity cosine (`qk_identity`) has covered half of its change over the run
      (`analysis.curves.half_way_step`: a measure that fluctuates before it rises would hand
      the steepest-rise rule a swing of its noise); the layer-1 previous-token score (`routing`)
      likewise over the run, for comparison;
    - refinement: centre of the window of steepest rise of the hard-case accuracy (mean of the
      var-restricted pools, `HARD_POOLS`) among windows that start after the jump's window.
    A jump or refinement whose rise is below `min_rise` is not detected (NaN); without a jump
    there is no refinement. window defaults to `default_window` (1/20 of the run).
    """
    m = metrics[metrics.member == member].sort_values("step")
    if m.empty:
        raise ValueError(f"member={member} has no metrics; members: {sorted(metrics.member.unique())}")
    steps = m.step.to_numpy(float)
    window = default_window(steps) if window is None else float(window)
    zero = m["acc_zero_var_train"].to_numpy()
    var = m[[f"acc_{p}" for p in VAR_POOLS]].mean(axis=1).to_numpy()
    hard = m[[f"acc_{p}" for p in HARD_POOLS]].mean(axis=1).to_numpy()
    at_level = [curves.crossing_step(steps, m[f"acc_{p}"], level) for p in VAR_POOLS]
    at_half = [curves.crossing_step(steps, m[f"acc_{p}"], 0.5) for p in VAR_POOLS]
    variable_step, var_half = float(np.fmin(*at_level)), float(np.fmin(*at_half))

    addition = curves.crossing_step(steps, zero, level)
    start = addition if not math.isnan(addition) else float(steps[0])
    jump, jump_rise = curves.steepest_rise(steps, var, window, after=start)
    later = steps >= start
    rise_after = float(var[later].max() - curves.value_at(steps, var, start)) if later.any() else float("nan")
    jump_share = jump_rise / rise_after if rise_after > 0 else float("nan")
    if not jump_rise >= min_rise:
        jump = float("nan")

    def half_way(columns, after=None):
        if not all(c in m for c in columns):
            return float("nan")
        keep = steps >= after if after is not None else np.ones(len(steps), bool)
        if keep.sum() < 2:
            return float("nan")
        return curves.half_way_step(steps[keep], m[list(columns)].mean(axis=1).to_numpy()[keep])

    refine, refine_rise = (curves.steepest_rise(steps, hard, window, after=jump + window / 2)
                           if not math.isnan(jump) else (float("nan"), float("nan")))
    if not refine_rise >= min_rise:
        refine = float("nan")
    return Phases(addition_step=addition, variable_step=variable_step,
                  var_half_step=var_half, zero_at_var_half=curves.value_at(steps, zero, var_half),
                  jump_from=start, jump_step=jump, jump_rise=jump_rise, jump_share=jump_share,
                  qk_step=half_way(["qk_identity"]), bound_step=half_way(["bound_over_values"], after=start),
                  routing_step=half_way(["routing"]), refine_step=refine, refine_rise=refine_rise,
                  window=window)


def phases_table(metrics: pd.DataFrame, window: float | None = None) -> pd.DataFrame:
    """`detect_phases` of every member, one row per member (index: member), with its seed."""
    rows = []
    for member in sorted(metrics.member.unique()):
        seed = metrics.loc[metrics.member == member, "seed"].iloc[0] if "seed" in metrics else member
        rows.append({"member": int(member), "seed": int(seed), **asdict(detect_phases(metrics, member, window))})
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


def pace_phrase(pace: Sequence[str]) -> str:
    """The sentence the text quotes about whether step numbers compare with the paper's."""
    if not pace:
        return "This run trains at the paper's pace, so its step numbers are compared with the paper's."
    return ("This run does not train at the paper's pace (" + "; ".join(pace) + "), so its step numbers are not "
            "the paper's: the scorecard records the timing parts of AA-2 and AA-3 as not measured and judges the rest.")


def hard_final_accuracy(metrics: pd.DataFrame) -> pd.Series:
    """Per member: the lowest final accuracy of the three hard (var-restricted) pools."""
    last = metrics[metrics.step == metrics.step.max()].set_index("member").sort_index()
    return last[[f"acc_{p}" for p in HARD_POOLS]].min(axis=1)


def checkpoint_before(run, step: float) -> int:
    """The last checkpoint strictly before `step` (the first checkpoint if none)."""
    before = [s for s in run.checkpoint_steps() if s < step]
    return before[-1] if before else run.checkpoint_steps()[0]


def checkpoint_after(run, step: float) -> int:
    """The first checkpoint at or after `step` (the last checkpoint if none)."""
    after = [s for s in run.checkpoint_steps() if s >= step]
    return after[0] if after else run.checkpoint_steps()[-1]


def stage_checkpoint(run, phases: Phases) -> int | None:
    """AA-12's stage: the last checkpoint before the jump's window, where layer 2 does not match
    variables yet, and never before the addition phase has ended (`jump_from`): the stage the
    theory is about is the plateau from which the jump starts, not the start of training. None
    when no jump was detected, or no checkpoint lies between the two (there is then no such stage
    to name: see `stage_missing_why`)."""
    if math.isnan(phases.jump_step):
        return None
    inside = [s for s in run.checkpoint_steps() if phases.jump_from <= s < phases.jump_step - phases.window / 2]
    return inside[-1] if inside else None


def stage_missing_why(phases: Phases) -> str:
    """Why `stage_checkpoint` named no stage."""
    if math.isnan(phases.jump_step):
        return "no jump detected, so there is no stage before it"
    return (f"no checkpoint lies between the end of the addition phase (step {phases.jump_from:.0f}) and the "
            f"jump's window (from step {phases.jump_step - phases.window / 2:.0f})")


def transition_checkpoints(run, phases: Phases) -> dict[str, int]:
    """Checkpoints that bracket the phases: first, before and after the jump, after the refinement, final."""
    ckpts = run.checkpoint_steps()
    out = {"init": ckpts[0]}
    if not math.isnan(phases.jump_step):
        out["before jump"] = checkpoint_before(run, phases.jump_step - phases.window / 2)
        out["after jump"] = checkpoint_after(run, phases.jump_step + phases.window / 2)
    if not math.isnan(phases.refine_step):
        out["after refinement"] = checkpoint_after(run, phases.refine_step + phases.window / 2)
    out["final"] = ckpts[-1]
    seen, unique = set(), {}
    for k, v in out.items():  # keep the order, drop repeats of the same checkpoint
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
    and the padding is not counted.
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
            batches = [batches[m] for m in ens.members]  # a chunk of a split run holds only some members
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


def sweep_split(cfg) -> str:
    """The sweeps' pair split: the chapter's rule (`authors` or `book`), re-drawn at each member's f.
    A file of pairs fixes one split, which no other f can use, so the sweeps then take `authors`."""
    split = cfg.get("pair_split") or "authors"
    return split if split in PAIR_SPLITS else "authors"


def _sweep(cfg, name: str, kind: str) -> tuple[Run, pd.DataFrame]:
    values = cfg.f_values if kind == "f" else cfg.r_values
    members = sweep_members(values, cfg.sweep_seeds)
    split = sweep_split(cfg)
    tasks = [make_task(cfg, train_fraction=v, pair_split=split) if kind == "f"
             else make_task(cfg, two_var_ratio=v, pair_split=split) for v in members.value]
    tc = TrainConfig(steps=cfg.sweep_steps, batch_size=cfg.sweep_batch_size, seeds=tuple(members.member_seed),
                     lr=cfg.sweep_lr, weight_decay=cfg.weight_decay, eval_every=cfg.sweep_eval_every,
                     checkpoint_every=None, log_checkpoints=4, precision=cfg.get("precision") or "fp32")
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


# =============================================================================
# Residual stream, MLP and probes (AA-8, AA-9)
# =============================================================================

def residual_at(model: ToyTransformer, tokens: torch.Tensor, hook: str = "blocks.1.hook_resid_mid",
                position: int | str = -1) -> torch.Tensor:
    return collect_activations(model, tokens, hook, position=position)


def residual_cosines(model: ToyTransformer | None, task: AssignAddTask, n: int = 1000, seed: int = 0,
                     hook: str = "blocks.1.hook_resid_mid",
                     residual: Callable[[torch.Tensor], torch.Tensor] | None = None) -> pd.DataFrame:
    """Residual vectors before the layer-2 MLP at `=`: variable vs constant additions (AA-8).

    n distinct training pairs (n1, n2) (cycled if n exceeds them), and for each pair one sequence
    of each variable form at training positions - 1-var left (x in a..j), 1-var right (y in c..l),
    2-var (x, y) drawn uniformly from the 92 training pairs of variables - and the 0-var sequence
    `+ n1 n2 =`. Per form, `analysis.representations.paired_cosines` of the variable vectors with
    the constant vectors: `matched` (same values), `mismatched` (the constant sequence of the
    next pair, a different one), and both `_centred` (the mean of the form's and the constant
    vectors subtracted). One row per (form, pair).

    residual(tokens) -> [B, d] replaces reading `hook` of `model` at the last position (a test
    gives a function with known residuals).
    """
    from ..analysis.representations import paired_cosines

    read = residual or (lambda tokens: residual_at(model, tokens, hook))
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(task.train_pairs), generator=g)
    pair = task.train_pairs[order[torch.arange(n) % len(order)]]
    n1, n2 = pair // task.modulus, pair % task.modulus
    left = torch.tensor(TWO_VAR_LEFT)[torch.randint(len(TWO_VAR_LEFT), (n,), generator=g)]
    right = torch.tensor(TWO_VAR_RIGHT)[torch.randint(len(TWO_VAR_RIGHT), (n,), generator=g)]
    xy = task._combos["train"][torch.randint(len(task._combos["train"]), (n,), generator=g)]
    const = read(task.make_batch(n1, n2, seed=seed).tokens)
    forms = {"1-var left": task.make_batch(n1, n2, left_var=left, seed=seed + 1).tokens,
             "1-var right": task.make_batch(n1, n2, right_var=right, seed=seed + 2).tokens,
             "2-var": task.make_batch(n1, n2, left_var=xy[:, 0], right_var=xy[:, 1], seed=seed + 3).tokens}
    rows = []
    for form, tokens in forms.items():
        cos = paired_cosines(read(tokens), const)
        rows.append(pd.DataFrame({"form": form, "n1": n1.numpy(), "n2": n2.numpy(),
                                  **{k: v.numpy() for k, v in cos.items()}}))
    return pd.concat(rows, ignore_index=True)


def mlp_preactivation_grid(model: ToyTransformer, task: AssignAddTask, n_layouts: int = 4, seed: int = 0,
                           hook: str = "blocks.1.mlp.hook_pre") -> torch.Tensor:
    """Layer-2 MLP pre-activations at `=` for every 0-var sum `+ n m =`, as [N, N, d_mlp]
    (axis 0 = n, axis 1 = m), averaged over `n_layouts` random prefixes (distractors, padding);
    each layout is read by `analysis.fourier.collect_grid_activations`."""
    total = 0
    for s in range(n_layouts):
        total = total + fourier.collect_grid_activations(
            model, lambda n, m: task.make_batch(n, m, seed=seed + s).tokens, hook, task.modulus)
    return total / n_layouts


def variable_probe_data(model: ToyTransformer, task: AssignAddTask, tokens: torch.Tensor,
                        hook: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(activations, variable id) at every assigned number token: what a probe for "which variable
    is this number bound to" reads at `hook`."""
    acts = residual_at(model, tokens, hook, position="all")  # [B, T, D]
    b, p = value_positions(tokens, task).nonzero(as_tuple=True)
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


def random_directions_block(M: torch.Tensor, n: int = N_VARS, seed: int = 0) -> torch.Tensor:
    """A form M [d, d] read along n random unit directions on both sides [n, n]: what the variable
    block would look like if the variables' directions carried nothing special (AA-12's baseline)."""
    R = torch.randn(n, M.shape[0], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    R = R / R.norm(dim=1, keepdim=True)
    return R @ M.double() @ R.T


def theory_qk_block(tokens: torch.Tensor, task: AssignAddTask) -> torch.Tensor:
    """The associative-memory block the gradient theory predicts [12, 12] (query variable x key variable),
    up to a positive factor, for the training sequences `tokens`.

    The idealised stage: layer 1 already routes (each assigned number carries its variable v',
    the query at `=` carries the variable operand(s)), layer 2 attends uniformly over the T = 16
    keys, and only the bound value(s) help the loss. Then -dL/ds_k is proportional to
    1[k bound] - B/T for a sequence with B bound values, and -dL/dW_QK sums, over sequences,
    (queried variable)^T (variable carried by key k) weighted by that coefficient: entry (u, v)
    adds 1 - B/T when v's value is bound and u is queried, and -B/T when v is an assigned
    distractor. A 2-var query carries both its variables, so each sees both bound values.
    """
    parsed = task.parse(tokens)
    values = value_positions(tokens, task)
    bound = bound_targets(tokens, task)
    n_bound = bound.sum(1, keepdim=True).double()
    coef = (bound.double() - n_bound / SEQ_LEN) * values.double()  # only assigned numbers carry a variable
    carried = torch.zeros(*tokens.shape, N_VARS, dtype=torch.float64)  # key position -> its variable, one-hot
    b, p = values.nonzero(as_tuple=True)
    carried[b, p, tokens[b, p - 1] - task.VAR0] = 1.0
    key_side = torch.einsum("bk,bkv->bv", coef, carried)  # [B, 12]
    query_side = torch.zeros(len(tokens), N_VARS, dtype=torch.float64)
    for side in ("left_var", "right_var"):
        v = parsed[side]
        ok = v >= 0
        query_side[ok.nonzero()[:, 0], v[ok]] += 1.0
    return query_side.T @ key_side / len(tokens)
