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

from . import draws, native, row_chunks
from .base import Batch, check_batch_size, one_member_batch, step_generator

KINDS = ("recall", "khop", "ngram", "ioi", "conditional")
OFFSETS = ("cyclic", "fixed")
INPUT_IDS = ("composite", "tokens")
COMMON, RARE, FILL, BOS = 0, 1, 2, 3
RUN_KEY_SOURCES = ("tasks/row_chunks.py", "tasks/native.py", "tasks/native.c")  # what makes the batches besides this file


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
        """The sequences that the choices `c` (each [B]) determine: the Lehmer codes decoded, then `build`."""
        stack = lambda names: (torch.stack([c[n] for n in names], 1) if names  # noqa: E731
                               else torch.zeros(len(c["offset"]), 0, dtype=torch.long, device=c["offset"].device))
        D, F = self.common_draws, self.n_fill
        rare = (_decode_lehmer([c[f"rare{j}"] for j in range(self.chain_len)], self.n_rare) if self.f_r > 0 else None)
        return self.build(
            pairs=_decode_lehmer([c[f"pair{j}"] for j in range(D)], self.n_pairs),
            orient=stack([f"orient{j}" for j in range(D)]),
            is_rare=c["rare"].bool() if self.f_r > 0 else torch.zeros_like(c["offset"], dtype=torch.bool),
            rare=rare,
            canon=stack([f"canon{i}" for i in range(1 + self.n_distractors)]).bool(),
            order=_decode_lehmer([c[f"order{j}"] for j in range(self.n_blocks)], self.n_blocks),
            gaps=stack([f"gap{f}" for f in range(F)]), fills=stack([f"fill{f}" for f in range(F)]),
            offset=c["offset"])

    def build(self, pairs: torch.Tensor, orient: torch.Tensor, is_rare: torch.Tensor, rare: torch.Tensor | None,
              canon: torch.Tensor, order: torch.Tensor, gaps: torch.Tensor, fills: torch.Tensor,
              offset: torch.Tensor) -> BlockListSample:
        """The sequences of decoded choices (every tensor [B, ...] on one device; no host synchronisation):

        pairs [B, D]: the distinct pairs the fresh common tokens come from, in order of use; orient [B, D]:
        which token of each pair is the fresh one (the other is its canonical partner); is_rare [B]: the
        queried chain uses rare tokens, rare [B, chain_len] (distinct rare tokens, None when f_r = 0);
        canon [B, 1 + n_distractors]: whether the queried link, then each distractor's last link, is
        canonical; order [B, n_blocks]: the blocks' permutation; gaps, fills [B, n_fill]: each filler's gap
        and token; offset [B]: the position-label shift, in [0, seq_len).

        Fresh tokens are used in order: the queried chain takes chain_len - 1 (and one more when its link is
        not canonical; a rare chain takes none), then each distractor block takes its tokens before the last
        (block_len - 1, or block_len - 2 after the shared key of `conditional`) and one more for a
        non-canonical last link.
        """
        B, D = pairs.shape
        device = pairs.device
        fresh, partner = 2 * pairs + orient, 2 * pairs + 1 - orient
        take = lambda table, idx: table.gather(1, idx.clamp(max=D - 1))  # noqa: E731
        n, L, cl = self.n_distractors, self.block_len, self.chain_len
        linked = canon[:, 0] & ~is_rare  # the queried link is canonical
        last = torch.where(linked, partner[:, cl - 2], fresh[:, min(cl - 1, D - 1)])
        rel = torch.cat([fresh[:, :cl - 1], last[:, None]], 1)  # the queried chain, common tokens
        if rare is not None:
            rel = torch.where(is_rare[:, None], self.n_common + rare, rel)
        # the distractors: block i's fresh tokens start where block i - 1's end (a rare chain used none)
        start = torch.where(is_rare, 0, (cl - 1) + (~linked).long())
        body_len = L - 2 if self.kind == "conditional" else L - 1
        used = body_len + (~canon[:, 1:]).long()  # [B, n]
        first = start[:, None] + used.cumsum(1) - used
        body = take(fresh, (first[:, :, None] + torch.arange(body_len, device=device)).flatten(1)).view(B, n, body_len)
        tail = torch.where(canon[:, 1:], take(partner, first + body_len - 1), take(fresh, first + body_len))
        parts = [body, tail[:, :, None]]
        if self.kind == "conditional":  # every distractor shares the query's key
            parts.insert(0, rel[:, None, :1].expand(B, n, 1))
        distractors = torch.cat(parts, 2)  # [B, n, L]
        relevant = rel.unfold(1, 2, 1) if self.kind == "khop" else rel[:, None, :]  # [B, hops or 1, L]
        blocks = torch.cat([relevant.repeat_interleave(self.burstiness, dim=1), distractors], 1)
        blocks = blocks.gather(1, order[:, :, None].expand(B, self.n_blocks, L))
        if self.kind == "ioi":
            query, target = rel[:, 1:2], rel[:, 0]
        else:  # recall, khop: [z0] -> z_last; ngram, conditional: all but the last -> the last
            query, target = rel[:, :self.query_len], rel[:, -1]
        tokens = self._lay_out(blocks, query, gaps, fills)
        positions = torch.arange(self.seq_len, device=device)[None, :] + offset[:, None]
        positions = torch.where(positions >= self.seq_len, positions - self.seq_len, positions)  # offset < seq_len
        return BlockListSample(tokens, positions, target, is_rare, canon[:, 0] & ~is_rare)

    def _lay_out(self, blocks: torch.Tensor, query: torch.Tensor, gaps: torch.Tensor, fills: torch.Tensor
                 ) -> torch.Tensor:
        """Blocks in order with fillers in their gaps (filler f before block gaps[f]; gap n_blocks: before the
        query), then the query; BOS first with bos=True: [B, L]."""
        B, nb, k = blocks.shape
        device = blocks.device
        tokens = torch.cat([blocks.flatten(1), query], 1)  # [B, nb * k + q]
        if self.n_fill:
            before = (gaps[:, None, :] <= torch.arange(nb + 1, device=device)[None, :, None]).sum(-1)  # [B, nb + 1]
            starts = torch.arange(nb + 1, device=device)[None, :] * k + before  # block i starts here; nb: the query
            cols = torch.cat([(starts[:, :nb, None] + torch.arange(k, device=device)).flatten(1),
                              starts[:, nb:] + torch.arange(self.query_len, device=device)], 1)
            L = nb * k + self.query_len + self.n_fill
            is_content = torch.zeros(B, L, dtype=torch.bool, device=device).scatter(1, cols, True)
            placed = torch.zeros(B, L, dtype=torch.long, device=device).scatter(1, cols, tokens)
            # the f-th free position of a row holds filler f
            rank = ((~is_content).long().cumsum(1) - 1).clamp(0, self.n_fill - 1)
            fill_tokens = self.n_common + self.n_rare + fills.gather(1, rank)
            tokens = torch.where(is_content, placed, fill_tokens)
        if self.bos:
            tokens = torch.cat([torch.full((B, 1), self.bos_token, dtype=torch.long, device=device), tokens], 1)
        return tokens

    # ------------------------------------------------------------ sampling and enumeration
    def sample(self, n: int, seed: int) -> BlockListSample:
        if not (isinstance(n, int) and n >= 1):
            raise ValueError(f"BlockListTask.sample: n={n!r} must be an integer >= 1")
        gen = torch.Generator().manual_seed(int(seed))
        return self.assemble(self.draw_choices(n, gen))

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

    @classmethod
    def batch_sampler(cls, tasks, keys, device="cpu") -> "BlockListSampler":
        """The training batches of members with these tasks (one each; knobs may differ)."""
        return BlockListSampler(tasks, keys, device)

    def train_batch(self, step: int, batch_size: int, seed: int) -> Batch:
        """The batch of the member with stream key `seed` at `step` (`BlockListSampler`)."""
        return one_member_batch(self, step, batch_size, seed)

    def reference_batch(self, step: int, batch_size: int, seed: int) -> Batch:
        """The batch before issue 36: every choice drawn by torch.multinomial from a torch.Generator seeded
        from (seed, step), then `assemble`. The same distribution as `train_batch` (tests compare them)."""
        return self.batch(self.assemble(self.draw_choices(check_batch_size(batch_size), step_generator(seed, step))))

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
    """Lehmer codes u_j in [0, n - j) -> the first len(codes) elements of a permutation of range(n): [B, len].

    Element j is the u_j-th smallest of those not taken before it. From the last code to the first, every
    later element at or above an earlier one moves up by one: len(codes) vectorised steps, no sorting.
    The steps run on a [len, B] copy in the smallest integer type that holds n (every step then reads and
    writes contiguous rows, a few bytes per element, and no int64 is made from the bool comparison).
    """
    if not codes:
        return torch.zeros(0, 0, dtype=torch.long)
    dtype = _small_int_dtype(n)
    x = torch.stack(codes, 0).to(dtype)  # [len, B]
    for j in range(len(codes) - 2, -1, -1):
        x[j + 1:] += x[j + 1:] >= x[j]
    return x.T.to(torch.long, memory_format=torch.contiguous_format)


def _small_int_dtype(n: int) -> torch.dtype:
    """The smallest signed integer type that holds every value in [0, n]."""
    for dtype in (torch.int8, torch.int16, torch.int32):
        if n <= torch.iinfo(dtype).max:
            return dtype
    return torch.long


# ---------------------------------------------------------------- the batched training stream

SITE_ROWS = 0  # the stream site of a batch's rows


def structure(task: BlockListTask) -> tuple:
    """What fixes the shape of a task's sequences and choices: every knob but the probabilities (f_r, f_v,
    zipf), and whether rare chains occur at all."""
    spec = task.spec()
    return tuple(sorted((k, v) for k, v in spec.items() if k not in ("f_r", "f_v", "zipf"))) + (task.f_r > 0,)


class BlockListSampler:
    """Training batches of K members at once, each on its own BlockListTask, from the counter-based stream
    (`tasks.draws`). Capturable (see `tasks.draws`).

    Members whose tasks share a `structure` are one group, made in one call of `BlockListTask.assemble`;
    within a group the knobs that only set probabilities (f_r, f_v, zipf) differ per member. Row r of a member
    reads one word per choice of `choices()` at (key, step, SITE_ROWS, r, column j of choice j) and draws the
    choice from the member's law of it (`draws.below` where the law is uniform, else `draws.categorical`):
    the very choices `draw_choices` draws with a torch.Generator, then the same `assemble`.
    """

    capturable = multi_step = True

    def __init__(self, tasks, keys, device="cpu"):
        self.device = torch.device(device)
        shapes = {(t.seq_len, t.vocab_size, t.n_outputs) for t in tasks}
        if len(shapes) != 1:
            raise ValueError(f"the members' block-list tasks must share seq_len, vocab_size and n_outputs for one "
                             f"model, got {sorted(shapes)}")
        groups: dict[tuple, list[int]] = {}
        for k, t in enumerate(tasks):
            groups.setdefault(structure(t), []).append(k)
        self.groups = [_Group([tasks[k] for k in members], [keys[k] for k in members], self.device)
                       for members in groups.values()]
        order = [k for members in groups.values() for k in members]
        self.inverse = torch.tensor(order, device=self.device).argsort()  # group order -> member order

    def __call__(self, step, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [K, B, T], labels [K, B]); with a list of S steps, [K, S * B, ...] (rows step-major)."""
        B = check_batch_size(batch_size)
        return self._members([g(step, B) for g in self.groups])

    def torch_form(self, step, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The same batches by torch ops only (every group's kernel set aside)."""
        B = check_batch_size(batch_size)
        return self._members([g.torch_form(step, B) for g in self.groups])

    def _members(self, made: list) -> tuple[torch.Tensor, torch.Tensor]:
        """The groups' batches in member order."""
        if len(made) == 1:
            return made[0]
        return tuple(torch.cat(parts).index_select(0, self.inverse) for parts in zip(*made))


class _Group:
    """Members whose tasks share one structure: their words, choices and sequences."""

    def __init__(self, tasks, keys, device):
        self.task = tasks[0]
        self.stream = draws.Stream(keys, device)
        self._streams: dict[tuple[int, int], draws.Stream] = {(0, len(keys)): self.stream}  # by member range
        laws = [[p.tolist() for _, p in t.choices()] for t in tasks]  # [member][choice] probabilities
        self.names = [name for name, _ in self.task.choices()]
        # every choice as if uniform over its outcomes; then the others, runs of neighbouring choices with one
        # law per member alike (the canon links) drawn together, overwrite theirs
        self.sizes = torch.tensor([len(p) for p in laws[0]], device=device)
        self.laws: list[tuple[slice, torch.Tensor]] = []
        for j, name in enumerate(self.names):
            if all(len(set(m[j])) == 1 for m in laws):
                continue
            law = [m[j] for m in laws]
            if self.laws and self.laws[-1][0].stop == j and self.laws[-1][2] == law:
                self.laws[-1] = (slice(self.laws[-1][0].start, j + 1), *self.laws[-1][1:])
            else:
                thresholds = torch.tensor([draws.cumulative_thresholds(p) for p in law], device=device)
                self.laws.append((slice(j, j + 1), thresholds[:, None, None, :], law))

        self.native = native.kernel_for(self, native.BlockListKernel, SITE_ROWS)

    @property
    def device(self) -> torch.device:
        return self.stream.device

    def __call__(self, step, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.native is not None and not torch.is_tensor(step):  # the same batches, fused (`tasks.native`)
            return self.native(step, B)
        return self.torch_form(step, B)

    def torch_form(self, step, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batches by torch ops: the definition, and the form of every device but the CPU."""
        make = lambda lo, hi, steps: self._make(lo, hi, steps, B)  # noqa: E731
        return row_chunks.made_in_chunks(make, self.stream.n_members, step, B, self.stream.device,
                                         row_bytes=8 * len(self.names))  # int64 words, one per choice

    def _make(self, lo: int, hi: int, step, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Members lo..hi-1 of the group: (tokens [hi - lo, rows, T], labels [hi - lo, rows])."""
        t = self.task
        if (lo, hi) not in self._streams:
            self._streams[(lo, hi)] = row_chunks.member_stream(self.stream, lo, hi)
        w = self._streams[(lo, hi)].words(step, SITE_ROWS, B, len(self.names))  # [k, rows, choices]
        K, rows = w.shape[:2]
        values = draws.below(w, self.sizes)
        for cols, thresholds, _ in self.laws:
            values[..., cols] = draws.categorical(w[..., cols], thresholds[lo:hi])
        values = values.view(K * rows, -1).T.contiguous()  # [choices, rows]: each choice's values contiguous
        s = t.assemble({name: values[j] for j, name in enumerate(self.names)})
        return t.model_inputs(s).view(K, rows, t.seq_len), s.targets.view(K, rows)


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
