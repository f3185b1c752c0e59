"""Analysis tools shared by the chapters.

- `attention`: attention patterns from hooks, top-key shares, identity-like QK forms
- `ace`: Algorithmic Core Extraction -- extract, collect from a model, validate, identify
- `compare`: projector overlap, CCA, weight and matrix cosine similarity
- `curves`: crossings, steepest rises and thresholds of training curves and sweeps
- `fourier`: Fourier fits of neurons on operand grids, key frequencies against random ones, embedding spectra
- `representations`: paired cosines against a mismatched baseline, ridge probes
"""
