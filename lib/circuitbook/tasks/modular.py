"""Modular addition `a b =` -> (a + b) mod p, the grokking task.

Tokens: numbers 0..p-1 and `=` (token p). The label is read at the last
position. A seeded fraction of the p^2 pairs is the training set; the rest is
the test set. With `equals_token=False` the input is just `a b` (vocabulary p, the
label read at b's position), as in the algorithmic-cores paper.
"""
from __future__ import annotations

import torch

from .base import Batch, FixedDataset


class ModularAddition(FixedDataset):
    def __init__(self, p: int = 113, train_fraction: float = 0.3, split_seed: int = 0, equals_token: bool = True):
        if not (isinstance(p, int) and p >= 2):
            raise ValueError(f"p must be an integer >= 2, got {p!r}")
        if not 0 < train_fraction < 1:
            raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction!r}")
        if not isinstance(equals_token, bool):
            raise ValueError(f"equals_token must be True or False, got {equals_token!r}")
        self.p, self.train_fraction, self.split_seed = p, train_fraction, split_seed
        self.equals_token = equals_token
        a, b = torch.meshgrid(torch.arange(p), torch.arange(p), indexing="ij")
        a, b = a.flatten(), b.flatten()
        tokens = torch.stack([a, b, torch.full_like(a, p)] if equals_token else [a, b], dim=1)
        labels = (a + b) % p
        order = torch.randperm(p * p, generator=torch.Generator().manual_seed(split_seed))
        n_train = round(train_fraction * p * p)
        self.train_idx, self.test_idx = order[:n_train], order[n_train:]
        self.all = Batch(tokens, labels)
        super().__init__(tokens[self.train_idx], labels[self.train_idx], vocab_size=p + int(equals_token), n_outputs=p)

    @property
    def train(self) -> Batch:
        return Batch(self.tokens, self.labels)

    @property
    def test(self) -> Batch:
        return Batch(self.all.tokens[self.test_idx], self.all.labels[self.test_idx])

    def spec(self) -> dict:
        spec = {"task": "modular_addition", "p": self.p, "train_fraction": self.train_fraction,
                "split_seed": self.split_seed}
        return spec if self.equals_token else {**spec, "equals_token": False}  # older runs' keys stay
