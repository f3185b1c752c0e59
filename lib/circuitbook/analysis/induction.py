"""Induction-head progress measures of a standard 2-layer, 1-head transformer, with the token sets chosen.

`analysis.imir.progress_measures` reads beta~ and gamma~ on one token set (by default the tokens that are
also outputs). A task whose layer 2 matches one kind of token and copies another (Assign and Add matches
variables and reads numbers) needs the two apart; and a placebo of alpha~ at another offset says how much of
a correlation with alpha~ is specific to the previous token.

    positional_score(model, offset)                 sum_i (p_{i-offset} W_K^1) . (p_i W_Q^1); offset 1 is alpha~
    induction_measures(model, match_ids, copy_ids)  alpha~, beta~ on match_ids, gamma~ on copy_ids
"""
from __future__ import annotations

from typing import Sequence

import torch


def positional_score(model, offset: int = 1, layer: int = 0, head: int = 0) -> float:
    """sum_i (p_{i-offset} W_K) . (p_i W_Q) over the learned positions p_i of `layer`'s head: how much the
    positions alone make position i attend `offset` tokens back. offset 1 is IMIR's alpha~."""
    if not (isinstance(offset, int) and 1 <= offset < model.W_pos.shape[0]):
        raise ValueError(f"offset must be an integer in [1, {model.W_pos.shape[0] - 1}], got {offset!r}")
    attn = model.blocks[layer].attn
    WP = model.W_pos.detach()
    return float(((WP[:-offset] @ attn.W_K[head].detach()) * (WP[offset:] @ attn.W_Q[head].detach())).sum())


def induction_measures(model, match_ids: Sequence[int] | None = None,
                       copy_ids: Sequence[int] | None = None) -> dict[str, float]:
    """IMIR's progress measures of a 2-layer ToyTransformer (head 0 of each layer):

    alpha~ = sum_i (p_{i-1} W_K^1) . (p_i W_Q^1)                     previous-token attention
    beta~  = sum_{t in match} (t W_V^1 W_O^1 W_K^2) . (t W_Q^2)      match of a token with its copy
    gamma~ = sum_{t in copy} (t W_V^2 W_O^2 W_U)[t]                  copy of an attended token to the output

    with t the embedding rows; `copy_ids` must be outputs. Either set defaults to every token that is also an
    output (then the values are `imir.progress_measures(model)`'s)."""
    b1, b2 = model.blocks[0].attn, model.blocks[1].attn
    WE, WU = model.W_E.detach(), model.W_U.detach()
    outputs = list(range(min(WE.shape[0], WU.shape[1])))
    match = outputs if match_ids is None else list(match_ids)
    copy = outputs if copy_ids is None else list(copy_ids)
    if any(not 0 <= t < WU.shape[1] for t in copy):
        raise ValueError(f"copy_ids must be output tokens (0..{WU.shape[1] - 1})")
    T = WE[match]
    copied = T @ b1.W_V[0].detach() @ b1.W_O[0].detach()
    beta = ((copied @ b2.W_K[0].detach()) * (T @ b2.W_Q[0].detach())).sum()
    C = WE[copy]
    out = C @ b2.W_V[0].detach() @ b2.W_O[0].detach() @ WU
    gamma = out[torch.arange(len(copy)), torch.tensor(copy)].sum()
    return {"alpha": positional_score(model, 1), "beta": float(beta), "gamma": float(gamma)}
