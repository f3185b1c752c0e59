"""analysis.fits: known answers for the line through the origin, the logistic fit and the paired gap."""
import math

import numpy as np
import pytest

from circuitbook.analysis import fits


def test_proportional_fit_recovers_a_planted_law():
    b = np.array([1, 2, 3, 4], float)
    assert fits.proportional_fit(b, 0.3 * b) == {"c": pytest.approx(0.3), "r2": pytest.approx(1.0)}
    assert fits.proportional_fit(b, 0.3 * b + 1.0)["r2"] < 0.5  # an intercept is not proportionality
    # least squares through the origin: c = sum(xy) / sum(x^2); NaN pairs are left out
    x, y = np.array([1.0, 2.0, np.nan, 3.0]), np.array([1.0, 3.0, 5.0, np.nan])
    assert fits.proportional_fit(x, y)["c"] == pytest.approx((1 + 6) / (1 + 4))
    rng = np.random.default_rng(0)
    x = rng.uniform(1, 5, 200)
    fit = fits.proportional_fit(x, 2.5 * x + rng.normal(0, 0.05, 200))
    assert fit["c"] == pytest.approx(2.5, abs=0.01) and fit["r2"] > 0.99
    assert math.isnan(fits.proportional_fit([1.0, 2.0], [3.0, 3.0])["r2"]), "constant y: R^2 undefined"


def test_logistic_fit_separates_a_separable_problem():
    rng = np.random.default_rng(0)
    centres = {"a": (-4.0, 0.0), "b": (4.0, 0.0), "c": (0.0, 6.0)}
    X = np.vstack([rng.normal(c, 0.5, size=(30, 2)) for c in centres.values()])
    y = [k for k in centres for _ in range(30)]
    fit = fits.logistic_fit(X, y)
    assert fit["cv_accuracy"] == 1.0 and fit["train_accuracy"] == 1.0 and fit["classes"] == ["a", "b", "c"]
    assert fit["cv_correct"].all() and len(fit["cv_correct"]) == 90
    X = rng.normal(size=(60, 2))
    assert fits.logistic_fit(X, ["a" if x0 > x1 else "b" for x0, x1 in X])["cv_accuracy"] >= 0.9
    noise = fits.logistic_fit(rng.normal(size=(60, 2)), list(rng.choice(["a", "b"], 60)))
    assert noise["cv_accuracy"] < 0.75
    one = fits.logistic_fit(X, ["a"] * 60)
    assert one["cv_accuracy"] == 1.0 and one["classes"] == ["a"]


def test_softmax_regression_is_the_penalised_optimum():
    """Two separable points in one dimension: the fit puts them on opposite sides, with larger weights
    for a weaker penalty."""
    X, y = np.array([[-1.0], [1.0]]), np.array([0, 1])
    strong, weak = (fits._softmax_regression(X, y, 2, l2) for l2 in (1.0, 1e-3))
    for W in (strong, weak):
        assert (np.hstack([X, np.ones((2, 1))]) @ W).argmax(1).tolist() == [0, 1]
    assert abs(weak[0, 1] - weak[0, 0]) > abs(strong[0, 1] - strong[0, 0])


def test_grouped_folds_never_test_on_a_copy():
    """Random labels on 40 points of 60 random features, each point copied 5 times: with the copies in
    the training folds the fit recalls them (high cross-validated accuracy); grouped, it is chance."""
    rng = np.random.default_rng(1)
    X = np.repeat(rng.normal(size=(40, 60)), 5, axis=0)
    y = list(np.repeat(rng.choice(["a", "b"], 40), 5))
    groups = np.repeat(np.arange(40), 5)
    assert fits.logistic_fit(X, y, l2=1e-6)["cv_accuracy"] > 0.9
    fit = fits.logistic_fit(X, y, l2=1e-6, groups=groups)
    assert fit["cv_accuracy"] < 0.7 and len(fit["cv_correct"]) == 200


def test_paired_gap_known_values():
    a = np.array([1, 0, 1, 0, 1, 1], bool)
    b = np.array([1, 1, 1, 1, 0, 1], bool)
    d = b.astype(float) - a
    out = fits.paired_gap(a, b)
    assert out["gap"] == pytest.approx(d.mean()) and out["se"] == pytest.approx(d.std(ddof=1) / math.sqrt(6))
    grouped = fits.paired_gap(np.array([0, 0, 1, 1]), np.array([1, 1, 1, 1]), groups=[7, 7, 9, 9])
    assert grouped["gap"] == 0.5 and grouped["se"] == pytest.approx(0.5)  # sqrt((1 + 1) * 2 / 1) / 4
    with pytest.raises(ValueError, match="two groups"):
        fits.paired_gap(np.array([0, 1]), np.array([1, 1]), groups=[0, 0])
    with pytest.raises(ValueError, match="two paired samples"):
        fits.paired_gap(np.array([1]), np.array([0]))


def test_paired_gap_finds_a_planted_difference():
    """b is right on every sample a is right on, and on a further fifth of them: the gap is 0.2, and its
    standard error is that of a mean of 0/1 differences with p = 0.2."""
    n = 1000
    a = np.zeros(n, bool)
    a[:500] = True
    b = a.copy()
    b[500:700] = True
    out = fits.paired_gap(a, b)
    assert out["gap"] == pytest.approx(0.2)
    assert out["se"] == pytest.approx(math.sqrt(0.2 * 0.8 / (n - 1)), rel=1e-9)
