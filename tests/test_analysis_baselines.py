"""analysis.baselines: random-subspace baselines, known answers."""
import pytest
import torch

from circuitbook.analysis import baselines
from circuitbook.analysis.baselines import CCA_LEADING, cca_summary, random_projection_cca, random_subspace_overlap
from circuitbook.analysis.compare import cca


def test_random_baselines_have_their_known_means():
    # E ||Qa^T Qb||_F^2 = ra rb / D for independent uniform subspaces, so the overlap averages sqrt(ra rb) / D
    assert random_subspace_overlap(64, 3, 3, n_draws=2000) == pytest.approx(3 / 64, rel=0.05)
    assert random_subspace_overlap(16, 2, 8, n_draws=2000) == pytest.approx(4 / 16, rel=0.05)
    # activations that are one 3-D signal in both models: every random 3-D projection sees all of it
    gen = torch.Generator().manual_seed(0)
    signal = torch.randn(2000, 3, generator=gen, dtype=torch.float64)
    a = signal @ torch.randn(3, 10, generator=gen, dtype=torch.float64)
    b = signal @ torch.randn(3, 12, generator=gen, dtype=torch.float64)
    same = random_projection_cca(a, b, 3, 3, n_draws=5)
    assert all(v == pytest.approx(1.0, abs=1e-9) for v in same.values())
    other = random_projection_cca(a, torch.randn(2000, 12, generator=gen, dtype=torch.float64), 3, 3)
    assert other["cca_top"] < 0.15 and other["cca_top3_min"] <= other["cca_top3_mean"] <= other["cca_top"]


def test_cca_summary_reads_the_top_three_as_the_paper_does():
    """Four directions of which three are shared (correlation ~1) and one is independent noise: the top-3
    summary is ~1 while the mean over every direction is pulled to ~0.75 (the book-init Markov cores)."""
    gen = torch.Generator().manual_seed(1)
    shared = torch.randn(5000, 3, generator=gen, dtype=torch.float64)
    X = torch.cat([shared, torch.randn(5000, 1, generator=gen, dtype=torch.float64)], 1)
    Y = torch.cat([shared @ torch.randn(3, 3, generator=gen, dtype=torch.float64),
                   torch.randn(5000, 1, generator=gen, dtype=torch.float64)], 1)
    out = cca_summary(cca(X, Y))
    assert out["cca_top"] == pytest.approx(1.0, abs=1e-9) and out["cca_top3_min"] == pytest.approx(1.0, abs=1e-9)
    assert out["cca_mean"] == pytest.approx(0.75, abs=0.02)


def test_a_subspace_against_the_whole_space_overlaps_exactly():
    """With rank_a = dim the first subspace is the whole space: ||Qb||_F^2 = rank_b for every draw, so the
    overlap rank_b / sqrt(dim rank_b) = sqrt(rank_b / dim) exactly, with no sampling error."""
    assert random_subspace_overlap(16, 16, 4, n_draws=20) == pytest.approx((4 / 16) ** 0.5, abs=1e-12)
    assert random_subspace_overlap(9, 1, 9, n_draws=20, seed=3) == pytest.approx(1 / 3, abs=1e-12)


def test_cca_summary_of_known_correlations():
    res = type("Res", (), {"correlations": torch.tensor([0.9, 0.8, 0.4, 0.1])})()
    out = cca_summary(res)
    assert CCA_LEADING == 3
    assert out == pytest.approx({"cca_top": 0.9, "cca_top3_min": 0.4, "cca_top3_mean": 0.7, "cca_mean": 0.55})
    assert cca_summary(res, leading=2)["cca_top3_min"] == pytest.approx(0.8)


def test_random_directions_block_of_the_identity_is_the_gram_matrix_of_unit_directions():
    B = baselines.random_directions_block(torch.eye(6, dtype=torch.float64), n=4, seed=0)
    assert B.shape == (4, 4) and torch.allclose(B.diagonal(), torch.ones(4, dtype=torch.float64))  # unit rows
    assert torch.allclose(B, B.T) and B.abs().max() <= 1 + 1e-12  # cosines between the directions
    M = torch.randn(6, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    again = baselines.random_directions_block(M, n=4, seed=0)
    R = baselines.random_directions_block(torch.eye(6, dtype=torch.float64), n=4, seed=0)
    assert again.shape == (4, 4) and not torch.allclose(again, R)


def test_compare_cores_of_one_model_with_itself_and_with_a_rotation():
    """The same core on the same activations: overlap 1 and CCA 1; the activations rotated by an orthogonal map
    (another model computing the same thing in other coordinates): CCA still 1, overlap that of the rotated
    subspace; the baselines are those of random subspaces of the same ranks."""
    from circuitbook.analysis.ace import extract_core
    gen = torch.Generator().manual_seed(0)
    D, N = 10, 400
    Z = torch.randn(N, 3, generator=gen, dtype=torch.float64)
    B = torch.randn(3, D, generator=gen, dtype=torch.float64)
    H = Z @ B + 0.01 * torch.randn(N, D, generator=gen, dtype=torch.float64)
    J = B[None].expand(N, 3, D).clone()  # three outputs that read the three planted directions
    core = extract_core(H, J, rank=3)
    same = baselines.compare_cores(core, H, core, H, seed=1)
    assert same["overlap"] == pytest.approx(1.0) and same["cca_top3_min"] == pytest.approx(1.0, abs=1e-8)
    R = torch.linalg.qr(torch.randn(D, D, generator=gen, dtype=torch.float64)).Q
    core_r = extract_core(H @ R, J @ R, rank=3)
    rot = baselines.compare_cores(core, H, core_r, H @ R, seed=1)
    assert rot["cca_top3_min"] == pytest.approx(1.0, abs=1e-6) and rot["overlap"] < 0.99
    assert rot["random_overlap"] == pytest.approx(random_subspace_overlap(D, 3, 3, seed=1))
    assert set(rot) >= {"random_cca_top", "random_cca_top3_min", "random_cca_mean"}
