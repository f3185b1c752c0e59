"""What every task gives the training loop: batches of tokens and labels.

Batches are a pure function of (seed, step): the loop never carries a data
iterator, so a run resumed from a checkpoint draws exactly the batches an
uninterrupted run would have drawn.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

import torch

IGNORE_INDEX = -100  # label value skipped by the next-token loss


@dataclass
class Batch:
    tokens: torch.Tensor  # [batch, pos] int64
    labels: torch.Tensor  # [batch] for loss="last", [batch, pos] for loss="next_token"


class Task(Protocol):
    vocab_size: int  # input vocabulary
    n_outputs: int  # output classes (unembedding width)
    seq_len: int
    loss: str  # "last" (classify at the last position) or "next_token"

    def train_batch(self, step: int, batch_size: int, seed: int) -> Batch: ...


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed that depends on every part (stable across processes)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator for the batch of one training step of one member."""
    return torch.Generator().manual_seed(derive_seed("batch", seed, step))


class FixedDataset:
    """A finite training set, shuffled once per epoch.

    batch_size >= len(dataset) means full-batch training. Epoch e's order is a
    permutation drawn from (seed, e), so the batch of any step is computable
    without replaying earlier steps.
    """

    def __init__(self, tokens: torch.Tensor, labels: torch.Tensor, *, vocab_size: int,
                 n_outputs: int, loss: str = "last"):
        if len(tokens) != len(labels):
            raise ValueError(f"tokens ({len(tokens)}) and labels ({len(labels)}) differ in length")
        if loss not in ("last", "next_token"):
            raise ValueError(f"loss must be 'last' or 'next_token', got {loss!r}")
        self.tokens, self.labels = tokens.long(), labels.long()
        self.vocab_size, self.n_outputs, self.loss = vocab_size, n_outputs, loss
        self.seq_len = tokens.shape[1]

    def __len__(self) -> int:
        return len(self.tokens)

    def steps_per_epoch(self, batch_size: int) -> int:
        return max(1, -(-len(self) // batch_size))

    def train_batch(self, step: int, batch_size: int, seed: int) -> Batch:
        n = len(self)
        if batch_size >= n:
            return Batch(self.tokens, self.labels)
        per_epoch = self.steps_per_epoch(batch_size)
        epoch, i = divmod(step, per_epoch)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed("epoch", seed, epoch)))
        idx = order[i * batch_size:(i + 1) * batch_size]
        return Batch(self.tokens[idx], self.labels[idx])
