"""A sampler's call on a CPU made in pieces that fit the cache: the same batches, made faster.

A batched sampler makes the rows of K members x S steps in one call. On a CPU its elementwise ops then
stream every intermediate tensor through memory once per op (16,000 rows of 97 words are 12 MB an op); in
pieces of about `PIECE_BYTES` they stay in the cache. A piece costs its ops' fixed overhead (some hundred
ops), so a call whose rows are few or narrow is made whole. Every row is a pure function of (member key,
step, row), so a piece of members or of steps makes exactly the rows the whole call would.

A tensor step (a captured step) and a call on a GPU (where one large call is what keeps the device busy)
are made whole.
"""
from __future__ import annotations

import copy
from typing import Callable

import torch

from . import draws

PIECE_BYTES = 2 ** 22  # 4 MB of words a piece: on this 2-core EPYC (1 MB L2 a core, 32 MB L3) 2-4 MB were fastest, 256 kB 2x slower


def made_in_chunks(make: Callable, n_members: int, step, batch_size: int, device: torch.device,
                   row_bytes: int) -> tuple[torch.Tensor, ...]:
    """make(lo, hi, steps) -> tensors [hi - lo, len(steps) * B, ...] of members lo..hi-1 (steps: a list of ints,
    or `step` itself when the call is made whole); returns those of every member and step, [K, S * B, ...].
    row_bytes: the bytes of one row's largest intermediate (its words), which sets the rows of a piece."""
    if torch.is_tensor(step) or torch.device(device).type != "cpu":
        return make(0, n_members, step)
    steps = list(step) if isinstance(step, (list, tuple, range)) else [step]
    K, B, S = n_members, batch_size, len(steps)
    rows = max(1, PIECE_BYTES // row_bytes)
    if K * B * S <= rows:
        return make(0, K, step)
    if K * B <= rows:  # whole steps, several at a time
        per = rows // (K * B)
        pieces = [(0, K, i, steps[i:i + per]) for i in range(0, S, per)]
    else:  # one step, a few members at a time
        per = max(1, rows // B)
        pieces = [(lo, min(K, lo + per), i, steps[i:i + 1]) for i in range(S) for lo in range(0, K, per)]
    out = None
    for lo, hi, i, chunk in pieces:
        made = make(lo, hi, chunk)
        if out is None:
            out = tuple(torch.empty((K, S * B, *m.shape[2:]), dtype=m.dtype, device=m.device) for m in made)
        for whole, part in zip(out, made):
            whole[lo:hi, i * B:(i + len(chunk)) * B] = part
    return out


def member_stream(stream: draws.Stream, lo: int, hi: int) -> draws.Stream:
    """The stream of members lo..hi-1 of `stream` (their lanes; the cached index tensors shared)."""
    part = copy.copy(stream)
    part.a, part.b = stream.a[lo:hi], stream.b[lo:hi]
    return part
