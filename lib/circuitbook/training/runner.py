"""`train()`: the one way the book trains, or finds in the store, an ensemble.

A run's key hashes its full configuration (name, model, training config, task, evaluation callback,
init function, fork) and the code that computes it (`runs.code_version`): the training core
(`training/config.py`, `ensemble.py`, `loop.py`, `tasks/base.py`) and the modules that define the model,
the task, the callback and the init function. How the run is chunked, planned, scheduled on a cluster
or read back is not part of it.
"""
from __future__ import annotations

import inspect
import os
import time
from dataclasses import asdict
from typing import Callable

from .. import context, log, runs
from ..models.registry import config_to_dict
from . import chunks
from .planning import current as current_plan
from .chunks import RunSpec, choose_chunk, train_in_parts
from .config import LOSSES, TrainConfig
from .device import default_device
from .evaluate import EvalFn
from .loop import Trainer
from .run import Run


DEADLINE_ENV = "CIRCUITBOOK_DEADLINE"  # unix time after which train() starts no new run (a GPU visit's budget)


class BudgetExhausted(RuntimeError):
    """The time budget ($CIRCUITBOOK_DEADLINE) ended before a run started: stopped between runs."""


def check_deadline(name: str) -> None:
    """Refuse to start training `name` once $CIRCUITBOOK_DEADLINE has passed (cached runs still load)."""
    raw = os.environ.get(DEADLINE_ENV)
    if not raw:
        return
    try:
        deadline = float(raw)
    except ValueError:
        raise ValueError(f"${DEADLINE_ENV}={raw!r} is not a unix time in seconds") from None
    if time.time() > deadline:
        raise BudgetExhausted(f"the time budget (${DEADLINE_ENV}) ended before run {name} started; stopped "
                              "between runs, nothing half-trained")


def train(name: str, model, task, config: TrainConfig, *, evaluate: EvalFn | None = None,
          store: runs.Store | None = None, init_fn: Callable | None = None,
          fork_from: tuple[Run, int] | None = None, progress: bool | None = None,
          device: str | None = None, chunk: int | str | None = None) -> Run:
    """Train (or load from the store) an ensemble; return the finished Run.

    task: one Task shared by all members (each samples its own batches from
    its seed) or one Task per member. init_fn(model, seed) customises the
    initial weights (it must be deterministic). fork_from=(run, step) starts
    every member from that run's checkpoint (weights and optimizer state) and
    continues the step count from there, e.g. to branch off with another
    weight decay. device: where to train (default $CIRCUITBOOK_DEVICE, else
    CUDA when available, else CPU); it is not part of the run key.
    chunk: how many members train together: None (default: $CIRCUITBOOK_CHUNK, else `auto`, measured
    by `choose_chunk`), `all`, or a number. Never part of the run key: member k ends with the same
    numbers (to float rounding) whatever the chunking.
    """
    store = store or runs.Store()
    tasks = list(task) if isinstance(task, (list, tuple)) else [task] * config.n_members
    if len(tasks) != config.n_members:
        raise ValueError(f"task: got {len(tasks)} tasks for {config.n_members} members; give one or one per member")
    loss_kind = tasks[0].loss
    if loss_kind not in LOSSES or any(t.loss != loss_kind for t in tasks):
        raise ValueError(f"task.loss must be one of {LOSSES} and equal across members")
    if fork_from is not None:
        parent, fork_step = fork_from
        if parent.n_members != config.n_members or parent.model_config != model:
            raise ValueError("fork_from: the parent run must have the same model config and number of members")
        if fork_step not in parent.checkpoint_steps() or fork_step >= config.steps:
            raise ValueError(f"fork_from step {fork_step} must be a checkpoint of the parent "
                             f"({parent.checkpoint_steps()}) and below steps={config.steps}")
    full_config = {
        "name": name,
        "model": config_to_dict(model),
        "train": {**asdict(config), "seeds": list(config.seeds)},
        "task": [fingerprint(t) for t in tasks] if isinstance(task, (list, tuple)) else fingerprint(task),
        "evaluate": fingerprint(evaluate),
        "init_fn": fingerprint(init_fn),
        "fork_from": None if fork_from is None else {"run": fork_from[0].key, "step": fork_from[1]},
        "code_version": runs.code_version([*tasks, evaluate, init_fn, model]),  # with their modules' code
    }
    rundir = store.run_dir(name, full_config)
    if current_plan() is not None:
        return current_plan().add(rundir, full_config, model, tasks, config, fork_from, evaluate)
    with rundir.lock() as lock:
        if store.open_complete(rundir):
            log.info(f"cached run {rundir.name} ({rundir.key[:8]})")
        else:
            check_deadline(rundir.name)
            spec = RunSpec(rundir, full_config, model, tasks, config, evaluate, init_fn, fork_from)
            dev = default_device(device)
            size = chunks.existing_chunk(rundir) or choose_chunk(spec, chunk, dev)
            if size >= config.n_members:
                Trainer(rundir, full_config, model, tasks, config, evaluate, init_fn, fork_from, progress,
                        dev, lock=lock).run()
            else:
                train_in_parts(spec, size, lock, progress, dev)
    run = Run(rundir)
    context.note_run(run)
    return run


def fingerprint(obj) -> object:
    """What identifies a task or callback in a run key: its spec(), else its source."""
    if obj is None:
        return None
    if hasattr(obj, "spec"):
        return obj.spec()
    try:
        src = inspect.getsource(obj)
    except (OSError, TypeError):
        src = ""
    return {"callable": getattr(obj, "__qualname__", type(obj).__name__), "source": runs.hash_text(src)[:16]}
