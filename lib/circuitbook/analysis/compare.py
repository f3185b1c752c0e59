"""Comparing cores, activations and weights across independently trained models.

- `projector_overlap`: how much two subspaces coincide (1 identical, 0 orthogonal)
- `cca`: canonical correlations of two sets of activations on the same inputs
  (invariant to invertible linear maps and shifts of either set)
- `weight_cosine`: cosine similarity of two models' parameters, per name and overall
- `matrix_cosine`: tr(A^T B) / (||A||_F ||B||_F)
- `contained_share`: the share of one subspace that lies inside another (1 inside, 0 orthogonal)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from .ace import AceCore, _as_float64


def _orthonormal_basis(basis, name: str) -> torch.Tensor:
    """Orthonormal basis [D, r] of the column span of an AceCore's Q or of a [D, r] matrix."""
    Q = basis.Q if isinstance(basis, AceCore) else _as_float64(basis, name)
    if Q.ndim != 2 or Q.shape[1] < 1:
        raise ValueError(f"{name} must be an AceCore or a [D, r] matrix with r >= 1; got shape {tuple(Q.shape)}")
    # re-orthonormalise: the overlap is a property of the subspace, not of the basis given
    return torch.linalg.qr(Q).Q


def projector_overlap(basis_i, basis_j) -> float:
    """||Qi^T Qj||_F^2 / sqrt(ri rj) for orthonormal bases of the two subspaces.

    1 for identical subspaces, 0 for orthogonal ones; for random r-dimensional subspaces
    of R^D it is about sqrt(ri rj) / D. Bases are re-orthonormalised (QR) first.
    """
    Qi, Qj = _orthonormal_basis(basis_i, "basis_i"), _orthonormal_basis(basis_j, "basis_j")
    if Qi.shape[0] != Qj.shape[0]:
        raise ValueError(f"basis_i and basis_j must live in the same space; got D={Qi.shape[0]} and D={Qj.shape[0]}")
    ri, rj = Qi.shape[1], Qj.shape[1]
    return float((Qi.T @ Qj).pow(2).sum() / (ri * rj) ** 0.5)


def contained_share(basis, container) -> float:
    """||F^T Q||_F^2 / r: the mean over the r directions of `basis` (Q) of the squared norm of their projection
    on the span of `container` (F). 1 when the subspace lies inside the container, 0 when orthogonal to it;
    a random r-dimensional subspace of R^D has dim(F) / D in expectation. Bases are re-orthonormalised."""
    Q, F = _orthonormal_basis(basis, "basis"), _orthonormal_basis(container, "container")
    if Q.shape[0] != F.shape[0]:
        raise ValueError(f"basis and container must live in the same space; got D={Q.shape[0]} and D={F.shape[0]}")
    return float((F.T @ Q).pow(2).sum() / Q.shape[1])


@dataclass(frozen=True)
class CCAResult:
    """Canonical correlations (descending, one per canonical pair) and their mean."""

    correlations: torch.Tensor
    mean: float


def _whitened_basis(X: torch.Tensor, rtol: float) -> torch.Tensor:
    """Orthonormal basis [N, rank] of the centred columns' span (an SVD drops rank deficiency)."""
    U, S, _ = torch.linalg.svd(X - X.mean(0), full_matrices=False)
    return U[:, S > rtol * S[0]] if S.numel() and S[0] > 0 else U[:, :0]


def cca(X, Y, n_components: int | None = None, rtol: float = 1e-10) -> CCAResult:
    """CCA of X [N, p] and Y [N, q], rows being the same N inputs.

    The canonical correlations are the singular values of Ux^T Uy, with Ux, Uy orthonormal
    bases of the centred column spaces. Directions with singular value < rtol * max are
    dropped, so rank-deficient inputs are fine. Keep N well above p + q: with few samples
    CCA finds spurious correlations near 1. n_components keeps the leading ones.
    """
    X, Y = _as_float64(X, "X"), _as_float64(Y, "Y")
    if X.ndim != 2 or Y.ndim != 2 or X.shape[0] != Y.shape[0] or X.shape[0] < 2:
        raise ValueError(f"X and Y must be [N, p] and [N, q] with the same N >= 2; "
                         f"got {tuple(X.shape)} and {tuple(Y.shape)}")
    Ux, Uy = _whitened_basis(X, rtol), _whitened_basis(Y, rtol)
    if Ux.shape[1] == 0 or Uy.shape[1] == 0:
        raise ValueError("X and Y must both vary across samples; one of them is constant")
    corr = torch.linalg.svdvals(Ux.T @ Uy).clamp(max=1.0)
    if n_components is not None:
        if not (isinstance(n_components, int) and 1 <= n_components <= corr.numel()):
            raise ValueError(f"n_components={n_components!r} is not allowed; "
                             f"expected an integer in [1, {corr.numel()}]")
        corr = corr[:n_components]
    return CCAResult(correlations=corr, mean=float(corr.mean()))


def matrix_cosine(A, B) -> float:
    """tr(A^T B) / (||A||_F ||B||_F) for two same-shape arrays (any number of dimensions)."""
    A, B = _as_float64(A, "A"), _as_float64(B, "B")
    if A.shape != B.shape:
        raise ValueError(f"A and B must have the same shape; got {tuple(A.shape)} and {tuple(B.shape)}")
    norms = A.norm() * B.norm()
    if norms == 0:
        return float("nan")  # the angle to a zero matrix is undefined
    return float((A * B).sum() / norms)


@dataclass(frozen=True)
class WeightCosine:
    """Cosine similarity per parameter name (nan where a parameter is all zeros) and over all
    matched parameters flattened into one vector."""

    per_parameter: dict[str, float]
    overall: float


def _float_tensors(model_or_state) -> dict[str, torch.Tensor]:
    """name -> floating tensor, from an nn.Module's parameters or a state-dict-like mapping."""
    if isinstance(model_or_state, torch.nn.Module):
        items = model_or_state.named_parameters()
    elif isinstance(model_or_state, Mapping):
        items = model_or_state.items()
    else:
        raise ValueError(f"expected an nn.Module or a mapping of name -> tensor; got {type(model_or_state).__name__}")
    return {name: t.detach() for name, t in items if isinstance(t, torch.Tensor) and t.is_floating_point()}


def weight_cosine(model_a, model_b, names: Sequence[str] | None = None) -> WeightCosine:
    """Cosine similarity of two models' parameters with matching names.

    names: restrict to these names (default: every floating parameter both models have).
    Parameters named alike must have the same shape. Independently initialised models give
    values near 0, a model against itself gives 1.
    """
    params_a, params_b = _float_tensors(model_a), _float_tensors(model_b)
    shared = [n for n in params_a if n in params_b] if names is None else list(names)
    missing = [n for n in shared if n not in params_a or n not in params_b]
    if missing:
        raise ValueError(f"names {missing} are not parameters of both models; allowed: "
                         f"{sorted(set(params_a) & set(params_b))}")
    if not shared:
        raise ValueError("the two models share no parameter names; nothing to compare")
    mismatched = {n: (tuple(params_a[n].shape), tuple(params_b[n].shape))
                  for n in shared if params_a[n].shape != params_b[n].shape}
    if mismatched:
        raise ValueError(f"parameters named alike must have the same shape; these differ: {mismatched}")
    per_parameter = {n: matrix_cosine(params_a[n], params_b[n]) for n in shared}
    flat_a = torch.cat([params_a[n].flatten().double().cpu() for n in shared])
    flat_b = torch.cat([params_b[n].flatten().double().cpu() for n in shared])
    return WeightCosine(per_parameter=per_parameter, overall=matrix_cosine(flat_a, flat_b))
