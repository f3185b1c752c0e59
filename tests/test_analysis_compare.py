"""compare.py: overlap, CCA and cosine similarities on cases with known answers."""
import pytest
import torch

from circuitbook.analysis.ace import extract_core
from circuitbook.analysis.compare import cca, contained_share, matrix_cosine, projector_overlap, weight_cosine
from circuitbook.models.toy import ToyConfig, ToyTransformer


def random_orthonormal(d: int, seed: int) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)).Q


def test_projector_overlap_known_values():
    basis = random_orthonormal(10, 0)
    assert projector_overlap(basis[:, :3], basis[:, :3]) == pytest.approx(1.0)
    assert projector_overlap(basis[:, :3], basis[:, 3:6]) == pytest.approx(0.0, abs=1e-12)
    # one shared direction out of 2 and 2: 1 / sqrt(2 * 2)
    assert projector_overlap(basis[:, :2], basis[:, 1:3]) == pytest.approx(0.5)
    # the subspace, not the basis: a mixed, scaled basis of the same span gives 1
    mixed = basis[:, :3] @ torch.tensor([[2.0, 1, 0], [0, 1, 3], [1, 0, 1]], dtype=torch.float64)
    assert projector_overlap(mixed, basis[:, :3]) == pytest.approx(1.0)


def test_projector_overlap_accepts_cores_and_checks_dimensions():
    gen = torch.Generator().manual_seed(1)
    H = torch.randn(200, 6, generator=gen, dtype=torch.float64)
    J = torch.randn(200, 2, 6, generator=gen, dtype=torch.float64)
    core = extract_core(H, J, energy_threshold=0.9)
    assert projector_overlap(core, core) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="same space"):
        projector_overlap(core, torch.eye(5)[:, :2])
    with pytest.raises(ValueError, match="basis_j"):
        projector_overlap(core, torch.ones(6))


def test_cca_of_rotated_scaled_shifted_copy_is_one():
    gen = torch.Generator().manual_seed(2)
    X = torch.randn(500, 4, generator=gen, dtype=torch.float64) * torch.tensor([5.0, 1, 0.5, 2], dtype=torch.float64)
    Y = 3 * X @ random_orthonormal(4, 3) + 7
    result = cca(X, Y)
    assert result.correlations.shape == (4,)
    assert torch.allclose(result.correlations, torch.ones(4, dtype=torch.float64), atol=1e-8)
    assert result.mean == pytest.approx(1.0)
    # an invertible but non-orthogonal map is also invisible to CCA
    Z = X @ torch.tensor([[1.0, 2, 0, 0], [0, 1, 0, 0], [0, 0, 3, 1], [1, 0, 0, 1]], dtype=torch.float64)
    assert cca(X, Z).mean == pytest.approx(1.0)


def test_cca_of_independent_data_is_small_and_rank_deficiency_is_fine():
    gen = torch.Generator().manual_seed(4)
    X = torch.randn(4000, 3, generator=gen, dtype=torch.float64)
    Y = torch.randn(4000, 3, generator=gen, dtype=torch.float64)
    assert cca(X, Y).mean < 0.1
    # a duplicated column adds no direction: still 2 correlations of 1
    X2 = torch.cat([X[:, :2], X[:, :1]], 1)
    result = cca(X2, X[:, :2] @ torch.tensor([[1.0, 1], [0, 2]], dtype=torch.float64))
    assert result.correlations.shape == (2,) and result.mean == pytest.approx(1.0)
    assert cca(X, Y, n_components=1).correlations.shape == (1,)
    with pytest.raises(ValueError, match="same N"):
        cca(X, Y[:10])
    with pytest.raises(ValueError, match="n_components"):
        cca(X, Y, n_components=5)


def test_weight_cosine():
    cfg = ToyConfig(d_vocab=10, n_ctx=4, d_model=16, n_layers=1, d_mlp=32, bias=False)
    model, other = ToyTransformer(cfg, seed=0), ToyTransformer(cfg, seed=1)
    same = weight_cosine(model, model)
    assert same.overall == pytest.approx(1.0)
    assert all(v == pytest.approx(1.0) for v in same.per_parameter.values())
    assert set(same.per_parameter) == {n for n, _ in model.named_parameters()}
    independent = weight_cosine(model, other)
    assert abs(independent.overall) < 0.1  # independent random weights are nearly orthogonal
    subset = weight_cosine(model.state_dict(), other.state_dict(), names=["blocks.0.mlp.W_in"])
    assert list(subset.per_parameter) == ["blocks.0.mlp.W_in"]
    assert subset.overall == pytest.approx(subset.per_parameter["blocks.0.mlp.W_in"])
    with pytest.raises(ValueError, match="names"):
        weight_cosine(model, other, names=["not.a.parameter"])
    wider = ToyTransformer(ToyConfig(d_vocab=10, n_ctx=4, d_model=16, n_layers=1, d_mlp=8, bias=False))
    with pytest.raises(ValueError, match="same shape"):
        weight_cosine(model, wider)


def test_matrix_cosine_known_values():
    A = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert matrix_cosine(A, 2 * A) == pytest.approx(1.0)
    assert matrix_cosine(A, -A) == pytest.approx(-1.0)
    assert matrix_cosine([[1.0, 0.0], [0.0, 0.0]], [[0.0, 1.0], [0.0, 0.0]]) == pytest.approx(0.0)
    assert matrix_cosine(torch.eye(2), torch.tensor([[1.0, 0], [0, 0]])) == pytest.approx(1 / 2 ** 0.5)
    with pytest.raises(ValueError, match="same shape"):
        matrix_cosine(A, torch.eye(3))


def test_contained_share_of_planted_subspaces():
    """1 for a subspace inside the container (any basis of it), 0 for an orthogonal one, the mean over its
    directions in between; a random subspace has dim(F) / D in expectation."""
    E = torch.eye(6, dtype=torch.float64)
    F = E[:, :3]
    assert contained_share(E[:, [0, 2]] @ torch.tensor([[1.0, 2.0], [3.0, -1.0]], dtype=torch.float64), F) == \
        pytest.approx(1.0)
    assert contained_share(E[:, [4, 5]], F) == pytest.approx(0.0, abs=1e-12)
    assert contained_share(E[:, [0, 5]], F) == pytest.approx(0.5)
    gen = torch.Generator().manual_seed(0)
    draws = [contained_share(torch.randn(40, 2, generator=gen, dtype=torch.float64), torch.eye(40, dtype=torch.float64)[:, :10])
             for _ in range(400)]
    assert sum(draws) / len(draws) == pytest.approx(10 / 40, abs=0.02)
    with pytest.raises(ValueError, match="same space"):
        contained_share(E[:, :2], torch.eye(5, dtype=torch.float64)[:, :2])
