"""Analysis tools shared by the chapters (any paper's tool, for any paper's model).

- `attention`: attention patterns from hooks, top-key shares, identity-like QK forms
- `ace`: Algorithmic Core Extraction -- extract, collect from a model, validate, identify; the class-mean shift
  operator and its unit-circle statistics
- `readout`: ACE at the last residual stream of a toy model, and the core's sufficient / necessary dimensions
- `baselines`: random-subspace overlap, random-projection CCA, random directions, two cores beside their baselines
- `compare`: projector overlap, the share of one subspace inside another, CCA, weight and matrix cosine similarity
- `curves`: crossings, half-way and settling steps, steepest rises and thresholds of training curves and sweeps
- `fits`: the line through the origin, a cross-validated logistic fit, the paired accuracy gap
- `fourier`: Fourier fits of neurons on operand grids, key frequencies against random ones, the answer's Fourier
  directions, embedding spectra
- `imir`: the invariant manifold S of inductive tasks (selection matrices, writing/action bases, projection,
  coordinates, restricted training, the standard transformer's progress measures)
- `induction`: induction progress measures read on chosen tokens and position offsets
- `leading_terms`: corpus statistics B, Sigma_B, Phi, Q, the leading-term predictions after s SGD steps,
  matrix cosines and leading-term removal
- `loss_position_terms`: the statistics a loss at the last position sees from a random initialisation, and
  agreements of early displacements with them
- `representations`: paired cosines against a mismatched baseline, ridge probes, residual-form cosines
- `subspace`: the share of a noisy vector in nested subspaces, unbiased from two independent estimates
"""
