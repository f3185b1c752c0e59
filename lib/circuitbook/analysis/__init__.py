"""Analysis tools shared by the chapters.

- `attention`: attention patterns from hooks, top-key shares, identity-like QK forms
- `ace`: Algorithmic Core Extraction -- extract, collect from a model, validate, identify
- `compare`: projector overlap, CCA, weight and matrix cosine similarity
- `curves`: crossings, steepest rises and thresholds of training curves and sweeps
- `fourier`: Fourier fits of neurons on operand grids, key frequencies against random ones, embedding spectra
- `imir`: the invariant manifold S of inductive tasks (selection matrices, writing/action bases, projection,
  coordinates, restricted training)
- `leading_terms`: corpus statistics B, Sigma_B, Phi, Q, the leading-term predictions after s SGD steps,
  matrix cosines and leading-term removal
- `representations`: paired cosines against a mismatched baseline, ridge probes
- `subspace`: the share of a noisy vector in nested subspaces, unbiased from two independent estimates
"""
