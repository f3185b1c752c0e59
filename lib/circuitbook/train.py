"""One training loop for every chapter, with an ensemble axis.

K members (different seeds, per-member learning rate or weight decay, per-member
data) are trained in one batched pass: their parameters are stacked along a
leading axis and the model runs under `torch.func.vmap`. Because the members
share nothing, the gradient of the summed loss is each member's own gradient.

Runs are cached in the artifact store (`runs.py`) under a key that hashes
everything that determines them. Checkpoints hold weights, optimizer state and
RNG state on a log-spaced plus regular schedule; a killed run resumes from its
last intact checkpoint and ends with the same numbers as an uninterrupted one,
because every batch is a pure function of (member seed, step).

Members share nothing, so a run may also train in chunks of members (`parts`):
each chunk is a sub-ensemble trained start to finish in `<run>/parts/`, with its
own checkpoints and lock, and the run is published (stacked checkpoints, merged
metrics, manifest) only when every chunk is in. The chunk size never enters the
run key; it is chosen from a short step-time calibration on the device at hand
(`choose_chunk`), and under a Ray build (`CIRCUITBOOK_RAY_ADDRESS`) the chunks
also run as Ray tasks on other nodes (`circuitbook.cluster`).
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import math
import os
import sys
import time
from functools import partial
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import pandas as pd
import torch
import torch.nn.functional as F
from torch.func import functional_call, stack_module_state, vmap
from tqdm import tqdm

from . import context, runs, settings
from .models.registry import config_from_dict, config_to_dict
from .models.toy import ToyConfig, ToyTransformer
from .tasks.base import IGNORE_INDEX, Batch, derive_seed

# cuBLAS reproduces its results only with a fixed workspace; it must be set before the first cuBLAS call of the
# process, hence here, on import (CPU training ignores it). See device_policy.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

OPTIMIZERS = ("adamw", "sgd")
LOSSES = ("last", "next_token")
PRECISIONS = ("fp32", "bf16")  # bf16: autocast of the forward pass (the Assign-and-Add authors' GPU setting)


@dataclass(frozen=True)
class TrainConfig:
    """How to train. `lr` and `weight_decay` may be one value or one per member."""

    steps: int
    batch_size: int
    seeds: tuple[int, ...] = (0,)
    lr: float | tuple[float, ...] = 1e-3
    weight_decay: float | tuple[float, ...] = 0.0
    optimizer: str = "adamw"
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    eval_every: int = 100
    checkpoint_every: int | None = None  # regular checkpoints (None: only log-spaced and final)
    log_checkpoints: int = 16  # log-spaced checkpoints between step 1 and the end
    micro_batch_size: int | None = None  # accumulate gradients over slices of this many sequences (same step)
    precision: str = "fp32"

    def __post_init__(self):
        object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))
        for name in ("lr", "weight_decay"):
            v = getattr(self, name)
            if isinstance(v, (list, tuple)):
                object.__setattr__(self, name, tuple(float(x) for x in v))
                if len(v) != len(self.seeds):
                    raise ValueError(f"TrainConfig.{name} has {len(v)} values but there are "
                                     f"{len(self.seeds)} members (seeds); give one value or one per member")
        object.__setattr__(self, "betas", tuple(self.betas))
        checks = [
            ("steps", self.steps >= 1, "an integer >= 1"),
            ("batch_size", self.batch_size >= 1, "an integer >= 1"),
            ("seeds", len(self.seeds) >= 1 and len(set(self.seeds)) == len(self.seeds), "at least one seed, no repeats"),
            ("optimizer", self.optimizer in OPTIMIZERS, f"one of {OPTIMIZERS}"),
            ("eval_every", self.eval_every >= 1, "an integer >= 1"),
            ("checkpoint_every", self.checkpoint_every is None or self.checkpoint_every >= 1, "None or an integer >= 1"),
            ("log_checkpoints", self.log_checkpoints >= 0, "an integer >= 0"),
            ("micro_batch_size", self.micro_batch_size is None or self.micro_batch_size >= 1, "None or an integer >= 1"),
            ("precision", self.precision in PRECISIONS, f"one of {PRECISIONS}"),
            ("lr", all(x > 0 for x in self.per_member("lr")), "positive"),
            ("weight_decay", all(x >= 0 for x in self.per_member("weight_decay")), ">= 0"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)!r} is not allowed; expected {allowed}")

    @property
    def n_members(self) -> int:
        return len(self.seeds)

    def per_member(self, name: str) -> list[float]:
        v = getattr(self, name)
        return list(v) if isinstance(v, tuple) else [float(v)] * len(self.seeds)

    def checkpoint_steps(self, start: int = 0) -> list[int]:
        """Log-spaced steps (dense early, where circuits form) + regular + first + last."""
        steps = {start, self.steps}
        if self.log_checkpoints:
            span = max(self.steps - start, 1)
            for i in range(self.log_checkpoints):
                steps.add(start + round(span ** ((i + 1) / self.log_checkpoints)))
        if self.checkpoint_every:
            steps.update(range(start, self.steps + 1, self.checkpoint_every))
        return sorted(s for s in steps if start <= s <= self.steps)


# ---------------------------------------------------------------- losses

def summed_loss(logits: torch.Tensor, labels: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy, number of scored labels) of one member's batch. logits [B, T, V].

    Written with log_softmax + gather rather than F.cross_entropy, which has no
    batching rule under vmap and falls back to a slow decomposition.
    """
    if kind == "last":
        logits, labels = logits[:, -1], labels
    keep = labels != IGNORE_INDEX
    logp = logits.float().log_softmax(-1)
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -(picked * keep).sum(), keep.sum()


def per_member_loss(logits: torch.Tensor, labels: torch.Tensor, kind: str) -> torch.Tensor:
    """Mean cross-entropy of one member's batch (over the scored labels)."""
    total, count = summed_loss(logits, labels, kind)
    return total / count.clamp(min=1)


def scored_labels(labels: torch.Tensor) -> torch.Tensor:
    """[K] number of labels the loss scores per member (labels [K, B] or [K, B, T])."""
    return (labels != IGNORE_INDEX).flatten(1).sum(1)


# ---------------------------------------------------------------- the ensemble

class Ensemble:
    """K models with identical architecture, parameters stacked on axis 0.

    `cfg` is any registered model config (`models.registry`): a ToyConfig, or another
    model class the book trains with this loop.
    """

    def __init__(self, cfg, seeds: Sequence[int], init_fn: Callable | None = None,
                 device: str | torch.device = "cpu", members: Sequence[int] | None = None):
        self.cfg, self.device = cfg, torch.device(device)
        # which members of the whole run these are: a chunk of a run split into parts holds members
        # lo..hi-1, and callbacks with per-member data (one pool per member) index it with these
        self.members = tuple(int(m) for m in members) if members is not None else tuple(range(len(seeds)))
        if len(self.members) != len(seeds):
            raise ValueError(f"Ensemble: {len(self.members)} member indices for {len(seeds)} seeds")
        members = [cfg.build(seed=s) for s in seeds]
        if init_fn is not None:
            for m, s in zip(members, seeds):
                init_fn(m, s)
        self.base = cfg.build(seed=0).to("meta")  # structure only, for functional_call
        self.trainable = set(members[0].trainable_names())
        params, buffers = stack_module_state(members)
        self.params = {k: v.detach().to(self.device).requires_grad_(k in self.trainable) for k, v in params.items()}
        self.buffers = {k: v.to(self.device) for k, v in buffers.items()}
        # each member draws its own random numbers (dropout) under vmap
        self._forward = vmap(self._member_forward, in_dims=(0, 0, 0), randomness="different")
        self._forward_last = vmap(partial(self._member_forward, last_only=True), in_dims=(0, 0, 0),
                                  randomness="different")

    @property
    def n_members(self) -> int:
        return next(iter(self.params.values())).shape[0]

    def _member_forward(self, params, buffers, tokens, last_only=False):
        return functional_call(self.base, (params, buffers), (tokens,), {"last_only": last_only})

    def logits(self, tokens: torch.Tensor, last_only: bool = False, training: bool = False) -> torch.Tensor:
        """tokens [B, T] (shared) or [K, B, T] (per member) -> logits [K, B, T, V].

        last_only: only the last position's logits ([K, B, 1, V]), at about half the cost.
        training: run the modules in train mode (dropout on); evaluation runs in eval mode.
        The result is on the device of `tokens` (the ensemble may live on a GPU).
        """
        out_device = tokens.device
        tokens = tokens.to(self.device)
        if tokens.dim() == 2:
            tokens = tokens.expand(self.n_members, *tokens.shape)
        buffers = {k: v.expand(self.n_members, *v.shape[1:]) for k, v in self.buffers.items()}
        forward = self._forward_last if last_only else self._forward
        self.base.train(training)
        return forward(self.params, buffers, tokens).to(out_device)

    def member(self, k: int):
        """An ordinary model (e.g. a ToyTransformer) holding member k's weights (a copy)."""
        model = self.cfg.build(seed=0)
        model.load_state_dict({n: p[k].detach().clone() for n, p in self.params.items()}, strict=False)
        return model.eval()

    def state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.params.items()}

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(tensors[n])


class Optimizer:
    """AdamW or SGD over stacked parameters, with per-member lr and weight decay.

    AdamW follows torch.optim.AdamW: decoupled decay p <- p (1 - lr wd), then
    the bias-corrected Adam step.
    """

    def __init__(self, params: dict[str, torch.Tensor], names: set[str], tc: TrainConfig):
        self.params = {n: p for n, p in params.items() if n in names}
        self.kind, self.betas, self.eps = tc.optimizer, tc.betas, tc.eps
        device = next(iter(self.params.values())).device
        self.lr = torch.tensor(tc.per_member("lr"), device=device)
        self.wd = torch.tensor(tc.per_member("weight_decay"), device=device)
        self.t = 0
        self.exp_avg = {n: torch.zeros_like(p) for n, p in self.params.items()} if self.kind == "adamw" else {}
        self.exp_avg_sq = {n: torch.zeros_like(p) for n, p in self.params.items()} if self.kind == "adamw" else {}

    @staticmethod
    def _per_member(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return v.view(-1, *([1] * (like.dim() - 1)))

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        b1, b2 = self.betas
        for n, p in self.params.items():
            g = p.grad
            lr, wd = self._per_member(self.lr, p), self._per_member(self.wd, p)
            if self.kind == "sgd":
                p.sub_(lr * (g + wd * p))  # plain SGD, L2 decay coupled (none in the papers)
                continue
            p.mul_(1 - lr * wd)
            m, v = self.exp_avg[n], self.exp_avg_sq[n]
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v / (1 - b2 ** self.t)).sqrt_().add_(self.eps)
            p.sub_(lr / (1 - b1 ** self.t) * m / denom)

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    def state(self) -> dict[str, torch.Tensor]:
        out = {f"exp_avg.{n}": t for n, t in self.exp_avg.items()}
        out.update({f"exp_avg_sq.{n}": t for n, t in self.exp_avg_sq.items()})
        return out

    def load_state(self, tensors: dict[str, torch.Tensor], t: int) -> None:
        self.t = t
        for n in self.exp_avg:
            self.exp_avg[n].copy_(tensors[f"exp_avg.{n}"])
            self.exp_avg_sq[n].copy_(tensors[f"exp_avg_sq.{n}"])


# ---------------------------------------------------------------- evaluation helpers

EvalFn = Callable[[Ensemble, int], dict]


def pool_accuracy(pools: dict[str, Batch], prefix: str = "acc_") -> EvalFn:
    """An evaluation callback: last-position accuracy of every member on each pool."""

    @torch.no_grad()
    def evaluate(ens: Ensemble, step: int) -> dict:
        out = {}
        for name, batch in pools.items():
            pred = ens.logits(batch.tokens, last_only=True)[:, :, -1].argmax(-1)  # [K, B]
            out[prefix + name] = (pred == batch.labels).float().mean(-1)
        return out

    evaluate.spec = lambda: {"pool_accuracy": {k: _tensor_digest(b.tokens, b.labels) for k, b in pools.items()},
                             "prefix": prefix}
    return evaluate


def _tensor_digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


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


# ---------------------------------------------------------------- the device

@contextlib.contextmanager
def device_policy(device: torch.device):
    """What training on `device` fixes about its arithmetic, the same for every chapter.

    fp32 matrix products run in full fp32 (`set_float32_matmul_precision("highest")`: no TF32 on a
    GPU), so a run trained on CUDA matches the same run on a CPU to float rounding (tests/test_cuda.py
    states the tolerances). On CUDA, deterministic algorithms are switched on (warn_only): the
    scatter-adds in the backward of gathers, index_select and embeddings, which are atomic adds in an
    arbitrary order otherwise, take their deterministic implementations, so a resumed or repeated CUDA
    run ends with the same numbers as its uninterrupted self; an op with no deterministic implementation
    warns instead of failing. The previous settings are restored on exit. A CPU is deterministic as it is.
    """
    if device.type != "cuda":
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.get_float32_matmul_precision())
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.set_float32_matmul_precision(before[2])


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


# ---------------------------------------------------------------- runs

def default_device(device: str | None = None) -> torch.device:
    """The device to train on: the argument, $CIRCUITBOOK_DEVICE, CUDA if available, else CPU."""
    choice = device or os.environ.get("CIRCUITBOOK_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(choice)
    except RuntimeError as e:
        raise ValueError(f"device {choice!r} is not a torch device (e.g. 'cpu', 'cuda', 'cuda:1'): {e}") from None


class Run:
    """A finished training run read from the store."""

    def __init__(self, rundir: runs.RunDir):
        self.dir = rundir
        self.path = rundir.path
        self.config = runs.read_json(rundir.file("config.json"))
        self.model_config = config_from_dict(self.config["model"])
        self.train_config = TrainConfig(**self.config["train"])
        self.manifest = rundir.manifest()

    def __repr__(self):
        return f"Run({self.dir.name}, key={self.dir.key}, members={self.n_members})"

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
        rel = _ckpt_rel(step)
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


def _ckpt_rel(step: int) -> str:
    return f"ckpt/step_{step:08d}.safetensors"


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
        "code_version": runs.code_version([*tasks, evaluate, init_fn, model]),  # model: its class's module
    }
    rundir = store.run_dir(name, full_config)
    if _planning is not None:
        return _planning.add(rundir, full_config, model, tasks, config, fork_from)
    with rundir.lock() as lock:
        if store.open_complete(rundir):
            print(f"[circuitbook] cached run {rundir.name} ({rundir.key}) at {rundir.path}", flush=True)
        else:
            check_deadline(rundir.name)
            spec = RunSpec(rundir, full_config, model, tasks, config, evaluate, init_fn, fork_from)
            dev = default_device(device)
            size = _existing_chunk(rundir) or choose_chunk(spec, chunk, dev)
            if size >= config.n_members:
                _Trainer(rundir, full_config, model, tasks, config, evaluate, init_fn, fork_from, progress,
                         dev, lock=lock).run()
            else:
                train_in_parts(spec, size, lock, progress, dev)
    run = Run(rundir)
    context.note_run(run)
    return run


def accumulate_gradients(ens: Ensemble, tokens: torch.Tensor, labels: torch.Tensor, kind: str,
                         tc: TrainConfig) -> torch.Tensor:
    """Backpropagate each member's mean loss over the whole batch; return the losses [K].

    With `micro_batch_size` the batch is processed in slices whose summed losses are divided
    by the whole batch's count of scored labels, so the accumulated gradient is the full
    batch's (one optimizer step per batch, as without slicing), at a slice's memory.
    """
    size = tokens.shape[1]
    step = tc.micro_batch_size or size
    total = scored_labels(labels).clamp(min=1).to(torch.float32)
    losses = torch.zeros_like(total)
    autocast = torch.autocast(ens.device.type, dtype=torch.bfloat16, enabled=tc.precision == "bf16")
    for start in range(0, size, step):
        with autocast:
            logits = ens.logits(tokens[:, start:start + step], last_only=kind == "last", training=True)
        summed, _ = vmap(partial(summed_loss, kind=kind))(logits, labels[:, start:start + step])
        part = summed / total
        part.sum().backward()
        losses += part.detach()
    return losses


class _Trainer:
    """Trains one ensemble into one folder: a whole run, or one part (members `members`) of a split run."""

    def __init__(self, rundir, full_config, model_cfg, tasks, tc: TrainConfig, evaluate, init_fn, fork_from, progress,
                 device, members: Sequence[int] | None = None, lock: runs.LeaseLock | None = None):
        self.dir, self.tc, self.tasks, self.evaluate = rundir, tc, tasks, evaluate
        self.full_config, self.lock = full_config, lock
        self.ens = Ensemble(model_cfg, tc.seeds, init_fn, device, members)
        self.members = self.ens.members
        self.opt = Optimizer(self.ens.params, self.ens.trainable, tc)
        self.start = 0
        if fork_from is not None:
            parent, step = fork_from
            self._load_checkpoint(parent.dir.file(_ckpt_rel(step)), parent.manifest["files"][_ckpt_rel(step)]["sha256"],
                                  members=self.members)
            self.opt.t = step
            self.start = step
        self.schedule = set(tc.checkpoint_steps(self.start))
        self.progress = progress if progress is not None else os.environ.get("CIRCUITBOOK_PROGRESS", "1") != "0"
        self.metrics_path = rundir.file("metrics.jsonl")
        self.last_loss = torch.full((tc.n_members,), float("nan"))
        print(f"[circuitbook] training {rundir.name} ({rundir.key}): {tc.n_members} member(s), {tc.steps} steps "
              f"on {self.ens.device}", flush=True)

    # -- checkpoints ---------------------------------------------------
    def _write_checkpoint(self, step: int) -> None:
        if self.lock is not None:
            self.lock.check()  # judged dead and taken over while paused: stop writing
        tensors = {f"param.{n}": p for n, p in self.ens.state().items()}
        tensors.update({f"opt.{n}": t for n, t in self.opt.state().items()})
        tensors["rng.torch"] = torch.get_rng_state()
        if self.ens.device.type == "cuda":  # dropout draws on the GPU's generator: a resumed run needs it too
            tensors["rng.cuda"] = torch.cuda.get_rng_state(self.ens.device)
        rel = _ckpt_rel(step)
        digest = runs.save_tensors(self.dir.file(rel), tensors)
        # the JSON marker is written last: a checkpoint without it never counts
        runs.atomic_write_json(self.dir.file(rel).with_suffix(".json"),
                               {"step": step, "opt_t": self.opt.t, "sha256": digest,
                                "size": self.dir.file(rel).stat().st_size})

    def _load_checkpoint(self, path: Path, sha256: str, members: Sequence[int] | None = None) -> None:
        """Weights, optimizer state and RNG state of a checkpoint; `members`: take only these rows of a
        checkpoint that holds more members (a part forking from a whole parent run)."""
        tensors = runs.load_tensors(path, sha256)
        if members is not None:
            rows = torch.tensor(list(members))
            tensors = {k: (v.index_select(0, rows) if k.startswith(("param.", "opt.")) else v)
                       for k, v in tensors.items()}
        self.ens.load_state({k[6:]: v for k, v in tensors.items() if k.startswith("param.")})
        self.opt.load_state({k[4:]: v for k, v in tensors.items() if k.startswith("opt.")}, self.opt.t)
        torch.set_rng_state(tensors["rng.torch"])
        if "rng.cuda" in tensors and self.ens.device.type == "cuda":
            torch.cuda.set_rng_state(tensors["rng.cuda"], self.ens.device)

    def _resume(self) -> int:
        """Load the newest intact checkpoint that an intact metrics history reaches; return its step.

        Every evaluation row up to a checkpoint's step must be in metrics.jsonl for the run to go
        on from there. If a row is garbled or missing, the run goes on from the newest checkpoint
        before the damage (everything after it is recomputed, so the history ends up whole) and
        says so; with none, it trains again from its start. It is never sealed with holes. A torn
        last line (a crash while appending) is expected and dropped.
        """
        markers = sorted(self.dir.path.glob("ckpt/step_*.json"), reverse=True)
        rows, problem = self._read_metrics()
        intact = self._intact_until(rows)
        for marker in markers:
            try:
                info = runs.read_json(marker)
                step = int(info["step"])
                if step > intact:
                    continue
                if problem or step < int(markers[0].stem[5:]):
                    why = problem or f"it has no rows after step {intact}"
                    last = max((int(r["step"]) for r in rows if int(r["step"]) <= intact), default=self.start)
                    print(f"[circuitbook] {self.metrics_path} is damaged ({why}); its history is intact up to step "
                          f"{last}, so {self.dir.name} goes on from the checkpoint at step {step} and recomputes "
                          "what follows", flush=True)
                self._load_checkpoint(marker.with_suffix(".safetensors"), info["sha256"])
                self.opt.t = info["opt_t"]
                kept = [r for r in rows if r["step"] <= step]
                runs.atomic_write_bytes(self.metrics_path, "".join(json.dumps(r) + "\n" for r in kept).encode())
                for later in markers:  # checkpoints after the damage are recomputed too
                    if int(later.stem[5:]) > step:
                        later.unlink(missing_ok=True)
                        later.with_suffix(".safetensors").unlink(missing_ok=True)
                print(f"[circuitbook] resuming {self.dir.name} from step {step}", flush=True)
                return step
            except (runs.DamagedRunError, KeyError, TypeError, ValueError) as e:
                print(f"[circuitbook] checkpoint {marker.name} is damaged ({e}); ignoring it", flush=True)
                marker.unlink(missing_ok=True)
                marker.with_suffix(".safetensors").unlink(missing_ok=True)
        if markers or rows:
            why = problem or "no checkpoint before the first missing row" if rows else "no intact checkpoint"
            print(f"[circuitbook] {self.dir.name}: {why}; training again from step {self.start}", flush=True)
        for stale in self.dir.path.glob("ckpt/step_*"):
            stale.unlink(missing_ok=True)
        self.metrics_path.unlink(missing_ok=True)
        return self.start

    def _read_metrics(self) -> tuple[list[dict], str]:
        """(rows up to the first unreadable line, what is wrong beyond a torn last line or '')."""
        if not self.metrics_path.exists():
            return [], ""
        lines = self.metrics_path.read_text().splitlines()
        rows = []
        for i, line in enumerate(lines):
            try:
                row = json.loads(line)
                if not isinstance(row, dict) or "step" not in row or "member" not in row:
                    raise ValueError("not a metrics row")
                rows.append(row)
            except ValueError:
                if i < len(lines) - 1:
                    return rows, f"line {i + 1} of {len(lines)} is garbled"
                break  # torn last line
        return rows, ""

    def _intact_until(self, rows: list[dict]) -> int:
        """The last step up to which every (evaluation step, member) row is present (start - 1: none)."""
        tc = self.tc
        have = {(int(r["step"]), int(r["member"])) for r in rows}
        evals = [self.start] + [s for s in range(self.start + 1, tc.steps + 1) if s % tc.eval_every == 0 or s == tc.steps]
        last = self.start - 1
        for i, s in enumerate(evals):
            if not all((s, k) in have for k in self.members):
                return (evals[i] - 1) if i else self.start - 1
            last = s
        return last

    # -- the loop ------------------------------------------------------
    def _batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        batches = [t.train_batch(step, self.tc.batch_size, derive_seed("data", s))
                   for t, s in zip(self.tasks, self.tc.seeds)]
        device = self.ens.device
        return torch.stack([b.tokens for b in batches]).to(device), torch.stack([b.labels for b in batches]).to(device)

    def _log(self, step: int) -> None:
        row_metrics = {"train_loss": self.last_loss}
        if self.evaluate is not None:
            row_metrics.update(self.evaluate(self.ens, step))
        rows = []
        for k in range(self.tc.n_members):
            row = {"step": step, "member": self.members[k], "seed": self.tc.seeds[k]}
            for name, values in row_metrics.items():
                v = values[k] if hasattr(values, "__len__") else values
                row[name] = float(v)
            rows.append(row)
        with open(self.metrics_path, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))

    def _accumulate_gradients(self, tokens: torch.Tensor, labels: torch.Tensor, kind: str) -> torch.Tensor:
        return accumulate_gradients(self.ens, tokens, labels, kind, self.tc)

    def run(self) -> None:
        # The run draws its random numbers (dropout) from its own stream, seeded from its members' seeds, so it
        # repeats in any process (torch seeds its global generator at random in each one); a resumed run
        # loads the stream's state from its checkpoint. The caller's generators are left as they were.
        devices = [self.ens.device] if self.ens.device.type == "cuda" else []
        with device_policy(self.ens.device), torch.random.fork_rng(devices=devices):
            torch.manual_seed(derive_seed("train", *self.tc.seeds))
            self._run()

    def _run(self) -> None:
        self.dir.path.mkdir(parents=True, exist_ok=True)
        runs.atomic_write_json(self.dir.file("config.json"), self.full_config)
        step = self._resume()
        tc, kind = self.tc, self.tasks[0].loss
        if step == self.start and not self.metrics_path.exists():
            self._log(step)
            if step in self.schedule:
                self._write_checkpoint(step)
        bar = tqdm(total=tc.steps, initial=step, desc=self.dir.name, disable=not self.progress,
                   mininterval=10, file=sys.stderr, dynamic_ncols=False, ncols=100)
        t0 = time.time()
        while step < tc.steps:
            tokens, labels = self._batch(step)
            self.opt.zero_grad()
            self.last_loss = self._accumulate_gradients(tokens, labels, kind)
            self.opt.step()
            step += 1
            bar.update(1)
            if step % tc.eval_every == 0 or step == tc.steps:
                self._log(step)
            if step in self.schedule:
                self._write_checkpoint(step)
        bar.close()
        if self.lock is not None:
            self.lock.check()
        files = ["config.json", "metrics.jsonl"]
        files += [p.relative_to(self.dir.path).as_posix() for p in sorted(self.dir.path.glob("ckpt/step_*"))]
        self.dir.finalize(files, {"checkpoints": sorted(self.schedule), "train_seconds": round(time.time() - t0, 2)})


# ---------------------------------------------------------------- chunks of members (parts)

CHUNK_ENV = "CIRCUITBOOK_CHUNK"
MIN_CALIBRATED_RUN_S = 60.0  # a run estimated shorter than this trains as one ensemble, uncalibrated
MIN_CALIBRATED_STEPS = 200  # ... and so does one of fewer steps (calibrating costs about 8 steps of the whole run)
CALIBRATION_REPEATS = 3  # timed steps per chunk size (after one warm-up); the fastest counts
# A chunk of several members must be estimated this much faster than one member at a time to be chosen:
# a few timed steps flatter larger chunks against whole runs on a CPU (benchmarks/README.md: assign_add in
# pairs calibrated at 1.02x of alone and ran at 0.90x; markov in eights at 1.04-1.09x, ran at 0.97-1.03x),
# and training members one after another is never slower than itself.
SEQUENTIAL_MARGIN = 0.10


@dataclass
class RunSpec:
    """Everything that determines a run, in a form that can be sent to another process (a Ray task)."""

    rundir: runs.RunDir
    full_config: dict
    model: object
    tasks: list
    tc: TrainConfig
    evaluate: EvalFn | None = None
    init_fn: Callable | None = None
    fork_from: tuple[Run, int] | None = None


def split_members(n_members: int, chunk: int) -> list[tuple[int, int]]:
    """[lo, hi) bounds of ceil(K / chunk) parts whose sizes differ by at most one member."""
    n = -(-n_members // max(1, min(chunk, n_members)))
    base, extra = divmod(n_members, n)
    bounds, lo = [], 0
    for i in range(n):
        hi = lo + base + (i < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def chunk_candidates(n_members: int) -> list[int]:
    """Chunk sizes the calibration measures: powers of two below K, and K."""
    out, c = [], 1
    while c < n_members:
        out.append(c)
        c *= 2
    return out + [n_members]


def best_chunk(n_members: int, steps: int, step_seconds: dict[int, float], workers: int = 1,
               setup_seconds: dict[int, float] | None = None, task_overhead_s: float = 0.0) -> int:
    """The chunk size with the least estimated wall time for the run, if it beats one member at a time
    by more than SEQUENTIAL_MARGIN; else 1.

    A chunk of c members trains in `step_seconds[c]` per step and costs `setup_seconds[c]` once per part
    (building its ensemble and optimizer, its first step's allocations: measured by `calibrate`); the
    ceil(K / c) parts run `workers` at a time, and on a cluster every part beyond the first also pays
    `task_overhead_s` (a Ray task's process and imports), shared among the workers. Ties between chunks
    above 1 go to the larger (fewer parts to publish).
    """
    setup_seconds = setup_seconds or {}
    est = {}
    for c, t in step_seconds.items():
        n = len(split_members(n_members, c))
        rounds = -(-n // max(1, workers))
        est[c] = rounds * (steps * t + setup_seconds.get(c, 0.0)) + (n - 1) * task_overhead_s / min(n, max(1, workers))
    best = min(est, key=lambda c: (est[c], -c))
    if 1 in est and best != 1 and est[best] > (1 - SEQUENTIAL_MARGIN) * est[1]:
        return 1
    return best


def _draws_random_numbers(model_cfg) -> bool:
    """Members that draw random numbers while training (dropout) share one random stream under vmap,
    so a chunk would not reproduce them exactly: such runs train as one ensemble."""
    return bool(getattr(model_cfg, "dropout", 0))


def _parse_chunk(choice) -> int | str:
    try:
        return settings.parse_chunk(choice)
    except settings.SettingError:
        raise ValueError(f"chunk={choice!r} (or ${CHUNK_ENV}) is not allowed; expected 'auto', 'all' or an "
                         "integer >= 1") from None


def choose_chunk(spec: RunSpec, requested=None, device: torch.device | None = None) -> int:
    """How many members train together: `requested`, else $CIRCUITBOOK_CHUNK, else measured.

    `auto` times one step of the whole ensemble; a run estimated under MIN_CALIBRATED_RUN_S trains as
    one ensemble. A longer one times a step at each candidate chunk size on this device (a few steps,
    well under 5% of the run) and takes `best_chunk`, counting the Ray cluster's nodes as workers when
    the run trains under a Ray build.
    """
    K = spec.tc.n_members
    choice = _parse_chunk(requested if requested is not None else os.environ.get(CHUNK_ENV, "auto"))
    if choice == "all" or K == 1:
        return K
    if isinstance(choice, int):
        return min(choice, K)
    if _draws_random_numbers(spec.model):
        return K
    device = device or default_device()
    whole = calibrate(spec, [K], device, repeats=2).step_s[K]
    if spec.tc.steps * whole < MIN_CALIBRATED_RUN_S or spec.tc.steps < MIN_CALIBRATED_STEPS:
        return K  # too short for the calibration (a few steps at each size) to pay for itself
    from . import cluster

    workers, task_overhead = (cluster.worker_slots(), cluster.TASK_OVERHEAD_S) if cluster.active() else (1, 0.0)
    cal = calibrate(spec, chunk_candidates(K), device)
    chunk = best_chunk(K, spec.tc.steps, cal.step_s, workers, cal.setup_s, task_overhead)
    print(f"[circuitbook] {spec.rundir.name}: chunk of {chunk} member(s) of {K} "
          f"(seconds per step | per part setup, by chunk size on {device_name(device)}: "
          + ", ".join(f"{c}: {t:.3f} | {cal.setup_s[c]:.2f}" for c, t in cal.step_s.items())
          + f"; {workers} worker(s))", flush=True)
    return chunk


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


@dataclass
class Calibration:
    """Measured on the device at hand, per chunk size c: `step_s[c]`, seconds of one training step of c
    members (forward, backward, optimizer; the fastest of a few), and `setup_s[c]`, the one-off cost of a
    part of c members (building its ensemble, optimizer and first batch, and its first step's extra time
    over a steady one). Chunk sizes that do not fit on the device are absent."""

    step_s: dict[int, float]
    setup_s: dict[int, float]


_calibrations: dict[str, Calibration] = {}


def calibrate(spec: RunSpec, sizes: Sequence[int], device: torch.device, repeats: int = CALIBRATION_REPEATS
              ) -> Calibration:
    """Time a training step of the first c members for each c in `sizes` on `device` (no evaluation),
    sizes interleaved so that a change in the machine's load hits them alike. Remembered per process for
    the same model, batch and device."""
    key = runs.hash_text(runs.canonical_json([config_to_dict(spec.model), spec.tc.batch_size, spec.tc.micro_batch_size,
                                              spec.tc.precision, spec.tc.optimizer, spec.tasks[0].loss,
                                              device_name(device), repeats]))
    have = _calibrations.setdefault(key, Calibration({}, {}))
    todo = [c for c in sizes if c not in have.step_s]
    if todo:
        steps, first = {}, {}
        with device_policy(device):  # timed with the kernels training will use
            _step_fn(spec, min(todo), device)  # the process's one-off costs (first kernels, allocator) are no part's setup
            for c in todo:
                try:
                    steps[c], first[c] = _step_fn(spec, c, device)
                except torch.cuda.OutOfMemoryError:  # a chunk too big for this device is never chosen
                    torch.cuda.empty_cache()
            best = {c: float("inf") for c in steps}
            for _ in range(repeats):
                for c, step in steps.items():
                    best[c] = min(best[c], step())
        have.step_s.update(best)
        have.setup_s.update({c: max(0.0, first[c] - best[c]) for c in steps})
    fits = [c for c in sizes if c in have.step_s]
    return Calibration({c: have.step_s[c] for c in fits}, {c: have.setup_s[c] for c in fits})


def _step_fn(spec: RunSpec, c: int, device: torch.device) -> tuple[Callable[[], float], float]:
    """A timed training step of members 0..c-1, and the seconds it took to build them and run their first
    (warm-up) step; the global RNG is left untouched."""
    t0 = time.perf_counter()
    tc = _member_slice(spec.tc, 0, c)
    with torch.random.fork_rng(devices=[]):
        ens = Ensemble(spec.model, tc.seeds, None, device)
    opt = Optimizer(ens.params, ens.trainable, tc)
    batches = [t.train_batch(0, tc.batch_size, derive_seed("data", s)) for t, s in zip(spec.tasks[:c], tc.seeds)]
    tokens = torch.stack([b.tokens for b in batches]).to(device)
    labels = torch.stack([b.labels for b in batches]).to(device)
    kind = spec.tasks[0].loss

    def step() -> float:
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            sync()
            t0 = time.perf_counter()
            opt.zero_grad()
            accumulate_gradients(ens, tokens, labels, kind, tc)
            opt.step()
            sync()
        return time.perf_counter() - t0

    step()
    return step, time.perf_counter() - t0


def _member_slice(tc: TrainConfig, lo: int, hi: int) -> TrainConfig:
    """The TrainConfig of members lo..hi-1 (per-member lr and weight decay sliced too)."""
    cut = {n: getattr(tc, n)[lo:hi] for n in ("lr", "weight_decay") if isinstance(getattr(tc, n), tuple)}
    return replace(tc, seeds=tc.seeds[lo:hi], **cut)


def _part_tag(lo: int, hi: int) -> str:
    return f"members_{lo:05d}_{hi:05d}"


def part_dir(rundir: runs.RunDir, lo: int, hi: int) -> runs.RunDir:
    return runs.RunDir(rundir.path / "parts" / _part_tag(lo, hi), rundir.name, rundir.key)


def _existing_chunk(rundir: runs.RunDir) -> int | None:
    """The chunk size an interrupted attempt chose (it resumes the same way), or None if nothing was trained."""
    plan = rundir.path / "parts" / "plan.json"
    if plan.exists():
        with_plan = runs.read_json(plan)
        return int(with_plan["chunk"])
    if rundir.file("metrics.jsonl").exists() or any(rundir.path.glob("ckpt/step_*.json")):
        return sys.maxsize  # an interrupted whole-ensemble run: resume it as one ensemble
    return None


def _event(rundir: runs.RunDir, tag: str, event: str, **extra) -> None:
    """One file per event (never an append: appends are not atomic on network filesystems)."""
    info = {"part": tag, "event": event, "host": runs._host_id(), "pid": os.getpid(), "time": time.time(), **extra}
    runs.atomic_write_json(rundir.path / "events" / f"{time.time_ns()}-{os.getpid()}-{tag}-{event}.json", info)


def events(rundir: runs.RunDir) -> list[dict]:
    """The training events of a run split into parts (start, resume, finish per part; publish), in order."""
    return sorted((runs.read_json(p) for p in rundir.path.glob("events/*.json")), key=lambda e: e["time"])


def train_part(spec: RunSpec, lo: int, hi: int, lock: runs.LeaseLock, progress=None, device=None) -> None:
    """Train members lo..hi-1 of a run into its part folder (resuming it), under the part's lock."""
    part = part_dir(spec.rundir, lo, hi)
    if part.check_complete()[0]:
        return
    if part.manifest_path.exists():
        part.wipe()  # a damaged part: recomputed
    tag = _part_tag(lo, hi)
    resumed = part.file("metrics.jsonl").exists()
    _event(spec.rundir, tag, "resume" if resumed else "start")
    _Trainer(part, {**spec.full_config, "part": [lo, hi]}, spec.model, spec.tasks[lo:hi], _member_slice(spec.tc, lo, hi),
             spec.evaluate, spec.init_fn, spec.fork_from, progress, device or default_device(),
             members=range(lo, hi), lock=lock).run()
    _event(spec.rundir, tag, "finish")


def train_part_if_free(spec: RunSpec, lo: int, hi: int, device: str | None = None) -> str:
    """What a Ray task runs: train the part unless it is complete or another process holds it."""
    part = part_dir(spec.rundir, lo, hi)
    if part.check_complete()[0]:
        return "complete"
    lock = runs.LeaseLock(spec.rundir.lock_path(_part_tag(lo, hi)))
    if not lock.try_acquire():
        return "busy"
    try:
        train_part(spec, lo, hi, lock, progress=False, device=default_device(device))
    finally:
        lock.release()
    return "trained"


def train_in_parts(spec: RunSpec, chunk: int, lock: runs.LeaseLock, progress=None, device=None, poll: float = 0.5) -> None:
    """Train a run as parts of at most `chunk` members, then publish it.

    This process trains every part it can claim; under a Ray build every part is also offered to
    the cluster as a task, and whichever process claims a part's lock first trains it (a part whose
    holder died is taken over: see runs.LeaseLock). The run is published once every part is complete.
    """
    rundir = spec.rundir
    plan_path = rundir.path / "parts" / "plan.json"
    if plan_path.exists():
        bounds = [tuple(b) for b in runs.read_json(plan_path)["parts"]]
    else:
        bounds = split_members(spec.tc.n_members, chunk)
        runs.atomic_write_json(plan_path, {"chunk": chunk, "parts": bounds})
    print(f"[circuitbook] training {rundir.name} ({rundir.key}) in {len(bounds)} parts: "
          + ", ".join(f"members {lo}-{hi - 1}" for lo, hi in bounds), flush=True)
    from . import cluster

    remote = cluster.submit_parts(spec, bounds) if cluster.active() else None
    watches: dict = {b: {} for b in bounds}
    try:
        while True:
            pending = [b for b in bounds if not part_dir(rundir, *b).check_complete()[0]]
            if not pending:
                break
            for lo, hi in pending:
                part_lock = runs.LeaseLock(rundir.lock_path(_part_tag(lo, hi)))
                if part_lock.try_acquire(watches[(lo, hi)]):
                    try:
                        train_part(spec, lo, hi, part_lock, progress, device)
                    finally:
                        part_lock.release()
                    break
            else:
                lock.check()
                time.sleep(poll)
    finally:
        if remote is not None:
            remote.close()
    lock.check()
    _publish_parts(spec, bounds)


def _publish_parts(spec: RunSpec, bounds: list[tuple[int, int]]) -> None:
    """Stack the parts' checkpoints along the member axis, merge their metrics, write the manifest."""
    rundir = spec.rundir
    parts = [part_dir(rundir, lo, hi) for lo, hi in bounds]
    manifests = [p.manifest() for p in parts]
    schedule = manifests[0]["checkpoints"]
    runs.atomic_write_json(rundir.file("config.json"), spec.full_config)
    for step in schedule:
        rel = _ckpt_rel(step)
        loaded = [runs.load_tensors(p.file(rel), m["files"][rel]["sha256"]) for p, m in zip(parts, manifests)]
        merged = {k: torch.cat([t[k] for t in loaded]) if k.startswith(("param.", "opt.")) else v
                  for k, v in loaded[0].items()}
        digest = runs.save_tensors(rundir.file(rel), merged)
        marker = runs.read_json(parts[0].file(rel).with_suffix(".json"))
        runs.atomic_write_json(rundir.file(rel).with_suffix(".json"),
                               {"step": step, "opt_t": marker["opt_t"], "sha256": digest,
                                "size": rundir.file(rel).stat().st_size})
    rows = [r for p in parts for r in runs.read_jsonl(p.file("metrics.jsonl"))]
    rows.sort(key=lambda r: (r["step"], r["member"]))
    runs.atomic_write_bytes(rundir.file("metrics.jsonl"), "".join(json.dumps(r) + "\n" for r in rows).encode())
    files = ["config.json", "metrics.jsonl"]
    files += [p.relative_to(rundir.path).as_posix() for p in sorted(rundir.path.glob("ckpt/step_*"))]
    rundir.finalize(files, {"checkpoints": schedule, "parts": [list(b) for b in bounds],
                            "train_seconds": round(sum(m["train_seconds"] for m in manifests), 2)})
    _event(rundir, "run", "publish")
    import shutil

    shutil.rmtree(rundir.path / "parts", ignore_errors=True)


# ---------------------------------------------------------------- planning (train nothing)

_planning: "Plan | None" = None


class PlannedRun:
    """What `train()` returns while planning: the run's identity and size, nothing trained."""

    def __init__(self, rundir: runs.RunDir, model, tasks: list, tc: TrainConfig, fork_from, complete: bool):
        self.dir, self.path, self.model_config, self.train_config = rundir, rundir.path, model, tc
        self.tasks, self.fork_from, self.complete = tasks, fork_from, complete
        self.manifest: dict = {}

    def __repr__(self):
        return f"PlannedRun({self.dir.name}, key={self.key}, members={self.n_members})"

    key = property(lambda self: self.dir.key)
    n_members = property(lambda self: self.train_config.n_members)

    @property
    def start(self) -> int:
        return 0 if self.fork_from is None else int(self.fork_from[1])

    def checkpoint_steps(self) -> list[int]:
        return self.train_config.checkpoint_steps(self.start)

    def metrics(self):
        raise RuntimeError(f"{self.dir.name} is planned, not trained: it has no metrics")


class Plan:
    """The runs `train()` was asked for while planning, in order (`planning()`)."""

    def __init__(self):
        self.runs: list[PlannedRun] = []

    def add(self, rundir, full_config, model, tasks, tc, fork_from) -> PlannedRun:
        complete = rundir.check_complete()[0]
        planned = PlannedRun(rundir, model, tasks, tc, fork_from, complete)
        if all(r.key != planned.key or r.dir.name != rundir.name for r in self.runs):
            self.runs.append(planned)
        return planned


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

    tc = _member_slice(spec.tc, 0, 1)
    b = min(batch, tc.batch_size)
    with torch.random.fork_rng(devices=[]):
        ens = Ensemble(spec.model, tc.seeds, None, "cpu")
    sample = spec.tasks[0].train_batch(0, b, derive_seed("data", tc.seeds[0]))
    counter = FlopCounterMode(display=False)
    with counter:
        accumulate_gradients(ens, sample.tokens[None], sample.labels[None], spec.tasks[0].loss, replace(tc, micro_batch_size=None))
    return counter.get_total_flops() * tc.batch_size / b * spec.tc.n_members
