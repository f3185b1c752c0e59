"""Small statistical fits: a line through the origin, multinomial logistic regression with grouped
cross-validation, and the paired gap between two predictors scored on the same samples.

    proportional_fit(x, y)                    y = c x through the origin: c and R^2
    logistic_fit(features, labels, ...)       k-fold (grouped) cross-validated accuracy of a softmax regression
    paired_gap(correct_a, correct_b, groups)  accuracy gap of two predictors and its (cluster-robust) standard error
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def proportional_fit(x, y) -> dict:
    """y = c x through the origin: c and R^2 = 1 - SS_res / SS_tot (SS_tot about the mean of y)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    c = float((x * y).sum() / (x * x).sum())
    ss_res = float(((y - c * x) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return {"c": c, "r2": 1 - ss_res / ss_tot if ss_tot > 0 else float("nan")}


def _softmax_regression(X: np.ndarray, y: np.ndarray, n_classes: int, l2: float) -> np.ndarray:
    """Weights [(p + 1), n_classes] (the last row the intercepts) of an L2-penalised multinomial logistic
    regression of integer labels y on X (L-BFGS from zero; the intercepts are not penalised)."""
    from scipy.optimize import minimize

    n, p = X.shape
    Xb = np.hstack([X, np.ones((n, 1))])
    Y = np.eye(n_classes)[y]

    def loss(w):
        W = w.reshape(p + 1, n_classes)
        Z = Xb @ W
        Z -= Z.max(1, keepdims=True)
        logp = Z - np.log(np.exp(Z).sum(1, keepdims=True))
        P = np.exp(logp)
        reg = 0.5 * l2 * (W[:-1] ** 2).sum()
        grad = Xb.T @ (P - Y) / n
        grad[:-1] += l2 * W[:-1]
        return -(Y * logp).sum() / n + reg, grad.ravel()

    res = minimize(loss, np.zeros((p + 1) * n_classes), jac=True, method="L-BFGS-B")
    return res.x.reshape(p + 1, n_classes)


def logistic_fit(features: np.ndarray, labels: Sequence[str], folds: int = 5, l2: float = 1e-3,
                 seed: int = 0, groups: Sequence | None = None) -> dict:
    """Multinomial logistic regression of `labels` on standardised `features`: k-fold cross-validated
    accuracy (and each sample's held-out correctness, `cv_correct`), and the in-sample accuracy of the
    fit on all points. groups: samples of one group (e.g. replicates of one initial point) always
    share a fold, so a fold never tests on a copy of what it trained on."""
    X = np.asarray(features, float)
    X = (X - X.mean(0)) / np.where(X.std(0) > 0, X.std(0), 1.0)
    classes = sorted(set(labels))
    y = np.array([classes.index(c) for c in labels])
    if len(classes) < 2:
        return {"cv_accuracy": 1.0, "train_accuracy": 1.0, "classes": classes, "cv_correct": np.ones(len(y), bool)}
    ids = np.arange(len(y)) if groups is None else np.unique(np.asarray(groups), return_inverse=True)[1]
    rng = np.random.default_rng(seed)
    fold_of = np.empty(ids.max() + 1, int)
    fold_of[rng.permutation(ids.max() + 1)] = np.arange(ids.max() + 1) % folds
    correct = np.zeros(len(y), bool)
    for f in range(folds):
        test = np.flatnonzero(fold_of[ids] == f)
        train_idx = np.flatnonzero(fold_of[ids] != f)
        if len(test) == 0:
            continue
        W = _softmax_regression(X[train_idx], y[train_idx], len(classes), l2)
        correct[test] = (np.hstack([X[test], np.ones((len(test), 1))]) @ W).argmax(1) == y[test]
    W = _softmax_regression(X, y, len(classes), l2)
    train_acc = float(((np.hstack([X, np.ones((len(y), 1))]) @ W).argmax(1) == y).mean())
    return {"cv_accuracy": float(correct.mean()), "train_accuracy": train_acc, "classes": classes,
            "cv_correct": correct}


def paired_gap(correct_a: np.ndarray, correct_b: np.ndarray, groups: Sequence | None = None) -> dict:
    """The accuracy gap mean(b) - mean(a) of two predictors scored on the same samples, and its
    standard error from the per-sample differences (cluster-robust over `groups`, whose samples are
    not independent; with one sample per group it is sd(d) / sqrt(n))."""
    d = np.asarray(correct_b, float) - np.asarray(correct_a, float)
    if d.ndim != 1 or len(d) < 2:
        raise ValueError(f"paired_gap: needs at least two paired samples, got {d.shape}")
    ids = np.arange(len(d)) if groups is None else np.unique(np.asarray(groups), return_inverse=True)[1]
    G = ids.max() + 1
    if G < 2:
        raise ValueError("paired_gap: needs at least two groups")
    sums = np.bincount(ids, weights=d - d.mean(), minlength=G)
    return {"gap": float(d.mean()), "se": float(np.sqrt((sums ** 2).sum() * G / (G - 1)) / len(d))}
