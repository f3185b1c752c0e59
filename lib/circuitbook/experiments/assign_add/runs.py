"""Where the chapter's runs are defined: config builders, run functions (each takes the notebook's `cfg`)
and `notebook_runs(cfg)`, the registry the notebooks' training cells and `circuitbook build --plan` call.

    main_run(cfg)       the paper's model as an ensemble of `cfg.seeds` (member 0 is the model the mechanism
                        pages show), `ProgressEvaluator` its callback; with a cooldown, a `ComposedRun`
    source_run(cfg)     the run a notebook reads: the main run, or a released run (`released_run`, a folder of
                        step checkpoints at `cfg.checkpoint_path`)
    f_sweep / r_sweep   the data-threshold sweeps (AA-6, AA-7) as ensembles, one member per (value, seed)
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Sequence

import pandas as pd

from ... import context
from ...models.loading import load_transformer_lens_checkpoint
from ...models.toy import ToyConfig, ToyTransformer
from ...tasks.assign_add import PAIR_SPLITS, SEQ_LEN, AssignAddTask
from ...training import ComposedRun, ReleasedRun, Run, TrainConfig, train
from .evaluate import ProgressEvaluator, sweep_evaluator

SWEEP_SEED_STRIDE = 1000  # member seed = seed * stride + value index; init from seed only


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


def main_run(cfg, progress: bool | None = None) -> "Run | ComposedRun":
    """The book's run of the paper's model, one ensemble member per seed (cached in the store).

    With `cooldown_steps` > 0 (a scale-down option; the paper keeps the learning rate constant) the
    run continues for that many steps at `cooldown_lr`, as a fork of the main run's last checkpoint;
    the two are returned as one `ComposedRun`.
    """
    task = make_task(cfg)
    evaluate = ProgressEvaluator(task, pool_size=cfg.pool_size, probe_size=cfg.probe_size, seed=eval_seed(cfg))
    run = train("assign_add/main", model_config(cfg), task, train_config(cfg), evaluate=evaluate,
                     progress=progress)
    if not cfg.get("cooldown_steps"):
        return run
    tc = replace(train_config(cfg), steps=cfg.steps + cfg.cooldown_steps, lr=cfg.cooldown_lr, log_checkpoints=0)
    cooldown = train("assign_add/main_cooldown", model_config(cfg), task, tc, evaluate=evaluate,
                          fork_from=(run, cfg.steps), progress=progress)
    return ComposedRun(run, cooldown)


def check_chapter_model(model: ToyTransformer, where: str) -> ToyTransformer:
    """An external model must read this chapter's tokens: 74 inputs, 59 outputs, 16 positions."""
    c = model.cfg
    if c.d_vocab != 74 or c.out_dim != 59 or c.n_ctx < SEQ_LEN:
        raise ValueError(f"{where}: d_vocab {c.d_vocab}, {c.out_dim} outputs and n_ctx {c.n_ctx}; this chapter's "
                         f"tokens need d_vocab 74 (0-58, +, =, PAD, a-l), 59 outputs and n_ctx >= {SEQ_LEN}")
    return model


def eval_seed(cfg) -> int:
    """The evaluation's draw (`eval_seed`; 1, the book's first draw, where a notebook's Params lack it)."""
    return int(cfg.get("eval_seed", 1) if cfg.get("eval_seed") is not None else 1)


def released_run(directory, task: AssignAddTask, pool_size: int, probe_size: int, seed: int = 1) -> ReleasedRun:
    """A released run's folder read like a book run of one member: every checkpoint evaluated with the
    chapter's `ProgressEvaluator` (the pools of `task`, i.e. the run's own pair split), so the phase rules
    and the stage-wise figures run on it as on the book's runs."""
    return ReleasedRun(directory, ProgressEvaluator(task, pool_size=pool_size, probe_size=probe_size, seed=seed),
                       check_chapter_model)


def note_release(cfg, evaluated: str) -> None:
    """Tell the results file that this notebook evaluates the released run at `checkpoint_path`
    (its folder or file name, the path, what was evaluated and on which pair split), so its
    scorecard rows say so (`context.note_release`)."""
    path = Path(cfg.checkpoint_path).expanduser().resolve()
    split = cfg.get("pair_split") or "authors"
    split = f"the pairs of {Path(split).name}" if split not in PAIR_SPLITS else f"the {split!r} pair split"
    context.note_release(path.name, str(path), f"{evaluated}, on {split}")


def source_run(cfg) -> "Run | ComposedRun | ReleasedRun":
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
    run = released_run(path, make_task(cfg), pool_size=cfg.pool_size, probe_size=cfg.probe_size, seed=eval_seed(cfg))
    note_release(cfg, f"{run.release.describe()}; every checkpoint evaluated")
    return run


def load_model(cfg, runs: dict | None = None, step: int | None = None
               ) -> tuple[ToyTransformer, str, "Run | ComposedRun | ReleasedRun | None"]:
    """The model a notebook analyses and where it comes from: (model, description, run or None);
    `runs`: the notebook's runs (`notebook_runs(cfg)`), read instead of asked for again.

    `checkpoint_path` a file: that TransformerLens state dict (config inferred from the weights;
    run None). A directory: its checkpoint at `step` (default: the last, the final model). Unset:
    member 0 of the book's main run at `step` (default: final).
    """
    path = cfg.get("checkpoint_path")
    if path and not Path(path).expanduser().is_dir():
        model = check_chapter_model(load_transformer_lens_checkpoint(path, None), f"checkpoint {path!r}")
        c = model.cfg
        note_release(cfg, f"one checkpoint file (d_model {c.d_model}, d_mlp {c.d_mlp}), no training history")
        # the file's name, never its path on the builder's machine: the description is printed on the page
        shape = f"d_model {c.d_model}, d_mlp {c.d_mlp}, {c.n_layers} layers"
        return model, f"external checkpoint {Path(path).name} ({shape})", None
    run = (runs or {}).get("main") or source_run(cfg)
    step = final_step(run) if step is None else step
    if path:
        note_release(cfg, f"{run.release.describe()}; the model at step {step} analysed (and any checkpoint the "
                          f"page names)")
    where = (f"released run {Path(path).expanduser().name}" if path
             else f"the book's own run {run.name} (key {run.key[:8]}), member 0")
    return run.model(0, step), f"{where}, step {step}", run


def final_step(run) -> int:
    return run.checkpoint_steps()[-1]


def final_models(cfg, runs: dict | None = None) -> tuple[list[ToyTransformer], str, "Run | ComposedRun | None"]:
    """Every final model a notebook evaluates: one per seed of the book's main run, or the one
    external model (`checkpoint_path`: a file, or a directory's last checkpoint). Returns
    (models, description, the run to record values against: None for external weights)."""
    path = cfg.get("checkpoint_path")
    if path:
        model, source, _ = load_model(cfg, runs)
        return [model], source, None
    run = (runs or {}).get("main") or main_run(cfg)
    return run.models(), f"the book's own run {run.name} (key {run.key[:8]}), final step, seeds {list(cfg.seeds)}", run


def sweep_members(values: Sequence[float], seeds: Sequence[int]) -> pd.DataFrame:
    """One row per ensemble member: value, seed, member_seed (= seed * 1000 + value index)."""
    rows = [{"member": i * len(values) + j, "value": float(v), "seed": int(s),
             "member_seed": int(s) * SWEEP_SEED_STRIDE + j}
            for i, s in enumerate(seeds) for j, v in enumerate(values)]
    return pd.DataFrame(rows)


def sweep_init(model: ToyTransformer, member_seed: int) -> None:
    """Members with the same seed start from the same weights, whatever their sweep value."""
    model.init_weights(member_seed // SWEEP_SEED_STRIDE)


def sweep_split(cfg) -> str:
    """The sweeps' pair split: the chapter's rule (`authors` or `book`), re-drawn at each member's f.
    A file of pairs fixes one split, which no other f can use, so the sweeps then take `authors`."""
    split = cfg.get("pair_split") or "authors"
    return split if split in PAIR_SPLITS else "authors"


def _sweep(cfg, name: str, kind: str) -> Run:
    values = cfg.f_values if kind == "f" else cfg.r_values
    members = sweep_members(values, cfg.sweep_seeds)
    split = sweep_split(cfg)
    tasks = [make_task(cfg, train_fraction=v, pair_split=split) if kind == "f"
             else make_task(cfg, two_var_ratio=v, pair_split=split) for v in members.value]
    tc = TrainConfig(steps=cfg.sweep_steps, batch_size=cfg.sweep_batch_size, seeds=tuple(members.member_seed),
                     lr=cfg.sweep_lr, weight_decay=cfg.weight_decay, eval_every=cfg.sweep_eval_every,
                     checkpoint_every=None, log_checkpoints=4, precision=cfg.get("precision") or "fp32")
    return train(name, model_config(cfg, cfg.sweep_d_model, cfg.sweep_d_mlp), tasks, tc,
                 evaluate=sweep_evaluator(tasks, cfg.sweep_pool_size), init_fn=sweep_init)


def f_sweep(cfg) -> Run:
    """AA-6: one member per (training-pair fraction f, seed) (`sweep_members(cfg.f_values, cfg.sweep_seeds)`)."""
    return _sweep(cfg, "assign_add/f_sweep", "f")


def r_sweep(cfg) -> Run:
    """AA-7: one member per (2-var frequency r = #2-var / #0-var, seed) at f = train_fraction
    (`sweep_members(cfg.r_values, cfg.sweep_seeds)`)."""
    return _sweep(cfg, "assign_add/r_sweep", "r")


def notebook_runs(cfg) -> dict:
    """Every run the notebook `cfg.notebook` trains or reads, by role (the chapter contract's registry).

    02, 04, 05 read `main` (the book's main run, or the released run at `checkpoint_path`; nothing for a
    single checkpoint file, which has no run); 03 also trains the f and r sweeps, except on a release
    (a release is evaluated, nothing of the book's is trained for it)."""
    if cfg.notebook == "01_task":
        return {}
    path = cfg.get("checkpoint_path")
    out = {} if path and not Path(path).expanduser().is_dir() else {"main": source_run(cfg)}
    if cfg.notebook == "03_generalization" and not path:
        out["f_sweep"], out["r_sweep"] = f_sweep(cfg), r_sweep(cfg)
    return out
