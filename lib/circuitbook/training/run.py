"""The read side of a finished run: `Run` (metrics, checkpoints, models) and `ComposedRun` (a run and
its continuation read as one). Not part of any run's key: how a run is read never changes what it is.

Every object a chapter hands its notebooks as "a run" answers the same questions (the run-like
protocol): `name`, `key`, `n_members`, `metrics()`, `checkpoint_steps()`, `model(member, step)`,
`models(step)`; `key` is None for weights that come from no run of the store (a released run).
"""
from __future__ import annotations

import pandas as pd
import torch

from .. import runs
from ..models.registry import config_from_dict
from .config import TrainConfig
from .ensemble import Ensemble


def checkpoint_rel(step: int) -> str:
    """A checkpoint's file inside its run folder."""
    return f"ckpt/step_{step:08d}.safetensors"


class Run:
    """A finished training run read from the store."""

    def __init__(self, rundir: runs.RunDir):
        self.dir = rundir
        self.path = rundir.path
        self.config = runs.read_json(rundir.file("config.json"))
        self.model_config = config_from_dict(self.config["model"])
        self.train_config = TrainConfig(**self.config["train"])
        self.manifest = rundir.manifest()

    def __repr__(self):  # what a notebook shows: the run's name and short key, never a path of the store
        return f"Run({self.name}, key {self.key[:8]}, {self.n_members} member(s), {self.train_config.steps:,} steps)"

    @property
    def name(self) -> str:
        return self.dir.name

    @property
    def key(self) -> str:
        return self.dir.key

    @property
    def n_members(self) -> int:
        return self.train_config.n_members

    def metrics(self) -> pd.DataFrame:
        """One row per (step, member) with every evaluated metric."""
        return pd.DataFrame(runs.read_jsonl(self.dir.file("metrics.jsonl")))

    def checkpoint_steps(self) -> list[int]:
        return sorted(int(s) for s in self.manifest["checkpoints"])

    def state(self, step: int | None = None) -> dict[str, torch.Tensor]:
        """Stacked weights [K, ...] at a checkpoint step (default: the final step)."""
        step = self.train_config.steps if step is None else step
        if step not in self.checkpoint_steps():
            raise ValueError(f"step={step} is not a checkpoint of {self}; checkpoints: {self.checkpoint_steps()}")
        rel = checkpoint_rel(step)
        tensors = runs.load_tensors(self.dir.file(rel), self.manifest["files"][rel]["sha256"])
        return {k[len("param."):]: v for k, v in tensors.items() if k.startswith("param.")}

    def model(self, member: int = 0, step: int | None = None):
        """Member `member`'s model (a ToyTransformer or another registered class) at `step` (default: final)."""
        if not 0 <= member < self.n_members:
            raise ValueError(f"member={member} is out of range; this run has members 0..{self.n_members - 1}")
        model = self.model_config.build(seed=0)
        model.load_state_dict({n: p[member] for n, p in self.state(step).items()}, strict=False)
        return model.eval()

    def models(self, step: int | None = None) -> list:
        return [self.model(k, step) for k in range(self.n_members)]

    def ensemble(self, step: int | None = None) -> Ensemble:
        ens = Ensemble(self.model_config, self.train_config.seeds)
        ens.load_state(self.state(step))
        return ens
