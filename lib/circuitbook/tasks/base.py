"""What every task gives the training loop: the batches of every member of a run, made on its device.

A run's batches are a pure function of (member key, step): the loop never carries a data iterator, so a
run resumed from a checkpoint, or split into chunks of members, draws exactly the batches an uninterrupted
run in one piece would have drawn. A member's key is `data_key(seed)`.

`make_sampler(tasks, keys, device)` builds, once per run, the callable `sampler(step, batch_size)` ->
(tokens [K, B, T], labels [K, B] or [K, B, T]) on the training device. A task class that defines the
classmethod `batch_sampler(tasks, keys, device)` makes all its members' batches in one vectorised call from
the counter-based stream of `tasks.draws` (capturable in a CUDA graph: see that module's docstring); asked
for one int step at a time, such a sampler makes a few steps' batches per call (`Prefetch`). A task that
only implements `train_batch(step, batch_size, key)` goes through `StackedSampler`, its batches made member
by member on the host. For the book's tasks `train_batch` is the sampler's batch of one member (what
notebooks read as "the batches this member trained on"); `reference_batch` is the batch the book drew before
issue 36 (a `torch.Generator` per member and step): the same distribution by other code, which the tests
and `benchmarks/data.py` compare the sampler with.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from .draws import MAX_STEP, Stream, check_step

IGNORE_INDEX = -100  # label value skipped by the loss (next-token positions, padded rows)
SITE_EPOCH = 1  # the stream site of a fixed dataset's epoch orders


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


class BatchSampler(Protocol):
    """The batches of K members: `sampler(step, batch_size)` -> (tokens [K, B, T], labels), on its device."""

    capturable: bool  # True: no host work, a 0-dim int64 device tensor as `step` (CUDA-graph capture)

    def __call__(self, step, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed that depends on every part (stable across processes)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def data_key(seed: int) -> int:
    """The key of a member's batches (its stream), from the member's seed."""
    return derive_seed("data", seed)


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator of one member's batch at one step before issue 36 (`reference_batch`)."""
    return torch.Generator().manual_seed(derive_seed("batch", seed, step))


def make_sampler(tasks: Sequence, keys: Sequence[int], device: str | torch.device = "cpu") -> BatchSampler:
    """The sampler of members with these tasks (one each) and stream keys: the tasks' batched sampler when
    they are all of one class that has one, else the generic `StackedSampler`."""
    if len(tasks) != len(keys) or not tasks:
        raise ValueError(f"make_sampler: {len(tasks)} tasks for {len(keys)} keys; give one task per key")
    cls = type(tasks[0])
    build = getattr(cls, "batch_sampler", None)
    if build is None or any(type(t) is not cls for t in tasks):
        return StackedSampler(tasks, keys, device)
    sampler = build(list(tasks), list(keys), device)
    return Prefetch(sampler, len(tasks)) if getattr(sampler, "multi_step", False) else sampler


def check_batch_size(batch_size) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    return batch_size


def steps_per_epoch(n_rows: int, batch_size: int) -> int:
    """Steps of one epoch of n_rows rows at this batch size (the last batch short; a batch >= n_rows is one)."""
    return max(1, -(-n_rows // batch_size))


def one_member_batch(task, step: int, batch_size: int, key: int) -> Batch:
    """Member `key`'s batch at `step`, as the task's batched sampler makes it (on the CPU)."""
    tokens, labels = type(task).batch_sampler([task], [key], "cpu")(check_step(step), check_batch_size(batch_size))
    return Batch(tokens[0], labels[0])


class StackedSampler:
    """The generic sampler: every member's `train_batch(step, batch_size, key)` on the host, stacked and moved
    to the device (today's tasks outside the book: tests' toy tasks, a user's task). Not capturable."""

    capturable = False

    def __init__(self, tasks: Sequence, keys: Sequence[int], device: str | torch.device = "cpu"):
        self.tasks, self.keys, self.device = list(tasks), [int(k) for k in keys], torch.device(device)

    def __call__(self, step, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        step = int(step)  # a tensor step is read back: this sampler works on the host anyway
        batches = [t.train_batch(step, batch_size, k) for t, k in zip(self.tasks, self.keys)]
        return (torch.stack([b.tokens for b in batches]).to(self.device),
                torch.stack([b.labels for b in batches]).to(self.device))


class Prefetch:
    """A sampler that accepts a list of steps (`multi_step`: rows [K, S * B, ...], step-major), asked for
    one int step at a time: it makes the batches of the next few steps in one call (about ROWS rows, at most
    AHEAD steps) and serves them one by one, so the fixed cost of a call (the Python and the launches of its
    ops) is paid once per block. Every batch is a pure function of (key, step), so a block's batches are
    those of its steps made one at a time; a tensor step (a captured step) makes its own batch. The batches
    served are views of the block: read them, do not write into them."""

    ROWS, AHEAD = 16384, 32

    def __init__(self, sampler, n_members: int):
        self.sampler, self.n_members, self.capturable = sampler, n_members, sampler.capturable
        self._block: tuple = (None, -1, 0, None)  # (batch size, first step, steps, (tokens, labels) [S, K, B, ...])

    def __getattr__(self, name):
        return getattr(self.__dict__["sampler"], name)

    def ahead(self, batch_size: int) -> int:
        """How many steps one call makes at this batch size."""
        return max(1, min(self.AHEAD, self.ROWS // (self.n_members * batch_size)))

    def __call__(self, step, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.is_tensor(step):
            return self.sampler(step, batch_size)
        step, B = check_step(step), check_batch_size(batch_size)
        size, first, count, made = self._block
        if size != B or not first <= step < first + count:
            steps = list(range(step, min(step + self.ahead(B), MAX_STEP + 1)))
            K, S = self.n_members, len(steps)
            made = tuple(x.view(K, S, B, *x.shape[2:]).transpose(0, 1).contiguous() for x in self.sampler(steps, B))
            size, first, count = B, step, S
            self._block = (size, first, count, made)
        return made[0][step - first], made[1][step - first]


# ---------------------------------------------------------------- a finite training set

class FixedDataset:
    """A finite training set, shuffled once per epoch.

    batch_size >= len(dataset) means full-batch training (the rows in their order). Otherwise epoch e of a
    member is the permutation of the rows sorted by their stream words at (member key, step = e, site
    SITE_EPOCH, row), and step s takes positions [i B, (i + 1) B) of epoch s // P, i = s % P, P = ceil(n / B)
    steps per epoch: every row exactly once per epoch, any step's batch computable without replaying the
    earlier ones. Batches have one shape: the last batch of an epoch (n mod B rows) is padded to B rows
    whose labels are IGNORE_INDEX, so the loss and its gradient are those of the short batch.
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
        return steps_per_epoch(len(self), batch_size)

    @classmethod
    def batch_sampler(cls, tasks: Sequence["FixedDataset"], keys: Sequence[int],
                      device: str | torch.device = "cpu") -> "EpochSampler":
        return EpochSampler(tasks, keys, device)

    def train_batch(self, step: int, batch_size: int, seed: int) -> Batch:
        """The rows of step `step` for the member with key `seed` (the last batch of an epoch unpadded)."""
        batch = one_member_batch(self, step, batch_size, seed)
        if batch_size >= len(self):
            return batch
        rows = min(batch_size, len(self) - (step % self.steps_per_epoch(batch_size)) * batch_size)
        return Batch(batch.tokens[:rows], batch.labels[:rows])

    def reference_batch(self, step: int, batch_size: int, seed: int) -> Batch:
        """The batch before issue 36: epoch e's order a torch.randperm seeded from (seed, e)."""
        n = len(self)
        if batch_size >= n:
            return Batch(self.tokens, self.labels)
        epoch, i = divmod(step, self.steps_per_epoch(batch_size))
        order = torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed("epoch", seed, epoch)))
        idx = order[i * batch_size:(i + 1) * batch_size]
        return Batch(self.tokens[idx], self.labels[idx])


EPOCH_WINDOW_STEPS = 256  # int steps whose epoch orders are made in one call: its ~20 small ops amortised
EPOCH_WINDOW_IDS = 1 << 21  # ... holding at most this many row ids (16 MiB); a bigger epoch is one per call


class EpochSampler:
    """FixedDataset batches of K members (one dataset each, possibly one shared object), on one device.

    The members' datasets are stacked into one table of rows (padded to the longest) plus a padding row (token 0,
    labels IGNORE_INDEX); a batch is the table's rows at [K, B] ids. Epoch orders are argsorts of distinct
    integer keys ((word << 24) | row), so every device computes the same permutation. With an int step the
    row ids of a window of E consecutive epochs are made in one call and cached (a pure function of (key,
    epoch): the window changes how often orders are made, never a batch), so a step is one slice and two
    index_selects; with a tensor step they are recomputed each call, branch-free.
    """

    capturable = True

    def __init__(self, tasks: Sequence[FixedDataset], keys: Sequence[int], device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        unique = list({id(t): t for t in tasks}.values())
        where = {id(t): i for i, t in enumerate(unique)}
        shapes = {(t.tokens.shape[1:], t.labels.shape[1:], t.loss) for t in unique}
        if len(shapes) != 1:
            raise ValueError(f"the members' datasets differ in sequence shape or loss: {sorted(map(str, shapes))}")
        self.sizes = [len(t) for t in tasks]
        self.n_max = max(self.sizes)
        self.stream = Stream(keys, self.device)
        pad = lambda x, fill: torch.cat([x, torch.full((self.n_max - len(x), *x.shape[1:]), fill)])  # noqa: E731
        self.tokens = torch.cat([pad(t.tokens, 0) for t in unique]
                                + [torch.zeros_like(unique[0].tokens[:1])]).to(self.device)
        self.labels = torch.cat([pad(t.labels, IGNORE_INDEX) for t in unique]
                                + [torch.full_like(unique[0].labels[:1], IGNORE_INDEX)]).to(self.device)
        self.pad_row = len(unique) * self.n_max  # the padding row: labels IGNORE_INDEX
        self.first = torch.tensor([where[id(t)] * self.n_max for t in tasks], device=self.device)  # member's rows
        self.size = torch.tensor(self.sizes, device=self.device)
        self._per_epoch: dict[int, torch.Tensor] = {}
        self._window: tuple = (None, None, None)  # (batch size, first epochs, row ids [K, E * P * B] of the window)
        self._full = None

    def _orders(self, epochs: torch.Tensor) -> torch.Tensor:
        """[K, E, n_max] row orders of the members' epochs [K, E] (padding rows last)."""
        words = self.stream.words(epochs, SITE_EPOCH, self.n_max, 1)[..., 0].view(*epochs.shape, self.n_max)
        rows = self.stream.arange(self.n_max)
        keys = torch.where(rows < self.size[:, None, None], (words << 24) | rows, 1 << 62)
        return keys.argsort(-1)

    def _ids(self, orders: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Table row ids [K, E, m] of positions pos [K, E, m] of those epochs (the padding row past a member's rows)."""
        row = orders.gather(-1, pos.clamp(max=self.n_max - 1))
        return torch.where(pos < self.size[:, None, None], self.first[:, None, None] + row, self.pad_row)

    def steps_per_epoch(self, batch_size: int) -> list[int]:
        return [steps_per_epoch(n, batch_size) for n in self.sizes]

    def window_epochs(self, batch_size: int) -> int:
        """E: the epochs whose orders one call makes for int steps (at least EPOCH_WINDOW_STEPS steps of the
        shortest epoch, at most EPOCH_WINDOW_IDS row ids)."""
        per_epoch = self.steps_per_epoch(batch_size)
        most_ids = len(self.sizes) * max(per_epoch) * batch_size
        return max(1, min(-(-EPOCH_WINDOW_STEPS // min(per_epoch)), EPOCH_WINDOW_IDS // most_ids))

    def _step_ids(self, step, B: int) -> torch.Tensor:
        per_epoch = self.steps_per_epoch(B)
        if torch.is_tensor(step):
            if B not in self._per_epoch:
                self._per_epoch[B] = torch.tensor(per_epoch, device=self.device)
            per, step = self._per_epoch[B], self.stream.step_tensor(step)
            epoch, pos = step // per, (step % per)[:, None] * B + self.stream.arange(B)
            return self._ids(self._orders(epoch[:, None]), pos[:, None])[:, 0]
        step, P, E = check_step(step), max(per_epoch), self.window_epochs(B)
        epochs = [step // p for p in per_epoch]
        starts = tuple(e - e % E for e in epochs)
        if self._window[:2] != (B, starts):
            first = torch.tensor(starts, device=self.device)[:, None] + self.stream.arange(E)
            span = self.stream.arange(P * B).expand(len(self.sizes), E, -1)
            self._window = (B, starts, self._ids(self._orders(first), span).flatten(1))
        offsets = [((e - s) * P + step % p) * B for e, s, p in zip(epochs, starts, per_epoch)]
        ids = self._window[2]
        if len(set(offsets)) == 1:  # every member at the same place of its window (one dataset size): a slice
            return ids[:, offsets[0]:offsets[0] + B]
        return ids.gather(1, torch.tensor(offsets, device=self.device)[:, None] + self.stream.arange(B))

    def __call__(self, step, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        B = check_batch_size(batch_size)
        K = len(self.sizes)
        if B >= self.n_max and len(set(self.sizes)) == 1:  # full batch: every row, in its order
            if self._full is None:
                ids = (self.first[:, None] + self.stream.arange(self.n_max)).flatten()
                self._full = (self.tokens.index_select(0, ids).view(K, self.n_max, *self.tokens.shape[1:]),
                              self.labels.index_select(0, ids).view(K, self.n_max, *self.labels.shape[1:]))
            return self._full
        ids = self._step_ids(step, B).reshape(-1)
        return (self.tokens.index_select(0, ids).view(K, B, *self.tokens.shape[1:]),
                self.labels.index_select(0, ids).view(K, B, *self.labels.shape[1:]))
