"""Random baselines for comparing two models' subspaces: what the same measure gives for random subspaces.

    random_subspace_overlap   mean projector overlap of independent uniformly random subspaces
    cca_summary, CCA_LEADING  a CCA result as the top correlation, the leading ones and the mean
    random_projection_cca     the CCA of two models' activations projected on random subspaces
    random_directions_block   a bilinear form read along random unit directions (a block of named directions' baseline)
    compare_cores             two models' cores: overlap and CCA, each beside its random baseline
    signal_to_noise           a quantity measured on K disjoint parts of a sample: its mean and how far above
                              its sampling noise it stands (a direction read below the noise is the draw's)
"""
from __future__ import annotations

import numpy as np
import torch

from .compare import cca, projector_overlap


def random_subspace_overlap(dim: int, rank_a: int, rank_b: int, n_draws: int = 500, seed: int = 0) -> float:
    """Mean projector overlap of two independent uniformly random subspaces of R^dim (ranks rank_a, rank_b)."""
    gen = torch.Generator().manual_seed(seed)
    vals = [projector_overlap(torch.randn(dim, rank_a, generator=gen, dtype=torch.float64),
                              torch.randn(dim, rank_b, generator=gen, dtype=torch.float64)) for _ in range(n_draws)]
    return float(np.mean(vals))


CCA_LEADING = 3  # the paper summarises CCA by its top 3 canonical correlations


def cca_summary(res, leading: int = CCA_LEADING) -> dict[str, float]:
    """A CCA result as the paper reports it and beside it: the top correlation, the smallest and the mean of
    the leading `leading` ones (the paper's top 3), and the mean over every direction."""
    rho = np.asarray(res.correlations, dtype=float)
    lead = rho[:leading]
    return {"cca_top": float(rho[0]), "cca_top3_min": float(lead.min()), "cca_top3_mean": float(lead.mean()),
            "cca_mean": float(rho.mean())}


def random_projection_cca(acts_a: torch.Tensor, acts_b: torch.Tensor, rank_a: int, rank_b: int,
                          n_draws: int = 20, seed: int = 0) -> dict[str, float]:
    """The CCA baseline of random subspaces: `cca_summary` averaged over n_draws pairs of random subspaces
    of ranks rank_a, rank_b, the two models' activations projected on them, same inputs."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.as_tensor(acts_a, dtype=torch.float64)
    b = torch.as_tensor(acts_b, dtype=torch.float64)
    draws = []
    for _ in range(n_draws):
        Ra = torch.linalg.qr(torch.randn(a.shape[1], rank_a, generator=gen, dtype=torch.float64)).Q
        Rb = torch.linalg.qr(torch.randn(b.shape[1], rank_b, generator=gen, dtype=torch.float64)).Q
        draws.append(cca_summary(cca(a @ Ra, b @ Rb)))
    return {k: float(np.mean([d[k] for d in draws])) for k in draws[0]}


def random_directions_block(M: torch.Tensor, n: int, seed: int = 0) -> torch.Tensor:
    """A form M [d, d] read along n random unit directions on both sides [n, n]: what the block of a
    form between n named directions (e.g. Assign and Add's variables, AA-12) looks like when those
    directions carry nothing special."""
    R = torch.randn(n, M.shape[0], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    R = R / R.norm(dim=1, keepdim=True)
    return R @ M.double() @ R.T


def compare_cores(core_a, acts_a: torch.Tensor, core_b, acts_b: torch.Tensor, seed: int = 0) -> dict[str, float]:
    """Two models' cores (AceCore of each, activations [N, D] of each on the same N inputs): the projector
    overlap of the two subspaces beside that of random subspaces of the same ranks (`random_subspace_overlap`),
    and the CCA of the two sets of core coordinates (`cca_summary`) beside the CCA of the activations projected
    on random subspaces of the same ranks (`random_projection_cca`, keys prefixed `random_`)."""
    ra, rb = core_a.rank, core_b.rank
    res = cca_summary(cca(core_a.coordinates(acts_a), core_b.coordinates(acts_b)))
    rand = random_projection_cca(acts_a, acts_b, ra, rb, seed=seed)
    return {"overlap": projector_overlap(core_a, core_b), "random_overlap": random_subspace_overlap(core_a.dim, ra, rb, seed=seed),
            **res, **{f"random_{k}": v for k, v in rand.items()}}


def signal_to_noise(parts) -> tuple[torch.Tensor, float]:
    """(mean, snr) of a quantity measured on K >= 2 disjoint, equally sized parts of one sample (e.g. a gradient
    on K sub-batches): the mean is the quantity on the whole sample; snr = ||mean|| / ||standard error of the
    mean|| (Frobenius norms; the standard error from the spread of the parts, elementwise). snr near 1 or below:
    the mean is mostly sampling noise, and its direction (a cosine with anything) is the draw's, not the
    model's; a quantity K parts agree on has a large snr."""
    x = torch.stack([torch.as_tensor(p, dtype=torch.float64) for p in parts])
    if x.shape[0] < 2:
        raise ValueError(f"signal_to_noise needs at least 2 parts to see the noise; got {x.shape[0]}")
    mean = x.mean(0)
    se = x.std(0, unbiased=True) / x.shape[0] ** 0.5
    noise = float(se.norm())
    return mean, (float(mean.norm()) / noise if noise > 0 else float("inf"))
