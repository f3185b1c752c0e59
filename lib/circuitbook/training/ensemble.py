"""K models trained as one: stacked parameters under `torch.func.vmap`, their optimizer, and the step.

Members share nothing, so the gradient of the summed loss is each member's own gradient. `train_step`
is the one training step of the book: the loop, the chunk calibration and the FLOP count all take it,
so a change to it (a schedule, clipping) changes all three alike. `data_sampler` is the one way a
run's batches are drawn: built once per run on the training device, it makes every member's batch of a
step in one call, each a pure function of (member seed, step), which is what makes a resumed run (or one
split into chunks of members) end with the numbers of an uninterrupted one.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Sequence

import torch
from torch.func import functional_call, stack_module_state, vmap

from ..tasks.base import IGNORE_INDEX, BatchSampler, data_key, make_sampler
from .config import TrainConfig

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
        # the step count lives on the device, with the bias corrections computed from it there, so that a step
        # replayed from a CUDA graph (training.capture) counts like an eager one; float64 keeps Adam's
        # corrections those of a Python float
        self._t = torch.zeros((), dtype=torch.float64, device=device)
        self.exp_avg = {n: torch.zeros_like(p) for n, p in self.params.items()} if self.kind == "adamw" else {}
        self.exp_avg_sq = {n: torch.zeros_like(p) for n, p in self.params.items()} if self.kind == "adamw" else {}

    @staticmethod
    def _per_member(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return v.view(-1, *([1] * (like.dim() - 1)))

    @property
    def t(self) -> int:
        """Optimizer steps taken (read from the device: for checkpoints, not for every step)."""
        return int(self._t.item())

    @t.setter
    def t(self, value: int) -> None:
        self._t.fill_(float(value))

    @torch.no_grad()
    def step(self) -> None:
        """One step of every member; nothing here reads the device back, so the step can be captured."""
        self._t.add_(1)
        b1, b2 = self.betas
        bias1, bias2 = 1 - torch.pow(b1, self._t), 1 - torch.pow(b2, self._t)
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
            denom = (v / bias2).sqrt_().add_(self.eps)
            p.sub_(lr / bias1 * m / denom)

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


def accumulate_gradients(ens: Ensemble, tokens: torch.Tensor, labels: torch.Tensor, kind: str,
                         tc: TrainConfig, autocast_cache: bool = True) -> torch.Tensor:
    """Backpropagate each member's mean loss over the whole batch; return the losses [K].

    With `micro_batch_size` the batch is processed in slices whose summed losses are divided
    by the whole batch's count of scored labels, so the accumulated gradient is the full
    batch's (one optimizer step per batch, as without slicing), at a slice's memory.
    """
    size = tokens.shape[1]
    step = tc.micro_batch_size or size
    total = scored_labels(labels).clamp(min=1).to(torch.float32)
    losses = torch.zeros_like(total)
    # a step captured in a CUDA graph must not keep autocast's cache of cast weights (they would be stale)
    autocast = torch.autocast(ens.device.type, dtype=torch.bfloat16, enabled=tc.precision == "bf16",
                              cache_enabled=autocast_cache)
    for start in range(0, size, step):
        with autocast:
            logits = ens.logits(tokens[:, start:start + step], last_only=kind == "last", training=True)
        summed, _ = vmap(partial(summed_loss, kind=kind))(logits, labels[:, start:start + step])
        part = summed / total
        part.sum().backward()
        losses += part.detach()
    return losses


def train_step(ens: Ensemble, opt: Optimizer, tokens: torch.Tensor, labels: torch.Tensor, kind: str,
               tc: TrainConfig, autocast_cache: bool = True) -> torch.Tensor:
    """One optimizer step of every member on its batch; returns the losses [K]."""
    opt.zero_grad()
    losses = accumulate_gradients(ens, tokens, labels, kind, tc, autocast_cache)
    opt.step()
    return losses


def data_sampler(tasks: Sequence, seeds: Sequence[int], device: str | torch.device = "cpu") -> BatchSampler:
    """The batches of members with `seeds` (one task each): `sampler(step, batch_size)` -> tokens and labels
    [K, B, ...] on `device`, member k's from the stream keyed by `data_key(seeds[k])` (`tasks.base`)."""
    return make_sampler(tasks, [data_key(s) for s in seeds], device)
