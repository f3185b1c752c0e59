"""The attention-only, one-hot transformer of "Leading gradient terms" (Im, Oh, Fang, Li 2026).

The residual stream is the vocabulary itself (width |V|): h^(0) = X, the one-hot rows of the
tokens, and every layer adds one causal attention read-out,

    h^(l) = h^(l-1) + softmax(Mask(h W^(l) h^T + DM(P^(l)))) h V^(l),    logits = h^(L) W_O,

with a merged query-key matrix W (|V| x |V|), a value matrix V (|V| x |V|) applied as h V, a
relative-position bias P (one value per sub-diagonal: P[k] is added to the score of query t on
key t - k) and an output matrix W_O. No scaling of the scores, no LayerNorm, no MLP, and every
weight starts at exactly zero.

Names follow TransformerLens: `blocks.{l}.attn.W_QK`, `blocks.{l}.attn.W_V`, `blocks.{l}.attn.P`
and `unembed.W_U` (the paper's W_O); hooks `blocks.{l}.hook_resid_pre`,
`blocks.{l}.attn.hook_attn_scores`, `blocks.{l}.attn.hook_pattern`, `blocks.{l}.hook_attn_out`,
`blocks.{l}.hook_resid_post`.

Speed. X is never built: the residual is carried as (tokens, D) with h = onehot(tokens) + D, so
every product with the one-hot part is an index lookup (X W = W[tokens], h W h^T gathers W at
token pairs in layer 0, X V = V[tokens], X W_O = W_U[tokens]) and only the dense part D pays for a
matrix product. A hook on a residual materialises h (and lets the hook edit it).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformer_lens import HookedRootModule
from transformer_lens.hook_points import HookPoint

from .registry import register_model


@register_model
@dataclass(frozen=True)
class OneHotConfig:
    """The paper's model: |V| = d_vocab, T = n_ctx, L = n_layers (the paper: 3000, 200, 3)."""

    d_vocab: int
    n_ctx: int
    n_layers: int = 3
    positional: bool = True  # the relative-position bias P of every layer
    init_std: float = 0.0  # the paper starts every weight at exactly zero

    def __post_init__(self):
        for name in ("d_vocab", "n_ctx", "n_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"OneHotConfig.{name}={v!r} is not allowed; expected an integer >= 1")
        if not isinstance(self.positional, bool):
            raise ValueError(f"OneHotConfig.positional={self.positional!r} is not allowed; expected True or False")
        if not (isinstance(self.init_std, (int, float)) and self.init_std >= 0):
            raise ValueError(f"OneHotConfig.init_std={self.init_std!r} is not allowed; expected a float >= 0")

    # TransformerLens-style names read by ActivationCache and friends
    @property
    def d_model(self) -> int:
        return self.d_vocab

    @property
    def n_heads(self) -> int:
        return 1

    @property
    def attn_only(self) -> bool:
        return True

    @property
    def normalization_type(self) -> None:
        return None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "OneHotConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown OneHotConfig fields {unknown}; allowed: {sorted(known)}")
        return cls(**d)

    def build(self, seed: int | None = 0) -> "OneHotTransformer":
        return OneHotTransformer(self, seed=seed)


def _hooked(hook: HookPoint) -> bool:
    """Whether anything is attached to a hook (then the residual is materialised for it)."""
    return bool(hook._forward_hooks)


def _with_hook(hook: HookPoint, tokens: torch.Tensor, dense: torch.Tensor | None, like: torch.Tensor):
    """Pass h = onehot(tokens) + dense through `hook` and return the (possibly edited) dense part.

    `like` is a [V, V] weight: it gives the vocabulary size and the dtype."""
    onehot = F.one_hot(tokens, like.shape[0]).to(like.dtype)
    h = hook(onehot if dense is None else onehot + dense)
    return h - onehot


class OneHotAttention(nn.Module):
    def __init__(self, cfg: OneHotConfig):
        super().__init__()
        V, T = cfg.d_vocab, cfg.n_ctx
        self.cfg = cfg
        self.W_QK = nn.Parameter(torch.zeros(V, V))
        self.W_V = nn.Parameter(torch.zeros(V, V))
        if cfg.positional:
            self.P = nn.Parameter(torch.zeros(T))
        self.register_buffer("mask", torch.tril(torch.ones(T, T, dtype=torch.bool)), persistent=False)
        offsets = torch.arange(T)[:, None] - torch.arange(T)[None, :]
        self.register_buffer("offsets", offsets.clamp(min=0), persistent=False)
        self.hook_attn_scores = HookPoint()  # [batch, query_pos, key_pos]
        self.hook_pattern = HookPoint()  # [batch, query_pos, key_pos]

    def forward(self, tokens: torch.Tensor, dense: torch.Tensor | None, last_only: bool = False) -> torch.Tensor:
        """The read-out softmax(...) h V of one layer, h = onehot(tokens) + dense.

        tokens [batch, T]; dense [batch, T, V] or None (layer 0: h is one-hot). Returns
        [batch, T, V], or [batch, 1, V] (the last query only) with last_only.
        """
        n = tokens.shape[-1]
        rows = slice(n - 1, n) if last_only else slice(0, n)
        queries = tokens[:, rows]
        if dense is None:  # one-hot rows: the scores are entries of W at (query token, key token)
            scores = self.W_QK[queries[:, :, None], tokens[:, None, :]]
            values = F.embedding(tokens, self.W_V)
        else:
            hW = F.embedding(queries, self.W_QK) + dense[:, rows] @ self.W_QK  # h W at the queries
            keys = tokens[:, None, :].expand(-1, hW.shape[1], -1)
            scores = hW.gather(-1, keys) + hW @ dense.transpose(-1, -2)  # (h W) h^T
            values = F.embedding(tokens, self.W_V) + dense @ self.W_V
        if self.cfg.positional:
            scores = scores + self.P[self.offsets[rows, :n]]
        scores = self.hook_attn_scores(scores.masked_fill(~self.mask[rows, :n], float("-inf")))
        pattern = self.hook_pattern(scores.softmax(-1))
        return pattern @ values


class OneHotBlock(nn.Module):
    def __init__(self, cfg: OneHotConfig):
        super().__init__()
        self.cfg = cfg
        self.attn = OneHotAttention(cfg)
        self.hook_resid_pre = HookPoint()  # [batch, pos, d_vocab]
        self.hook_attn_out = HookPoint()
        self.hook_resid_post = HookPoint()

    def forward(self, tokens, dense, last_only: bool = False):
        """(tokens, dense part of the residual) -> the dense part after this layer."""
        if _hooked(self.hook_resid_pre):
            dense = _with_hook(self.hook_resid_pre, tokens, dense, self.attn.W_V)
        out = self.hook_attn_out(self.attn(tokens, dense, last_only))
        if dense is not None:
            out = (dense[:, -1:] if last_only else dense) + out
        if _hooked(self.hook_resid_post):
            out = _with_hook(self.hook_resid_post, tokens[:, -1:] if last_only else tokens, out, self.attn.W_V)
        return out


class OneHotUnembed(nn.Module):
    def __init__(self, cfg: OneHotConfig):
        super().__init__()
        self.W_U = nn.Parameter(torch.zeros(cfg.d_vocab, cfg.d_vocab))  # the paper's output matrix W_O

    def forward(self, tokens, dense):
        return F.embedding(tokens, self.W_U) + dense @ self.W_U


class OneHotTransformer(HookedRootModule):
    """The paper's attention-only transformer on one-hot inputs (see the module docstring)."""

    def __init__(self, cfg: OneHotConfig, seed: int | None = 0):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList([OneHotBlock(cfg) for _ in range(cfg.n_layers)])
        self.unembed = OneHotUnembed(cfg)
        self.init_weights(seed)
        self.setup()

    @torch.no_grad()
    def init_weights(self, seed: int | None = 0) -> None:
        """All zero (the paper); N(0, init_std^2) from `seed` when init_std > 0 (tests, ablations)."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        for p in self.parameters():
            if self.cfg.init_std > 0:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * self.cfg.init_std)
            else:
                p.zero_()

    def forward(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """tokens [batch, T] -> logits [batch, T, d_vocab] ([batch, 1, d_vocab] with last_only)."""
        dense = None
        for i, block in enumerate(self.blocks):
            dense = block(tokens, dense, last_only and i == len(self.blocks) - 1)
        if last_only:
            tokens = tokens[:, -1:]
        if dense is None:  # no layers: logits = X W_O
            return F.embedding(tokens, self.unembed.W_U)
        return self.unembed(tokens, dense)

    def trainable_names(self) -> list[str]:
        return [n for n, _ in self.named_parameters()]

    def weights(self) -> dict[str, torch.Tensor]:
        """The paper's names: W_O, and W{l}, V{l}, P{l} per layer (views of the parameters)."""
        out = {"W_O": self.unembed.W_U}
        for l, block in enumerate(self.blocks):
            out[f"W{l}"] = block.attn.W_QK
            out[f"V{l}"] = block.attn.W_V
            if self.cfg.positional:
                out[f"P{l}"] = block.attn.P
        return out

    @property
    def W_U(self) -> torch.Tensor:
        return self.unembed.W_U

    def run_with_cache(self, *model_args, return_cache_object: bool = True, **kwargs):
        """(logits, ActivationCache) like HookedTransformer.run_with_cache."""
        from transformer_lens import ActivationCache

        out, cache = super().run_with_cache(*model_args, **kwargs)
        if return_cache_object:
            cache = ActivationCache(cache, self, has_batch_dim=not kwargs.get("remove_batch_dim", False))
        return out, cache


def reference_forward(model: OneHotTransformer, tokens: torch.Tensor) -> torch.Tensor:
    """The paper's formula written literally, with dense one-hot matrices: h^(0) = X and
    h^(l) = h + softmax(Mask(h W h^T + DM(P))) h V, logits = h^(L) W_O.

    The naive form: a test checks the model against it and `benchmarks/onehot.py` times both.
    """
    cfg = model.cfg
    T = tokens.shape[-1]
    W_O = model.unembed.W_U
    h = F.one_hot(tokens, cfg.d_vocab).to(W_O.dtype)
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=tokens.device))
    offsets = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).clamp(min=0).to(tokens.device)
    for block in model.blocks:
        attn = block.attn
        scores = h @ attn.W_QK @ h.transpose(-1, -2)
        if cfg.positional:
            scores = scores + attn.P[offsets]
        pattern = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        h = h + pattern @ (h @ attn.W_V)
    return h @ W_O
