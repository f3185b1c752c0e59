"""The chapter's evaluation callbacks (`training.Evaluator` subclasses); their module is part of the key of the
runs they evaluate, so it holds nothing else: editing a measurement retrains nothing.

    NextTokenAccuracy   every-position next-token accuracy (the Markov runs, notebook 02)
    modular_evaluate    last-position accuracy on the train and test pairs (grokking and the sweeps)
"""
from __future__ import annotations

import torch

from ...tasks.base import Batch
from ...tasks.modular import ModularAddition
from ...training import Evaluator, pool_accuracy


class NextTokenAccuracy(Evaluator):
    """`acc_<pool>` [K]: the next-token accuracy of every member over every position of each pool (the base
    `Evaluator` scores the last position only; a Markov model predicts at every one)."""

    def __init__(self, pools: dict[str, Batch]):
        bad = [name for name, pool in pools.items() if not isinstance(pool, Batch)]
        if bad:
            raise ValueError(f"pools {bad} must be one Batch each (every member reads the same sequences)")
        super().__init__(pools)

    def settings(self) -> dict:
        return {"positions": "all"}

    @torch.no_grad()
    def __call__(self, ens, step: int) -> dict:
        out = {}
        for name, batch in self.pools.items():
            pred = ens.logits(batch.tokens).argmax(-1)  # [K, B, T]
            out[self.prefix + name] = (pred == batch.labels).float().mean((-1, -2))
        out.update(self.measures(ens, step))
        return out


def modular_evaluate(task: ModularAddition) -> Evaluator:
    """Last-position accuracy on the task's training and test pairs: `acc_train`, `acc_test`."""
    return pool_accuracy({"train": task.train, "test": task.test})
