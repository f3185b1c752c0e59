"""analysis.representations: paired cosines and ridge probes with known answers."""
import pytest
import torch

from circuitbook.analysis import representations as rep


def test_identical_vectors_give_matched_one_and_an_orthogonal_mismatch():
    a = torch.eye(4) * torch.tensor([1.0, 2.0, 3.0, 4.0])[:, None]  # orthogonal items
    out = rep.paired_cosines(a, a.clone())
    torch.testing.assert_close(out["matched"], torch.ones(4, dtype=torch.float64))
    torch.testing.assert_close(out["mismatched"], torch.zeros(4, dtype=torch.float64))
    torch.testing.assert_close(out["matched_centred"], torch.ones(4, dtype=torch.float64))


def test_a_shared_component_inflates_the_raw_cosine_but_not_the_centred_one():
    g = torch.Generator().manual_seed(0)
    shared = 10 * torch.ones(8)
    content = torch.randn(200, 8, generator=g)
    a, b = shared + content, shared + torch.randn(200, 8, generator=g)  # b: another content entirely
    out = rep.paired_cosines(a, b)
    assert out["matched"].mean() > 0.9 and out["mismatched"].mean() > 0.9  # the shared part dominates
    assert abs(float(out["matched_centred"].mean())) < 0.1
    same = rep.paired_cosines(a, shared + content)
    assert float(same["matched_centred"].min()) == pytest.approx(1.0)
    assert abs(float(same["mismatched_centred"].mean())) < 0.1


def test_explicit_mismatch_and_bad_input():
    a = torch.eye(3)
    out = rep.paired_cosines(a, a, mismatch=torch.tensor([2, 0, 1]))
    torch.testing.assert_close(out["mismatched"], torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="none equal to its own row"):
        rep.paired_cosines(a, a, mismatch=torch.tensor([0, 2, 1]))
    with pytest.raises(ValueError, match=r"\[n, d\]"):
        rep.paired_cosines(a, torch.eye(4))


def test_probe_accuracy_separable_and_chance():
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (400,), generator=g)
    X = torch.nn.functional.one_hot(y, 4).float() * 3 + 0.1 * torch.randn(400, 4, generator=g)
    assert rep.probe_accuracy(X[:200], y[:200], X[200:], y[200:], 4) == 1.0
    noise = torch.randn(2000, 8, generator=g)
    y = torch.randint(0, 4, (2000,), generator=g)
    assert rep.probe_accuracy(noise[:1000], y[:1000], noise[1000:], y[1000:], 4) == pytest.approx(0.25, abs=0.05)
    with pytest.raises(ValueError, match="matching lengths"):
        rep.probe_accuracy(X[:10], y[:9], X[:5], y[:5])
