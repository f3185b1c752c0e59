"""The main run's evaluation callback: the cosine of every weight with its leading term, every evaluation.

`CosineEvaluator` is identified by what determines the statistics (a digest of the first batch's tokens
and labels, the vocabulary size, the statistics' settings), which is cheap, and computes the statistics
on its first call (minutes at the full profile), so a run's key is known before anything is computed
(`circuitbook build --plan`).
"""
from __future__ import annotations

import torch

from ...analysis import leading_terms as lt
from ...training import Evaluator, tensor_digest

# the statistics and the weight names come from here: part of the key of every run this callback evaluates
RUN_KEY_SOURCES = ("analysis/leading_terms.py",)


class CosineEvaluator(Evaluator):
    """An evaluation callback: cos(weight, leading term) of every weight of every member.

    Logged as `cos_<weight>` (W_O, W0, V0, P0, ...). The leading-term directions are fixed (they
    come from the first batch: `lt.leading_stats(tokens, labels, vocab_size)`), so the curves need
    no checkpoint. The cosines are computed in float64 from the (float32) weights: a float32 dot
    product over |V|^2 entries errs by about 1e-5, more than the fourth decimal where the paper's
    values differ (and it can exceed 1). In float64 the error is about 1e-13; what remains above 1
    (or below -1) is clipped, as Cauchy-Schwarz says it must be.
    """

    def __init__(self, tokens: torch.Tensor, labels: torch.Tensor, vocab_size: int, attention: bool = True):
        super().__init__({})
        self.tokens, self.labels = tokens.cpu(), labels.cpu()
        self.vocab_size, self.attention = int(vocab_size), bool(attention)
        self._stats: lt.LeadingStats | None = None
        self._directions: dict[str, torch.Tensor] | None = None

    def settings(self) -> dict:
        return {"first_batch": tensor_digest(self.tokens, self.labels), "vocab_size": self.vocab_size,
                "attention": self.attention, "dtype": "float64"}

    @property
    def stats(self) -> lt.LeadingStats:
        """The maps of the first batch (computed once, on first use)."""
        if self._stats is None:
            self._stats = lt.leading_stats(self.tokens, self.labels, self.vocab_size, attention=self.attention)
        return self._stats

    @property
    def directions(self) -> dict[str, torch.Tensor]:
        if self._directions is None:
            self._directions = {kind: self.stats.direction(kind).double() for kind in lt.WEIGHT_KINDS
                                if kind in ("W_O", "V") or self.stats.Q is not None}
        return self._directions

    @torch.no_grad()
    def measures(self, ens, step: int) -> dict:
        out = {}
        directions = self.directions
        for param, value in ens.params.items():
            name = lt.weight_name(param)
            if name is None or lt.kind_of(name) not in directions:
                continue
            d = directions[lt.kind_of(name)].to(value.device).flatten()
            flat = value.detach().double().flatten(1)  # [K, n]
            dots = flat @ d
            norms = flat.norm(dim=1) * d.norm()
            cos = (dots / norms.clamp(min=1e-300)).clamp(-1.0, 1.0)
            out[f"cos_{name}"] = torch.where(norms > 0, cos, torch.nan).cpu()
        return out
