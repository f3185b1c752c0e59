"""fourier.py: fits on synthetic cosine grids with known frequencies, phases and amplitudes."""
import math

import pytest
import torch

from circuitbook.analysis import fourier
from circuitbook.models.toy import ToyConfig, ToyTransformer

N = 59


def wave(k: int, phase: float) -> torch.Tensor:
    return torch.cos(2 * math.pi * k * torch.arange(N, dtype=torch.float64) / N + phase)


def additive_neuron(k, a, b, amp_n=1.0, amp_m=1.0, const=0.0) -> torch.Tensor:
    """c + A cos(2 pi k n/N + a) + B cos(2 pi k m/N + b) on the [n, m] grid."""
    return const + amp_n * wave(k, a)[:, None] + amp_m * wave(k, b)[None, :]


def angle_gap(x, y) -> float:
    """|x - y| as angles, in [0, pi]."""
    return abs(math.remainder(float(x) - float(y), 2 * math.pi))


@pytest.fixture(scope="module")
def planted_grid():
    """Neurons 0-5 are pure single-frequency neurons, 6-8 are noise."""
    gen = torch.Generator().manual_seed(0)
    spec = [(9, 0.3, -1.2, 2.0, 1.5), (17, 2.5, 0.4, 1.0, 1.0), (21, -2.0, 3.0, 0.5, 0.8),
            (9, 1.0, 1.1, 1.0, 2.0), (17, -0.5, -2.9, 3.0, 1.0), (21, 0.0, 1.5, 1.0, 1.0)]
    neurons = [additive_neuron(k, a, b, A, B, const=0.1 * i) for i, (k, a, b, A, B) in enumerate(spec)]
    neurons += [torch.randn(N, N, generator=gen, dtype=torch.float64) for _ in range(3)]
    return torch.stack(neurons, -1), spec


def test_single_frequency_fit_recovers_frequency_phase_amplitude(planted_grid):
    grid, spec = planted_grid
    fit = fourier.fit_single_frequency(grid)
    assert fit.r2.shape == (9, N // 2)
    for i, (k, a, b, A, B) in enumerate(spec):
        assert int(fit.best_frequency[i]) == k
        assert float(fit.best_r2[i]) == pytest.approx(1.0, abs=1e-9)
        assert angle_gap(fit.phase_n[i], a) < 1e-8
        assert angle_gap(fit.phase_m[i], b) < 1e-8
        assert float(fit.amplitude_n[i]) == pytest.approx(A) and float(fit.amplitude_m[i]) == pytest.approx(B)
        assert float(fit.constant[i]) == pytest.approx(0.1 * i, abs=1e-9)
    assert (fit.best_r2[6:] < 0.02).all()  # 4 parameters cannot explain 3481 noise values


def test_key_frequencies_of_a_run(planted_grid):
    grid, _ = planted_grid
    fit = fourier.fit_single_frequency(grid)
    assert fourier.key_frequencies(fit, power_fraction=0.9) == [9, 17, 21]
    assert int(fit.neuron_counts.sum()) == 9  # every neuron, noise included, has a best frequency
    assert (fit.neuron_counts[[8, 16, 20]] >= 2).all()  # index k - 1 holds frequency k
    with pytest.raises(ValueError, match="power_fraction"):
        fourier.key_frequencies(fit, power_fraction=1.5)


def test_multi_frequency_fit():
    two_freq = additive_neuron(9, 0.3, 0.2) + additive_neuron(25, -1.0, 2.0, 0.5, 0.5)
    single = fourier.fit_single_frequency(two_freq)
    assert float(single.best_r2[0]) < 0.9  # one frequency misses the other's variance
    multi = fourier.fit_frequencies(two_freq, [9, 25])
    assert float(multi.r2[0]) == pytest.approx(1.0, abs=1e-9)
    assert multi.amplitude_n.shape == (1, 2)
    assert torch.allclose(multi.amplitude_n[0], torch.tensor([1.0, 0.5], dtype=torch.float64))
    assert angle_gap(multi.phase_m[0, 1], 2.0) < 1e-8
    with pytest.raises(ValueError, match="frequencies"):
        fourier.fit_frequencies(two_freq, [0, 30])
    with pytest.raises(ValueError, match="acts"):
        fourier.fit_frequencies(torch.zeros(5, 6), [1])


def test_embedding_spectrum_and_basis():
    basis, labels = fourier.fourier_basis(N)
    assert torch.allclose(basis @ basis.T, torch.eye(N, dtype=torch.float64), atol=1e-10)
    assert labels[:3] == ["const", "cos 1", "sin 1"] and len(labels) == N
    gen = torch.Generator().manual_seed(1)
    phases = torch.rand(8, generator=gen, dtype=torch.float64) * 2 * math.pi
    W_E = torch.stack([wave(13, float(p)) for p in phases], 1)  # [N, d]: every column at frequency 13
    W_E = torch.cat([W_E, torch.randn(5, 8, generator=gen, dtype=torch.float64)])  # non-number tokens
    spectrum = fourier.embedding_spectrum(W_E, modulus=N)
    assert spectrum.shape == (N // 2 + 1,) and int(spectrum.argmax()) == 13
    assert float(spectrum.pow(2).sum()) == pytest.approx(float(W_E[:N].pow(2).sum()))  # Parseval
    assert float(spectrum[13] ** 2) == pytest.approx(float(W_E[:N].pow(2).sum()))
    assert torch.allclose(fourier.embedding_spectrum(W_E[:N].T, axis=1), spectrum)
    with pytest.raises(ValueError, match="modulus"):
        fourier.embedding_spectrum(W_E, modulus=100)


def test_collect_grid_activations_on_toy_model():
    p = 7
    cfg = ToyConfig(d_vocab=p + 1, n_ctx=3, d_model=16, n_layers=2, d_mlp=24, mlp=(False, True), d_vocab_out=p)
    model = ToyTransformer(cfg, seed=0)
    make_tokens = lambda n, m: torch.stack([n, m, torch.full_like(n, p)], 1)  # noqa: E731 -- "n m ="
    grid = fourier.collect_grid_activations(model, make_tokens, "blocks.1.mlp.hook_pre", p)
    assert grid.shape == (p, p, 24)
    with torch.no_grad():
        _, cache = model.run_with_cache(torch.tensor([[3, 5, p]]))
    assert torch.allclose(grid[3, 5], cache["blocks.1.mlp.hook_pre"][0, -1], atol=1e-6)
    assert fourier.fit_single_frequency(grid).best_frequency.shape == (24,)


def test_summarise_grid_key_frequencies_beat_random_ones(planted_grid):
    grid, _ = planted_grid
    six = grid[..., :6]  # the pure neurons: every one is fitted exactly by its own frequency
    s = fourier.summarise_grid(six, power_fraction=0.9, n_random=4, seed=1)
    assert s.key_frequencies == [9, 17, 21]
    assert s.median_single_r2 == pytest.approx(1.0, abs=1e-9) and s.median_multi_r2 == pytest.approx(1.0, abs=1e-9)
    # a pure neuron's R^2 on random frequencies is 1 if they include its own, else 0 exactly (the
    # frequencies are orthogonal on the grid); the baseline is the median over neurons, mean over draws
    own = torch.tensor([k for k, *_ in planted_grid[1]])
    expected = []
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        drawn = torch.randperm(N // 2, generator=gen)[:3] + 1
        expected.append(float(torch.isin(own, drawn).double().median()))
    assert s.random_frequencies_r2 == pytest.approx(sum(expected) / 4, abs=1e-9)
    with pytest.raises(ValueError, match="n_random"):
        fourier.summarise_grid(six, n_random=0)


def test_summarise_grid_of_noise_needs_many_frequencies():
    noise = torch.randn(N, N, 12, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    s = fourier.summarise_grid(noise, power_fraction=0.8)
    assert len(s.key_frequencies) >= 20  # no few frequencies carry the power of noise
    assert s.median_single_r2 < 0.01


def test_answer_fourier_subspace_recovers_the_planted_answer_directions():
    """A grid that carries cos / sin of 2 pi k (n + m) / N along planted directions u, v (and a function of n
    alone along w): the answer's subspace at k is exactly span(u, v), and the direction of n alone stays out."""
    N, D, k = 13, 9, 3
    gen = torch.Generator().manual_seed(0)
    u, v, w = torch.linalg.qr(torch.randn(D, 3, generator=gen, dtype=torch.float64)).Q.T
    n, m = torch.meshgrid(torch.arange(N), torch.arange(N), indexing="ij")
    c = ((n + m) % N).double()
    grid = (torch.cos(2 * math.pi * k * c / N)[..., None] * u + torch.sin(2 * math.pi * k * c / N)[..., None] * v
            + torch.cos(2 * math.pi * 2 * n.double() / N)[..., None] * w + 5.0)
    F = fourier.answer_fourier_subspace(grid, [k])
    assert F.shape == (D, 2)
    P = F @ F.T
    assert torch.allclose(P @ u, u, atol=1e-10) and torch.allclose(P @ v, v, atol=1e-10)
    assert float((P @ w).norm()) < 1e-10, "a feature of one operand is not the answer's"
    # a frequency the grid does not carry adds no direction; none carried at all is refused
    assert fourier.answer_fourier_subspace(grid, [k, 5]).shape == (D, 2)
    with pytest.raises(ValueError, match="none of the given frequencies"):
        fourier.answer_fourier_subspace(grid, [5])
    with pytest.raises(ValueError, match="frequencies"):
        fourier.answer_fourier_subspace(grid, [])
