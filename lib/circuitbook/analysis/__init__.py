"""Analysis tools shared by the chapters.

- `ace`: Algorithmic Core Extraction -- extract, collect from a model, validate, identify
- `compare`: projector overlap, CCA, weight and matrix cosine similarity
- `fourier`: Fourier fits of neurons on operand grids, embedding spectra
"""
