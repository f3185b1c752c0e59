"""Counter-based random numbers for training batches: one vectorised call for every member of a run.

Every random word is a pure function of (member key, step, draw site, element), where an element is a
(row, column) of the batch. Nothing is carried from one step to the next and no member's words depend on
which other members share the call, so a resumed run, a run split into chunks of members and a run on
another device draw the very same batches.

The hash (integers only, the same on every device)
--------------------------------------------------
Words are 32-bit values held in int64 tensors. The mixer is Chris Wellons' `lowbias32`
(x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16, all mod 2^32), a bijection
of 32-bit integers with strong avalanche. Its second multiplier is applied as 0x846ca68b - 2^32, a negative
number of magnitude < 2^31: every product then has magnitude < 2^63, so no int64 operation overflows, and
`& 0xffffffff` of a negative product keeps its low 32 bits (two's complement, which C++20 guarantees and
every platform torch runs on uses). Shifts only ever see non-negative values. So the integers are exactly
defined on the CPU and on CUDA, and equal to the pure-Python definition `word()` below. Rows of `WIDE` words
or more mix their elements in int32 instead (`mix_int32`: the same bits, half the memory traffic, twice as
fast on a CPU); the words a sampler reads are int64 either way.

A state of two 32-bit lanes (a, b) absorbs one 32-bit word w as a <- mix(a ^ w), b <- mix(b ^ a). From fixed
initial lanes the state absorbs the member key's low and high halves (once, when the stream is built), the
step, then `site << 24 | row`; the element's word is mix(b ^ (column * (2 a + 1) mod 2^32)). Column 0
reads lane b, column 1 then fixes lane a (to its top bit), so two rows (of any members, steps or sites)
agree on their first two columns only if their states do (about 2^-63), not whenever one 32-bit lane does
(which, at 2^-32 a pair, would repeat some rows of a long run); and the odd multiplier keeps a row's
columns distinct inputs of the bijection `mix`. Limits, checked where the values are known on the host:
keys in [0, 2^64), steps in [0, 2^32), sites in [0, 256), rows in [0, 2^24), columns in [0, 2^16) (so
column * (2 a + 1) < 2^49).

Turning words into draws (no float arithmetic before the last step)
-------------------------------------------------------------------
`below(w, n)` = (w * n) >> 32 is uniform on [0, n) up to a relative bias below n / 2^32 (n <= 2^31);
`threshold(p)` is the host integer round(p * 2^32) and `w < threshold(p)` has probability p to 2^-32;
`categorical` compares a word with host-computed cumulative thresholds; `sort_keys` appends the column to
each word, so the keys of a row are distinct and `argsort` gives one permutation on every device (ties
would be ordered differently by the CPU's and CUDA's sorts); `uniform` is the only float conversion.

Capturing the training step in a CUDA graph
-------------------------------------------
A sampler built on this stream (every training task's `batch_sampler`) may be called with `step` a Python
int or a 0-dim int64 tensor on the training device. With a tensor step nothing reads a value back to the
host: no `.item()`/`.tolist()`, no `nonzero` or boolean-mask indexing, no shape or Python branch that
depends on a tensor's value; every shape depends only on (members, batch_size). Index tensors are cached
per shape on first use, so call the sampler once (a warm-up) with the batch size before capturing.
Samplers with `capturable = False` (the generic fallback for tasks that only implement `train_batch`)
work on the host and cannot be captured.
"""
from __future__ import annotations

import math
from itertools import accumulate
from typing import Sequence

import torch

MASK32 = 0xFFFF_FFFF
_MUL1 = 0x7FEB352D
_MUL2 = 0x846CA68B - (1 << 32)  # the same multiplier mod 2^32; |x * _MUL2| < 2^63 for x < 2^32
_IV = (0x243F6A88, 0x85A308D3)  # the initial lanes (digits of pi)
SITE_BITS, ROW_BITS = 8, 24
MAX_STEP = (1 << 32) - 1
MAX_ROWS = 1 << ROW_BITS
MAX_COLUMNS = 1 << 16
SORT_COLUMN_BITS = 16  # sort_keys: the column in the low 16 bits
WIDE = 4  # rows of at least this many words mix their elements in int32 (narrower rows: the conversions cost more)


def mix(x):
    """lowbias32 on 32-bit values: a Python int in [0, 2^32) or an int64 tensor of such values."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & MASK32
    return x ^ (x >> 16)


def mix_int32(x: torch.Tensor) -> torch.Tensor:
    """`mix` on an int32 tensor holding 32-bit values in two's complement (the value v as v - 2^32 when
    v >= 2^31): the same bits as `mix` of the int64 values. Products wrap mod 2^32 (the low 32 bits of the
    exact product, what every CPU and CUDA multiply of 32-bit integers gives), and the right shifts are
    masked to be logical. Twice as fast as the int64 form where the tensor is large (it streams half the bytes)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _MUL1
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _MUL2
    return x ^ ((x >> 16) & 0xFFFF)


def absorb(a, b, word):
    """The two-lane state (a, b) after absorbing one 32-bit word (ints or tensors)."""
    a = mix(a ^ word)
    return a, mix(b ^ a)


def key_state(key: int) -> tuple[int, int]:
    """The lanes after absorbing a member's key (its low, then its high 32 bits)."""
    if not (isinstance(key, int) and 0 <= key < 1 << 64):
        raise ValueError(f"a stream key must be an integer in [0, 2^64), got {key!r}")
    a, b = absorb(*_IV, key & MASK32)
    return absorb(a, b, key >> 32)


def check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be an integer in [0, 2^32) or a 0-dim int64 tensor, got {step!r}")
    return step


def word(key: int, step: int, site: int, row: int, column: int) -> int:
    """One random word, by the definition (plain integers): what `Stream.words` computes for every element."""
    if not (0 <= site < 1 << SITE_BITS and 0 <= row < MAX_ROWS and 0 <= column < MAX_COLUMNS):
        raise ValueError(f"site, row, column out of range: {site}, {row}, {column}")
    a, b = key_state(key)
    a, b = absorb(a, b, check_step(step))
    a, b = absorb(a, b, site << ROW_BITS | row)
    return mix(b ^ ((column * (2 * a + 1)) & MASK32))


class Stream:
    """The random words of K members (one key each) on one device: `words(step, site, rows, width)`."""

    def __init__(self, keys: Sequence[int], device: str | torch.device = "cpu"):
        states = [key_state(int(k)) for k in keys]
        if not states:
            raise ValueError("a stream needs at least one member key")
        self.device = torch.device(device)
        self.a = torch.tensor([s[0] for s in states], dtype=torch.long, device=self.device)
        self.b = torch.tensor([s[1] for s in states], dtype=torch.long, device=self.device)
        self._index: dict[tuple, torch.Tensor] = {}

    @property
    def n_members(self) -> int:
        return len(self.a)

    def step_tensor(self, step, most_dims: int = 1) -> "int | torch.Tensor":
        """A Python int (checked) or an int64 tensor on this device: 0-dim, [K] (one counter per member) or, with
        most_dims=2, [K, S] (S steps of each member)."""
        if torch.is_tensor(step):
            K = self.n_members
            if (step.dtype != torch.long or step.device != self.device or step.dim() > most_dims
                    or (step.dim() > 0 and len(step) != K)):
                shapes = f"0-dim, [{K}]" + (f" or [{K}, S]" if most_dims == 2 else "")
                raise ValueError(f"step must be a {shapes} int64 tensor on {self.device}, got "
                                 f"{step.dtype} {tuple(step.shape)} on {step.device}")
            return step
        return check_step(step)

    def arange(self, n: int, offset: int = 0) -> torch.Tensor:
        """offset + arange(n) on this device, cached (cached tensors must exist before a CUDA graph capture)."""
        key = (n, offset)
        if key not in self._index:
            self._index[key] = torch.arange(offset, offset + n, dtype=torch.long, device=self.device)
        return self._index[key]

    def words(self, step, site: int, rows: int, width: int) -> torch.Tensor:
        """[K, S * rows, width] words: element (k, s * rows + r, c) is word(key_k, step_s, site, r, c).

        step: an int or a 0-dim int64 tensor (S = 1), a [K] int64 tensor (one step per member, S = 1), a list of
        ints (S steps, rows step-major: several steps' batches in one call), or a [K, S] int64 tensor (S steps
        of each member's own).
        """
        if not (0 <= site < 1 << SITE_BITS and 1 <= rows <= MAX_ROWS and 1 <= width <= MAX_COLUMNS):
            raise ValueError(f"site in [0, 256), rows in [1, 2^24] and width in [1, 2^16] needed, got {site}, {rows}, "
                             f"{width}")
        if isinstance(step, (list, tuple, range)):
            step = torch.tensor([check_step(s) for s in step], dtype=torch.long, device=self.device)
        else:
            step = self.step_tensor(step, most_dims=2)
            step = step[:, None] if torch.is_tensor(step) and step.dim() == 1 else step
        a, b = absorb(self.a[:, None], self.b[:, None], step)  # [K, S]
        a, b = absorb(a[:, :, None], b[:, :, None], self.arange(rows, site << ROW_BITS))  # [K, S, rows]
        a, b = a.flatten(1), b.flatten(1)
        if width < WIDE:
            return mix(b[:, :, None] ^ ((self.arange(width) * (2 * a + 1)[:, :, None]) & MASK32))
        # the same words in int32 arithmetic (half the bytes an op moves): see `mix_int32`
        columns = self.arange(width).to(torch.int32)
        x = mix_int32(b.to(torch.int32)[:, :, None] ^ (columns * (2 * a + 1).to(torch.int32)[:, :, None]))
        return x.long() & MASK32


# ---------------------------------------------------------------- words -> draws

def below(words: torch.Tensor, n) -> torch.Tensor:
    """Uniform integers in [0, n) (n an int or an int64 tensor broadcastable to words, 1 <= n <= 2^31)."""
    return (words * n) >> 32


def threshold(p: float) -> int:
    """The integer t with P(word < t) = p (to 2^-32): round(p * 2^32), for p in [0, 1]."""
    if not (isinstance(p, (int, float)) and 0.0 <= p <= 1.0):
        raise ValueError(f"a probability in [0, 1] is needed, got {p!r}")
    return min(1 << 32, max(0, round(float(p) * 2.0 ** 32)))


def cumulative_thresholds(probs: Sequence[float]) -> list[int]:
    """The C - 1 integer thresholds of a categorical law over C outcomes (probabilities summing to 1):
    outcome i is drawn when the word lies in [t_{i-1}, t_i)."""
    probs = [float(p) for p in probs]
    total = math.fsum(probs)
    if not probs or min(probs) < 0 or not math.isclose(total, 1.0, rel_tol=0, abs_tol=1e-9):
        raise ValueError(f"probabilities must be >= 0 and sum to 1, got {probs}")
    return [threshold(min(1.0, c / total)) for c in accumulate(probs)][:-1]


def categorical(words: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """Outcomes of categorical laws: thresholds [..., C - 1] (`cumulative_thresholds`), broadcast with words."""
    return (words.unsqueeze(-1) >= thresholds).sum(-1)


def sort_keys(words: torch.Tensor) -> torch.Tensor:
    """Distinct int64 keys along the last dim (word above, column below): argsort is a uniform permutation,
    the same on every device."""
    width = words.shape[-1]
    if width > 1 << SORT_COLUMN_BITS:
        raise ValueError(f"sort_keys: at most 2^16 columns, got {width}")
    return (words << SORT_COLUMN_BITS) | torch.arange(width, device=words.device)


def bits(words: torch.Tensor, n: int) -> torch.Tensor:
    """n fair bits from the last dim's words (32 per word): [..., n] int64 in {0, 1}."""
    if n > 32 * words.shape[-1]:
        raise ValueError(f"bits: {n} bits need {math.ceil(n / 32)} words, got {words.shape[-1]}")
    j = torch.arange(n, device=words.device)
    return (words[..., j // 32] >> (j % 32)) & 1


def uniform(words: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in [0, 1) with 24 bits (exactly representable)."""
    return (words >> 8).to(torch.float32) * (1.0 / (1 << 24))
