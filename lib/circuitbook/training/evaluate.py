"""Evaluation callbacks of `train()`: pools in, per-member metrics out, identified by a digest.

A callback is called as `evaluate(ens, step) -> {metric: tensor [K]}` every `eval_every` steps and
must say what it is through `spec()`, which enters the run's key (with the source of the module that
defines its class). `Evaluator` is the one base: it scores the last position of every pool for every
member and digests the pools itself, so a chapter's callback only adds its own measures.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Mapping, Sequence

import torch

from ..tasks.base import Batch
from .ensemble import Ensemble

EvalFn = Callable[[Ensemble, int], dict]
CHUNK = 2048  # sequences per forward pass while evaluating (memory, not numbers)


def tensor_digest(*tensors: torch.Tensor) -> str:
    """A short SHA-256 of tensors' bytes: what identifies data in a run key."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


class Evaluator:
    """Last-position accuracy of every member on every pool: `acc_<name>` [K] (and `loss_<name>`, the mean
    cross-entropy there, with `loss=True`), plus whatever `measures(ens, step)` adds.

    pools: {name: Batch} read by every member, or {name: [Batch per member]} for per-member data (a sweep
    whose members train on different pair splits); per-member batches of different lengths are padded and
    the padding is not counted. A subclass adds measures by overriding `measures`, and the settings that
    change them by overriding `settings()` (both enter `spec()`, part of the run key).
    """

    prefix = "acc_"

    def __init__(self, pools: Mapping[str, Batch | Sequence[Batch]], loss: bool = False):
        self.pools = dict(pools)
        self.loss = loss

    # -- identity ---------------------------------------------------------
    def settings(self) -> dict:
        return {}

    def spec(self) -> dict:
        def digest(pool):
            if isinstance(pool, Batch):
                return tensor_digest(pool.tokens, pool.labels)
            return [tensor_digest(b.tokens, b.labels) for b in pool]

        return {"evaluator": type(self).__qualname__, "pools": {k: digest(v) for k, v in self.pools.items()},
                "prefix": self.prefix, "loss": self.loss, **self.settings()}

    # -- the call ---------------------------------------------------------------
    def measures(self, ens: Ensemble, step: int) -> dict:
        """Metrics beyond the pools' accuracy: {name: tensor [K]} (none here)."""
        return {}

    @torch.no_grad()
    def __call__(self, ens: Ensemble, step: int) -> dict:
        out = {}
        for name, pool in self.pools.items():
            tokens, labels, keep = self._stacked(pool, ens.members)
            logits = torch.cat([ens.logits(tokens[..., i:i + CHUNK, :], last_only=True)[:, :, -1]
                                for i in range(0, tokens.shape[-2], CHUNK)], 1)  # [K, B, V]
            count = keep.sum(-1).clamp(min=1)
            out[self.prefix + name] = ((logits.argmax(-1) == labels).float() * keep).sum(-1) / count
            if self.loss:
                nll = -logits.float().log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
                out[f"loss_{name}"] = (nll * keep).sum(-1) / count
        out.update(self.measures(ens, step))
        return out

    @staticmethod
    def _stacked(pool, members: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens [B, T] or [K, B, T], labels [K, B], keep [K, B]) of one pool for the ensemble's members."""
        k = len(members)
        if isinstance(pool, Batch):
            n = len(pool.labels)
            return pool.tokens, pool.labels.expand(k, n), torch.ones(k, n)
        batches = [pool[m] for m in members]  # a part of a run split into chunks holds only some members
        n = max(len(b.labels) for b in batches)
        tokens = torch.stack([_pad(b.tokens, n) for b in batches])
        labels = torch.stack([_pad(b.labels, n) for b in batches])
        keep = torch.stack([torch.arange(n) < len(b.labels) for b in batches]).float()
        return tokens, labels, keep


def _pad(t: torch.Tensor, n: int) -> torch.Tensor:
    if len(t) == n:
        return t
    if len(t) == 0:
        return torch.zeros((n, *t.shape[1:]), dtype=t.dtype)
    reps = -(-n // len(t))
    return t.repeat(reps, *([1] * (t.dim() - 1)))[:n]


def pool_accuracy(pools: Mapping[str, Batch | Sequence[Batch]], prefix: str = "acc_") -> Evaluator:
    """An `Evaluator` of `pools` (the callback most runs need)."""
    ev = Evaluator(pools)
    ev.prefix = prefix
    return ev
