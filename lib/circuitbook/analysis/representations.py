"""Comparing representations: paired cosines against a mismatched baseline, linear probes.

`paired_cosines` asks whether two ways of presenting the same content (e.g. a variable addition
and the constant addition with the same values) reach a layer as the same vector. The raw cosine
is inflated by everything the two sets share whatever their content (the embedding of the query
token, its position), so it is also given after subtracting the mean vector of both sets
(`centred`), and each is paired with a *mismatched* baseline: the same comparison with the
partner of another item. A centred matched cosine near 1 beside a mismatched one near 0 says the
layer encodes the content and not the presentation.
"""
from __future__ import annotations

import pandas as pd
import torch


def _cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a, b, dim=-1)


def paired_cosines(a, b, mismatch: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Row-wise cosines between a [n, d] and b [n, d] (row i of each presents the same item).

    mismatch [n]: for row i, the row of b it is compared with as the baseline (default: the next
    row, cyclically; it must differ from i). Returns float64 [n] tensors `matched`, `mismatched`,
    `matched_centred`, `mismatched_centred`; the centred ones subtract the mean of all 2n vectors.
    """
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    if a.shape != b.shape or a.dim() != 2 or len(a) < 2:
        raise ValueError(f"a and b must both be [n, d] with n >= 2; got {tuple(a.shape)} and {tuple(b.shape)}")
    n = len(a)
    mismatch = torch.roll(torch.arange(n), -1) if mismatch is None else torch.as_tensor(mismatch).long()
    if mismatch.shape != (n,) or bool((mismatch == torch.arange(n)).any()) or bool(
            ((mismatch < 0) | (mismatch >= n)).any()):
        raise ValueError(f"mismatch must be [n] = [{n}] row indices of b, none equal to its own row")
    mean = torch.cat([a, b]).mean(0)
    ac, bc = a - mean, b - mean
    return {"matched": _cosine(a, b), "mismatched": _cosine(a, b[mismatch]),
            "matched_centred": _cosine(ac, bc), "mismatched_centred": _cosine(ac, bc[mismatch])}


def probe_accuracy(X_train, y_train, X_test, y_test, n_classes: int | None = None, ridge: float = 1e-3) -> float:
    """Test accuracy of a closed-form ridge-regression probe onto one-hot labels (argmax decoding).

    Features are standardised with the training mean and std; `ridge` is relative to the mean
    diagonal of the training Gram matrix.
    """
    X_train, X_test = torch.as_tensor(X_train, dtype=torch.float64), torch.as_tensor(X_test, dtype=torch.float64)
    y_train, y_test = torch.as_tensor(y_train).long(), torch.as_tensor(y_test).long()
    if len(X_train) != len(y_train) or len(X_test) != len(y_test) or len(X_train) == 0 or len(X_test) == 0:
        raise ValueError("X_train/y_train and X_test/y_test must be non-empty and of matching lengths")
    k = n_classes or int(max(y_train.max(), y_test.max())) + 1
    mu, sd = X_train.mean(0), X_train.std(0).clamp(min=1e-8)
    A = torch.cat([(X_train - mu) / sd, torch.ones(len(X_train), 1, dtype=torch.float64)], 1)
    B = torch.cat([(X_test - mu) / sd, torch.ones(len(X_test), 1, dtype=torch.float64)], 1)
    Y = torch.nn.functional.one_hot(y_train, k).double()
    gram = A.T @ A
    lam = ridge * gram.diagonal().mean()
    W = torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=torch.float64), A.T @ Y)
    return float(((B @ W).argmax(1) == y_test).double().mean())


def form_cosines(read, forms: dict, reference: torch.Tensor) -> pd.DataFrame:
    """`paired_cosines` of several presentations of the same items against one reference presentation,
    at one layer: `read(tokens) -> [n, d]` reads the layer (e.g. a hook at the last position), `forms`
    {name: tokens [n, T]} and `reference` tokens [n, T] list the n items in the same order. One row per
    (form, item) with `matched`, `mismatched` and their `_centred` versions (the residual cosines of
    Assign and Add's AA-8: variable additions against the constant addition of the same values)."""
    ref = read(reference)
    rows = []
    for form, tokens in forms.items():
        cos = paired_cosines(read(tokens), ref)
        rows.append(pd.DataFrame({"form": form, "item": range(len(tokens)), **{k: v.numpy() for k, v in cos.items()}}))
    return pd.concat(rows, ignore_index=True)
