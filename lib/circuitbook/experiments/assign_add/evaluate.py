"""The chapter's evaluation callbacks and the progress measures they log (in the key of the runs they evaluate).

`ProgressEvaluator` (the main run: every pool's accuracy and the routing measures of AA-2, AA-10, AA-11)
and `sweep_evaluator` (the f and r sweeps: per-member pools). The measures the main run logs over training
live here, beside the callback, because this file is part of that run's key: `routing_score`,
`bound_attention`, `bound_over_values_share`, `addends_top_share`, `variable_qk_matrix` (the notebooks
apply the same functions to any ToyTransformer, through the package).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from ...analysis import attention
from ...models.toy import ToyTransformer
from ...tasks.assign_add import N_VARS, PREFIX_LEN, AssignAddTask
from ...tasks.base import Batch
from ...training import Ensemble, Evaluator, tensor_digest

# The logged measures compute through the attention-pattern and QK summaries of analysis/attention.py:
# that file is part of what the main run computes, so it enters the run's key with this one.
RUN_KEY_SOURCES = ("analysis/attention.py",)


MEASURES_VERSION = 3  # bump when ProgressEvaluator's measures change meaning (it is part of the run key)


TWO_VAR_POOLS = ("two_var_train", "two_var_add_restricted", "two_var_var_restricted_one",
                 "two_var_var_restricted_two")


def eval_pools(task: AssignAddTask, size: int, seed: int = 1) -> dict[str, Batch]:
    """The nine pools plus the exact held-out 0-var set (`heldout_zero_var`), pool seed `seed`."""
    pools = task.eval_pools(size=size, seed=seed)
    pools["heldout_zero_var"] = task.heldout_zero_var(seed=seed)
    return {k: v for k, v in pools.items() if len(v.labels)}


@torch.no_grad()
def pool_accuracies(model: ToyTransformer, pools: dict[str, Batch], chunk: int = 4096) -> dict[str, float]:
    """Last-position accuracy of one model on each pool."""
    out = {}
    for name, batch in pools.items():
        pred = torch.cat([model(batch.tokens[i:i + chunk], last_only=True)[:, -1].argmax(-1)
                          for i in range(0, len(batch.labels), chunk)])
        out[name] = float((pred == batch.labels).float().mean())
    return out


def value_positions(tokens: torch.Tensor, task: AssignAddTask) -> torch.Tensor:
    """Bool [B, T]: positions of the number token of a prefix assignment `var value`."""
    is_var = (tokens[:, :PREFIX_LEN] >= task.VAR0)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, 1:PREFIX_LEN + 1] = is_var  # the value sits right after its variable
    return mask


def bound_targets(tokens: torch.Tensor, task: AssignAddTask) -> torch.Tensor:
    """Bool [B, T]: positions of the value token(s) bound to the query's variable operand(s)."""
    parsed = task.parse(tokens)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    for key in ("left_pos", "right_pos"):
        pos = parsed[key]
        ok = pos >= 0
        mask[ok.nonzero()[:, 0], pos[ok]] = True
    return mask


def routing_score(pattern0: torch.Tensor, tokens: torch.Tensor, task: AssignAddTask) -> torch.Tensor:
    """Per head: mean layer-1 attention of an assigned number token to the variable right before it.

    pattern0 [B, H, Q, K] (layer 1 = blocks.0). Averaged over every assignment of every sequence.
    1 means a perfect previous-token head on constants; uniform attention gives about 1/(p+1).
    """
    b, p = value_positions(tokens, task).nonzero(as_tuple=True)
    return pattern0[b, :, p, p - 1].mean(0)


def bound_attention(pattern1: torch.Tensor, tokens: torch.Tensor, task: AssignAddTask) -> torch.Tensor:
    """Per head: mean over sequences with a variable operand of the attention of `=` (the last
    query) in layer 2 to the value token(s) bound to the variable operand(s), summed for 2-var.
    NaN if no sequence has a variable operand."""
    targets = bound_targets(tokens, task)
    has = targets.any(1)
    if not has.any():
        return torch.full((pattern1.shape[1],), float("nan"))
    row = pattern1[:, :, -1]  # [B, H, K]
    return (row * targets[:, None]).sum(-1)[has].mean(0)


def addend_targets(tokens: torch.Tensor, task: AssignAddTask) -> torch.Tensor:
    """Bool [B, T]: the keys that hold the two addends of the query: the value(s) bound to its
    variable operand(s) and, where an operand is a number, that operand's own token in the query."""
    mask = bound_targets(tokens, task)
    parsed = task.parse(tokens)
    for side, pos in (("left_var", PREFIX_LEN + 1), ("right_var", PREFIX_LEN + 2)):
        mask[:, pos] |= parsed[side] < 0  # a number operand is an addend itself
    return mask


def prefix_keys(tokens: torch.Tensor) -> torch.Tensor:
    """Bool [B, T]: the positions of the prefix (assignments and PADs), before the query core."""
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, :PREFIX_LEN] = True
    return mask


def addends_top_share(pattern1: torch.Tensor, tokens: torch.Tensor, task: AssignAddTask, head: int = 0) -> float:
    """Share of the addends (`addend_targets`: bound value(s) and number operands) that get more
    layer-2 attention from `=` than every other prefix key (distractor values, variable tokens,
    PADs): AA-11's "`=` attends to the constant bound to the queried variable", with the other
    addend, which `=` must read too, not counted as a competitor. Where both addends are read
    equally, both count (`analysis.attention.top_key_share`). A random pattern scores about 1/12."""
    targets = addend_targets(tokens, task)
    return attention.top_key_share(pattern1[:, head, -1], targets, prefix_keys(tokens) & ~targets)


def bound_over_values_share(pattern1: torch.Tensor, tokens: torch.Tensor, task: AssignAddTask,
                            head: int = 0) -> float:
    """Share of bound values that get more layer-2 attention from `=` than every other assigned
    value of the prefix: specific to binding (attention to all the prefix's numbers rises early,
    before `=` tells them apart), so it times AA-2's "`=` starts to attend to the bound value".
    A pattern that spreads over the values at random scores about E[1/k] (k assignments)."""
    targets = bound_targets(tokens, task)
    return attention.top_key_share(pattern1[:, head, -1], targets, value_positions(tokens, task) & ~targets)


def variable_qk_matrix(model: ToyTransformer, task: AssignAddTask, composed: bool = True, head: int = 0,
                       layer: int = 1) -> torch.Tensor:
    """[12, 12] layer-2 attention score between variables: rows the queried variable, columns the
    variable of a key.

    composed=True (the mechanism): both sides are the variable embeddings after the layer-1 OV
    circuit, e_v W_V^1 W_O^1, because that is how a variable reaches layer 2 - at `=` through
    layer-1 attention to the operand token, at an assigned number through its previous-token
    attention to the variable. composed=False uses the raw embeddings e_v. The score is
    x_q W_Q W_K^T x_k^T / sqrt(d_head), the pre-softmax logit it adds.
    """
    E = model.W_E[task.VAR0:task.VAR0 + N_VARS].detach()
    if composed:
        a0 = model.blocks[0].attn
        E = E @ torch.einsum("hde,hef->df", a0.W_V.detach(), a0.W_O.detach())
    attn = model.blocks[layer].attn
    scale = model.cfg.attn_scale if model.cfg.attn_scale is not None else math.sqrt(model.cfg.head_dim)
    return (E @ attn.W_Q[head].detach()) @ (E @ attn.W_K[head].detach()).T / scale


class ProgressEvaluator(Evaluator):
    """Evaluation callback of the main run: accuracy of every pool and the progress measures.

    Per member it returns `acc_<pool>` for the nine pools and the exact held-out 0-var set, and
      routing      layer-1 previous-token attention of assigned numbers (`routing_score`, AA-10),
      bound_1var   layer-2 attention of `=` to the bound value, 1-var sequences (`bound_attention`),
      bound_2var   the same summed over both operands, 2-var sequences,
      bound_over_values  share of bound values that `=` reads more than every other assigned value
                   (`bound_over_values_share`, mean of 1- and 2-var: AA-2's timing),
      addends_top  share of addends that `=` reads more than every other prefix key
                   (`addends_top_share`, mean of 1- and 2-var: AA-11 over training),
      qk_diag      `diagonal_argmax_fraction` of the composed `variable_qk_matrix`,
      qk_identity  `template_cosine` of that matrix with the identity.
    Its spec() (part of the run key) holds digests of every pool and of the probes, and MEASURES_VERSION.
    """

    def __init__(self, task: AssignAddTask, pool_size: int = 2000, probe_size: int = 512, seed: int = 1):
        super().__init__(eval_pools(task, pool_size, seed))
        self.task = task
        self.probe = {"1var": task.eval_pool("one_var_train", probe_size, seed + 1000).tokens,
                      "2var": task.eval_pool("two_var_train", probe_size, seed + 1000).tokens}

    def settings(self) -> dict:
        return {"assign_add_progress": MEASURES_VERSION, "probe": {k: tensor_digest(v) for k, v in self.probe.items()}}

    @torch.no_grad()
    def model_measures(self, model: ToyTransformer) -> dict[str, float]:
        """The progress measures of one model."""
        out, over_values, addends = {}, [], []
        for kind, tokens in self.probe.items():
            p0, p1 = attention.attention_patterns(model, tokens)
            if kind == "1var":
                out["routing"] = float(routing_score(p0, tokens, self.task).max())
            out[f"bound_{kind}"] = float(bound_attention(p1, tokens, self.task).max())
            over_values.append(bound_over_values_share(p1, tokens, self.task))
            addends.append(addends_top_share(p1, tokens, self.task))
        out["bound_over_values"] = float(np.mean(over_values))
        out["addends_top"] = float(np.mean(addends))
        qk = variable_qk_matrix(model, self.task)
        out["qk_diag"] = attention.diagonal_argmax_fraction(qk)
        out["qk_identity"] = attention.template_cosine(qk)
        return out

    def evaluate_model(self, model: ToyTransformer) -> dict[str, float]:
        """The same metrics for one model (a checkpoint of a released run)."""
        acc = pool_accuracies(model, self.pools)
        return {**{f"acc_{k}": v for k, v in acc.items()}, **self.model_measures(model)}

    def measures(self, ens: Ensemble, step: int) -> dict:
        per_member = []
        with torch.random.fork_rng(devices=[]):  # building a member model draws (unused) init weights
            for k in range(ens.n_members):
                per_member.append(self.model_measures(ens.member(k)))
        return {name: torch.tensor([m[name] for m in per_member]) for name in per_member[0]}


def sweep_evaluator(tasks: Sequence[AssignAddTask], pool_size: int) -> Evaluator:
    """Per member (each with its own pair split): exact held-out 0-var accuracy, 0-var training-pair
    accuracy and the 2-var union accuracy (the four 2-var pools together)."""
    pools = {"heldout_zero_var": [], "zero_var_train": [], "two_var_union": []}
    for t in tasks:
        pools["heldout_zero_var"].append(t.heldout_zero_var(seed=1))
        pools["zero_var_train"].append(t.eval_pool("zero_var_train", pool_size, 1))
        two = [b for b in (t.eval_pool(p, pool_size, 1) for p in TWO_VAR_POOLS) if len(b.labels)]
        pools["two_var_union"].append(Batch(torch.cat([b.tokens for b in two]), torch.cat([b.labels for b in two])))
    return Evaluator(pools)
