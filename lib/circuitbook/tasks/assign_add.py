"""Assign and Add: variable binding composed with modular addition.

Exoo, Bietti, Sous, "Assign and Add: a mechanistic study of compositional
arithmetic" (arXiv 2605.31497). Chapter `assign_add` of PAPERS.md.

The sequences
-------------
Modulus N = 59. Tokens: the numbers 0..N-1, `+` (N), `=` (N+1), PAD (N+2) and
twelve variables `a`..`l` (N+3..N+14): 74 tokens at N = 59. Every sequence has
16 tokens: a 12-token prefix of 1..6 assignments `var value` (each two
contiguous tokens, in random order, the spare positions filled by PAD tokens
scattered at random between and around them), then the query core
`+ lhs rhs =` in prefix notation. The model classifies over the N numbers at
the last position; the label is (n1 + n2) mod N, where a variable operand
takes its assigned value:

    PAD PAD a 40 PAD j 18 PAD PAD PAD k 9 + a 27 =   ->   (40 + 27) mod 59 = 8

Four sequence types: 0-var `+ n m =` (every assignment is a distractor),
1-var-left `+ x m =`, 1-var-right `+ n x =`, 2-var `+ x y =` (x != y: with
x == y the two operand values could not be chosen independently, so the row
universe below would not be a product). A variable is assigned at most once
per sequence, every queried variable is assigned, distractors get uniform
random values.

What a "row" is, and why the training universe has 102,312 rows
----------------------------------------------------------------
The universe of rows is (variable, type, n1, n2) with n1, n2 the VALUES of the
two operands: 12 x 4 x 59 x 59 = 167,088 rows. Two rules hold data out:

* held-out pairs: floor(f * 3481) of the (n1, n2) pairs are training pairs
  (2,436 at f = 0.7; 0.7 * 3481 = 2436.7, so the authors truncate - rounding
  would give 2,437); a row whose pair is not a training pair is held out in
  every type. Which pairs (`pair_split`): "authors" is the authors' split,
  Python's `random.Random(split_seed).sample(pairs, n_train)` over the
  lexicographic list `[(a, b) for a in range(N) for b in range(N)]` (at
  split_seed 42 and f = 0.7 exactly the pairs their released checkpoints were
  trained on); "book" is this library's first split, a seeded torch
  permutation cut at n_train; a file lists the training pairs themselves (one
  `n1 n2` or `n1,n2` per line, or a JSON list of [n1, n2]), so an external
  checkpoint is evaluated on its own held-out pairs;
* held-out positions: `a`, `b` are never the right operand in training, `k`,
  `l` never the left operand, in 1-var and 2-var rows alike, operand by
  operand: a 2-var training query `+ x y =` has x in a..j, y in c..l and
  x != y, 10 x 10 - 8 = 92 ordered variable pairs.

102,312 = 2,436 x 42, so each training pair carries 42 of the 48 (variable,
type) combinations:

* 0-var: the row's variable is a distractor that the prefix is guaranteed to
  assign. It is never an operand, so no position rule removes it: 12 rows.
  (Requiring one uniformly drawn variable to be assigned leaves the prefix
  distribution unchanged - the assigned set is a uniform random subset either
  way - so this only weights 0-var by 12 in the mix.)
* 1-var-left: the variable is the left operand; `k`, `l` are removed: 10.
* 1-var-right: the variable is the right operand; `a`, `b` are removed: 10.
* 2-var: the variable is the right operand y; `a`, `b` are removed: 10. The
  left operand x is drawn afresh for every sequence, uniformly among the
  variables allowed on the left (a..j) other than y: 9 choices for y in c..j,
  10 for y in {k, l}. Every one of the 92 ordered pairs occurs, each with
  probability 1/90 or 1/100 (the paper does not say how the second operand
  is drawn; reading the row's variable as the left operand also counts 10
  and gives the mirror-image weights).

12 + 10 + 10 + 10 = 42. Readings that miss: counting 0-var once per pair gives
2,436 x 31 = 75,516; counting 2-var by (x, y) gives 2,436 x 124 = 302,064.

Training distribution: each step draws rows uniformly from the 102,312
training rows (type shares 12:10:10:10 out of 42), with a fresh distractor,
padding and (2-var) left-operand draw. The knob r = #2-var / #0-var is
10 / 12 = 0.833 for the natural universe; `two_var_ratio` re-weights the 2-var
rows to any r >= 0.

Evaluation pools (names are metric names)
-----------------------------------------
"Per type: train pairs, held-out pairs (add-restricted), held-out positions
(var-restricted); 2-var var-restricted split by one or two restricted
variables". 0-var has no operand variable, so no var-restricted pool; the
two 1-var types are pooled (half left, half right). That makes nine:

    zero_var_train             0-var, training pairs
    zero_var_add_restricted    0-var, held-out pairs
    one_var_train              1-var (left/right), training pairs and positions
    one_var_add_restricted     1-var, held-out pairs, training positions
    one_var_var_restricted     1-var, training pairs, `k`/`l` left or `a`/`b` right
    two_var_train              2-var, training pairs and positions
    two_var_add_restricted     2-var, held-out pairs, training positions
    two_var_var_restricted_one 2-var, training pairs, exactly one operand restricted
    two_var_var_restricted_two 2-var, training pairs, both operands restricted

A 2-var operand is "restricted" when it sits at a held-out position: `k`/`l`
on the left or `a`/`b` on the right ("one": exactly one operand, 36 ordered
pairs; "two": both, 4 pairs). Each var-restricted pool uses training
pairs and each add-restricted pool training positions, so every pool tests one
kind of novelty. The train pools follow the training distribution of their
type(s). `heldout_zero_var` is the exact evaluation: every held-out pair once
as a 0-var sequence.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import re
from pathlib import Path
from typing import NamedTuple, Sequence

import torch

from functools import lru_cache
from itertools import combinations, permutations

from . import draws, native
from .base import Batch, check_batch_size, derive_seed, one_member_batch, step_generator

VAR_NAMES = tuple("abcdefghijkl")
N_VARS = len(VAR_NAMES)
PREFIX_LEN = 12  # assignments + PADs
MAX_ASSIGNMENTS = PREFIX_LEN // 2
SEQ_LEN = PREFIX_LEN + 4  # + `+ lhs rhs =`

ZERO_VAR, ONE_VAR_LEFT, ONE_VAR_RIGHT, TWO_VAR = range(4)
TYPE_NAMES = ("zero_var", "one_var_left", "one_var_right", "two_var")

NOT_RIGHT = (0, 1)  # a, b: never the right operand in training ("right-restricted")
NOT_LEFT = (10, 11)  # k, l: never the left operand in training
# Variables allowed in each operand slot of a training query (1-var and 2-var alike).
TWO_VAR_LEFT = tuple(v for v in range(N_VARS) if v not in NOT_LEFT)  # a..j
TWO_VAR_RIGHT = tuple(v for v in range(N_VARS) if v not in NOT_RIGHT)  # c..l
PAIR_SPLITS = ("authors", "book")  # or the path of a file of training pairs

POOL_NAMES = (
    "zero_var_train",
    "zero_var_add_restricted",
    "one_var_train",
    "one_var_add_restricted",
    "one_var_var_restricted",
    "two_var_train",
    "two_var_add_restricted",
    "two_var_var_restricted_one",
    "two_var_var_restricted_two",
)
PAD_LAYOUTS = ("random", "left", "right")
SPEC_VERSION = 3  # bump when the meaning of the generated data changes (3: the batched counter-based stream)


class Queries(NamedTuple):
    """The query cores of a batch, before padding and distractors are drawn.

    left_var / right_var: variable index of an operand, -1 when it is a number.
    n1, n2: operand values. featured: the 0-var row's guaranteed distractor (-1
    otherwise).
    """
    seq_type: torch.Tensor
    left_var: torch.Tensor
    right_var: torch.Tensor
    n1: torch.Tensor
    n2: torch.Tensor
    featured: torch.Tensor


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _generator(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed("assign_add", *parts))


def _pick(choices: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """n uniform draws (with replacement) from the rows of `choices`."""
    return choices[torch.randint(len(choices), (n,), generator=gen)]


def _var_ids(v) -> torch.Tensor:
    """Variables given as None (-1: a number operand), index, letter, or a sequence/tensor of them."""
    if v is None:
        return torch.tensor([-1])
    if isinstance(v, str) or _is_int(v):
        v = [v]
    if torch.is_tensor(v):
        ids = v.long().reshape(-1)
    else:
        ids = torch.tensor([VAR_NAMES.index(x) if x in VAR_NAMES else int(x) for x in v], dtype=torch.long)
    _require(bool(((ids >= 0) & (ids < N_VARS)).all()), f"variables must be a..l or 0..{N_VARS - 1}")
    return ids


def _two_var_combos(kind: str) -> torch.Tensor:
    """All (x, y), x != y, with 0 ("train", 92 pairs), 1 ("one", 36) or 2 ("two", 4) operands at a
    held-out position (`k`/`l` left, `a`/`b` right)."""
    restricted = {"train": 0, "one": 1, "two": 2}[kind]
    return torch.tensor([(x, y) for x in range(N_VARS) for y in range(N_VARS)
                         if x != y and (x not in TWO_VAR_LEFT) + (y not in TWO_VAR_RIGHT) == restricted])


def authors_split(modulus: int, n_train: int, seed: int = 42) -> torch.Tensor:
    """The authors' pair split: `random.Random(seed).sample(pairs, n_train)` over the lexicographic
    list of pairs `[(a, b) for a in range(N) for b in range(N)]`, as sorted pair ids n1 * N + n2."""
    pairs = [(a, b) for a in range(modulus) for b in range(modulus)]
    chosen = random.Random(seed).sample(pairs, n_train)
    return torch.tensor(sorted(a * modulus + b for a, b in chosen), dtype=torch.long)


def read_pair_file(path, modulus: int) -> torch.Tensor:
    """Training pairs from a file, as sorted pair ids n1 * N + n2.

    Text: one pair per line, `n1 n2` or `n1,n2` (blank lines and `#` comments are skipped); or a
    `.json` file holding a list of [n1, n2]. Every number must be in [0, N-1], no pair may repeat,
    and at least one pair is needed. Errors name the file and the line.
    """
    path = Path(path).expanduser()
    _require(path.is_file(), f"pair_split {str(path)!r} is neither one of {PAIR_SPLITS} nor a file of training pairs")
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"pair_split file {str(path)!r} is not valid JSON: {e}") from None
        _require(isinstance(data, list), f"pair_split file {str(path)!r} must hold a JSON list of [n1, n2] pairs")
        rows = [(f"item {i}", item) for i, item in enumerate(data)]
    else:
        rows = []
        for i, line in enumerate(path.read_text().splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if line:
                rows.append((f"line {i}", [x for x in re.split(r"[\s,]+", line) if x]))
    ids, seen = [], set()
    for where, item in rows:
        numbers = [int(x) if _is_int(x) or (isinstance(x, str) and x.isdigit()) else None
                   for x in (item if isinstance(item, (list, tuple)) else [item])]
        ok = len(numbers) == 2 and None not in numbers
        a, b = numbers if ok else (-1, -1)
        _require(ok and 0 <= a < modulus and 0 <= b < modulus,
                 f"pair_split file {str(path)!r}, {where}: expected two integers n1 n2 in [0, {modulus - 1}], "
                 f"got {item!r}")
        _require((a, b) not in seen, f"pair_split file {str(path)!r}, {where}: pair ({a}, {b}) is listed twice")
        seen.add((a, b))
        ids.append(a * modulus + b)
    _require(len(ids) >= 1, f"pair_split file {str(path)!r} lists no pairs")
    return torch.tensor(sorted(ids), dtype=torch.long)


class AssignAddTask:
    """The Assign-and-Add task (see the module docstring); implements `base.Task`."""

    seq_len = SEQ_LEN
    loss = "last"

    def __init__(self, train_fraction: float | None = 0.7, two_var_ratio: float | None = None,
                 split_seed: int = 42, modulus: int = 59, pair_split: str | Path = "authors"):
        _require(_is_int(modulus) and 2 <= modulus <= 1000, f"modulus must be an integer in [2, 1000], got {modulus!r}")
        n_pairs = modulus * modulus
        _require(train_fraction is None or (isinstance(train_fraction, (int, float))
                                            and not isinstance(train_fraction, bool) and 0 < train_fraction <= 1),
                 f"train_fraction must be in (0, 1] (or None with a pair_split file), got {train_fraction!r}")
        _require(two_var_ratio is None or (isinstance(two_var_ratio, (int, float))
                                           and not isinstance(two_var_ratio, bool)
                                           and math.isfinite(two_var_ratio) and two_var_ratio >= 0),
                 f"two_var_ratio must be None (natural) or a finite number >= 0, got {two_var_ratio!r}")
        _require(_is_int(split_seed) and split_seed >= 0, f"split_seed must be an integer >= 0, got {split_seed!r}")
        _require(isinstance(pair_split, (str, Path)) and str(pair_split) != "",
                 f"pair_split must be one of {PAIR_SPLITS} or the path of a file of training pairs, "
                 f"got {pair_split!r}")

        self.modulus = self.n_outputs = modulus
        self.PLUS, self.EQ, self.PAD, self.VAR0 = modulus, modulus + 1, modulus + 2, modulus + 3
        self.vocab_size = self.VAR0 + N_VARS
        # Pairs are ids n1 * N + n2.
        if str(pair_split) in PAIR_SPLITS:
            _require(train_fraction is not None, f"train_fraction must be in (0, 1] with pair_split={pair_split!r}")
            n_train = math.floor(train_fraction * n_pairs)
            _require(n_train >= 1, f"train_fraction must be in [1/{n_pairs}, 1] so that at least one pair "
                                   f"trains, got {train_fraction!r}")
            train = (authors_split(modulus, n_train, split_seed) if pair_split == "authors"
                     else torch.randperm(n_pairs, generator=_generator("pairs", split_seed))[:n_train])
            self.pair_split = str(pair_split)
        else:
            train = read_pair_file(pair_split, modulus)
            if train_fraction is not None:
                _require(math.floor(train_fraction * n_pairs) == len(train),
                         f"pair_split file {str(pair_split)!r} lists {len(train)} training pairs, but "
                         f"train_fraction={train_fraction!r} asks for {math.floor(train_fraction * n_pairs)}; "
                         f"pass train_fraction=None to take the file's split as it is")
            self.pair_split = str(Path(pair_split).expanduser())
        self.is_train_pair = torch.zeros(n_pairs, dtype=torch.bool)
        self.is_train_pair[train] = True
        self.train_pairs = self.is_train_pair.nonzero()[:, 0]
        self.heldout_pairs = (~self.is_train_pair).nonzero()[:, 0]
        n_train = len(self.train_pairs)
        self.train_fraction = float(train_fraction) if train_fraction is not None else n_train / n_pairs
        self.two_var_ratio, self.split_seed = two_var_ratio, split_seed

        # The row variables each type allows in training (see the module docstring).
        row_vars = [range(N_VARS),
                    [v for v in range(N_VARS) if v not in NOT_LEFT],
                    [v for v in range(N_VARS) if v not in NOT_RIGHT],
                    TWO_VAR_RIGHT]
        self.row_vars = [torch.tensor(list(vs)) for vs in row_vars]
        # The same as a padded [type, slot] table, for vectorised draws.
        self._n_row_vars = torch.tensor([len(vs) for vs in self.row_vars])
        self._row_var_table = torch.stack([torch.cat([vs, vs.new_zeros(N_VARS - len(vs))]) for vs in self.row_vars])
        self.rows_per_type = torch.tensor([len(vs) * n_train for vs in self.row_vars])
        weights = self.rows_per_type.double()
        if two_var_ratio is not None:
            # r = (2-var mass) / (0-var mass): give the 2-var rows that total mass.
            weights[TWO_VAR] = two_var_ratio * weights[ZERO_VAR]
        self.type_probs = weights / weights.sum()
        self._combos = {kind: _two_var_combos(kind) for kind in ("train", "one", "two")}

    # ------------------------------------------------------------------ sizes
    @property
    def universe_size(self) -> int:
        return N_VARS * 4 * self.modulus ** 2

    @property
    def natural_two_var_ratio(self) -> float:
        return int(self.rows_per_type[TWO_VAR]) / int(self.rows_per_type[ZERO_VAR])

    @property
    def effective_two_var_ratio(self) -> float:
        return float(self.type_probs[TWO_VAR] / self.type_probs[ZERO_VAR])

    def n_training_rows(self) -> int:
        return int(self.rows_per_type.sum())

    def training_rows(self) -> torch.Tensor:
        """Every training row as [variable, type, n1, n2], type-major."""
        N, blocks = self.modulus, []
        for t, vs in enumerate(self.row_vars):
            var = vs.repeat_interleave(len(self.train_pairs))
            pair = self.train_pairs.repeat(len(vs))
            blocks.append(torch.stack([var, torch.full_like(var, t), pair // N, pair % N], 1))
        return torch.cat(blocks)

    def is_training_row(self, var, seq_type, n1, n2) -> torch.Tensor:
        """Whether universe rows (variable, type, n1, n2) are training rows (vectorised)."""
        var, seq_type, n1, n2 = (torch.as_tensor(x).long() for x in (var, seq_type, n1, n2))
        allowed = torch.zeros(4, N_VARS, dtype=torch.bool)
        for t, vs in enumerate(self.row_vars):
            allowed[t, vs] = True
        return allowed[seq_type, var] & self.is_train_pair[n1 * self.modulus + n2]

    def is_training_query(self, seq_type, left_var, right_var, n1, n2) -> torch.Tensor:
        """Whether query cores could occur in training (vectorised; vars -1 = number operand)."""
        seq_type, left, right, n1, n2 = torch.broadcast_tensors(
            *(torch.atleast_1d(torch.as_tensor(x)).long() for x in (seq_type, left_var, right_var, n1, n2)))
        left_ok = ~torch.isin(left, torch.tensor(NOT_LEFT))
        right_ok = ~torch.isin(right, torch.tensor(NOT_RIGHT))
        two_ok = torch.isin(left, torch.tensor(TWO_VAR_LEFT)) & right_ok & (left != right)
        # Row t of position_ok: whether the operands sit at training positions for type t.
        position_ok = torch.stack([torch.ones_like(left_ok), left_ok, right_ok, two_ok])
        position_ok = position_ok[seq_type, torch.arange(len(seq_type))]
        return position_ok & self.is_train_pair[n1 * self.modulus + n2]

    def set_sizes(self, pool_size: int = 2000) -> list[dict]:
        """Sizes of the row sets, the pair split and the evaluation sets.

        `population` (pools only) counts the distinct query cores
        (type, operand variables, n1, n2) a pool samples from.
        """
        n_train, n_held = len(self.train_pairs), len(self.heldout_pairs)
        table = [
            {"set": "universe", "size": self.universe_size, "unit": "rows"},
            {"set": "pairs", "size": self.modulus ** 2, "unit": "pairs"},
            {"set": "train_pairs", "size": n_train, "unit": "pairs"},
            {"set": "heldout_pairs", "size": n_held, "unit": "pairs"},
            {"set": "train_rows", "size": self.n_training_rows(), "unit": "rows"},
        ]
        table += [{"set": f"train_rows_{name}", "size": int(n), "unit": "rows"}
                  for name, n in zip(TYPE_NAMES, self.rows_per_type)]
        one_var_train_cores = len(self.row_vars[ONE_VAR_LEFT]) + len(self.row_vars[ONE_VAR_RIGHT])
        cores = {  # distinct operand-variable configurations x pairs
            "zero_var_train": n_train, "zero_var_add_restricted": n_held,
            "one_var_train": one_var_train_cores * n_train,
            "one_var_add_restricted": one_var_train_cores * n_held,
            "one_var_var_restricted": (len(NOT_LEFT) + len(NOT_RIGHT)) * n_train,
            "two_var_train": len(self._combos["train"]) * n_train,
            "two_var_add_restricted": len(self._combos["train"]) * n_held,
            "two_var_var_restricted_one": len(self._combos["one"]) * n_train,
            "two_var_var_restricted_two": len(self._combos["two"]) * n_train,
        }
        for name in POOL_NAMES:
            size = pool_size if cores[name] else 0
            table.append({"set": name, "size": size, "unit": "sequences", "population": cores[name]})
        table.append({"set": "heldout_zero_var", "size": n_held, "unit": "sequences", "population": n_held})
        return table

    def spec(self) -> dict:
        """Everything that defines the generated data (JSON-serialisable; for run keys)."""
        split = self.pair_split if self.pair_split in PAIR_SPLITS else "file"  # a file is known by its pairs
        return {"task": "assign_add", "version": SPEC_VERSION, "modulus": self.modulus,
                "train_fraction": self.train_fraction, "two_var_ratio": self.two_var_ratio,
                "split_seed": self.split_seed, "pair_split": split,
                "train_pairs": hashlib.sha256(self.train_pairs.numpy().tobytes()).hexdigest()[:16],
                "n_vars": N_VARS, "seq_len": SEQ_LEN,
                "max_assignments": MAX_ASSIGNMENTS, "not_left": [VAR_NAMES[v] for v in NOT_LEFT],
                "not_right": [VAR_NAMES[v] for v in NOT_RIGHT]}

    # ------------------------------------------------------------ training data
    @classmethod
    def batch_sampler(cls, tasks: Sequence["AssignAddTask"], keys: Sequence[int],
                      device: str | torch.device = "cpu") -> "AssignAddSampler":
        """The training batches of members with these tasks (one each; pair splits and r may differ)."""
        return AssignAddSampler(tasks, keys, device)

    def train_batch(self, step: int, batch_size: int, seed: int) -> Batch:
        """The batch of the member with stream key `seed` at `step` (`AssignAddSampler`)."""
        return one_member_batch(self, step, batch_size, seed)

    def reference_batch(self, step: int, batch_size: int, seed: int) -> Batch:
        """The batch before issue 36: `_training_queries` and `_render` on a torch.Generator seeded from
        (seed, step). The same distribution as `train_batch`, drawn by other code (tests compare them)."""
        check_batch_size(batch_size)
        gen = step_generator(seed, step)
        return self._render(self._training_queries(batch_size, gen), gen)

    def _training_queries(self, n: int, gen: torch.Generator, types: tuple[int, ...] | None = None,
                          pairs: torch.Tensor | None = None) -> Queries:
        """Rows drawn like training rows. types=None: the training mix (r applied); a tuple of
        types: those types in their natural proportions (pools do not move with r).
        `pairs` swaps the training pairs for another pair set."""
        if types is None:
            probs = self.type_probs
        else:
            probs = torch.zeros(4, dtype=torch.double)
            probs[list(types)] = self.rows_per_type[list(types)].double()
        seq_type = torch.multinomial(probs, n, replacement=True, generator=gen)
        # Within a type the rows are (allowed variable) x (pair): draw the two independently.
        slot = (torch.rand(n, generator=gen) * self._n_row_vars[seq_type]).long()
        var = self._row_var_table[seq_type, slot]
        pair = _pick(self.train_pairs if pairs is None else pairs, n, gen)
        left = torch.where(seq_type == ONE_VAR_LEFT, var, -1)
        left = torch.where(seq_type == TWO_VAR, self._draw_two_var_left(var, gen), left)
        right = torch.where((seq_type == ONE_VAR_RIGHT) | (seq_type == TWO_VAR), var, -1)
        featured = torch.where(seq_type == ZERO_VAR, var, -1)
        return Queries(seq_type, left, right, pair // self.modulus, pair % self.modulus, featured)

    @staticmethod
    def _draw_two_var_left(right: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """For each 2-var right operand, a uniform left operand in c..j other than it."""
        allowed = torch.zeros(len(right), N_VARS, dtype=torch.bool)
        allowed[:, list(TWO_VAR_LEFT)] = True
        allowed[torch.arange(len(right)), right] = False
        keys = torch.where(allowed, torch.rand(len(right), N_VARS, generator=gen), -1.0)
        return keys.argmax(1)

    # ------------------------------------------------------------- rendering
    def _render(self, q: Queries, gen: torch.Generator, n_assignments: int | None = None,
                pads: str = "random") -> Batch:
        """Token sequences for query cores: draw distractors, their values and the padding."""
        n, N = len(q.n1), self.modulus
        # Required assignments: the left operand (or the 0-var featured distractor, with a
        # random value) and the right operand; -1 = none. Column N_VARS is a dummy target.
        has_left = q.left_var >= 0
        first_var = torch.where(has_left, q.left_var, q.featured)
        first_val = torch.where(has_left, q.n1, torch.randint(N, (n,), generator=gen))
        req_var = torch.stack([first_var, q.right_var], 1)
        req_val = torch.stack([first_val, q.n2], 1)
        req_col = torch.where(req_var >= 0, req_var, N_VARS)
        n_req = (req_var >= 0).sum(1)

        if n_assignments is None:  # uniform over the counts that fit the required ones
            k = n_req + (torch.rand(n, generator=gen) * (MAX_ASSIGNMENTS + 1 - n_req)).long()
        else:
            fits = _is_int(n_assignments) and bool((n_req <= n_assignments).all())
            _require(fits and n_assignments <= MAX_ASSIGNMENTS,
                     f"n_assignments must be an integer in [{int(n_req.max()) if n else 1}, {MAX_ASSIGNMENTS}], "
                     f"got {n_assignments!r}")
            k = torch.full((n,), n_assignments)

        # Assigned variables: the required ones sort first, then distinct random distractors.
        var_keys = torch.rand(n, N_VARS + 1, generator=gen).scatter(1, req_col, -1.0)
        chosen = var_keys[:, :N_VARS].argsort(1)[:, :MAX_ASSIGNMENTS]
        values = torch.randint(N, (n, N_VARS + 1), generator=gen).scatter(1, req_col, req_val)
        chosen_val = values.gather(1, chosen)

        # Layout: the prefix is a row of 12 - k items, k of them assignment blocks (two
        # tokens) and the rest PADs. Sorting random keys picks the block slots and, through
        # the rank, which assignment fills each block - a uniform order of assignments.
        n_slots = PREFIX_LEN - 1  # most items when k = 1
        slot = torch.arange(n_slots).expand(n, n_slots)
        n_items = (PREFIX_LEN - k)[:, None]
        if pads == "random":
            offset = torch.zeros(n, n_slots)
        elif pads == "left":  # all PADs first
            offset = (slot < n_items - k[:, None]).float()
        elif pads == "right":  # all PADs last
            offset = (slot >= k[:, None]).float()
        else:
            raise ValueError(f"pads must be one of {PAD_LAYOUTS}, got {pads!r}")
        slot_keys = torch.rand(n, n_slots, generator=gen) + offset
        slot_keys = torch.where(slot < n_items, slot_keys, 3.0)  # unused slots sort last
        rank = slot_keys.argsort(1).argsort(1)
        is_block = rank < k[:, None]
        start = slot + is_block.cumsum(1) - is_block.long()  # each block before an item adds a token
        which = rank.clamp(max=MAX_ASSIGNMENTS - 1)
        prefix = torch.full((n, PREFIX_LEN + 1), self.PAD)
        prefix.scatter_(1, torch.where(is_block, start, PREFIX_LEN), self.VAR0 + chosen.gather(1, which))
        prefix.scatter_(1, torch.where(is_block, start + 1, PREFIX_LEN), chosen_val.gather(1, which))

        lhs = torch.where(has_left, self.VAR0 + q.left_var, q.n1)
        rhs = torch.where(q.right_var >= 0, self.VAR0 + q.right_var, q.n2)
        core = torch.stack([torch.full_like(lhs, self.PLUS), lhs, rhs, torch.full_like(lhs, self.EQ)], 1)
        tokens = torch.cat([prefix[:, :PREFIX_LEN], core], 1)
        return Batch(tokens, (q.n1 + q.n2) % N)

    # ------------------------------------------------------------- evaluation
    def eval_pools(self, size: int = 2000, seed: int = 0) -> dict[str, Batch]:
        """The nine evaluation pools (see the module docstring), seeded and deterministic.

        A pool whose population is empty (held-out pairs at train_fraction = 1) is an empty Batch.
        """
        _require(_is_int(size) and size >= 1, f"size must be an integer >= 1, got {size!r}")
        return {name: self.eval_pool(name, size, seed) for name in POOL_NAMES}

    def eval_pool(self, name: str, size: int = 2000, seed: int = 0) -> Batch:
        _require(name in POOL_NAMES, f"name must be one of {POOL_NAMES}, got {name!r}")
        gen = _generator("pool", name, seed)
        add_restricted = name.endswith("add_restricted")
        if add_restricted and len(self.heldout_pairs) == 0:
            return Batch(torch.empty(0, SEQ_LEN, dtype=torch.long), torch.empty(0, dtype=torch.long))
        pairs = self.heldout_pairs if add_restricted else None
        if name.startswith("zero_var"):
            q = self._training_queries(size, gen, (ZERO_VAR,), pairs)
        elif name == "one_var_var_restricted":
            q = self._one_var_restricted(size, gen)
        elif name.startswith("one_var"):
            q = self._training_queries(size, gen, (ONE_VAR_LEFT, ONE_VAR_RIGHT), pairs)
        elif name.startswith("two_var_var_restricted"):
            q = self._two_var_queries(self._combos[name.rsplit("_", 1)[1]], size, gen)
        else:
            q = self._training_queries(size, gen, (TWO_VAR,), pairs)
        return self._render(q, gen)

    def _one_var_restricted(self, n: int, gen: torch.Generator) -> Queries:
        """1-var at held-out positions: `k`/`l` on the left or `a`/`b` on the right, half each."""
        on_left = torch.rand(n, generator=gen) < 0.5
        left = torch.where(on_left, _pick(torch.tensor(NOT_LEFT), n, gen), -1)
        right = torch.where(on_left, -1, _pick(torch.tensor(NOT_RIGHT), n, gen))
        pair = _pick(self.train_pairs, n, gen)
        seq_type = torch.where(on_left, ONE_VAR_LEFT, ONE_VAR_RIGHT)
        return Queries(seq_type, left, right, pair // self.modulus, pair % self.modulus, torch.full((n,), -1))

    def _two_var_queries(self, combos: torch.Tensor, n: int, gen: torch.Generator) -> Queries:
        xy, pair = _pick(combos, n, gen), _pick(self.train_pairs, n, gen)
        return Queries(torch.full((n,), TWO_VAR), xy[:, 0], xy[:, 1], pair // self.modulus,
                       pair % self.modulus, torch.full((n,), -1))

    def heldout_zero_var(self, seed: int = 0) -> Batch:
        """Exact evaluation: every held-out pair once, as a 0-var sequence (pair order)."""
        gen, pair, n = _generator("heldout_zero_var", seed), self.heldout_pairs, len(self.heldout_pairs)
        featured = torch.randint(N_VARS, (n,), generator=gen)
        q = Queries(torch.full((n,), ZERO_VAR), torch.full((n,), -1), torch.full((n,), -1),
                    pair // self.modulus, pair % self.modulus, featured)
        return self._render(q, gen)

    # ------------------------------------------------- building and reading sequences
    def make_batch(self, n1, n2, left_var=None, right_var=None, *, n_assignments: int | None = None,
                   pads: str = "random", seed: int = 0) -> Batch:
        """Sequences with chosen operands: a variable operand (letter or index) takes the value
        n1 (left) or n2 (right), a None operand is the number itself. Scalars broadcast.

        n_assignments fixes the number of assignments (default: random in [#variables, 6]);
        pads = "random" | "left" (all PADs before the assignments) | "right" (after them).
        The assignment order, distractors and (0-var) the assigned variable stay random.
        """
        n1, n2 = (torch.atleast_1d(torch.as_tensor(x)).long() for x in (n1, n2))
        _require(bool(((n1 >= 0) & (n1 < self.modulus) & (n2 >= 0) & (n2 < self.modulus)).all()),
                 f"n1 and n2 must be in [0, {self.modulus - 1}]")
        n1, n2, left, right = (t.clone() for t in torch.broadcast_tensors(n1, n2, _var_ids(left_var),
                                                                         _var_ids(right_var)))
        n = len(n1)
        _require(bool(((left < 0) | (left != right)).all()), "left_var and right_var must differ")
        seq_type = (left >= 0).long() + 2 * (right >= 0).long()
        gen = _generator("make_batch", seed)
        featured = torch.where(seq_type == ZERO_VAR, torch.randint(N_VARS, (n,), generator=gen), -1)
        return self._render(Queries(seq_type, left, right, n1, n2, featured), gen, n_assignments, pads)

    def parse(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """Read sequences back (vectorised): seq_type, left_var / right_var (-1 = number),
        n1 / n2 (operand values, -1 if an operand variable is unassigned), left_pos /
        right_pos (position of the value token bound to a variable operand, -1 otherwise),
        n_assignments and label ((n1 + n2) mod N, -1 if undefined)."""
        tokens = torch.as_tensor(tokens).long().reshape(-1, SEQ_LEN)
        n = len(tokens)
        prefix = tokens[:, :PREFIX_LEN]
        is_var = prefix >= self.VAR0
        col = torch.where(is_var, prefix - self.VAR0, N_VARS)
        value_of = torch.full((n, N_VARS + 1), -1).scatter(1, col, tokens[:, 1:PREFIX_LEN + 1])
        value_pos = torch.arange(1, PREFIX_LEN + 1).expand(n, PREFIX_LEN)
        pos_of = torch.full((n, N_VARS + 1), -1).scatter(1, col, value_pos)

        def operand(tok):
            var = torch.where(tok >= self.VAR0, tok - self.VAR0, -1)
            idx = var.clamp(min=0)[:, None]
            value = torch.where(var >= 0, value_of.gather(1, idx)[:, 0], tok)
            pos = torch.where(var >= 0, pos_of.gather(1, idx)[:, 0], -1)
            return var, value, pos

        left_var, n1, left_pos = operand(tokens[:, PREFIX_LEN + 1])
        right_var, n2, right_pos = operand(tokens[:, PREFIX_LEN + 2])
        label = torch.where((n1 >= 0) & (n2 >= 0), (n1 + n2) % self.modulus, -1)
        return {"seq_type": (left_var >= 0).long() + 2 * (right_var >= 0).long(),
                "left_var": left_var, "right_var": right_var, "n1": n1, "n2": n2,
                "left_pos": left_pos, "right_pos": right_pos,
                "n_assignments": is_var.sum(1), "label": label}

    def token_names(self) -> list[str]:
        """The name of every token id."""
        return [str(i) for i in range(self.modulus)] + ["+", "=", "PAD"] + list(VAR_NAMES)

    def decode(self, tokens) -> str | list[str]:
        """Readable text: one string for a sequence, a list of strings for a batch."""
        tokens = torch.as_tensor(tokens)
        names = self.token_names()
        if tokens.dim() == 1:
            return " ".join(names[t] for t in tokens.tolist())
        return [self.decode(row) for row in tokens]

    def encode(self, text: str | list[str]) -> torch.Tensor:
        """Inverse of `decode`: "PAD a 40 ... + a 27 =" -> token ids ([n, 16] for a list)."""
        if not isinstance(text, str):
            return torch.stack([self.encode(t) for t in text])
        ids = {name: i for i, name in enumerate(self.token_names())}
        words = text.split()
        unknown = [w for w in words if w not in ids]
        _require(not unknown, f"unknown tokens {unknown}")
        _require(len(words) == SEQ_LEN, f"a sequence has {SEQ_LEN} tokens, got {len(words)}")
        return torch.tensor([ids[w] for w in words])


# ---------------------------------------------------------------- the batched training stream

SITE_ROWS = 0  # the stream site of a batch's rows
RUN_KEY_SOURCES = ("tasks/native.py", "tasks/native.c")  # the sampler's CPU kernel (the same batches)
# The words of one training row, by column of `draws.Stream.words`.
W_TYPE, W_SLOT, W_PAIR, W_LEFT, W_FIRST_VALUE, W_COUNT, W_SUBSET, W_LAYOUT, W_VALUES = range(9)
MAX_DISTRACTORS = MAX_ASSIGNMENTS - 1  # every sequence has a required assignment (an operand or the featured one)
ROW_WORDS = W_VALUES + MAX_DISTRACTORS  # one value word per distractor
MAX_SETS = MAX_ASSIGNMENTS + 1  # subset tables are indexed by m * MAX_SETS + d
MAX_COPIES = 3  # blocks of one required assignment (a bursty task's repeats)


@lru_cache(maxsize=None)
def _prefix_tables() -> dict[str, torch.Tensor]:
    """The prefix's combinatorics as tables, so that a row's prefix is a few lookups (no sorting):

    subsets: every d-subset of range(m) (distractors among the m variables that are not required), padded
    to 5 columns; those of (m, d) at rows subset_start[i] .. + subset_count[i], i = m * 7 + d.
    layouts: every arrangement of k assignment blocks among the 12 - 2k PADs (C(12 - k, k) choices of the
    block places) crossed with every order of the k blocks (k!); a row holds the prefix position of each
    block (its variable token; the value follows), blocks k .. 8 at position 12 (a column the query core
    overwrites); those of k at rows layout_start[k] .. + layout_count[k].
    A uniform subset and a uniform layout row draw what `_render` draws: a uniform set of distractors, a
    uniform order of the blocks, a uniform placement of the PADs.
    """
    subset_rows, sub_start, sub_count = [], [0] * (N_VARS + 1) * MAX_SETS, [0] * (N_VARS + 1) * MAX_SETS
    for m in range(N_VARS + 1):
        for d in range(min(m, MAX_DISTRACTORS) + 1):
            sub_start[m * MAX_SETS + d], sub_count[m * MAX_SETS + d] = len(subset_rows), math.comb(m, d)
            subset_rows += [list(c) + [0] * (MAX_DISTRACTORS - d) for c in combinations(range(m), d)]
    layout_rows, lay_start, lay_count = [], [], []
    for k in range(MAX_ASSIGNMENTS + 1):
        lay_start.append(len(layout_rows))
        for places in combinations(range(PREFIX_LEN - k), k):
            # item i of the prefix (a block or a PAD) starts at i plus one for every block before it
            starts = [item + sum(p < item for p in places) for item in places]
            for order in permutations(range(k)):
                position = [PREFIX_LEN] * (MAX_ASSIGNMENTS + MAX_COPIES)
                for place, block in zip(starts, order):
                    position[block] = place
                layout_rows.append(position)
        lay_count.append(len(layout_rows) - lay_start[-1])
    tensor = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return {"subsets": tensor(subset_rows), "subset_start": tensor(sub_start), "subset_count": tensor(sub_count),
            "layouts": tensor(layout_rows), "layout_start": tensor(lay_start), "layout_count": tensor(lay_count)}


def _two_var_left_table() -> tuple[torch.Tensor, torch.Tensor]:
    """For each 2-var right operand y: the allowed left operands (a..j other than y), flat [12 * 10], and
    their count [12]."""
    width = len(TWO_VAR_LEFT)
    table, count = torch.zeros(N_VARS, width, dtype=torch.long), torch.zeros(N_VARS, dtype=torch.long)
    for y in range(N_VARS):
        allowed = [x for x in TWO_VAR_LEFT if x != y]
        table[y, :len(allowed)], count[y] = torch.tensor(allowed), len(allowed)
    return table.flatten(), count


class AssignAddSampler:
    """Training batches of K members at once, each on its own AssignAddTask (its pair split and r), from the
    counter-based stream (`tasks.draws`); `repeats` of a BurstyAssignAddTask repeat the variable operands'
    assignments. Capturable (see `tasks.draws`).

    Row r of member k reads ROW_WORDS words (k, step, SITE_ROWS, r, column): the query core as
    `_training_queries` draws it (type from the member's type shares, the row variable uniform among those its
    type allows, the pair uniform among the member's training pairs, a 2-var left operand uniform among a..j
    other than the right one), then the prefix as `_render` draws it: the featured distractor's value, the
    number of assignment blocks k uniform over the counts that fit the required ones, a uniform set of
    distinct distractors with uniform values, and a uniform arrangement of blocks and PADs (`_prefix_tables`).
    """

    capturable = multi_step = True

    def __init__(self, tasks: Sequence[AssignAddTask], keys: Sequence[int], device: str | torch.device = "cpu"):
        moduli = {t.modulus for t in tasks}
        _require(len(moduli) == 1, f"the members' tasks must share one modulus, got {sorted(moduli)}")
        self.device = torch.device(device)
        self.task, self.modulus = tasks[0], tasks[0].modulus
        self.stream = draws.Stream(keys, self.device)
        on = lambda x: x.to(self.device)  # noqa: E731
        self.type_thresholds = on(torch.tensor([draws.cumulative_thresholds(t.type_probs.tolist()) for t in tasks]))
        width = max(len(t.train_pairs) for t in tasks)
        self.pairs = on(torch.stack([torch.cat([t.train_pairs, t.train_pairs.new_zeros(width - len(t.train_pairs))])
                                     for t in tasks]))
        self.n_pairs = on(torch.tensor([len(t.train_pairs) for t in tasks]))
        self.repeats = on(torch.tensor([getattr(t, "repeats", 1) for t in tasks]))
        self.row_vars, self.n_row_vars = on(tasks[0]._row_var_table.flatten()), on(tasks[0]._n_row_vars)
        self.left_table, self.left_count = map(on, _two_var_left_table())
        self.tables = {name: on(t) for name, t in _prefix_tables().items()}
        self.native = native.kernel_for(self, native.AssignAddKernel, SITE_ROWS)

    def __call__(self, step, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [K, B, 16], labels [K, B]); with a list of S steps, [K, S * B, ...] (rows step-major)."""
        if self.native is not None and not torch.is_tensor(step):  # the same batches, fused (`tasks.native`)
            return self.native(step, check_batch_size(batch_size))
        return self.torch_form(step, batch_size)

    def torch_form(self, step, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batches by torch ops: the definition, and the form of every device but the CPU."""
        w = self.stream.words(step, SITE_ROWS, check_batch_size(batch_size), ROW_WORDS)  # [K, rows, ROW_WORDS]
        q = self.queries(w)
        return self.render(q, w), (q.n1 + q.n2) % self.modulus

    def queries(self, w: torch.Tensor) -> Queries:
        """The query cores (`Queries`, each [K, B]) of the words w [K, B, ROW_WORDS]."""
        seq_type = draws.categorical(w[..., W_TYPE], self.type_thresholds[:, None, :])
        var = self.row_vars.take(seq_type * N_VARS + draws.below(w[..., W_SLOT], self.n_row_vars.take(seq_type)))
        pair = self.pairs.gather(1, draws.below(w[..., W_PAIR], self.n_pairs[:, None]))
        width = len(TWO_VAR_LEFT)
        two_left = self.left_table.take(var * width + draws.below(w[..., W_LEFT], self.left_count.take(var)))
        left = torch.where(seq_type == ONE_VAR_LEFT, var, torch.where(seq_type == TWO_VAR, two_left, -1))
        right = torch.where((seq_type == ONE_VAR_RIGHT) | (seq_type == TWO_VAR), var, -1)
        featured = torch.where(seq_type == ZERO_VAR, var, -1)
        return Queries(seq_type, left, right, pair // self.modulus, pair % self.modulus, featured)

    def render(self, q: Queries, w: torch.Tensor) -> torch.Tensor:
        """The token sequences [K, B, 16] of the query cores q, their prefixes drawn from the words w.

        The k blocks in canonical order: the d distractors, the first variable's c_first copies, the right
        operand's c_right; a layout row gives each its place. Writing the distractors, then the first
        variable's three possible copies, then the right operand's three, every place ends up with its block
        (a copy beyond its count lands on a later block's place, which that block then overwrites, or in the
        core's columns, which the core overwrites last).
        """
        t, task = self.tables, self.task
        has_left, has_right = q.left_var >= 0, q.right_var >= 0
        first_var = torch.where(has_left, q.left_var, q.featured)  # -1: none (1-var-right)
        first_val = torch.where(has_left, q.n1, draws.below(w[..., W_FIRST_VALUE], self.modulus))
        reps = self.repeats[:, None]
        c_first = torch.where(has_left, reps, (first_var >= 0).long())  # blocks of each required assignment
        c_req = c_first + torch.where(has_right, reps, 0)
        n_req = (first_var >= 0).long() + has_right.long()
        d = draws.below(w[..., W_COUNT], MAX_SETS - c_req)  # distractors: k - c_req, k uniform on [c_req, 6]
        sets = (N_VARS - n_req) * MAX_SETS + d
        pick = t["subset_start"].take(sets) + draws.below(w[..., W_SUBSET], t["subset_count"].take(sets))
        subset = t["subsets"].index_select(0, pick.flatten()).view(*pick.shape, MAX_DISTRACTORS)
        # subset entries count the variables that are not required: skip the required ones, the lower first
        r1 = torch.where(first_var >= 0, first_var, N_VARS)
        r2 = torch.where(has_right, q.right_var, N_VARS)
        distractor = subset + (subset >= torch.minimum(r1, r2)[..., None])
        distractor = distractor + (distractor >= torch.maximum(r1, r2)[..., None])
        k = d + c_req
        row = t["layout_start"].take(k) + draws.below(w[..., W_LAYOUT], t["layout_count"].take(k))
        place = t["layouts"].index_select(0, row.flatten()).view(*row.shape, -1)  # [K, B, 9]
        copies = self.stream.arange(MAX_COPIES)
        first_place = place.gather(-1, d[..., None] + copies)
        right_place = place.gather(-1, (d + c_first)[..., None] + copies)
        tokens = torch.full((*k.shape, SEQ_LEN), task.PAD, dtype=torch.long, device=self.device)
        values = draws.below(w[..., W_VALUES:], self.modulus)
        for where, var, value in ((place[..., :MAX_DISTRACTORS], distractor, values),
                                  (first_place, first_var[..., None], first_val[..., None]),
                                  (right_place, q.right_var[..., None], q.n2[..., None])):
            tokens.scatter_(-1, where, (task.VAR0 + var).expand(where.shape))
            tokens.scatter_(-1, where + 1, value.expand(where.shape))
        tokens[..., PREFIX_LEN] = task.PLUS
        tokens[..., PREFIX_LEN + 1] = torch.where(has_left, task.VAR0 + q.left_var, q.n1)
        tokens[..., PREFIX_LEN + 2] = torch.where(has_right, task.VAR0 + q.right_var, q.n2)
        tokens[..., PREFIX_LEN + 3] = task.EQ
        return tokens
