"""Planning (train nothing): what `train()` would train, and what a step of it costs.

Inside `planning()`, `train()` trains nothing and returns a `PlannedRun` (the run's name, key, model and
training configs), so `circuitbook build --plan` enumerates the very runs, with the very keys, that the
notebooks train. `step_flops` counts one `ensemble.train_step`. Not part of any run's key.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from .. import runs
from .chunks import RunSpec, member_slice
from .config import TrainConfig
from .ensemble import Ensemble, Optimizer, data_sampler, train_step

_planning: "Plan | None" = None


class PlannedRun:
    """What `train()` returns while planning: the run's identity and size, nothing trained."""

    def __init__(self, rundir: runs.RunDir, model, tasks: list, tc: TrainConfig, fork_from, complete: bool,
                 evaluate=None):
        self.dir, self.path, self.model_config, self.train_config = rundir, rundir.path, model, tc
        self.tasks, self.fork_from, self.complete, self.evaluate = tasks, fork_from, complete, evaluate
        self.manifest: dict = {}

    def __repr__(self):
        return f"PlannedRun({self.dir.name}, key={self.key}, members={self.n_members})"

    key = property(lambda self: self.dir.key)
    name = property(lambda self: self.dir.name)
    n_members = property(lambda self: self.train_config.n_members)

    @property
    def start(self) -> int:
        return 0 if self.fork_from is None else int(self.fork_from[1])

    def checkpoint_steps(self) -> list[int]:
        return self.train_config.checkpoint_steps(self.start)

    def metrics(self):
        raise RuntimeError(f"{self.dir.name} is planned, not trained: it has no metrics")


class Plan:
    """The runs `train()` was asked for while planning, in order (`planning()`), and notes on them."""

    def __init__(self):
        self.runs: list[PlannedRun] = []
        self.notes: dict[str, str] = {}

    def add(self, rundir, full_config, model, tasks, tc, fork_from, evaluate=None) -> PlannedRun:
        complete = rundir.check_complete()[0]
        planned = PlannedRun(rundir, model, tasks, tc, fork_from, complete, evaluate)
        if all(r.key != planned.key or r.dir.name != rundir.name for r in self.runs):
            self.runs.append(planned)
        return planned


def current() -> "Plan | None":
    """The plan `train()` adds to instead of training (None: train)."""
    return _planning


def note(run_name: str, text: str) -> None:
    """While planning, say how a run was planned where the notebook decides at run time (a fork step
    chosen from trained curves): `--plan` prints it under the run. Outside planning it does nothing."""
    if _planning is not None:
        _planning.notes[run_name] = text


@contextlib.contextmanager
def planning():
    """Within this block `train()` trains nothing: it returns a PlannedRun and adds it to the Plan."""
    global _planning
    previous, _planning = _planning, Plan()
    try:
        yield _planning
    finally:
        _planning = previous


def count_parameters(model_cfg) -> int:
    """Trainable parameters of one member."""
    with torch.random.fork_rng(devices=[]):
        model = model_cfg.build(seed=0)
    names = set(model.trainable_names())
    return sum(p.numel() for n, p in model.named_parameters() if n in names)


def step_flops(spec: RunSpec, batch: int = 8) -> float:
    """FLOPs of one training step of the whole ensemble (forward and backward, counted by torch's
    FlopCounterMode on one member at a small batch, scaled to the run's batch and members)."""
    from torch.utils.flop_counter import FlopCounterMode

    tc = replace(member_slice(spec.tc, 0, 1), micro_batch_size=None)
    b = min(batch, tc.batch_size)
    with torch.random.fork_rng(devices=[]):
        ens = Ensemble(spec.model, tc.seeds, None, "cpu")
        opt = Optimizer(ens.params, ens.trainable, tc)
        tokens, labels = data_sampler(spec.tasks[:1], tc.seeds)(0, b)
        counter = FlopCounterMode(display=False)
        with counter:  # the optimizer's elementwise work is not counted: FLOPs of the matrix products
            train_step(ens, opt, tokens, labels, spec.tasks[0].loss, tc)
    return counter.get_total_flops() * tc.batch_size / b * spec.tc.n_members
