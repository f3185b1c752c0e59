"""Block-list tasks (chapter `inductive_manifold`, Musat et al., arXiv 2607.11875).

A sequence is a list of blocks of a few tokens followed by a query block; the target is the
token that follows the query, determined by relations between earlier blocks. One generator
covers the family:

    recall       blocks [x y];        query [x]       -> y      (in-context associative recall)
    khop         blocks [z0 z1] [z1 z2] ... [z_{h-1} z_h] (shuffled); query [z0] -> z_h
    ngram        blocks [z0 .. z_{n-1}]; query [z0 .. z_{n-2}] -> z_{n-1}   (in-context n-grams)
    ioi          blocks [x y];        query [y]       -> x      (IOI-like: name the other one)
    conditional  blocks [k c v], distractor blocks [k c' v'] share the key k;
                 query [k c] -> v                             (conditional retrieval)

Tokens. Common tokens come in `n_pairs` associated pairs (2i, 2i+1); the association map C
swaps the two tokens of each pair (a symmetric pairing, C = C^T). The link into a block's
target token is *canonical* (target = C of the token before it) with probability 1 - f_v and
a fresh non-canonical token otherwise (within-class variability f_v). With probability f_r the
queried chain uses *rare* tokens instead: drawn fresh for each sequence, with no fixed
association (lexinvariant), so only the context can tell the answer. Every other token of a
sequence is distinct. The queried block appears `burstiness` (b) times; the remaining blocks
are distractors of the same shape. `n_fill` filler tokens (their own class) sit in random gaps
between blocks, so block offsets vary; the blocks' order is a uniformly random permutation.
With bos=True every sequence starts with a beginning-of-sequence token (a class of its own):
without it the first position, which can only attend to itself, looks to a previous-token
head like a token preceded by itself.

Positions. With offsets="cyclic" the position label of index i is (i + o) mod L, with o
uniform per sequence: the model sees only relative positions (mod L), which makes the
positional shift an exact symmetry of the data. offsets="fixed" (o = 0) gives absolute
positions and breaks it.

Symmetries (exact by construction). Token choices are a uniformly random element of the group
that preserves the relations (permute pairs, swap within pairs; any permutation of rare tokens,
of filler tokens) applied to a template; `zipf` > 0 draws the queried pair from a Zipf law and
breaks the token symmetry on purpose.

How randomness is organised: every sequence is a deterministic function of independent
categorical *choices* with fixed ranges (Lehmer codes for the random permutations). Sampling
draws the choices; `enumerate_outcomes` lists every combination with its probability, so the
exact distribution of a small task (and an exact expected gradient) is available to tests.

Model inputs. input_ids="composite" encodes (token, position label) as one id,
token + V * label, which the theory's transformer embeds as [token embedding; position one-hot];
input_ids="tokens" gives plain token ids (for a standard transformer with learned positions).
The label is the target token (loss "last").
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from .base import Batch, step_generator

KINDS = ("recall", "khop", "ngram", "ioi", "conditional")
OFFSETS = ("cyclic", "fixed")
INPUT_IDS = ("composite", "tokens")
COMMON, RARE, FILL, BOS = 0, 1, 2, 3


@dataclass
class BlockListSample:
    """A batch of block-list sequences with what generated them."""

    tokens: torch.Tensor  # [B, L] token ids
    positions: torch.Tensor  # [B, L] position labels
    targets: torch.Tensor  # [B] target token ids
    is_rare: torch.Tensor  # [B] bool: the queried chain uses rare tokens
    canonical: torch.Tensor  # [B] bool: the queried link is canonical (target = C of its predecessor)
    info: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def subset(self, idx) -> "BlockListSample":
        return BlockListSample(self.tokens[idx], self.positions[idx], self.targets[idx], self.is_rare[idx],
                               self.canonical[idx], dict(self.info))


def _check(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"BlockListTask: {name}={value!r} is not allowed; expected {allowed}")


class BlockListTask:
    """One generator for the block-list family; see the module docstring for every knob."""

    loss = "last"

    def __init__(self, kind: str = "recall", *, n_pairs: int = 8, n_rare: int = 0, n_blocks: int = 4,
                 hops: int = 2, ngram: int = 3, f_r: float = 0.0, f_v: float = 0.0, burstiness: int = 1,
                 n_fill: int = 0, n_fill_tokens: int = 1, offsets: str = "cyclic", zipf: float = 0.0,
                 input_ids: str = "composite", bos: bool = False):
        _check(kind in KINDS, "kind", kind, f"one of {KINDS}")
        for name, v, lo in (("n_pairs", n_pairs, 2), ("n_blocks", n_blocks, 1), ("hops", hops, 1),
                            ("ngram", ngram, 2), ("burstiness", burstiness, 1), ("n_rare", n_rare, 0),
                            ("n_fill", n_fill, 0), ("n_fill_tokens", n_fill_tokens, 1)):
            _check(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= lo, name, v,
                   f"an integer >= {lo}")
        for name, v in (("f_r", f_r), ("f_v", f_v)):
            _check(isinstance(v, (int, float)) and 0.0 <= v <= 1.0, name, v, "a probability in [0, 1]")
        _check(isinstance(zipf, (int, float)) and zipf >= 0, "zipf", zipf, "a number >= 0 (0: uniform)")
        _check(offsets in OFFSETS, "offsets", offsets, f"one of {OFFSETS}")
        _check(input_ids in INPUT_IDS, "input_ids", input_ids, f"one of {INPUT_IDS}")
        _check(isinstance(bos, bool), "bos", bos, "True or False")
        self.bos = bos
        self.kind, self.n_pairs, self.n_rare, self.n_blocks = kind, int(n_pairs), int(n_rare), int(n_blocks)
        self.hops, self.ngram, self.f_r, self.f_v = int(hops), int(ngram), float(f_r), float(f_v)
        self.burstiness, self.n_fill, self.offsets, self.zipf = int(burstiness), int(n_fill), offsets, float(zipf)
        self.n_fill_tokens_arg = int(n_fill_tokens)
        self.n_fill_tokens = int(n_fill_tokens) if n_fill > 0 else 0
        self.input_ids = input_ids
        _check(self.n_distractors >= 0, "n_blocks", n_blocks,
               f">= {self.n_relevant_blocks * self.burstiness} (relevant blocks x burstiness) for kind={kind!r}")
        _check(self.common_draws <= self.n_pairs, "n_pairs", n_pairs,
               f">= {self.common_draws}: every token of a sequence is distinct and each fresh common token "
               f"uses its own pair (kind={kind!r}, n_blocks={n_blocks})")
        _check(self.f_r == 0 or self.n_rare >= self.chain_len, "n_rare", n_rare,
               f">= {self.chain_len} (the queried chain's tokens) when f_r > 0")

    # ------------------------------------------------------------ shape of the task
    @property
    def block_len(self) -> int:
        return {"recall": 2, "ioi": 2, "khop": 2, "ngram": self.ngram, "conditional": 3}[self.kind]

    @property
    def chain_len(self) -> int:
        """Tokens of the queried chain (z_0 .. z_last)."""
        return {"recall": 2, "ioi": 2, "khop": self.hops + 1, "ngram": self.ngram, "conditional": 3}[self.kind]

    @property
    def n_relevant_blocks(self) -> int:
        return self.hops if self.kind == "khop" else 1

    @property
    def n_distractors(self) -> int:
        return self.n_blocks - self.n_relevant_blocks * self.burstiness

    @property
    def query_len(self) -> int:
        return {"recall": 1, "ioi": 1, "khop": 1, "ngram": self.ngram - 1, "conditional": 2}[self.kind]

    @property
    def distractor_fresh(self) -> int:
        """Fresh common tokens per distractor block (conditional distractors share the key)."""
        return self.block_len - 1 if self.kind == "conditional" else self.block_len

    @property
    def common_draws(self) -> int:
        return self.chain_len + self.n_distractors * self.distractor_fresh

    @property
    def seq_len(self) -> int:
        return int(self.bos) + self.n_blocks * self.block_len + self.n_fill + self.query_len

    @property
    def n_common(self) -> int:
        return 2 * self.n_pairs

    @property
    def n_tokens(self) -> int:
        """V: common, then rare, then filler tokens, then the BOS token."""
        return self.n_common + self.n_rare + self.n_fill_tokens + int(self.bos)

    @property
    def bos_token(self) -> int | None:
        return self.n_tokens - 1 if self.bos else None

    @property
    def vocab_size(self) -> int:
        return self.n_tokens * self.seq_len if self.input_ids == "composite" else self.n_tokens

    @property
    def n_outputs(self) -> int:
        return self.n_tokens

    def token_classes(self) -> torch.Tensor:
        """[V] class of every token: 0 common, 1 rare, 2 filler, 3 BOS."""
        return torch.tensor([COMMON] * self.n_common + [RARE] * self.n_rare + [FILL] * self.n_fill_tokens
                            + [BOS] * int(self.bos))

    def association(self) -> torch.Tensor:
        """The association map C as a token permutation [V]: swaps each common pair, fixes the rest."""
        perm = torch.arange(self.n_tokens)
        perm[: self.n_common] = perm[: self.n_common] ^ 1
        return perm

    def spec(self) -> dict:
        return {"task": "blocklist", "kind": self.kind, "n_pairs": self.n_pairs, "n_rare": self.n_rare,
                "n_blocks": self.n_blocks, "hops": self.hops, "ngram": self.ngram, "f_r": self.f_r, "f_v": self.f_v,
                "burstiness": self.burstiness, "n_fill": self.n_fill, "n_fill_tokens": self.n_fill_tokens_arg,
                "offsets": self.offsets, "zipf": self.zipf, "input_ids": self.input_ids, "bos": self.bos}

    def with_knobs(self, **changes) -> "BlockListTask":
        """The same task with some knobs changed (validated like a new task)."""
        kw = {k: v for k, v in self.spec().items() if k != "task"}
        unknown = sorted(set(changes) - set(kw))
        if unknown:
            raise ValueError(f"BlockListTask.with_knobs: unknown knobs {unknown}; knobs: {sorted(kw)}")
        kw.update(changes)
        return BlockListTask(**kw)

    def __repr__(self) -> str:
        return f"BlockListTask({', '.join(f'{k}={v!r}' for k, v in self.spec().items() if k != 'task')})"

    # ------------------------------------------------------------ the choices
    def choices(self) -> list[tuple[str, torch.Tensor]]:
        """Every independent categorical choice: (name, probabilities over its range)."""
        out = []
        for j in range(self.common_draws):
            n = self.n_pairs - j
            if j == 0 and self.zipf > 0:
                w = torch.arange(1, n + 1, dtype=torch.float64) ** -self.zipf
                out.append((f"pair{j}", w / w.sum()))
            else:
                out.append((f"pair{j}", torch.full((n,), 1.0 / n, dtype=torch.float64)))
            out.append((f"orient{j}", torch.full((2,), 0.5, dtype=torch.float64)))
        if self.f_r > 0:
            out.append(("rare", torch.tensor([1 - self.f_r, self.f_r], dtype=torch.float64)))
            for j in range(self.chain_len):
                n = self.n_rare - j
                out.append((f"rare{j}", torch.full((n,), 1.0 / n, dtype=torch.float64)))
        for i in range(1 + self.n_distractors):  # the queried link, then each distractor's last link
            out.append((f"canon{i}", torch.tensor([self.f_v, 1 - self.f_v], dtype=torch.float64)))
        for j in range(self.n_blocks):
            n = self.n_blocks - j
            out.append((f"order{j}", torch.full((n,), 1.0 / n, dtype=torch.float64)))
        for f in range(self.n_fill):
            out.append((f"gap{f}", torch.full((self.n_blocks + 1,), 1.0 / (self.n_blocks + 1), dtype=torch.float64)))
            out.append((f"fill{f}", torch.full((self.n_fill_tokens,), 1.0 / self.n_fill_tokens, dtype=torch.float64)))
        L = self.seq_len
        out.append(("offset", torch.full((L,), 1.0 / L, dtype=torch.float64) if self.offsets == "cyclic"
                    else torch.ones(1, dtype=torch.float64)))
        return out

    def draw_choices(self, n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
        return {name: torch.multinomial(p.float().expand(n, -1), 1, replacement=True, generator=gen).squeeze(1)
                for name, p in self.choices()}

    # ------------------------------------------------------------ assembling sequences
    def assemble(self, c: dict[str, torch.Tensor]) -> BlockListSample:
        """The sequences that the choices `c` (each [B]) determine."""
        B = next(iter(c.values())).shape[0]
        pairs = _decode_lehmer([c[f"pair{j}"] for j in range(self.common_draws)], self.n_pairs)  # [B, D]
        orient = torch.stack([c[f"orient{j}"] for j in range(self.common_draws)], 1) if self.common_draws else None
        fresh = 2 * pairs + orient  # [B, D] fresh common tokens
        partner = 2 * pairs + 1 - orient  # their canonical partners
        rows = torch.arange(B)
        counter = torch.zeros(B, dtype=torch.long)

        def take_fresh():
            nonlocal counter
            tok, par = fresh[rows, counter], partner[rows, counter]
            counter = counter + 1
            return tok, par

        def chain(length: int, canon: torch.Tensor, key=None):
            """`length` tokens; the last one is C(previous) where canon, else fresh. key: a shared first token."""
            toks, last_partner = [], None
            for i in range(length):
                if i == 0 and key is not None:
                    toks.append(key)
                    continue
                if i == length - 1:
                    f_tok, f_par = take_fresh_if(~canon)
                    toks.append(torch.where(canon, last_partner, f_tok))
                else:
                    tok, last_partner = take_fresh()
                    toks.append(tok)
            return torch.stack(toks, 1)

        def take_fresh_if(mask):
            nonlocal counter
            idx = counter.clamp(max=fresh.shape[1] - 1)
            tok, par = fresh[rows, idx], partner[rows, idx]
            counter = counter + mask.long()
            return tok, par

        canon = [c[f"canon{i}"].bool() for i in range(1 + self.n_distractors)]
        is_rare = c["rare"].bool() if self.f_r > 0 else torch.zeros(B, dtype=torch.bool)
        # the queried chain: common (its link canonical or not) or rare (all fresh rare tokens)
        rel_common = chain(self.chain_len, canon[0] & ~is_rare)
        counter = torch.where(is_rare, torch.zeros_like(counter), counter)  # a rare chain used no common draws
        if self.f_r > 0:
            rare_idx = _decode_lehmer([c[f"rare{j}"] for j in range(self.chain_len)], self.n_rare)
            rel_rare = self.n_common + rare_idx
            rel = torch.where(is_rare[:, None], rel_rare, rel_common)
        else:
            rel = rel_common
        canonical = canon[0] & ~is_rare
        # blocks: the relevant ones (repeated b times), then the distractors
        if self.kind == "khop":
            relevant = [rel[:, i:i + 2] for i in range(self.hops)]
        else:
            relevant = [rel]
        blocks = [blk for blk in relevant for _ in range(self.burstiness)]
        for i in range(self.n_distractors):
            key = rel[:, 0] if self.kind == "conditional" else None
            blocks.append(chain(self.block_len, canon[1 + i], key=key))
        blocks = torch.stack(blocks, 1)  # [B, n_blocks, block_len]
        order = _decode_lehmer([c[f"order{j}"] for j in range(self.n_blocks)], self.n_blocks)
        blocks = blocks[rows[:, None], order]
        if self.kind == "ioi":
            query, target = rel[:, 1:2], rel[:, 0]
        else:  # recall, khop: [z0] -> z_last; ngram, conditional: all but the last -> the last
            query, target = rel[:, :self.query_len], rel[:, -1]
        tokens = self._lay_out(blocks, query, c)
        L = self.seq_len
        positions = (torch.arange(L)[None, :] + c["offset"][:, None]) % L
        return BlockListSample(tokens, positions, target, is_rare, canonical)

    def _lay_out(self, blocks: torch.Tensor, query: torch.Tensor, c: dict) -> torch.Tensor:
        """Blocks in order with fillers in their gaps, then the query: [B, L]."""
        B, nb, k = blocks.shape
        tokens = self._fill_gaps(blocks, query, c)
        if self.bos:
            tokens = torch.cat([torch.full((B, 1), self.bos_token, dtype=torch.long), tokens], 1)
        return tokens

    def _fill_gaps(self, blocks: torch.Tensor, query: torch.Tensor, c: dict) -> torch.Tensor:
        B, nb, k = blocks.shape
        L = self.seq_len - int(self.bos)
        tokens = torch.empty(B, L, dtype=torch.long)
        content = torch.cat([blocks.flatten(1), query], 1)  # [B, nb * k + q]
        if self.n_fill == 0:
            return content
        gaps = torch.stack([c[f"gap{f}"] for f in range(self.n_fill)], 1)  # [B, F]
        # fillers in gap i come before block i (gap nb: before the query)
        before = (gaps[:, None, :] <= torch.arange(nb + 1)[None, :, None]).sum(-1)  # [B, nb + 1]
        starts = torch.arange(nb + 1)[None, :] * k + before  # block i starts here; index nb = the query
        is_content = torch.zeros(B, L, dtype=torch.bool)
        cols = torch.cat([(starts[:, :nb, None] + torch.arange(k)).flatten(1),
                          starts[:, nb:] + torch.arange(self.query_len)], 1)
        is_content[torch.arange(B)[:, None], cols] = True
        tokens[torch.arange(B)[:, None], cols] = content
        fill_tokens = self.n_common + self.n_rare + torch.stack([c[f"fill{f}"] for f in range(self.n_fill)], 1)
        tokens[~is_content] = fill_tokens.flatten()
        return tokens

    # ------------------------------------------------------------ sampling and enumeration
    def sample(self, n: int, seed: int) -> BlockListSample:
        if not (isinstance(n, int) and n >= 1):
            raise ValueError(f"BlockListTask.sample: n={n!r} must be an integer >= 1")
        gen = torch.Generator().manual_seed(int(seed))
        return self.assemble(self.draw_choices(n, gen))

    def sample_at(self, step: int, n: int, seed: int) -> BlockListSample:
        return self.assemble(self.draw_choices(n, step_generator(seed, step)))

    def n_outcomes(self) -> int:
        return math.prod(int((p > 0).sum()) for _, p in self.choices())

    def enumerate_outcomes(self, max_outcomes: int = 2_000_000) -> tuple[BlockListSample, torch.Tensor]:
        """Every combination of choices with positive probability, and its probability (float64).

        Distinct combinations can give the same sequence; their probabilities then add up, so
        sums over outcomes are exact expectations over the task's distribution.
        """
        count = self.n_outcomes()
        if count > max_outcomes:
            raise ValueError(f"BlockListTask.enumerate_outcomes: {count} outcomes exceed max_outcomes={max_outcomes}; "
                             f"use a smaller task (n_pairs, n_blocks, n_fill, f_r/f_v in {{0, 1}} prune choices)")
        names, supports, probs = [], [], []
        for name, p in self.choices():
            keep = torch.nonzero(p > 0).squeeze(1)
            names.append(name)
            supports.append(keep)
            probs.append(p[keep])
        sizes = [len(s) for s in supports]
        flat = torch.arange(count)
        c, prob = {}, torch.ones(count, dtype=torch.float64)
        for name, support, p, size, stride in zip(names, supports, probs, sizes, _strides(sizes)):
            idx = (flat // stride) % size
            c[name] = support[idx]
            prob = prob * p[idx]
        return self.assemble(c), prob

    # ------------------------------------------------------------ what the training loop reads
    def model_inputs(self, s: BlockListSample) -> torch.Tensor:
        return s.tokens + self.n_tokens * s.positions if self.input_ids == "composite" else s.tokens

    def batch(self, s: BlockListSample) -> Batch:
        return Batch(self.model_inputs(s), s.targets)

    def train_batch(self, step: int, batch_size: int, seed: int) -> Batch:
        return self.batch(self.sample_at(step, batch_size, seed))

    def decode(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Composite ids -> (tokens, position labels)."""
        if self.input_ids != "composite":
            raise ValueError("decode: only composite ids carry position labels (input_ids='composite')")
        return ids % self.n_tokens, ids // self.n_tokens

    def describe(self, s: BlockListSample, i: int) -> str:
        """One sequence as text: tokens (c: common, r: rare, _: filler), the query and the target."""
        names = [self.token_name(int(t)) for t in s.tokens[i]]
        L, k, q = self.seq_len, self.block_len, self.query_len
        return " ".join(names[:L - q]) + " | " + " ".join(names[L - q:]) + " -> " + self.token_name(int(s.targets[i]))

    def token_name(self, t: int) -> str:
        if t < self.n_common:
            return f"c{t}"
        if t < self.n_common + self.n_rare:
            return f"r{t - self.n_common}"
        if self.bos and t == self.bos_token:
            return "<s>"
        return "_" if self.n_fill_tokens == 1 else f"_{t - self.n_common - self.n_rare}"

    # ------------------------------------------------------------ symmetries
    def random_automorphism(self, gen: torch.Generator) -> torch.Tensor:
        """A uniformly random token permutation [V] that preserves the association and the classes."""
        pair_perm = torch.randperm(self.n_pairs, generator=gen)
        swap = torch.randint(0, 2, (self.n_pairs,), generator=gen)
        perm = torch.empty(self.n_tokens, dtype=torch.long)
        perm[0:self.n_common:2] = 2 * pair_perm + swap
        perm[1:self.n_common:2] = 2 * pair_perm + 1 - swap
        r0, f0 = self.n_common, self.n_common + self.n_rare
        perm[r0:f0] = r0 + torch.randperm(self.n_rare, generator=gen)
        perm[f0:f0 + self.n_fill_tokens] = f0 + torch.randperm(self.n_fill_tokens, generator=gen)
        if self.bos:
            perm[self.bos_token] = self.bos_token
        return perm

    def relabel(self, s: BlockListSample, perm: torch.Tensor) -> BlockListSample:
        """Apply the token permutation `perm` [V] to every sequence and target."""
        perm = torch.as_tensor(perm)
        if sorted(perm.tolist()) != list(range(self.n_tokens)):
            raise ValueError(f"relabel: perm must be a permutation of range({self.n_tokens})")
        return BlockListSample(perm[s.tokens], s.positions, perm[s.targets], s.is_rare, s.canonical, dict(s.info))

    def shift(self, s: BlockListSample, offset: int) -> BlockListSample:
        """Shift every position label by `offset` (mod L): the block offsets move together."""
        return BlockListSample(s.tokens, (s.positions + int(offset)) % self.seq_len, s.targets, s.is_rare,
                               s.canonical, dict(s.info))


def _strides(sizes: list[int]) -> list[int]:
    out, acc = [], 1
    for size in reversed(sizes):
        out.append(acc)
        acc *= size
    return out[::-1]


def _decode_lehmer(codes: list[torch.Tensor], n: int) -> torch.Tensor:
    """Lehmer codes u_j in [0, n - j) -> the first len(codes) elements of a permutation of range(n): [B, len]."""
    if not codes:
        return torch.zeros(0, 0, dtype=torch.long)
    B = codes[0].shape[0]
    available = torch.ones(B, n, dtype=torch.bool)
    out = []
    for u in codes:
        rank = available.long().cumsum(1) - 1  # rank of each still-available element
        pick = ((rank == u[:, None]) & available).float().argmax(1)
        out.append(pick)
        available[torch.arange(B), pick] = False
    return torch.stack(out, 1)


# ---------------------------------------------------------------- the two-sample test

FEATURES = ("query", "target", "query_target", "first", "first_pair", "first_label_token", "last_label")


def sequence_features(task: BlockListTask, s: BlockListSample) -> dict[str, torch.Tensor]:
    """One categorical value per sequence for each feature the test compares ([B] int64 each)."""
    V, L = task.n_tokens, task.seq_len
    q = s.tokens[:, -1]
    return {"query": q, "target": s.targets, "query_target": q * V + s.targets, "first": s.tokens[:, 0],
            "first_pair": s.tokens[:, 0] * V + s.tokens[:, 1], "first_label_token": s.positions[:, 0] * V + s.tokens[:, 0],
            "last_label": s.positions[:, -1]}


def two_sample_test(task: BlockListTask, x: BlockListSample, y: BlockListSample) -> dict:
    """Do x and y come from the same distribution? Chi-square homogeneity per feature, Bonferroni.

    Each feature is one categorical value per sequence, so counts are independent across
    sequences; cells empty in both samples are dropped. Returns the p-value of every feature and
    the combined p = min(1, n_features * min p).
    """
    from scipy.stats import chi2_contingency

    fx, fy = sequence_features(task, x), sequence_features(task, y)
    pvalues = {}
    for name in FEATURES:
        size = int(max(fx[name].max(), fy[name].max())) + 1
        table = np.stack([np.bincount(fx[name].numpy(), minlength=size), np.bincount(fy[name].numpy(), minlength=size)])
        table = table[:, table.sum(0) > 0]
        if table.shape[1] < 2:
            pvalues[name] = 1.0
            continue
        pvalues[name] = float(chi2_contingency(table, correction=False).pvalue)
    combined = min(1.0, len(pvalues) * min(pvalues.values()))
    return {"p_value": combined, "feature_p_values": pvalues}


def symmetry_test(task: BlockListTask, transform: str, n: int, seed: int) -> dict:
    """Compare n sequences with n others (independent seed) moved by a random symmetry.

    transform: "relabel" (a random association-preserving token permutation) or "shift"
    (a random offset 1..L-1). Under an invariant generator the two samples share one
    distribution, so the p-value is uniform; a broken generator gives small p-values.
    """
    if transform not in ("relabel", "shift"):
        raise ValueError(f"symmetry_test: transform={transform!r}; expected 'relabel' or 'shift'")
    x = task.sample(n, seed=2 * seed)
    y = task.sample(n, seed=2 * seed + 1)
    gen = torch.Generator().manual_seed(10_000 + seed)
    if transform == "relabel":
        y = task.relabel(y, task.random_automorphism(gen))
    else:
        y = task.shift(y, int(torch.randint(1, task.seq_len, (1,), generator=gen)))
    return two_sample_test(task, x, y)


def rejection_rate(task: BlockListTask, transform: str, n: int, reps: int, alpha: float = 0.01,
                   first_seed: int = 0) -> float:
    """Fraction of `reps` independent symmetry tests that reject at level alpha: the test's size
    for an invariant task, its power against a broken one."""
    return float(np.mean([symmetry_test(task, transform, n, first_seed + r)["p_value"] < alpha for r in range(reps)]))
