"""The lenses chapter's evaluation callbacks (in the key of the runs they evaluate).

    BurstEvaluator   the bursty Assign-and-Add runs (notebook 03): every member on the same ordinary pools
                     (b = 1) and on the 1-var pool of its own task
    burst_init       their init function: members with the same seed start from the same weights

Both live here because this file is part of those runs' keys (the init function's module enters the key too);
what the notebooks only read afterwards lives in `measure.py`.
"""
from __future__ import annotations

from typing import Sequence

from ...models.toy import ToyTransformer
from ...tasks.assign_add import AssignAddTask
from ...training import Evaluator

BURST_SEED_STRIDE = 1000  # member seed = seed * stride + index of b; the init reads the seed only
ORDINARY_POOLS = ("zero_var_train", "one_var_train", "two_var_train")
BURST_EVAL_VERSION = 1  # bump when BurstEvaluator's metrics change meaning


class BurstEvaluator(Evaluator):
    """Per member: `acc_<pool>` on the ordinary task's training-pair pools (0-var, 1-var, 2-var: the same
    sequences for every member, no repetition) and `acc_one_var_own`, the 1-var pool of the member's own task
    (its b). `ordinary` is the task without repetition, `tasks` one task per member."""

    def __init__(self, ordinary: AssignAddTask, tasks: Sequence[AssignAddTask], pool_size: int, seed: int = 1):
        pools = {name: ordinary.eval_pool(name, pool_size, seed) for name in ORDINARY_POOLS}
        pools["one_var_own"] = [t.eval_pool("one_var_train", pool_size, seed) for t in tasks]
        super().__init__(pools)

    def settings(self) -> dict:
        return {"lenses_burst": BURST_EVAL_VERSION}


def burst_init(model: ToyTransformer, member_seed: int) -> None:
    """Members with the same seed start from the same weights, whatever their b."""
    model.init_weights(member_seed // BURST_SEED_STRIDE)
