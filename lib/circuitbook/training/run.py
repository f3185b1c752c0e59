"""The read side of a finished run: `Run` (metrics, checkpoints, models), `ComposedRun` (a run and its
continuation read as one) and `ReleasedRun` (a released run's checkpoint folder read like a run of one
member). Not part of any run's key: how a run is read never changes what it is.

Every object a chapter hands its notebooks as "a run" answers the same questions (the run-like
protocol): `name`, `key`, `n_members`, `metrics()`, `checkpoint_steps()`, `model(member, step)`,
`models(step)`; `key` is None for weights that come from no run of the store (a released run).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable, Protocol

import pandas as pd
import torch

from .. import runs
from ..models.registry import config_from_dict
from .config import TrainConfig
from .ensemble import Ensemble


class RunLike(Protocol):
    """What every object a chapter hands its notebooks as "a run" answers (Run, ComposedRun, ReleasedRun,
    and PlannedRun while planning, which has no metrics)."""

    name: str
    key: str | None
    n_members: int

    def metrics(self) -> pd.DataFrame: ...
    def checkpoint_steps(self) -> list[int]: ...
    def model(self, member: int = 0, step: int | None = None): ...
    def models(self, step: int | None = None) -> list: ...


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


class ComposedRun:
    """A run and its continuation (a fork from the run's last checkpoint) read as one run: metrics,
    checkpoints and models over the whole span; `name` and `key` are the continuation's (its weights
    are the final model's)."""

    def __init__(self, first: Run, second: Run):
        self.first, self.second = first, second
        self.model_config = second.model_config
        self.train_config = second.train_config
        self.dir, self.key, self.path = second.dir, second.key, second.path
        self.name, self.n_members = second.name, second.n_members
        self.boundary = first.train_config.steps
        self.manifest = {"train_seconds": round(first.manifest.get("train_seconds", 0)
                                                + second.manifest.get("train_seconds", 0), 2)}

    def __repr__(self):
        return f"ComposedRun({self.first!r} -> {self.second!r} from step {self.boundary})"

    def metrics(self) -> pd.DataFrame:
        a, b = self.first.metrics(), self.second.metrics()
        return pd.concat([a, b[b.step > self.boundary]], ignore_index=True)

    def checkpoint_steps(self) -> list[int]:
        return sorted(set(self.first.checkpoint_steps()) | set(self.second.checkpoint_steps()))

    def model(self, member: int = 0, step: int | None = None):
        step = self.train_config.steps if step is None else step
        return (self.first if step <= self.boundary else self.second).model(member, step)

    def models(self, step: int | None = None) -> list:
        return [self.model(k, step) for k in range(self.n_members)]


class ReleasedRun:
    """A released training run, a folder of TransformerLens state dicts whose file names carry their
    step (`checkpoint_step_5301.pth`), with or without a step-less final model (`model_state_dict.pth`,
    the run's last checkpoint: `models.loading.read_release`), read like a run of one member.

    `metrics()` evaluates every checkpoint with `evaluator.evaluate_model(model) -> {metric: value}`, so
    the rules that read a run's curves read it as they read the book's runs; the table is cached under
    $CIRCUITBOOK_RUNS/external, keyed by the files (name, size, modification time) and `evaluator.spec()`.
    `check_model(model, where)` refuses weights of another chapter's shape. `key` is None: values measured
    on it come from no run of the store.
    """

    n_members = 1
    key = None

    def __init__(self, directory, evaluator, check_model: Callable | None = None):
        from ..models.loading import read_release

        self.path = Path(directory).expanduser()
        self.release = read_release(self.path)
        self.files = self.release.files
        self.evaluator = evaluator
        self.check_model = check_model or (lambda model, where: model)
        stat = [(step, f.name, f.stat().st_size, f.stat().st_mtime_ns) for step, f in self.files.items()]
        ident = json.dumps({"files": stat, "evaluator": evaluator.spec()}, sort_keys=True)
        self.digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
        self._metrics: pd.DataFrame | None = None

    def __repr__(self):  # the folder's name, never its path on the builder's machine
        return f"ReleasedRun({self.path.name}, {len(self.files)} checkpoints)"

    @property
    def name(self) -> str:
        return self.path.name

    def checkpoint_steps(self) -> list[int]:
        return list(self.files)

    def model(self, member: int = 0, step: int | None = None):
        from ..models.loading import load_transformer_lens_checkpoint

        if member != 0:
            raise ValueError(f"member={member} is out of range; a released run has one member (0)")
        step = self.checkpoint_steps()[-1] if step is None else step
        if step not in self.files:
            raise ValueError(f"step={step} is not a checkpoint of {self}; steps: {self.checkpoint_steps()}")
        return self.check_model(load_transformer_lens_checkpoint(self.files[step]), str(self.files[step]))

    def models(self, step: int | None = None) -> list:
        return [self.model(0, step)]

    def metrics(self) -> pd.DataFrame:
        """One row per checkpoint: step, member 0, seed -1, and the evaluator's metrics; no `train_loss`
        (a release's training loss is not in its weights)."""
        if self._metrics is None:
            cache = runs.runs_root() / "external" / f"{self.digest}.json"
            if cache.exists():
                rows = runs.read_json(cache)
            else:
                rows = [{"step": step, "member": 0, "seed": -1, **self.evaluator.evaluate_model(self.model(0, step))}
                        for step in self.files]
                runs.atomic_write_json(cache, rows)
            frame = pd.DataFrame(rows)
            first = ["step", "member", "seed"]
            self._metrics = frame[first + sorted(c for c in frame.columns if c not in first)]
        return self._metrics
