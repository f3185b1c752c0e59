"""The invariant manifold S of Musat et al. (arXiv 2607.11875): IMIR coordinates.

The theory's transformer is attention-only, with embeddings x = [u_token; p_label] in an
embedding space of dimension d0 = V + L (class-centred one-hot tokens, one-hot cyclic position
labels), one merged key-query matrix per head (score x_i^T W x_j, query i, key j) and frozen
value-output maps that copy the whole residual stream into the head's own block (a
concatenated residual stream). The residual before layer l is then a sum over *paths*
u = (the heads a vector went through, in layer order), each carrying a d0-vector z_u, placed in
the residual by an *action* matrix A_u (a product of writing maps W_V W_O and the embedding
placement): these are the action basis V_{1:l} of the paper ((H+1)^l paths).

Selection matrices. The data symmetries (association-preserving token permutations, cyclic
shifts of the position labels) act on the embedding space; the matrices that commute with them
span the *selections*: on tokens {I, C} for common tokens (I = the centred identity P_c,
C = the association, both on the centred common subspace), the identity of every other token
class (rare, filler: their own permutation groups), and on positions the circulant shifts
{M^0, ..., M^{L-1}} (``pos{s}``: the key sits s labels before the query). The readout adds
one bias per token class (a constant logit shift of the class: all that positions can say to
the outputs).

The manifold S: every key-query matrix of layer l in span{A_u S A_v^T : u, v paths before
layer l, S a selection} and the readout in span{A_u R : u a final path, R a readout selection}.
Theorem 1 (IM-1): with weights in S the expected gradient lies in S.

Everything here works from a given model's frozen maps (`IMIRBasis.from_model`); coordinates
come back through Moore-Penrose pseudo-inverses of the stacked action matrices (an orthogonal
projection when the paths are orthonormal, as in the theory's model).

Also here: the theory's transformer as a ToyTransformer configuration (`theory_config`,
`TheoryInit`), exact and sampled expected gradients, the named circuit directions of the
2-layer model (alpha, beta, gamma, delta) and the predecessor paper's progress measures for a
standard transformer.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass
from typing import Iterable, Mapping, Sequence

import torch

COMMON, RARE, FILL, BOS = 0, 1, 2, 3
CLASS_NAMES = {COMMON: "common", RARE: "rare", FILL: "fill", BOS: "bos"}


# ---------------------------------------------------------------- the embedding space and its selections

@dataclass(frozen=True)
class Layout:
    """The embedding space: V token coordinates, then L position-label coordinates.

    token_classes[t] is 0 (common), 1 (rare), 2 (filler) or 3 (BOS); association[t] = C(t), a
    permutation that swaps each common pair and fixes every other token.
    """

    token_classes: tuple[int, ...]
    association: tuple[int, ...]
    seq_len: int

    def __post_init__(self):
        V = len(self.token_classes)
        if len(self.association) != V or sorted(self.association) != list(range(V)):
            raise ValueError(f"Layout.association must be a permutation of range({V}); got {self.association}")
        if any(c not in CLASS_NAMES for c in self.token_classes):
            raise ValueError(f"Layout.token_classes must be 0 (common), 1 (rare), 2 (filler) or 3 (BOS); "
                             f"got {self.token_classes}")
        if not (isinstance(self.seq_len, int) and self.seq_len >= 2):
            raise ValueError(f"Layout.seq_len={self.seq_len!r} must be an integer >= 2")

    @classmethod
    def from_task(cls, task) -> "Layout":
        return cls(tuple(int(c) for c in task.token_classes()), tuple(int(c) for c in task.association()),
                   int(task.seq_len))

    @property
    def n_tokens(self) -> int:
        return len(self.token_classes)

    @property
    def d0(self) -> int:
        return self.n_tokens + self.seq_len

    def class_mask(self, cls: int) -> torch.Tensor:
        return torch.tensor([c == cls for c in self.token_classes])

    def token_embedding(self, dtype=torch.float64) -> torch.Tensor:
        """[V, V] class-centred one-hot rows: e_t - 1_class(t) / |class(t)| (orthonormal up to centring)."""
        V = self.n_tokens
        E = torch.eye(V, dtype=dtype)
        for cls in CLASS_NAMES:
            m = self.class_mask(cls)
            if m.any():
                E[m] -= m.to(dtype) / m.sum()
        return E

    def centred_projector(self, cls: int, dtype=torch.float64) -> torch.Tensor:
        """[V, V] the projector on the centred subspace of one token class (zero elsewhere)."""
        m = self.class_mask(cls).to(dtype)
        n = m.sum()
        if n == 0:
            return torch.zeros(self.n_tokens, self.n_tokens, dtype=dtype)
        return torch.diag(m) - torch.outer(m, m) / n

    def association_matrix(self, dtype=torch.float64) -> torch.Tensor:
        """[V, V] C with C e_a = e_{C(a)}."""
        V = self.n_tokens
        C = torch.zeros(V, V, dtype=dtype)
        C[list(self.association), list(range(V))] = 1
        return C

    def selections(self, dtype=torch.float64) -> dict[str, torch.Tensor]:
        """The key-query selections T u P as [d0, d0] matrices (query rows, key columns)."""
        V, L, d0 = self.n_tokens, self.seq_len, self.d0
        out = {}
        Pc = self.centred_projector(COMMON, dtype)
        for name, tok in (("I", Pc), ("C", self.association_matrix(dtype) @ Pc),
                          ("I_rare", self.centred_projector(RARE, dtype)), ("I_fill", self.centred_projector(FILL, dtype))):
            if tok.abs().sum() > 0:
                S = torch.zeros(d0, d0, dtype=dtype)
                S[:V, :V] = tok
                out[name] = S
        for s in range(L):
            S = torch.zeros(d0, d0, dtype=dtype)
            q = torch.arange(L)
            S[V + q, V + (q - s) % L] = 1  # the key's label is s before the query's
            out[f"pos{s}"] = S
        return out

    def readout_selections(self, dtype=torch.float64) -> dict[str, torch.Tensor]:
        """The readout selections as [d0, V] matrices (logits = z^T R)."""
        V, d0 = self.n_tokens, self.d0
        out = {}
        for name, sel in self.selections(dtype).items():
            if not name.startswith("pos"):
                out[name] = sel[:, :V].clone()
        for cls in CLASS_NAMES:
            m = self.class_mask(cls)
            if m.any():
                R = torch.zeros(d0, V, dtype=dtype)
                R[V:, m] = 1.0
                out[f"bias_{CLASS_NAMES[cls]}"] = R
        return out

    def embedding_table(self, dtype=torch.float64, token_embedding: torch.Tensor | None = None) -> torch.Tensor:
        """[V * L, d0] rows for composite ids t + V * label: [u_t; e_label]."""
        V, L = self.n_tokens, self.seq_len
        U = self.token_embedding(dtype) if token_embedding is None else token_embedding.to(dtype)
        ids = torch.arange(V * L)
        table = torch.zeros(V * L, self.d0, dtype=dtype)
        table[:, :V] = U[ids % V]
        table[ids, V + ids // V] = 1.0
        return table


# ---------------------------------------------------------------- paths and the action basis

Path = tuple  # ((layer, head), ...): the heads a vector went through, layers 1-based


def paths(n_layers_before: int, n_heads: int) -> list[Path]:
    """Paths in the residual before layer n_layers_before + 1, in concatenation order:
    [paths before], then for each head h the same paths continued through that head."""
    out: list[Path] = [()]
    for layer in range(1, n_layers_before + 1):
        out = out + [p + ((layer, h),) for h in range(n_heads) for p in out]
    return out


def path_name(p: Path) -> str:
    return "emb" if not p else ">".join(f"L{l}H{h}" for l, h in p)


def parse_path(name: str) -> Path:
    if name == "emb":
        return ()
    out = []
    for part in name.split(">"):
        l, h = part[1:].split("H")
        out.append((int(l), int(h)))
    return tuple(out)


def writing_maps(model) -> list[torch.Tensor]:
    """Per layer: [H, D, D] column-convention maps O_h = (W_V[h] W_O[h])^T of a ToyTransformer."""
    return [torch.einsum("hde,hef->hfd", b.attn.W_V.detach(), b.attn.W_O.detach()) for b in model.blocks]


def action_basis(maps: Sequence[torch.Tensor], placement: torch.Tensor) -> list[torch.Tensor]:
    """A_u for every path before each layer: element l is [n_paths(l), D, d0] (l = 0..n_layers).

    maps: per layer [H, D, D] writing maps (column convention); placement: [D, d0], how the
    embedding space sits in the residual stream.
    """
    acts = [placement.unsqueeze(0)]
    for O in maps:
        prev = acts[-1]
        acts.append(torch.cat([prev] + [torch.einsum("de,pef->pdf", O[h], prev) for h in range(O.shape[0])], 0))
    return acts


# ---------------------------------------------------------------- the basis of S

class IMIRBasis:
    """The invariant manifold S of one model: coordinates, weights, projections.

    Coordinates: qk[l] of shape [H, n_u, n_u, n_sel] per layer (l = 0-based layer index; n_u
    paths before it) and readout [n_paths_final, n_rsel]. Parameter names follow the
    ToyTransformer: blocks.{l}.attn.W_QK [H, D, D] and unembed.W_U [D, V].
    """

    def __init__(self, layout: Layout, maps: Sequence[torch.Tensor], placement: torch.Tensor,
                 dtype=torch.float64):
        self.layout, self.dtype = layout, dtype
        self.n_layers = len(maps)
        self.n_heads = int(maps[0].shape[0]) if maps else 1
        self.D = int(placement.shape[0])
        self.acts = [a.to(dtype) for a in action_basis([m.to(dtype) for m in maps], placement.to(dtype))]
        self.sel = layout.selections(dtype)
        self.rsel = layout.readout_selections(dtype)
        self.sel_names, self.rsel_names = list(self.sel), list(self.rsel)
        self.S = torch.stack(list(self.sel.values()))  # [n_sel, d0, d0]
        self.R = torch.stack(list(self.rsel.values()))  # [n_rsel, d0, V]
        self._gram_inv = torch.linalg.inv(torch.einsum("aij,bij->ab", self.S, self.S))
        self._rgram_inv = torch.linalg.inv(torch.einsum("aij,bij->ab", self.R, self.R))
        self._pinv_cache: dict[int, torch.Tensor] = {}
        self.paths = [paths(l, self.n_heads) for l in range(self.n_layers + 1)]

    @classmethod
    def from_model(cls, model, layout: Layout, dtype=torch.float64) -> "IMIRBasis":
        """S of a ToyTransformer in the theory's configuration (embedding space in the first d0 coordinates)."""
        D = model.cfg.d_model
        placement = torch.zeros(D, layout.d0, dtype=dtype)
        placement[: layout.d0, : layout.d0] = torch.eye(layout.d0, dtype=dtype)
        return cls(layout, writing_maps(model), placement, dtype)

    @classmethod
    def concatenated(cls, layout: Layout, n_layers: int, n_heads: int, dtype=torch.float64) -> "IMIRBasis":
        """S of the theory's concatenated model, without building a model."""
        maps = copy_maps(layout.d0, n_layers, n_heads, dtype)
        D = layout.d0 * (n_heads + 1) ** n_layers
        placement = torch.zeros(D, layout.d0, dtype=dtype)
        placement[: layout.d0] = torch.eye(layout.d0, dtype=dtype)
        return cls(layout, maps, placement, dtype)

    def _pinv(self, l: int) -> torch.Tensor:
        """Moore-Penrose pseudo-inverse of the stacked action matrices before layer l+1 (cached)."""
        if l not in self._pinv_cache:
            self._pinv_cache[l] = torch.linalg.pinv(self._stacked(l))
        return self._pinv_cache[l]

    def _stacked(self, l: int) -> torch.Tensor:
        """[D, n_paths * d0]: the action matrices of the paths before layer l+1, side by side."""
        a = self.acts[l]
        return a.permute(1, 0, 2).reshape(self.D, -1)

    # -- sizes and names
    @property
    def d0(self) -> int:
        return self.layout.d0

    def qk_shape(self, l: int) -> tuple[int, ...]:
        n = len(self.paths[l])
        return (self.n_heads, n, n, len(self.sel_names))

    @property
    def readout_shape(self) -> tuple[int, int]:
        return (len(self.paths[self.n_layers]), len(self.rsel_names))

    @property
    def n_coords(self) -> int:
        return sum(math.prod(self.qk_shape(l)) for l in range(self.n_layers)) + math.prod(self.readout_shape)

    def coordinate_names(self) -> list[str]:
        """Names in flat order: 'L{l}H{h}|{query path}|{key path}|{selection}' (l 1-based), then 'U|{path}|{sel}'."""
        names = []
        for l in range(self.n_layers):
            for h in range(self.n_heads):
                for u in self.paths[l]:
                    for v in self.paths[l]:
                        names += [f"L{l + 1}H{h}|{path_name(u)}|{path_name(v)}|{s}" for s in self.sel_names]
        for u in self.paths[self.n_layers]:
            names += [f"U|{path_name(u)}|{r}" for r in self.rsel_names]
        return names

    def index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.coordinate_names())}

    # -- coordinates <-> weights
    def split_flat(self, theta: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Flat coordinates [..., n_coords] -> (qk list, readout), keeping leading dims."""
        out, i = [], 0
        lead = theta.shape[:-1]
        for l in range(self.n_layers):
            n = math.prod(self.qk_shape(l))
            out.append(theta[..., i:i + n].reshape(*lead, *self.qk_shape(l)))
            i += n
        return out, theta[..., i:].reshape(*lead, *self.readout_shape)

    def flat(self, qk: Sequence[torch.Tensor], readout: torch.Tensor) -> torch.Tensor:
        lead = readout.shape[:-2]
        return torch.cat([q.reshape(*lead, -1) for q in qk] + [readout.reshape(*lead, -1)], -1)

    def block_matrix(self, theta_l: torch.Tensor) -> torch.Tensor:
        """[..., H, n_u, n_u, n_sel] -> [..., H, n_u*d0, n_u*d0]: the key-query matrix in path coordinates."""
        B = torch.einsum("...huvs,sij->...huivj", theta_l, self.S.to(theta_l.dtype))
        *lead, H, n, d, _, _ = B.shape
        return B.reshape(*lead, H, n * d, n * d)

    def readout_matrix(self, theta_u: torch.Tensor) -> torch.Tensor:
        """[..., n_u, n_rsel] -> [..., n_u*d0, V]."""
        R = torch.einsum("...ur,riv->...uiv", theta_u, self.R.to(theta_u.dtype))
        return R.flatten(-3, -2)

    def weights(self, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        """Flat coordinates -> ToyTransformer weights {blocks.l.attn.W_QK: [H, D, D], unembed.W_U: [D, V]}."""
        qk, ro = self.split_flat(theta.to(self.dtype))
        out = {}
        for l in range(self.n_layers):
            A = self._stacked(l)
            out[f"blocks.{l}.attn.W_QK"] = A @ self.block_matrix(qk[l]) @ A.T
        out["unembed.W_U"] = self._stacked(self.n_layers) @ self.readout_matrix(ro)
        return out

    def coordinates(self, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The flat coordinates of the projection of `params` (W_QK of every layer, W_U) on S."""
        qk = []
        for l in range(self.n_layers):
            W = params[f"blocks.{l}.attn.W_QK"].detach().to(self.dtype)
            P = self._pinv(l)
            B = P @ W @ P.T  # [H, n*d0, n*d0]
            n, d = len(self.paths[l]), self.d0
            B = B.reshape(self.n_heads, n, d, n, d)
            rhs = torch.einsum("huivj,sij->huvs", B, self.S)
            qk.append(rhs @ self._gram_inv.T)
        Cu = (self._pinv(self.n_layers) @ params["unembed.W_U"].detach().to(self.dtype))
        Cu = Cu.reshape(len(self.paths[self.n_layers]), self.d0, -1)
        ro = torch.einsum("uiv,riv->ur", Cu, self.R) @ self._rgram_inv.T
        return self.flat(qk, ro)

    def project(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The part of W_QK / W_U inside S (same names and shapes)."""
        return self.weights(self.coordinates(params))

    def outside(self, params: Mapping[str, torch.Tensor], trainable: Iterable[str] | None = None) -> dict:
        """Norms of the parts of `params` (weights or gradients) inside and outside S.

        Every name in `trainable` other than W_QK / W_U (e.g. value maps made trainable) has no
        room in S: all of it counts as outside. Returns {inside, outside, total, relative}
        (Frobenius norms over all parameters) and per-parameter outside norms.
        """
        names = list(trainable) if trainable is not None else list(params)
        inside = self.project(params)
        per = {}
        out2 = in2 = 0.0
        for n in names:
            g = params[n].detach().to(self.dtype)
            if n in inside:
                o = (g - inside[n]).norm().item()
                i = inside[n].norm().item()
            else:
                o, i = g.norm().item(), 0.0
            per[n] = o
            out2 += o * o
            in2 += i * i
        total = math.sqrt(sum(params[n].detach().to(self.dtype).pow(2).sum().item() for n in names))
        return {"inside": math.sqrt(in2), "outside": math.sqrt(out2), "total": total,
                "relative": math.sqrt(out2) / total if total > 0 else 0.0, "per_parameter": per}

    def random_point(self, seed: int, scale: float = 1.0) -> torch.Tensor:
        """Flat coordinates with i.i.d. N(0, scale^2) entries (a generic point of S)."""
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(self.n_coords, generator=gen, dtype=self.dtype) * scale

    def direction_weights(self, direction: Mapping[str, float]) -> torch.Tensor:
        """A direction {coordinate name: coefficient} as flat coordinates."""
        idx = self.index()
        theta = torch.zeros(self.n_coords, dtype=self.dtype)
        for name, coef in direction.items():
            if name not in idx:
                raise ValueError(f"unknown IMIR coordinate {name!r}; names look like "
                                 f"{self.coordinate_names()[0]!r} or {self.coordinate_names()[-1]!r}")
            theta[idx[name]] = coef
        return theta

    def coordinate_norms(self) -> torch.Tensor:
        """[n_coords] Frobenius norm of each basis element's weights (||S|| or ||R||: the paths are orthonormal
        in the theory's model; for other action matrices this is the norm of A_u S A_v^T)."""
        parts = []
        for l in range(self.n_layers):
            A = self.acts[l]  # [n, D, d0]
            # ||A_u S A_v^T||_F^2 = tr(S^T (A_u^T A_u) S (A_v^T A_v))
            K = torch.einsum("udi,udj->uij", A, A)
            n2 = torch.einsum("sij,uik,skl,vjl->uvs", self.S, K, self.S, K)
            parts.append(n2.clamp(min=0).sqrt().expand(self.n_heads, -1, -1, -1).flatten())
        A = self.acts[self.n_layers]
        K = torch.einsum("udi,udj->uij", A, A)
        parts.append(torch.einsum("rij,uik,rkj->ur", self.R, K, self.R).clamp(min=0).sqrt().flatten())
        return torch.cat(parts)

    def direction_norm(self, direction: Mapping[str, float]) -> float:
        W = self.weights(self.direction_weights(direction))
        return float(math.sqrt(sum(w.pow(2).sum().item() for w in W.values())))

    def direction_value(self, params: Mapping[str, torch.Tensor], direction: Mapping[str, float]) -> float:
        """<W, W_d> / ||W_d|| (Frobenius, over W_QK and W_U): the weights' coefficient on the *unit*
        direction d, in the units an IMIRModel's phi uses."""
        Wd = self.weights(self.direction_weights(direction))
        num = sum((params[n].detach().to(self.dtype) * Wd[n]).sum() for n in Wd)
        den = math.sqrt(sum(Wd[n].pow(2).sum().item() for n in Wd))
        return float(num / den)


def copy_maps(d0: int, n_layers: int, n_heads: int, dtype=torch.float64) -> list[torch.Tensor]:
    """The theory's writing maps in column convention: head h of layer l copies the residual so far
    (its first d0 (H+1)^(l-1) coordinates) into its own block."""
    D = d0 * (n_heads + 1) ** n_layers
    maps = []
    for l in range(n_layers):
        size = d0 * (n_heads + 1) ** l
        O = torch.zeros(n_heads, D, D, dtype=dtype)
        for h in range(n_heads):
            O[h, size * (h + 1) + torch.arange(size), torch.arange(size)] = 1
        maps.append(O)
    return maps


# ---------------------------------------------------------------- the theory's transformer as a ToyTransformer

def theory_config(layout: Layout, n_layers: int = 2, n_heads: int = 1, trained_value_maps: bool = False,
                  init_std: float = 0.0):
    """ToyConfig of the theory's transformer: attention only, merged key-query, no bias or norm,
    composite (token, label) ids embedded by a frozen table, frozen copy value-output maps
    (unless trained_value_maps), d_model = d0 (H+1)^L, attention scale 1."""
    from ..models.toy import ToyConfig

    if not (isinstance(n_layers, int) and n_layers >= 1 and isinstance(n_heads, int) and n_heads >= 1):
        raise ValueError(f"theory_config: n_layers={n_layers!r} and n_heads={n_heads!r} must be integers >= 1")
    d0 = layout.d0
    D = d0 * (n_heads + 1) ** n_layers
    frozen = ("embed.W_E",) if trained_value_maps else ("embed.W_E", "blocks.*.attn.W_V", "blocks.*.attn.W_O")
    return ToyConfig(d_vocab=layout.n_tokens * layout.seq_len, n_ctx=layout.seq_len, d_model=D, n_layers=n_layers,
                     n_heads=n_heads, d_head=d0 * (n_heads + 1) ** (n_layers - 1), mlp=False, d_mlp=0,
                     d_vocab_out=layout.n_tokens, bias=False, normalization=None, positional="none",
                     merged_qk=True, frozen=frozen, attn_scale=1.0, init_std=init_std)


def value_output_maps(d0: int, n_layers: int, n_heads: int, d_head: int, dtype=torch.float32):
    """(W_V, W_O) per layer, [H, D, d_head] and [H, d_head, D], whose product copies the residual
    so far into the head's block: W_V selects it, W_O places it."""
    D = d0 * (n_heads + 1) ** n_layers
    out = []
    for l in range(n_layers):
        size = d0 * (n_heads + 1) ** l
        WV = torch.zeros(n_heads, D, d_head, dtype=dtype)
        WO = torch.zeros(n_heads, d_head, D, dtype=dtype)
        for h in range(n_heads):
            WV[h, torch.arange(size), torch.arange(size)] = 1
            WO[h, torch.arange(size), size * (h + 1) + torch.arange(size)] = 1
        out.append((WV, WO))
    return out


class TheoryInit:
    """init_fn(model, seed) for `circuitbook.train`: sets the frozen embedding table and copy maps
    of the theory's transformer, and optionally puts W_QK / W_U at a point of S.

    coords: flat IMIR coordinates (None: keep the model's own init of W_QK / W_U, zero with
    init_std=0); random_scale: instead, a random point of S with N(0, random_scale^2)
    coordinates drawn from the member's seed; off_s_std: add i.i.d. N(0, off_s_std^2) to W_QK
    and W_U (seeded by the member's seed), a start off S; token_embedding: "centred" (the
    theory) or "gaussian" (a broken assumption: random, non-orthonormal token vectors).
    """

    def __init__(self, layout: Layout, coords: torch.Tensor | Sequence[float] | None = None, off_s_std: float = 0.0,
                 token_embedding: str = "centred", random_scale: float | None = None):
        if token_embedding not in ("centred", "gaussian"):
            raise ValueError(f"TheoryInit.token_embedding={token_embedding!r}; expected 'centred' or 'gaussian'")
        if off_s_std < 0:
            raise ValueError(f"TheoryInit.off_s_std={off_s_std!r} must be >= 0")
        if random_scale is not None and (random_scale <= 0 or coords is not None):
            raise ValueError(f"TheoryInit.random_scale={random_scale!r} must be > 0 and comes instead of coords")
        self.layout, self.off_s_std, self.token_embedding = layout, float(off_s_std), token_embedding
        self.random_scale = None if random_scale is None else float(random_scale)
        self.coords = None if coords is None else torch.as_tensor(coords, dtype=torch.float64).detach().clone()

    def spec(self) -> dict:
        digest = None
        if self.coords is not None:
            digest = hashlib.sha256(self.coords.numpy().tobytes()).hexdigest()[:16]
        return {"theory_init": asdict(self.layout), "coords": digest, "off_s_std": self.off_s_std,
                "token_embedding": self.token_embedding, "random_scale": self.random_scale}

    @torch.no_grad()
    def __call__(self, model, seed: int) -> None:
        cfg, lay = model.cfg, self.layout
        dt = model.embed.W_E.dtype
        U = None
        if self.token_embedding == "gaussian":
            gen = torch.Generator().manual_seed(12345)
            U = torch.randn(lay.n_tokens, lay.n_tokens, generator=gen, dtype=torch.float64) / math.sqrt(lay.n_tokens)
        table = lay.embedding_table(torch.float64, U)
        model.embed.W_E.zero_()
        model.embed.W_E[:, : lay.d0] = table.to(dt)
        for block, (WV, WO) in zip(model.blocks, value_output_maps(lay.d0, cfg.n_layers, cfg.n_heads, cfg.head_dim, dt)):
            block.attn.W_V.copy_(WV)
            block.attn.W_O.copy_(WO)
        coords = self.coords
        if self.random_scale is not None:
            coords = IMIRBasis.from_model(model, lay).random_point(int(seed), self.random_scale)
        if coords is not None:
            basis = IMIRBasis.from_model(model, lay)
            for name, W in basis.weights(coords).items():
                model.get_parameter(name).copy_(W.to(dt))
        if self.off_s_std > 0:
            gen = torch.Generator().manual_seed(int(seed) + 7919)
            for name in [f"blocks.{l}.attn.W_QK" for l in range(cfg.n_layers)] + ["unembed.W_U"]:
                p = model.get_parameter(name)
                p.add_((torch.randn(p.shape, generator=gen, dtype=torch.float64) * self.off_s_std).to(dt))


def theory_model(layout: Layout, n_layers: int = 2, n_heads: int = 1, coords=None, dtype=torch.float64,
                 trained_value_maps: bool = False, token_embedding: str = "centred", off_s_std: float = 0.0,
                 seed: int = 0):
    """A ToyTransformer in the theory's configuration (float64 by default), weights at `coords` in S."""
    from ..models.toy import ToyTransformer

    model = ToyTransformer(theory_config(layout, n_layers, n_heads, trained_value_maps), seed=seed).to(dtype)
    TheoryInit(layout, coords, off_s_std, token_embedding)(model, seed)
    return model


# ---------------------------------------------------------------- expected gradients

LOSSES = ("ce", "mse")


def label_targets(layout: Layout, labels: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """[n, V] the class-centred one-hot embedding of each label: the MSE target on the label embedding."""
    return layout.token_embedding(dtype)[labels]


def last_position_loss(logits: torch.Tensor, labels: torch.Tensor, loss: str = "ce",
                       layout: Layout | None = None) -> torch.Tensor:
    """Per-sequence loss at the last position: cross-entropy ("ce", the library's training loss) or
    half the squared error between the output and the label's centred embedding ("mse", the
    predecessor paper's loss; needs the layout)."""
    if loss == "ce":
        logp = logits.to(torch.float64).log_softmax(-1)
        return -logp.gather(-1, labels[:, None]).squeeze(-1)
    if loss == "mse":
        if layout is None:
            raise ValueError("last_position_loss: loss='mse' needs the layout (the label embeddings)")
        target = label_targets(layout, labels.cpu()).to(logits.device, logits.dtype)
        return 0.5 * (logits - target).pow(2).sum(-1).to(torch.float64)
    raise ValueError(f"last_position_loss: loss={loss!r}; expected one of {LOSSES}")


def weighted_gradient(model, tokens: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None,
                      chunk: int = 4096, loss: str = "ce", layout: Layout | None = None,
                      device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
    """sum_x w(x) grad loss(x) over a set of sequences (last-position loss, see `last_position_loss`).

    weights: probabilities of an enumerated distribution (the exact expected gradient) or None
    for the plain mean of a sample. device: compute on a copy of the model there (the gradients
    come back on the CPU). Returns the gradient of every trainable parameter.
    """
    if loss not in LOSSES:
        raise ValueError(f"weighted_gradient: loss={loss!r}; expected one of {LOSSES}")
    if device is not None and torch.device(device).type != "cpu":
        import copy

        model = copy.deepcopy(model).to(device)
        tokens, labels = tokens.to(device), labels.to(device)
    n = tokens.shape[0]
    w = torch.full((n,), 1.0 / n, dtype=torch.float64) if weights is None else weights.to(torch.float64)
    w = w.to(tokens.device)
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    for p in params.values():
        p.grad = None
    for i in range(0, n, chunk):
        logits = model(tokens[i:i + chunk], last_only=True)[:, -1]
        per = last_position_loss(logits, labels[i:i + chunk], loss, layout)
        (per * w[i:i + chunk]).sum().backward()
    grads = {k: p.grad.detach().cpu().clone() for k, p in params.items()}
    for p in params.values():
        p.grad = None
    return grads


def expected_gradient(model, task, max_outcomes: int = 2_000_000, loss: str = "ce") -> dict[str, torch.Tensor]:
    """The exact expected gradient of the last-position loss over the task's whole distribution
    (enumerated; for small tasks)."""
    s, prob = task.enumerate_outcomes(max_outcomes)
    return weighted_gradient(model, task.model_inputs(s), s.targets, prob, loss=loss, layout=Layout.from_task(task))


def sampled_gradient(model, task, n: int, seed: int, loss: str = "ce",
                     device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
    """The mean gradient over n sampled sequences (a Monte-Carlo estimate)."""
    s = task.sample(n, seed)
    return weighted_gradient(model, task.model_inputs(s), s.targets, loss=loss, layout=Layout.from_task(task),
                             device=device)


def outside_fraction(basis: IMIRBasis, grads: Mapping[str, torch.Tensor]) -> float:
    """||g outside S|| / ||g|| over every trainable parameter."""
    return basis.outside(grads, grads.keys())["relative"]


def distance_to_s(basis: IMIRBasis, params: Mapping[str, torch.Tensor]) -> float:
    """||W - proj_S W|| / ||W|| over W_QK of every layer and W_U."""
    names = [f"blocks.{l}.attn.W_QK" for l in range(basis.n_layers)] + ["unembed.W_U"]
    return basis.outside({n: params[n] for n in names}, names)["relative"]


# ---------------------------------------------------------------- named circuit directions

def two_layer_directions(basis: IMIRBasis, head: int = 0) -> dict[str, dict[str, float]]:
    """alpha, beta, gamma, delta of a 2-layer model (head `head` of each layer).

    alpha: layer 1 attends from each position to the previous one (pos1);
    beta:  layer 2 matches the query's token against the token layer 1 copied to the key (I);
    gamma: the readout copies the token layer 2 attended to (I);
    delta: the readout maps the current token through the association (C).
    Identity selections include the rare class when it exists, so the same circuit serves
    rare tokens.
    """
    if basis.n_layers != 2:
        raise ValueError(f"two_layer_directions: the basis has {basis.n_layers} layers; expected 2")
    ids = ["I"] + (["I_rare"] if "I_rare" in basis.sel_names else [])
    l1, l2 = f"L1H{head}", f"L2H{head}"
    return {"alpha": {f"{l1}|emb|emb|pos1": 1.0},
            "beta": {f"{l2}|emb|{l1}|{s}": 1.0 for s in ids},
            "gamma": {f"U|{l2}|{s}": 1.0 for s in ids},
            "delta": {"U|emb|C": 1.0}}


# ---------------------------------------------------------------- progress measures of a standard transformer

def progress_measures(model, token_ids: Sequence[int] | None = None) -> dict[str, float]:
    """The predecessor paper's progress measures for a standard 2-layer, 1-head ToyTransformer
    with learned positions and separate W_Q, W_K (head 0 of each layer):

    alpha~ = sum_i (p_{i-1} W_K^1) . (p_i W_Q^1)             previous-token attention
    beta~  = sum_t (t W_V^1 W_O^1 W_K^2) . (t W_Q^2)        match of the query with the copied token
    gamma~ = sum_t (t W_V^2 W_O^2 W_U)[t]                   copy of the attended token to the output
    with p_i the rows of W_pos and t the embedding rows of `token_ids` (default: every token
    that is also an output).
    """
    b1, b2 = model.blocks[0].attn, model.blocks[1].attn
    WE, WP, WU = model.W_E.detach(), model.W_pos.detach(), model.W_U.detach()
    ids = list(range(min(WE.shape[0], WU.shape[1]))) if token_ids is None else list(token_ids)
    T = WE[ids]
    alpha = ((WP[:-1] @ b1.W_K[0].detach()) * (WP[1:] @ b1.W_Q[0].detach())).sum()
    copied = T @ b1.W_V[0].detach() @ b1.W_O[0].detach()
    beta = ((copied @ b2.W_K[0].detach()) * (T @ b2.W_Q[0].detach())).sum()
    out = T @ b2.W_V[0].detach() @ b2.W_O[0].detach() @ WU
    gamma = out[torch.arange(len(ids)), torch.tensor(ids)].sum()
    return {"alpha": float(alpha), "beta": float(beta), "gamma": float(gamma)}


# ---------------------------------------------------------------- reading a model's weights in IMIR coordinates

def s_dimensions(layout: Layout, n_layers: int, n_heads: int = 1):
    """Coordinates of S per weight matrix against that matrix's number of entries (a DataFrame)."""
    import pandas as pd

    basis = IMIRBasis.concatenated(layout, n_layers, n_heads)
    rows = []
    for l in range(n_layers):
        n = len(basis.paths[l])
        rows.append({"layers": n_layers, "weight": f"W_QK layer {l + 1}", "paths seen": n,
                     "coordinates": math.prod(basis.qk_shape(l)), "entries": n_heads * basis.D ** 2})
    rows.append({"layers": n_layers, "weight": "W_U", "paths seen": len(basis.paths[n_layers]),
                 "coordinates": math.prod(basis.readout_shape), "entries": basis.D * layout.n_tokens})
    return pd.DataFrame(rows)


def unit_coordinates(basis: IMIRBasis, params: Mapping[str, torch.Tensor]):
    """Every coordinate of the projection on S in units of its unit basis element (theta * ||element||),
    a pandas Series indexed by coordinate name."""
    import pandas as pd

    theta = basis.coordinates(params) * basis.coordinate_norms()
    return pd.Series(theta.numpy(), index=basis.coordinate_names())


def captured_fraction(basis: IMIRBasis, params: Mapping[str, torch.Tensor],
                      directions: Mapping[str, Mapping[str, float]]) -> float:
    """Share of ||proj_S W||^2 on the named (mutually orthogonal) directions."""
    inside = basis.project(params)
    total = sum(w.pow(2).sum().item() for w in inside.values())
    on = sum(basis.direction_value(params, d) ** 2 for d in directions.values())
    return on / total if total > 0 else float("nan")


def largest_other_coordinates(basis: IMIRBasis, params: Mapping[str, torch.Tensor],
                              directions: Mapping[str, Mapping[str, float]], top: int):
    """The `top` largest coordinates (unit elements) that belong to none of the named directions (a DataFrame)."""
    import pandas as pd

    coords = unit_coordinates(basis, params)
    named = {c for d in directions.values() for c in d}
    other = coords[[n for n in coords.index if n not in named]]
    order = other.abs().sort_values(ascending=False).index[:top]
    return pd.DataFrame({"coordinate": order, "value (unit element)": other[order].to_numpy()})


def coordinates_of(run, member: int, layout: Layout) -> torch.Tensor:
    """Flat IMIR coordinates of a trained member of `run` (its theta for an IMIRModel, the projection on S
    for a full model)."""
    model = run.model(member)
    # An IMIRModel (models/imir.py, built on this module, so not imported here) is its coordinates.
    if callable(getattr(model, "theta", None)):
        return model.theta().detach().double()
    return IMIRBasis.from_model(model, layout).coordinates(dict(model.named_parameters()))
