"""Shares of a vector in nested subspaces, from two noisy estimates: known answers."""
import math

import pytest
import torch

from circuitbook.analysis import subspace


def nested(n=40, k_in=3, k_out=10, seed=0):
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return Q[:, :k_in], Q[:, :k_out], Q[:, k_out:]


def test_exact_vector_planted_shares():
    """g = 3 e_in + 4 e_mid + 12 e_off: inside the outer span (25 of 169 outside it) the share outside
    the inner span is 16 / 25, whatever the off-span part; the columns need not be orthonormal."""
    inner, outer, off = nested()
    g = 3 * inner[:, 0] + 4 * outer[:, 5] + 12 * off[:, 2]
    mix = torch.randn(10, 10, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = subspace.share_outside(g, g, inner @ torch.diag(torch.tensor([2.0, 0.5, 7.0], dtype=torch.float64)),
                                 outer @ mix)
    assert out["share_outside"] == pytest.approx(16 / 25, abs=1e-12)
    assert out["in_inner"] == pytest.approx(9.0) and out["in_outer"] == pytest.approx(25.0)
    assert subspace.share_outside(g, g, inner)["share_outside"] == pytest.approx(1 - 9 / 169)


def test_two_noisy_estimates_are_unbiased_where_one_is_not():
    """g = 4 e_in + 3 e_mid (share outside the inner span 9/25 = 0.36) and noise of std 1.5 per
    coordinate: the cross estimate's mean stays at 0.36; one estimate used twice (a squared norm)
    is pulled towards the noise's own share (7 of 10 outer dimensions): about 0.52."""
    inner, outer, _ = nested()
    g = 4 * inner[:, 0] + 3 * outer[:, 5]
    gen = torch.Generator().manual_seed(2)
    cross, same = [], []
    for _ in range(400):
        a = g + 1.5 * torch.randn(40, generator=gen, dtype=torch.float64)
        b = g + 1.5 * torch.randn(40, generator=gen, dtype=torch.float64)
        out = subspace.share_outside(a, b, inner, outer)
        cross.append((out["in_inner"], out["in_outer"]))
        same.append(subspace.share_outside(a, a, inner, outer)["share_outside"])
    num, den = (sum(c[i] for c in cross) / len(cross) for i in (0, 1))
    assert 1 - num / den == pytest.approx(0.36, abs=0.04)
    assert sum(same) / len(same) == pytest.approx(1 - (16 + 6.75) / (25 + 22.5), abs=0.04)


def test_hostile_inputs():
    inner, outer, off = nested()
    g = inner[:, 0]
    with pytest.raises(ValueError, match="not inside"):
        subspace.share_outside(g, g, off[:, :2], outer)
    with pytest.raises(ValueError, match="differ in size"):
        subspace.share_outside(g, g[:-1], inner)
    with pytest.raises(ValueError, match="rows of length"):
        subspace.share_outside(g[:-1], g[:-1], inner)
    with pytest.raises(ValueError, match="zero"):
        subspace.orthonormal_columns(torch.zeros(5, 2))
    assert subspace.orthonormal_columns(torch.ones(5, 3)).shape == (5, 1), "repeated columns span one dimension"
    assert math.isnan(subspace.share_outside(off[:, 0], -off[:, 0], inner, outer)["share_outside"])
