"""How much of a noisy vector lies in a subspace, without the bias that noise adds to squared norms.

A Monte-Carlo gradient g + e (e zero-mean noise) overstates ||P g||^2 by E||P e||^2 in every
subspace, so the share of g that lies outside a small subspace looks larger than it is. With two
independent estimates a = g + e1 and b = g + e2, the cross product <P a, P b> has expectation
<P g, P g> exactly: the noise cancels in expectation, whatever its size.

- `orthonormal_columns`: an orthonormal basis [n, r] of the span of given columns
- `share_outside`: the share of a vector's part in an outer subspace that lies outside an inner
  one, from two independent estimates (or one exact vector given twice)
"""
from __future__ import annotations

import torch


def orthonormal_columns(columns: torch.Tensor, tol: float = 1e-10) -> torch.Tensor:
    """[n, r] orthonormal basis of the span of the columns of an [n, k] matrix (float64; columns that
    add nothing to the span, within tol of the largest singular value, are dropped)."""
    if columns.dim() != 2 or columns.shape[1] < 1:
        raise ValueError(f"orthonormal_columns: expected an [n, k] matrix with k >= 1, got {tuple(columns.shape)}")
    U, S, _ = torch.linalg.svd(columns.double(), full_matrices=False)
    if S[0] == 0:
        raise ValueError("orthonormal_columns: every column is zero")
    return U[:, S > tol * S[0]]


def share_outside(a: torch.Tensor, b: torch.Tensor, inner: torch.Tensor, outer: torch.Tensor | None = None) -> dict:
    """For a vector g estimated twice independently (a, b), the share of its part in span(outer)
    that lies outside span(inner): 1 - <P_in a, P_in b> / <P_out a, P_out b>.

    inner, outer: [n, k] matrices whose columns span the subspaces (span(inner) must lie in
    span(outer); outer None: the whole space). Returns {share_outside, in_inner, in_outer} with the
    two cross products (unbiased estimates of ||P_in g||^2 and ||P_out g||^2). NaN share when the
    outer estimate is not positive (the vector is lost in the noise there).
    """
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"share_outside: the two estimates differ in size ({a.numel()} and {b.numel()})")
    Qi = orthonormal_columns(inner)
    if Qi.shape[0] != a.numel():
        raise ValueError(f"share_outside: inner has rows of length {Qi.shape[0]}, the vectors {a.numel()}")
    if outer is None:
        in_outer = float(a @ b)
    else:
        Qo = orthonormal_columns(outer)
        if Qo.shape[0] != a.numel():
            raise ValueError(f"share_outside: outer has rows of length {Qo.shape[0]}, the vectors {a.numel()}")
        if (Qi - Qo @ (Qo.T @ Qi)).norm() > 1e-8 * max(1.0, float(Qi.norm())):
            raise ValueError("share_outside: span(inner) is not inside span(outer)")
        in_outer = float((Qo.T @ a) @ (Qo.T @ b))
    in_inner = float((Qi.T @ a) @ (Qi.T @ b))
    share = 1.0 - in_inner / in_outer if in_outer > 0 else float("nan")
    return {"share_outside": share, "in_inner": in_inner, "in_outer": in_outer}
