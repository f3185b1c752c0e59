"""A restricted model of Musat et al. whose only parameters are IMIR coordinates (`IMIRConfig`, `IMIRModel`).

Its weights are a sum over named directions of S (`analysis.imir`: the layout, the action basis and the
coordinates it computes in), phi_d * direction_d, and only phi trains. It is computed in path coordinates,
so it is much cheaper than the ToyTransformer with the same weights (identical logits: tested).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Mapping

import torch
import torch.nn as nn

from ..analysis.imir import IMIRBasis, Layout
from .registry import from_known_fields, register_model

# The model computes through the layout's embedding and the basis' selections, which live in analysis/imir.py:
# that file is part of what an IMIR run computes, so it enters the run's key with this one.
RUN_KEY_SOURCES = ("analysis/imir.py",)


@register_model
@dataclass(frozen=True)
class IMIRConfig:
    """A restricted model: weights = sum over directions of phi_d * direction_d, phi trainable.

    directions: ((name, ((coordinate, coefficient), ...)), ...); empty means every coordinate
    of S is its own direction (the full manifold). init: ((direction name, value), ...) for
    phi at step 0 (others 0, plus N(0, init_std^2) noise seeded by the member's seed).
    """

    token_classes: tuple[int, ...]
    association: tuple[int, ...]
    seq_len: int
    n_layers: int = 2
    n_heads: int = 1
    directions: tuple = ()
    init: tuple = ()
    init_std: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "token_classes", tuple(int(c) for c in self.token_classes))
        object.__setattr__(self, "association", tuple(int(c) for c in self.association))
        object.__setattr__(self, "directions", tuple((str(n), tuple((str(c), float(v)) for c, v in d))
                                                     for n, d in self.directions))
        object.__setattr__(self, "init", tuple((str(n), float(v)) for n, v in self.init))
        Layout(self.token_classes, self.association, self.seq_len)  # validates
        if not (isinstance(self.n_layers, int) and self.n_layers >= 1 and isinstance(self.n_heads, int)
                and self.n_heads >= 1):
            raise ValueError(f"IMIRConfig: n_layers={self.n_layers!r}, n_heads={self.n_heads!r} must be integers >= 1")
        if self.init_std < 0:
            raise ValueError(f"IMIRConfig.init_std={self.init_std!r} must be >= 0")
        names = [n for n, _ in self.directions]
        if len(set(names)) != len(names):
            raise ValueError(f"IMIRConfig.directions: repeated names {names}")
        unknown = [n for n, _ in self.init if self.directions and n not in names]
        if unknown:
            raise ValueError(f"IMIRConfig.init names {unknown} are not directions; directions: {names}")

    @property
    def layout(self) -> Layout:
        return Layout(self.token_classes, self.association, self.seq_len)

    @classmethod
    def with_directions(cls, layout: Layout, directions: Mapping[str, Mapping[str, float]], **kw) -> "IMIRConfig":
        return cls(layout.token_classes, layout.association, layout.seq_len,
                   directions=tuple((n, tuple(d.items())) for n, d in directions.items()), **kw)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["token_classes"], d["association"] = list(self.token_classes), list(self.association)
        d["directions"] = [[n, [[c, v] for c, v in dd]] for n, dd in self.directions]
        d["init"] = [[n, v] for n, v in self.init]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "IMIRConfig":
        return from_known_fields(cls, d)

    def build(self, seed: int | None = 0) -> "IMIRModel":
        return IMIRModel(self, seed)


class IMIRModel(nn.Module):
    """The theory's transformer computed in path coordinates, parameterised by IMIR directions.

    forward(tokens [B, L] composite ids, last_only) -> logits [B, L or 1, V]; identical to the
    ToyTransformer with weights `basis.weights(theta)` (tested), but each layer works on the
    paths it can see (n_u d0 wide instead of D), so it is much cheaper.

    Every direction is scaled to unit Frobenius norm in weight space, so phi_d is the weights'
    coefficient on a unit direction and a gradient step on phi moves the weights as the same
    step on the full weights would, projected on the directions (exactly when the directions
    are orthogonal, as alpha, beta, gamma, delta are; in full-S mode I and C overlap by
    -1/(n_common - 1), a small distortion).
    """

    def __init__(self, cfg: IMIRConfig, seed: int | None = 0):
        super().__init__()
        self.cfg = cfg
        layout = cfg.layout
        basis = IMIRBasis.concatenated(layout, cfg.n_layers, cfg.n_heads, dtype=torch.float64)
        self.n_coords, self.n_layers, self.n_heads, self.d0 = basis.n_coords, cfg.n_layers, cfg.n_heads, layout.d0
        self.qk_shapes = [basis.qk_shape(l) for l in range(cfg.n_layers)]
        self.readout_shape = basis.readout_shape
        self.coordinate_names = basis.coordinate_names()
        norms = basis.coordinate_norms()
        if cfg.directions:
            idx = basis.index()
            Dm = torch.zeros(self.n_coords, len(cfg.directions), dtype=torch.float64)
            for j, (name, direction) in enumerate(cfg.directions):
                for coord, coef in direction:
                    if coord not in idx:
                        raise ValueError(f"IMIRConfig direction {name!r}: unknown coordinate {coord!r}")
                    Dm[idx[coord], j] = coef
                Dm[:, j] /= basis.direction_norm(dict(direction))
            self.direction_names = [n for n, _ in cfg.directions]
            self.register_buffer("directions", Dm)
        else:
            self.direction_names = list(self.coordinate_names)
            self.register_buffer("directions", 1.0 / norms)  # a diagonal: each coordinate's unit direction
        # float64 buffers (1/3 is not a float32): cast to the parameters' dtype where used
        self.register_buffer("embedding", layout.embedding_table(torch.float64))
        self.register_buffer("S", basis.S)
        self.register_buffer("R", basis.R)
        self.phi = nn.Parameter(torch.zeros(len(self.direction_names)))
        self.register_buffer("mask", torch.tril(torch.ones(layout.seq_len, layout.seq_len, dtype=torch.bool)),
                             persistent=False)
        self.init_weights(seed)

    def trainable_names(self) -> list[str]:
        return ["phi"]

    @torch.no_grad()
    def init_weights(self, seed: int | None) -> None:
        phi = torch.zeros(len(self.direction_names))
        pos = {n: i for i, n in enumerate(self.direction_names)}
        for name, value in self.cfg.init:
            if name not in pos:
                raise ValueError(f"IMIRConfig.init: unknown direction or coordinate {name!r}")
            phi[pos[name]] = value
        if self.cfg.init_std > 0 and seed is not None:
            gen = torch.Generator().manual_seed(int(seed))
            phi += torch.randn(phi.shape, generator=gen) * self.cfg.init_std
        self.phi.copy_(phi)

    def theta(self) -> torch.Tensor:
        """Flat IMIR coordinates [n_coords]."""
        D = self.directions.to(self.phi.dtype)
        return D * self.phi if D.dim() == 1 else D @ self.phi

    def _split(self, theta):
        out, i = [], 0
        for shape in self.qk_shapes:
            n = math.prod(shape)
            out.append(theta[i:i + n].reshape(shape))
            i += n
        return out, theta[i:].reshape(self.readout_shape)

    def forward(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        qk, ro = self._split(self.theta())
        dt = self.phi.dtype
        S, R = self.S.to(dt), self.R.to(dt)
        z = self.embedding.to(dt)[tokens]  # [B, L, d0]: the single path of the embedding
        L = tokens.shape[-1]
        for l, theta_l in enumerate(qk):
            H, n = theta_l.shape[0], theta_l.shape[1]
            # the key-query matrix in path coordinates (a dense product was faster than exploiting the
            # selections' structure at every size measured, up to V = 257)
            B = torch.einsum("huvs,sij->huivj", theta_l, S).reshape(H, n * self.d0, n * self.d0)
            last = last_only and l == self.n_layers - 1
            zq = z[:, -1:] if last else z
            scores = torch.einsum("bqi,hij,bkj->bhqk", zq, B, z)
            rows = slice(L - 1, L) if last else slice(0, L)
            scores = scores.masked_fill(~self.mask[rows, :L], float("-inf"))
            pattern = scores.softmax(-1)
            heads = torch.einsum("bhqk,bki->bhqi", pattern, z)  # each head copies every path it sees
            z = torch.cat([zq] + [heads[:, h] for h in range(H)], -1)
        R = torch.einsum("ur,riv->uiv", ro, R).flatten(0, 1)
        return z @ R
