"""The book's one small transformer, on TransformerLens's HookedRootModule.

Weight and hook names follow TransformerLens (`embed.W_E`, `blocks.0.attn.W_Q`
of shape [n_heads, d_model, d_head], `blocks.1.mlp.hook_pre`, ...), so
`run_with_cache`, `ActivationCache`, `FactoredMatrix` and the patching tools
work unchanged. Every variant the papers need is a field of `ToyConfig`.
The forward pass has no data-dependent Python control flow, so it runs under
`torch.func.vmap` for ensemble training.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformer_lens import ActivationCache, FactoredMatrix, HookedRootModule
from transformer_lens.hook_points import HookPoint

from .registry import register_model

POSITIONAL = ("learned", "relative", "none")
NORMALIZATION = (None, "LN", "postLN")
ACT_FNS = ("relu", "gelu")
# How the weights start (`ToyConfig.init`): "normal", every W_* ~ N(0, init_std^2) with zero biases (the book's
# first choice); "pytorch", what the same model built from PyTorch modules starts with (nn.Embedding token and
# position embeddings, nn.TransformerEncoderLayer attention and feed-forward, an nn.Linear readout), see
# `ToyTransformer.init_weights`.
INIT_SCHEMES = ("normal", "pytorch")
# init "pytorch": the authors' position embedding is an nn.Embedding of this many rows, of which a model reads
# the first n_ctx; its draws come before every layer's, so its size decides every later weight.
PYTORCH_POSITION_ROWS = 64


@register_model
@dataclass(frozen=True)
class ToyConfig:
    d_vocab: int
    n_ctx: int
    d_model: int
    n_layers: int = 1
    n_heads: int = 1
    d_head: int | None = None  # default d_model // n_heads
    d_mlp: int = 0
    mlp: tuple[bool, ...] | bool = True  # per layer; no MLP anywhere when d_mlp == 0
    d_vocab_out: int | None = None  # default d_vocab
    act_fn: str = "relu"
    bias: bool = True
    normalization: str | None = None  # "LN" (pre-norm + final LN), "postLN" (LN after each residual add) or None
    positional: str = "learned"  # learned absolute, relative bias per head, or none
    one_hot_embed: bool = False  # W_E = identity (frozen); needs d_model == d_vocab
    merged_qk: bool = False  # one W_QK [n_heads, d_model, d_model] per layer
    frozen: tuple[str, ...] = ()  # parameter-name patterns the optimizer never updates
    attn_scale: float | None = None  # default sqrt(d_head)
    init_std: float | None = None  # init "normal": default 1 / sqrt(d_model); 0 = all-zero init
    init: str = "normal"  # one of INIT_SCHEMES
    layer_norm_eps: float = 1e-5
    dropout: float = 0.0  # in training mode only: attention pattern, attention out, MLP hidden, MLP out

    def __post_init__(self):
        def check(ok, name, allowed):
            if not ok:
                raise ValueError(f"ToyConfig.{name}={getattr(self, name)!r} is not allowed; expected {allowed}")

        for name in ("d_vocab", "n_ctx", "d_model", "n_layers", "n_heads"):
            check(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, name, "an integer >= 1")
        check(self.positional in POSITIONAL, "positional", f"one of {POSITIONAL}")
        check(self.normalization in NORMALIZATION, "normalization", f"one of {NORMALIZATION}")
        check(self.act_fn in ACT_FNS, "act_fn", f"one of {ACT_FNS}")
        check(self.init in INIT_SCHEMES, "init", f"one of {INIT_SCHEMES}")
        check(self.init != "pytorch" or self.init_std is None, "init_std",
              "None with init='pytorch' (PyTorch's defaults fix every scale)")
        check(self.init != "pytorch" or not self.merged_qk, "merged_qk",
              "False with init='pytorch' (PyTorch has no merged query-key module)")
        check(self.d_mlp >= 0, "d_mlp", "an integer >= 0")
        check(isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1, "dropout", "a number in [0, 1)")
        check(self.d_head is None or self.d_head >= 1, "d_head", "None or an integer >= 1")
        check(not self.one_hot_embed or self.d_model == self.d_vocab, "one_hot_embed",
              f"False unless d_model == d_vocab ({self.d_model} != {self.d_vocab})")
        mlp = self.mlp if isinstance(self.mlp, bool) else tuple(self.mlp)
        if not isinstance(mlp, bool):
            check(len(mlp) == self.n_layers, "mlp", f"a bool or {self.n_layers} bools (one per layer)")
        object.__setattr__(self, "mlp", mlp)
        object.__setattr__(self, "frozen", tuple(self.frozen))

    @property
    def head_dim(self) -> int:
        return self.d_head or self.d_model // self.n_heads

    @property
    def out_dim(self) -> int:
        return self.d_vocab_out or self.d_vocab

    @property
    def attn_only(self) -> bool:  # TransformerLens name, read by ActivationCache
        return not any(self.has_mlp(layer) for layer in range(self.n_layers))

    @property
    def normalization_type(self) -> str | None:  # TransformerLens name
        return self.normalization

    def has_mlp(self, layer: int) -> bool:
        on = self.mlp if isinstance(self.mlp, bool) else self.mlp[layer]
        return on and self.d_mlp > 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mlp"] = self.mlp if isinstance(self.mlp, bool) else list(self.mlp)
        d["frozen"] = list(self.frozen)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ToyConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ToyConfig fields {unknown}; allowed: {sorted(known)}")
        d = dict(d)
        if isinstance(d.get("mlp"), list):
            d["mlp"] = tuple(d["mlp"])
        if "frozen" in d:
            d["frozen"] = tuple(d["frozen"])
        return cls(**d)

    def build(self, seed: int | None = 0) -> "ToyTransformer":
        """The model this config describes, weights drawn from `seed` (None: uninitialised draw)."""
        return ToyTransformer(self, seed=seed)


class LayerNorm(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.eps = cfg.layer_norm_eps
        self.w = nn.Parameter(torch.ones(cfg.d_model))
        self.b = nn.Parameter(torch.zeros(cfg.d_model))
        self.hook_scale = HookPoint()  # [batch, pos, 1]
        self.hook_normalized = HookPoint()  # [batch, pos, d_model]

    def forward(self, x):
        if not self.hook_scale._forward_hooks:  # nothing reads the scale: PyTorch's fused kernel
            return self.hook_normalized(F.layer_norm(x, x.shape[-1:], self.w, self.b, self.eps))
        x = x - x.mean(-1, keepdim=True)
        scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return self.hook_normalized(x / scale * self.w + self.b)


def _linear(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W (+ b) for W [d_in, d_out], as one fused GEMM (bias included).

    The leading dims are flattened first: under vmap (the ensemble) a 3-D x with a
    batched W would otherwise broadcast W over the batch, and its gradient would be
    built as one [d_in, d_out] outer product per sequence, then summed.
    """
    return F.linear(x.reshape(-1, x.shape[-1]), W.T, b).unflatten(0, x.shape[:-1])


def _per_head(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [batch, pos, d_model] @ W [head, d_model, d_head] (+ b [head, d_head]) -> [batch, pos, head, d_head].

    All heads in one GEMM: the einsum form would copy the activations to reorder them.
    """
    h, d, e = W.shape
    out = _linear(x, W.permute(1, 0, 2).reshape(d, h * e), None if b is None else b.reshape(h * e))
    return out.unflatten(-1, (h, e))


class Attention(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        h, d, dh = cfg.n_heads, cfg.d_model, cfg.head_dim
        self.cfg = cfg
        if cfg.merged_qk:
            self.W_QK = nn.Parameter(torch.empty(h, d, d))
        else:
            self.W_Q = nn.Parameter(torch.empty(h, d, dh))
            self.W_K = nn.Parameter(torch.empty(h, d, dh))
            if cfg.bias:
                self.b_Q = nn.Parameter(torch.zeros(h, dh))
                self.b_K = nn.Parameter(torch.zeros(h, dh))
        self.W_V = nn.Parameter(torch.empty(h, d, dh))
        self.W_O = nn.Parameter(torch.empty(h, dh, d))
        if cfg.bias:
            self.b_V = nn.Parameter(torch.zeros(h, dh))
            self.b_O = nn.Parameter(torch.zeros(d))
        if cfg.positional == "relative":
            # P[h, k]: added to the score of query i on key i - k (the k-th sub-diagonal)
            self.P = nn.Parameter(torch.zeros(h, cfg.n_ctx))
        self.register_buffer("mask", torch.tril(torch.ones(cfg.n_ctx, cfg.n_ctx, dtype=torch.bool)), persistent=False)
        offsets = torch.arange(cfg.n_ctx)[:, None] - torch.arange(cfg.n_ctx)[None, :]
        self.register_buffer("offsets", offsets.clamp(min=0), persistent=False)
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        self.hook_attn_scores = HookPoint()  # [batch, head, query_pos, key_pos]
        self.hook_pattern = HookPoint()  # [batch, head, query_pos, key_pos]
        self.hook_z = HookPoint()  # [batch, pos, head, d_head]

    @property
    def QK(self) -> FactoredMatrix:
        """Bilinear query-key map per head, [n_heads, d_model, d_model]."""
        if self.cfg.merged_qk:
            return FactoredMatrix(self.W_QK, torch.eye(self.cfg.d_model, device=self.W_QK.device).expand_as(self.W_QK))
        return FactoredMatrix(self.W_Q, self.W_K.transpose(-1, -2))

    @property
    def OV(self) -> FactoredMatrix:
        return FactoredMatrix(self.W_V, self.W_O)

    def forward(self, x, last_only: bool = False):
        """x [batch, pos, d_model] -> [batch, pos, d_model]; with last_only, queries only at the last position."""
        cfg = self.cfg
        n = x.shape[-2]
        rows = slice(n - 1, n) if last_only else slice(0, n)
        xq = x[:, rows]
        scale = cfg.attn_scale if cfg.attn_scale is not None else math.sqrt(cfg.head_dim)
        v = self.hook_v(_per_head(x, self.W_V, self.b_V if cfg.bias else None))
        if cfg.merged_qk:
            q = self.hook_q(_per_head(xq, self.W_QK))
            k = self.hook_k(x.unsqueeze(-2).expand(*x.shape[:-1], cfg.n_heads, cfg.d_model))
        else:
            q = self.hook_q(_per_head(xq, self.W_Q, self.b_Q if cfg.bias else None))
            k = self.hook_k(_per_head(x, self.W_K, self.b_K if cfg.bias else None))
        scores = (q.transpose(1, 2) @ k.permute(0, 2, 3, 1)) / scale  # [batch, head, query, key]
        if cfg.positional == "relative":
            scores = scores + self.P[:, self.offsets[rows, :n]]
        scores = self.hook_attn_scores(scores.masked_fill(~self.mask[rows, :n], float("-inf")))
        pattern = _dropout(self.hook_pattern(scores.softmax(-1)), cfg.dropout, self.training)
        z = self.hook_z((pattern @ v.transpose(1, 2)).transpose(1, 2))  # [batch, query, head, d_head]
        return _linear(z.flatten(-2), self.W_O.flatten(0, 1), self.b_O if cfg.bias else None)  # all heads at once


class MLP(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.cfg = cfg
        self.W_in = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp))
        self.W_out = nn.Parameter(torch.empty(cfg.d_mlp, cfg.d_model))
        if cfg.bias:
            self.b_in = nn.Parameter(torch.zeros(cfg.d_mlp))
            self.b_out = nn.Parameter(torch.zeros(cfg.d_model))
        self.hook_pre, self.hook_post = HookPoint(), HookPoint()  # [batch, pos, d_mlp]

    def forward(self, x):
        bias = self.cfg.bias
        pre = self.hook_pre(_linear(x, self.W_in, self.b_in if bias else None))
        act = F.relu if self.cfg.act_fn == "relu" else F.gelu
        hidden = _dropout(self.hook_post(act(pre)), self.cfg.dropout, self.training)
        return _linear(hidden, self.W_out, self.b_out if bias else None)


def _dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """F.dropout in training mode when p > 0, else x itself (no op, so default models run as before).

    Under the ensemble's vmap(randomness="different") every member draws its own mask.
    """
    return F.dropout(x, p, training=True) if p > 0 and training else x


class Block(nn.Module):
    """Pre-LN (`normalization="LN"`): x + attn(ln1(x)), then + mlp(ln2(.)).
    Post-LN (`"postLN"`, PyTorch's default TransformerEncoderLayer): ln1(x + attn(x)), then ln2(. + mlp(.)).
    """

    def __init__(self, cfg: ToyConfig, layer: int):
        super().__init__()
        self.cfg = cfg
        self.has_mlp = cfg.has_mlp(layer)
        self.has_ln = cfg.normalization == "LN"
        self.post_ln = cfg.normalization == "postLN"
        if self.has_ln or self.post_ln:
            self.ln1 = LayerNorm(cfg)
        self.attn = Attention(cfg)
        if self.has_mlp:
            if self.has_ln or self.post_ln:
                self.ln2 = LayerNorm(cfg)
            self.mlp = MLP(cfg)
            self.hook_resid_mid = HookPoint()
            self.hook_mlp_out = HookPoint()
        self.hook_resid_pre = HookPoint()
        self.hook_attn_out = HookPoint()
        self.hook_resid_post = HookPoint()

    def forward(self, resid, last_only: bool = False):
        p, training = self.cfg.dropout, self.training
        resid = self.hook_resid_pre(resid)
        attn_out = self.hook_attn_out(_dropout(self.attn(self.ln1(resid) if self.has_ln else resid, last_only),
                                               p, training))
        resid = (resid[:, -1:] if last_only else resid) + attn_out
        if self.post_ln:
            resid = self.ln1(resid)
        if self.has_mlp:
            resid = self.hook_resid_mid(resid)
            resid = resid + self.hook_mlp_out(_dropout(self.mlp(self.ln2(resid) if self.has_ln else resid), p, training))
            if self.post_ln:
                resid = self.ln2(resid)
        return self.hook_resid_post(resid)


class Embed(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.W_E = nn.Parameter(torch.empty(cfg.d_vocab, cfg.d_model))

    def forward(self, tokens):
        return F.embedding(tokens, self.W_E)


class PosEmbed(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.W_pos = nn.Parameter(torch.empty(cfg.n_ctx, cfg.d_model))

    def forward(self, tokens):
        return self.W_pos[: tokens.shape[-1]].expand(*tokens.shape, -1)


class Unembed(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.W_U = nn.Parameter(torch.empty(cfg.d_model, cfg.out_dim))
        if cfg.bias:
            self.b_U = nn.Parameter(torch.zeros(cfg.out_dim))
        self.bias = cfg.bias

    def forward(self, x):
        return _linear(x, self.W_U, self.b_U if self.bias else None)


class ToyTransformer(HookedRootModule):
    """A small causal transformer with TransformerLens names and hooks.

    `ToyTransformer(cfg, seed=0)` draws its weights from `seed` without
    touching the global RNG.
    """

    def __init__(self, cfg: ToyConfig, seed: int | None = 0):
        super().__init__()
        self.cfg = cfg
        self.embed = Embed(cfg)
        self.hook_embed = HookPoint()
        if cfg.positional == "learned":
            self.pos_embed = PosEmbed(cfg)
            self.hook_pos_embed = HookPoint()
        self.blocks = nn.ModuleList([Block(cfg, layer) for layer in range(cfg.n_layers)])
        if cfg.normalization == "LN":
            self.ln_final = LayerNorm(cfg)
        self.unembed = Unembed(cfg)
        self.init_weights(seed)
        for name, p in self.named_parameters():
            if self.is_frozen(name):
                p.requires_grad_(False)
        self.setup()

    def is_frozen(self, name: str) -> bool:
        from fnmatch import fnmatch

        if self.cfg.one_hot_embed and name == "embed.W_E":
            return True
        return any(fnmatch(name, pattern) for pattern in self.cfg.frozen)

    @torch.no_grad()
    def init_weights(self, seed: int | None):
        """Draw the weights from `seed` by the config's scheme (`ToyConfig.init`); one-hot W_E = I.

        "normal": weights ~ N(0, init_std^2), biases 0, LayerNorm gains 1.
        "pytorch": see `_init_pytorch`.

        The draws come from a generator of their own, seeded with `seed`: its stream is the one the global
        generator gives right after torch.manual_seed(seed) (so "pytorch" matches the authors' model built
        under that call), but the global generator is neither read nor advanced, so what other code drew
        before (data, dropout, another model) never changes a model's weights. seed=None draws from the
        global generator.
        """
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        if self.cfg.init == "pytorch":
            self._init_pytorch(gen)
        else:
            std = self.cfg.init_std if self.cfg.init_std is not None else 1 / math.sqrt(self.cfg.d_model)
            for name, p in self.named_parameters():
                leaf = name.rsplit(".", 1)[-1]
                if leaf.startswith("W_"):
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
                elif leaf == "w":
                    p.fill_(1.0)
                else:
                    p.zero_()
        if self.cfg.one_hot_embed:
            self.embed.W_E.copy_(torch.eye(self.cfg.d_vocab))

    def _init_pytorch(self, gen: torch.Generator | None) -> None:
        """PyTorch's default initialisation of the modules this model corresponds to, drawn in the order the
        authors' model builds them, so that seed s gives their initial weights value for value.

        Laws: nn.Embedding (W_E, W_pos) N(0, 1). nn.MultiheadAttention: the in-projection [3 H d_head, d_model]
        that holds W_Q, W_K, W_V is xavier-uniform, its bias and the out-projection's bias are 0, the
        out-projection W_O is an nn.Linear weight. nn.Linear (feed-forward W_in / W_out, readout W_U):
        kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)), and a bias from the same
        range. LayerNorm gain 1, bias 0 (no draw); relative position biases 0.

        Order (PAPERS.md, algorithmic_cores, "The order of draws"): the token embedding; the position
        embedding as a table of `PYTORCH_POSITION_ROWS` rows of which the model keeps the first n_ctx; then
        per layer, as nn.TransformerEncoderLayer's constructor draws: the attention out-projection's weight
        and a bias that MultiheadAttention then sets to zero (built as an nn.Linear before the in-projection
        is reset), the in-projection, the two feed-forward layers (weight then bias each); the readout (weight
        then bias). Every layer draws its own weights, as one nn.TransformerEncoderLayer per layer built in
        turn does (nn.TransformerEncoder's deep copies of one layer would start every layer equal).
        Weights are drawn in PyTorch's [out, in] layout and stored transposed into TransformerLens's
        [in, out] layout. `tests/test_models.py` checks every value against PyTorch's own modules.
        """
        init = nn.init
        cfg = self.cfg
        h, d, dh = cfg.n_heads, cfg.d_model, cfg.head_dim

        def linear(W: torch.Tensor, b: torch.Tensor | None, fan_in: int) -> None:
            # nn.Linear.reset_parameters: weight kaiming_uniform_(a=sqrt(5)), then bias U(+-1/sqrt(fan_in))
            w = torch.empty(W.shape[-1], fan_in)
            init.kaiming_uniform_(w, a=math.sqrt(5), generator=gen)
            W.copy_(w.T.reshape(W.shape))
            if b is not None:
                init.uniform_(b, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in), generator=gen)

        for name, p in self.named_parameters():  # LayerNorm gains 1; every bias not drawn below stays 0
            if name.rsplit(".", 1)[-1] == "w":
                p.fill_(1.0)
            else:
                p.zero_()
        init.normal_(self.embed.W_E, generator=gen)
        if cfg.positional == "learned":
            table = torch.empty(max(PYTORCH_POSITION_ROWS, cfg.n_ctx), d)
            init.normal_(table, generator=gen)
            self.pos_embed.W_pos.copy_(table[:cfg.n_ctx])
        for block in self.blocks:
            attn = block.attn
            # the out-projection [d_model, H d_head] is an nn.Linear: weight, then a bias MultiheadAttention zeroes
            linear(attn.W_O.view(h * dh, d), torch.empty(d) if cfg.bias else None, fan_in=h * dh)
            in_proj = torch.empty(3 * h * dh, d)  # PyTorch's packed [W_q; W_k; W_v], rows = output features
            init.xavier_uniform_(in_proj, generator=gen)
            for W, rows in zip((attn.W_Q, attn.W_K, attn.W_V), in_proj.split(h * dh)):
                W.copy_(rows.reshape(h, dh, d).transpose(1, 2))  # [head, d_model, d_head]
            if block.has_mlp:
                mlp = block.mlp
                linear(mlp.W_in, mlp.b_in if cfg.bias else None, fan_in=d)
                linear(mlp.W_out, mlp.b_out if cfg.bias else None, fan_in=cfg.d_mlp)
        linear(self.unembed.W_U, self.unembed.b_U if cfg.bias else None, fan_in=d)

    def forward(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """tokens [batch, pos] -> logits [batch, pos, d_vocab_out].

        last_only=True computes the last layer only where the last position needs
        it (its query, the MLP and unembedding at that position) and returns
        logits [batch, 1, d_vocab_out]; earlier layers still run at every position
        because the last query reads their keys and values. Training with a
        last-position loss uses it: about half the compute for the paper models.
        """
        resid = self.hook_embed(self.embed(tokens))
        if self.cfg.positional == "learned":
            resid = resid + self.hook_pos_embed(self.pos_embed(tokens))
        for i, block in enumerate(self.blocks):
            resid = block(resid, last_only and i == len(self.blocks) - 1)
        if self.cfg.normalization == "LN":
            resid = self.ln_final(resid)
        return self.unembed(resid)

    def run_with_cache(self, *model_args, return_cache_object: bool = True, **kwargs):
        """Like HookedTransformer.run_with_cache: (output, ActivationCache)."""
        out, cache = super().run_with_cache(*model_args, **kwargs)
        if return_cache_object:
            cache = ActivationCache(cache, self, has_batch_dim=not kwargs.get("remove_batch_dim", False))
        return out, cache

    @property
    def W_E(self):
        return self.embed.W_E

    @property
    def W_U(self):
        return self.unembed.W_U

    @property
    def W_pos(self):
        return self.pos_embed.W_pos

    def trainable_names(self) -> list[str]:
        return [n for n, p in self.named_parameters() if not self.is_frozen(n)]
