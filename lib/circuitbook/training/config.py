"""How to train: `TrainConfig`, validated and frozen. Part of every run's key (code and values)."""
from __future__ import annotations

from dataclasses import dataclass

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
