"""Assign and Add with a burstiness knob: the queried assignment repeated in the prefix.

A variant of `tasks.assign_add` for the lenses chapter (IM-4's knob, "b sets how often the queried block
repeats", on Assign and Add). With `repeats` = b, each variable operand's assignment `x v` appears b times in
the 12-position prefix; 0-var sequences (no variable operand) are unchanged. Everything else follows the
ordinary task: the same pairs, positions, types and pools; distractors are distinct other variables with
uniform random values; the number of assignment blocks k is uniform over the counts that fit the required
ones (k in [c, 6], c = b per variable operand, plus one for the 0-var featured distractor); the blocks come
in a uniform random order with the PADs scattered at random between and around them:

    b = 2:   PAD a 40 j 18 PAD a 40 PAD PAD k 9 + a 27 =   ->   (40 + 27) mod 59 = 8

b = 1 is the ordinary task exactly (the parent's rendering, batch for batch); a 2-var query needs 2b blocks,
so b is at most 3 (at b = 3 a 2-var prefix holds its two operands' assignments and nothing else).
Only the random PAD layout is drawn for b > 1 (`make_batch(..., pads=...)` other than "random" raises).
"""
from __future__ import annotations

import torch

from .assign_add import MAX_ASSIGNMENTS, N_VARS, PREFIX_LEN, SPEC_VERSION, AssignAddTask, Queries, _require
from .base import Batch

# The batches are rendered from the parent's queries, pools and (at b = 1) its rendering: its file is part of what
# a bursty run computes, so it enters the run's key with this one.
RUN_KEY_SOURCES = ("tasks/assign_add.py", "tasks/native.py", "tasks/native.c")
BURSTY_VERSION = 1  # bump when the meaning of the repeated prefix changes
MAX_REPEATS = MAX_ASSIGNMENTS // 2  # a 2-var query needs 2b blocks


class BurstyAssignAddTask(AssignAddTask):
    """Assign and Add with each variable operand's assignment repeated `repeats` times (see the module
    docstring); the other arguments are `AssignAddTask`'s."""

    def __init__(self, repeats: int = 1, **kwargs):
        _require(isinstance(repeats, int) and not isinstance(repeats, bool) and 1 <= repeats <= MAX_REPEATS,
                 f"repeats must be an integer in [1, {MAX_REPEATS}], got {repeats!r}")
        super().__init__(**kwargs)
        self.repeats = repeats

    def spec(self) -> dict:
        return {**super().spec(), "task": "assign_add_bursty", "version": [SPEC_VERSION, BURSTY_VERSION],
                "repeats": self.repeats}

    def _render(self, q: Queries, gen: torch.Generator, n_assignments: int | None = None,
                pads: str = "random") -> Batch:
        if self.repeats == 1:
            return super()._render(q, gen, n_assignments, pads)
        _require(pads == "random", f"pads must be 'random' with repeats > 1, got {pads!r}")
        n, N, b = len(q.n1), self.modulus, self.repeats
        has_left = q.left_var >= 0
        has_right = q.right_var >= 0
        # The required variables: the left operand (or the 0-var featured distractor) and the right operand,
        # with their copy counts: b for a variable operand, 1 for the featured distractor, 0 for none.
        first_var = torch.where(has_left, q.left_var, q.featured)
        first_val = torch.where(has_left, q.n1, torch.randint(N, (n,), generator=gen))
        c_first = torch.where(has_left, b, (first_var >= 0).long())
        c_right = torch.where(has_right, b, 0)
        n_req = (first_var >= 0).long() + has_right.long()
        c_req = c_first + c_right
        if n_assignments is None:  # uniform over the block counts that fit the required copies
            k = c_req + (torch.rand(n, generator=gen) * (MAX_ASSIGNMENTS + 1 - c_req)).long()
        else:
            ok = isinstance(n_assignments, int) and bool((c_req <= n_assignments).all())
            _require(ok and n_assignments <= MAX_ASSIGNMENTS,
                     f"n_assignments must be an integer in [{int(c_req.max()) if n else 1}, {MAX_ASSIGNMENTS}] "
                     f"(it counts the repeated blocks), got {n_assignments!r}")
            k = torch.full((n,), n_assignments)

        # Distinct distractors: a random order of the variables with the required ones first.
        req = torch.stack([first_var, q.right_var], 1)
        req_col = torch.where(req >= 0, req, N_VARS)
        keys = torch.rand(n, N_VARS + 1, generator=gen).scatter(1, req_col, -1.0)
        order = keys[:, :N_VARS].argsort(1)  # [n, 12]
        values = torch.randint(N, (n, N_VARS), generator=gen)

        # Block j of a sequence: the first variable's copies, then the right operand's, then distractors.
        j = torch.arange(MAX_ASSIGNMENTS).expand(n, MAX_ASSIGNMENTS)
        d_idx = (n_req[:, None] + j - c_req[:, None]).clamp(0, N_VARS - 1)
        distractor = order.gather(1, d_idx)
        block_var = torch.where(j < c_first[:, None], first_var[:, None],
                                torch.where(j < c_req[:, None], q.right_var[:, None], distractor))
        block_val = values.gather(1, block_var.clamp(min=0))
        block_val = torch.where(j < c_first[:, None], first_val[:, None],
                                torch.where(j < c_req[:, None], q.n2[:, None], block_val))

        # Layout: 12 - k items (k blocks of two tokens and 12 - 2k PADs) in a uniform random order; item i < k
        # is block i, so the blocks' order is uniform too.
        n_slots = PREFIX_LEN - 1
        item = torch.arange(n_slots).expand(n, n_slots)
        n_items = (PREFIX_LEN - k)[:, None]
        slot_keys = torch.where(item < n_items, torch.rand(n, n_slots, generator=gen), 2.0)
        perm = slot_keys.argsort(1)  # perm[:, p]: the item at place p
        is_block = (perm < k[:, None]) & (item < n_items)
        start = (1 + is_block.long()).cumsum(1) - (1 + is_block.long())  # first token of each place
        which = perm.clamp(max=MAX_ASSIGNMENTS - 1)
        prefix = torch.full((n, PREFIX_LEN + 1), self.PAD)
        dump = torch.full_like(start, PREFIX_LEN)  # PADs and unused places write into a spare column
        prefix.scatter_(1, torch.where(is_block, start, dump), self.VAR0 + block_var.gather(1, which))
        prefix.scatter_(1, torch.where(is_block, start + 1, dump), block_val.gather(1, which))

        lhs = torch.where(has_left, self.VAR0 + q.left_var, q.n1)
        rhs = torch.where(has_right, self.VAR0 + q.right_var, q.n2)
        core = torch.stack([torch.full_like(lhs, self.PLUS), lhs, rhs, torch.full_like(lhs, self.EQ)], 1)
        return Batch(torch.cat([prefix[:, :PREFIX_LEN], core], 1), (q.n1 + q.n2) % N)
