"""Fourier analysis of modular-arithmetic models (claim AA-9 and grokking analyses).

Neuron fits. For a neuron's pre-activation f(n, m) on the N x N grid of operand values,
the single-frequency model is

    f(n, m) ~ c + A cos(2 pi k n / N + a) + B cos(2 pi k m / N + b),

the paper's form cos(2 pi k n/N + a_k) + cos(2 pi k m/N + b_k) with a free constant and
free amplitudes A, B for the two operands. A cos(t + a) = alpha cos t + beta sin t, so the
fit is linear least squares on [1, cos, sin (n), cos, sin (m)]; A = hypot(alpha, beta),
a = atan2(-beta, alpha). `fit_frequencies` sums the same terms over a set of frequencies.

Key frequencies (`key_frequencies`): the frequency-k power of a run is the variance of all
neurons explained by their frequency-k fit, summed over neurons (on the full grid, the
terms of different frequencies are orthogonal, so these powers add up to the variance the
additive Fourier model explains). The key frequencies are the fewest frequencies, taken in
order of decreasing power, whose powers add up to `power_fraction` of the total.

Grids are indexed [n, m, neuron]: axis 0 is the left operand, axis 1 the right operand.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .ace import Position, _as_float64, collect_activations


def _check_grid(acts) -> torch.Tensor:
    """[N, N] or [N, N, K] -> float64 [N, N, K]."""
    grid = _as_float64(acts, "acts")
    if grid.ndim == 2:
        grid = grid[..., None]
    if grid.ndim != 3 or grid.shape[0] != grid.shape[1] or grid.shape[0] < 3:
        raise ValueError(f"acts must be an N x N grid [N, N] or [N, N, n_neurons] with N >= 3; "
                         f"got shape {tuple(grid.shape)}")
    return grid


def _check_frequencies(freqs: Sequence[int], modulus: int) -> list[int]:
    freqs = [int(k) for k in freqs]
    if not freqs or any(not 1 <= k <= modulus // 2 for k in freqs) or len(set(freqs)) != len(freqs):
        raise ValueError(f"frequencies={freqs!r} are not allowed; expected distinct integers in [1, {modulus // 2}]")
    return freqs


def grid_design(modulus: int, frequencies: Sequence[int]) -> torch.Tensor:
    """Design matrix [N*N, 1 + 4 len(frequencies)]: a constant, then per frequency k
    cos(2 pi k n/N), sin(2 pi k n/N), cos(2 pi k m/N), sin(2 pi k m/N); rows in grid order (n, m)."""
    n, m = torch.meshgrid(torch.arange(modulus, dtype=torch.float64), torch.arange(modulus, dtype=torch.float64),
                          indexing="ij")
    columns = [torch.ones(modulus * modulus, dtype=torch.float64)]
    for k in frequencies:
        for operand in (n, m):
            angle = 2 * math.pi * k * operand.flatten() / modulus
            columns += [angle.cos(), angle.sin()]
    return torch.stack(columns, 1)


def _least_squares(design: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Coefficients [n_cols, K] and R^2 [K] (nan for constant targets, where R^2 is undefined)."""
    # the design has few columns: its pseudo-inverse is cheap, shared by all neurons, and copes
    # with the all-zero sin column of k = N/2 for even N
    coef = torch.linalg.pinv(design) @ targets
    ss_res = (targets - design @ coef).pow(2).sum(0)
    ss_tot = (targets - targets.mean(0)).pow(2).sum(0)
    r2 = torch.where(ss_tot > 0, 1 - ss_res / ss_tot.clamp(min=1e-300), torch.full_like(ss_tot, float("nan")))
    return coef, r2


def _amplitude_phase(cos_coef: torch.Tensor, sin_coef: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """alpha cos t + beta sin t = A cos(t + a)  ->  (A, a) with a in (-pi, pi]."""
    return torch.hypot(cos_coef, sin_coef), torch.atan2(-sin_coef, cos_coef)


@dataclass(frozen=True)
class SingleFrequencyFit:
    """Per-neuron single-frequency fits over all candidate frequencies 1..N//2.

    r2 [K, F] is each neuron's R^2 at each candidate frequency (F = N//2);
    best_frequency, best_r2 and the fitted constant / amplitudes / phases [K] are at each
    neuron's best frequency; power [F] is the summed explained variance per frequency and
    neuron_counts [F] how many neurons have that frequency as their best.
    """

    modulus: int
    frequencies: torch.Tensor
    r2: torch.Tensor
    best_frequency: torch.Tensor
    best_r2: torch.Tensor
    constant: torch.Tensor
    amplitude_n: torch.Tensor
    phase_n: torch.Tensor
    amplitude_m: torch.Tensor
    phase_m: torch.Tensor
    power: torch.Tensor
    neuron_counts: torch.Tensor


def fit_single_frequency(acts) -> SingleFrequencyFit:
    """Fit every neuron of an [N, N, K] grid to c + A cos(2 pi k n/N + a) + B cos(2 pi k m/N + b)
    for each k in 1..N//2 and keep each neuron's best k (highest R^2)."""
    grid = _check_grid(acts)
    N, K = grid.shape[0], grid.shape[2]
    targets = grid.reshape(N * N, K)
    centred_ss = (targets - targets.mean(0)).pow(2).sum(0)
    freqs = list(range(1, N // 2 + 1))
    fits = [_least_squares(grid_design(N, [k]), targets) for k in freqs]
    coefs = torch.stack([c for c, _ in fits])  # [F, 5, K]
    r2 = torch.stack([r for _, r in fits], 1)  # [K, F]
    best = r2.nan_to_num(-math.inf).argmax(1)  # [K]
    at_best = coefs[best, :, torch.arange(K)]  # [K, 5]
    amp_n, phase_n = _amplitude_phase(at_best[:, 1], at_best[:, 2])
    amp_m, phase_m = _amplitude_phase(at_best[:, 3], at_best[:, 4])
    power = (r2.nan_to_num(0.0) * centred_ss[:, None]).sum(0)  # explained sum of squares per k
    return SingleFrequencyFit(
        modulus=N, frequencies=torch.tensor(freqs), r2=r2, best_frequency=torch.tensor(freqs)[best],
        best_r2=r2[torch.arange(K), best], constant=at_best[:, 0], amplitude_n=amp_n, phase_n=phase_n,
        amplitude_m=amp_m, phase_m=phase_m, power=power,
        neuron_counts=torch.bincount(best, minlength=len(freqs)))


def key_frequencies(fit: SingleFrequencyFit, power_fraction: float = 0.9) -> list[int]:
    """The fewest frequencies, by decreasing summed power, that carry `power_fraction` of the
    power of all frequencies (see the module docstring); returned in increasing order."""
    if not 0 < power_fraction <= 1:
        raise ValueError(f"power_fraction={power_fraction!r} is not allowed; expected a number in (0, 1]")
    total = fit.power.sum()
    if total <= 0:
        return []
    order = torch.argsort(fit.power, descending=True, stable=True)
    share = fit.power[order].cumsum(0) / total
    n_key = int(torch.searchsorted(share, torch.tensor(power_fraction - 1e-12, dtype=share.dtype))) + 1
    return sorted(int(k) for k in fit.frequencies[order[:n_key]])


@dataclass(frozen=True)
class MultiFrequencyFit:
    """Fit of every neuron to c + sum_k [A_k cos(2 pi k n/N + a_k) + B_k cos(2 pi k m/N + b_k)].

    frequencies [F]; constant [K]; amplitude_n, phase_n, amplitude_m, phase_m [K, F]; r2 [K].
    """

    frequencies: list[int]
    constant: torch.Tensor
    amplitude_n: torch.Tensor
    phase_n: torch.Tensor
    amplitude_m: torch.Tensor
    phase_m: torch.Tensor
    r2: torch.Tensor


def fit_frequencies(acts, frequencies: Sequence[int]) -> MultiFrequencyFit:
    """Least-squares fit of every neuron of an [N, N, K] grid to the sum over `frequencies`."""
    grid = _check_grid(acts)
    N, K = grid.shape[0], grid.shape[2]
    freqs = _check_frequencies(frequencies, N)
    coef, r2 = _least_squares(grid_design(N, freqs), grid.reshape(N * N, K))
    waves = coef[1:].reshape(len(freqs), 4, K)  # per k: cos n, sin n, cos m, sin m
    amp_n, phase_n = _amplitude_phase(waves[:, 0], waves[:, 1])
    amp_m, phase_m = _amplitude_phase(waves[:, 2], waves[:, 3])
    return MultiFrequencyFit(frequencies=freqs, constant=coef[0], amplitude_n=amp_n.T, phase_n=phase_n.T,
                             amplitude_m=amp_m.T, phase_m=phase_m.T, r2=r2)


def fourier_basis(modulus: int) -> tuple[torch.Tensor, list[str]]:
    """Real orthonormal Fourier basis of R^N as rows [N, N] with labels
    ('const', 'cos 1', 'sin 1', ...); for even N the last row is 'cos N/2'."""
    if not (isinstance(modulus, int) and modulus >= 2):
        raise ValueError(f"modulus={modulus!r} is not allowed; expected an integer >= 2")
    x = torch.arange(modulus, dtype=torch.float64)
    rows, labels = [torch.ones(modulus, dtype=torch.float64)], ["const"]
    for k in range(1, modulus // 2 + 1):
        angle = 2 * math.pi * k * x / modulus
        rows.append(angle.cos())
        labels.append(f"cos {k}")
        if 2 * k != modulus:  # sin(pi x) vanishes on the integers
            rows.append(angle.sin())
            labels.append(f"sin {k}")
    basis = torch.stack(rows)
    return basis / basis.norm(dim=1, keepdim=True), labels


def embedding_spectrum(W, modulus: int | None = None, axis: int = 0) -> torch.Tensor:
    """Norm of an embedding matrix per frequency k = 0..N//2 along its token axis.

    W: e.g. W_E [vocab, d] (axis=0) or W_U [d, vocab] (axis=1); the first `modulus` tokens
    (default: all) are the numbers 0..N-1. Entry k is the Frobenius norm of W's component in
    the span of cos/sin of frequency k, so the squared entries add up to ||W[:N]||_F^2.
    """
    mat = _as_float64(W, "W")
    if mat.ndim != 2 or axis not in (0, 1):
        raise ValueError(f"W must be 2-D and axis 0 or 1; got shape {tuple(mat.shape)}, axis={axis!r}")
    tokens_first = mat if axis == 0 else mat.T
    N = tokens_first.shape[0] if modulus is None else modulus
    if not (isinstance(N, int) and 2 <= N <= tokens_first.shape[0]):
        raise ValueError(f"modulus={modulus!r} is not allowed; expected an integer in [2, {tokens_first.shape[0]}]")
    basis, labels = fourier_basis(N)
    coeffs = basis @ tokens_first[:N]  # [N, d], one row per basis vector
    freq_of_row = torch.tensor([0 if lab == "const" else int(lab.split()[1]) for lab in labels])
    power = torch.zeros(N // 2 + 1, dtype=torch.float64).index_add_(0, freq_of_row, coeffs.pow(2).sum(1))
    return power.sqrt()


def collect_grid_activations(model, make_tokens: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                             hook_name: str, modulus: int, position: Position = -1,
                             batch_size: int = 512) -> torch.Tensor:
    """Activations at `hook_name` for every operand pair, as an [N, N, D] grid.

    make_tokens(n [M], m [M]) -> tokens [M, pos] builds the input for each pair, e.g. the
    0-var sequences `PAD ... + n m =`; the activation is read at `position`.
    """
    if not (isinstance(modulus, int) and modulus >= 3):
        raise ValueError(f"modulus={modulus!r} is not allowed; expected an integer >= 3")
    if position == "all":
        raise ValueError("position='all' is not allowed here; expected one integer position")
    n, m = torch.meshgrid(torch.arange(modulus), torch.arange(modulus), indexing="ij")
    tokens = make_tokens(n.flatten(), m.flatten())
    acts = collect_activations(model, tokens, hook_name, position=position, batch_size=batch_size)
    return acts.reshape(modulus, modulus, -1)


@dataclass(frozen=True)
class FourierSummary:
    """What claim AA-9 reads from a grid of neuron pre-activations (see `summarise_grid`)."""

    single: SingleFrequencyFit
    key_frequencies: list[int]
    multi: MultiFrequencyFit | None
    median_single_r2: float  # median over neurons of the best single-frequency R^2
    median_multi_r2: float  # median over neurons of the R^2 of all key frequencies together
    random_frequencies_r2: float  # the same with as many random frequencies (mean over draws)


def _median(x: torch.Tensor) -> float:
    return float(x.nanmedian()) if x.numel() and not bool(x.isnan().all()) else float("nan")


def summarise_grid(acts, power_fraction: float = 0.8, n_random: int = 8, seed: int = 0) -> FourierSummary:
    """Single-frequency fits, the key frequencies, their joint fit, and a random baseline.

    The baseline fits every neuron to as many frequencies as there are key frequencies, drawn
    uniformly at random from 1..N//2 (`n_random` draws, seeded): a subspace of the same dimension
    that was not chosen by the neurons. Key frequencies that explain the neurons beat it by far;
    for a neuron with no Fourier structure the two are alike.
    """
    if not (isinstance(n_random, int) and n_random >= 1):
        raise ValueError(f"n_random={n_random!r} is not allowed; expected an integer >= 1")
    grid = _check_grid(acts)
    single = fit_single_frequency(grid)
    keys = key_frequencies(single, power_fraction)
    multi = fit_frequencies(grid, keys) if keys else None
    gen = torch.Generator().manual_seed(seed)
    n_freq = grid.shape[0] // 2
    random_r2 = [_median(fit_frequencies(grid, (torch.randperm(n_freq, generator=gen)[:len(keys)] + 1).tolist()).r2)
                 for _ in range(n_random)] if keys else [float("nan")]
    return FourierSummary(single=single, key_frequencies=keys, multi=multi,
                          median_single_r2=_median(single.best_r2),
                          median_multi_r2=_median(multi.r2) if multi is not None else float("nan"),
                          random_frequencies_r2=float(sum(random_r2) / len(random_r2)))


def answer_fourier_subspace(acts, frequencies: Sequence[int]) -> torch.Tensor:
    """Orthonormal basis [D, 2 K] of the directions along which a grid of activations [N, N, D] varies as
    cos and sin of 2 pi k (n + m) / N, for each of the K `frequencies`: the features of the answer
    c = (n + m) mod N at those frequencies (the directions a Fourier-feature readout reads).

    Each direction is the least-squares coefficient vector of one basis function over the whole grid
    (on the full grid the functions are orthogonal, so each coefficient is the grid's projection on it);
    a frequency whose coefficients vanish adds no direction, and the basis spans what is left (QR of the
    coefficient vectors; a coefficient vector below 1e-9 of the grid's largest entry is dropped).
    """
    grid = _check_grid(acts)
    N = grid.shape[0]
    keys = _check_frequencies(frequencies, N)
    if not keys:
        raise ValueError("frequencies must name at least one frequency in 1..N//2")
    n, m = torch.meshgrid(torch.arange(N), torch.arange(N), indexing="ij")
    c = ((n + m) % N).flatten().double()
    H = grid.reshape(N * N, -1)
    H = H - H.mean(0)
    cols = []
    for k in keys:
        for f in (torch.cos, torch.sin):
            phi = f(2 * math.pi * k * c / N)
            if float(phi.norm()) < 1e-9:  # sin at k = N/2 vanishes on the grid
                continue
            cols.append(H.T @ phi / phi.dot(phi))
    C = torch.stack(cols, 1)
    scale = max(float(H.abs().max()), 1e-300)  # a coefficient at rounding level of the grid is no direction
    C = C[:, C.norm(dim=0) > 1e-9 * scale]
    if C.shape[1] == 0:
        raise ValueError("the grid carries none of the given frequencies of the answer (all coefficients vanish)")
    U, S, _ = torch.linalg.svd(C, full_matrices=False)
    return U[:, S > 1e-9 * S[0]]
