"""Attention patterns and the shape of query-key forms, for any HookedRootModule.

`attention_patterns` reads `blocks.{l}.attn.hook_pattern` (TransformerLens names);
`top_key_share` asks whether a query attends to the keys it should more than to any other;
`diagonal_argmax_fraction` and `template_cosine` say how identity-like (or how much like any
template) a bilinear form read on a set of embeddings is.
"""
from __future__ import annotations

import torch


@torch.no_grad()
def attention_patterns(model, tokens: torch.Tensor, layers=None, batch_size: int = 1024) -> list[torch.Tensor]:
    """Attention patterns [B, heads, query, key] of each layer in `layers` (default: all), on the CPU."""
    layers = list(range(model.cfg.n_layers)) if layers is None else list(layers)
    names = [f"blocks.{i}.attn.hook_pattern" for i in layers]
    out = [[] for _ in names]
    for start in range(0, len(tokens), batch_size):
        _, cache = model.run_with_cache(tokens[start:start + batch_size], names_filter=lambda n: n in names,
                                        return_cache_object=False)
        for i, n in enumerate(names):
            out[i].append(cache[n].float().cpu())
    return [torch.cat(x) for x in out]


def top_key_share(rows: torch.Tensor, targets: torch.Tensor) -> float:
    """Share of target keys that get more attention than every non-target key of their row.

    rows [B, K]: one query's attention over its keys per row; targets [B, K] bool: the keys the
    query should read (one or several per row). Each target counts once; a row without a
    non-target key counts its targets as above. NaN when there is no target at all.
    A uniform pattern scores 0 (a tie is not "more"); a random one about 1 / (keys per row).
    """
    rows, targets = torch.as_tensor(rows, dtype=torch.float64), torch.as_tensor(targets, dtype=torch.bool)
    if rows.shape != targets.shape or rows.dim() != 2:
        raise ValueError(f"rows and targets must both be [B, K]; got {tuple(rows.shape)} and {tuple(targets.shape)}")
    if not targets.any():
        return float("nan")
    best_other = torch.where(targets, -torch.inf, rows).max(1, keepdim=True).values
    above = (rows > best_other) & targets
    return float(above.sum() / targets.sum())


def diagonal_argmax_fraction(M: torch.Tensor) -> float:
    """Fraction of rows whose largest entry is on the diagonal (1.0 for an identity-like matrix)."""
    M = torch.as_tensor(M)
    return float((M.argmax(1) == torch.arange(M.shape[0])).float().mean())


def double_centre(M: torch.Tensor) -> torch.Tensor:
    """M minus its row means and column means, plus its grand mean (float64)."""
    M = torch.as_tensor(M, dtype=torch.float64)
    return M - M.mean(0, keepdim=True) - M.mean(1, keepdim=True) + M.mean()


def template_cosine(M: torch.Tensor, template: torch.Tensor | None = None) -> float:
    """Cosine between the double-centred M and the double-centred template (default identity).

    Double centring removes row and column offsets (a constant, a per-query or per-key bias), so
    a*T + b*J + row/column terms scores 1 for a > 0, -1 for a < 0, and a matrix without T's
    structure about 0. NaN if either centred matrix is zero.
    """
    M = double_centre(M)
    T = double_centre(torch.eye(M.shape[0], device=M.device) if template is None else template)
    if T.shape != M.shape:
        raise ValueError(f"template has shape {tuple(T.shape)}; M has {tuple(M.shape)}")
    denom = M.norm() * T.norm()
    return float((M * T).sum() / denom) if denom > 0 else float("nan")
