"""Leading gradient terms: known answers for the basis maps and for the first SGD steps from zero."""
import math

import pytest
import torch
import torch.nn.functional as F

from circuitbook.analysis import leading_terms as lt
from circuitbook.models.onehot import OneHotConfig
from circuitbook.tasks.markov import MarkovChain


def batch(V=9, T=6, N=30, seed=0):
    x = torch.randint(0, V, (N, T + 1), generator=torch.Generator().manual_seed(seed))
    return x[:, :-1], x[:, 1:]


def literal_maps(inputs, targets, V):
    """B, Phi, Q and q_pos written exactly as the paper's sums, with dense one-hot matrices and J_t."""
    N, T = inputs.shape
    X = F.one_hot(inputs, V).double()
    Y = F.one_hot(targets, V).double()
    U = torch.full((V,), 1.0 / V, dtype=torch.float64)
    A0 = torch.tril(torch.ones(T, T, dtype=torch.float64))
    A0 = A0 / A0.sum(-1, keepdim=True)
    B = sum(X[i].T @ (Y[i] - U) for i in range(N)) / (N * T)
    Phi = sum((Y[i] - U).T @ A0 @ X[i] for i in range(N)) / (N * T)
    Sigma = B.T @ B
    Q = torch.zeros(V, V, dtype=torch.float64)
    q_pos = torch.zeros(T, dtype=torch.float64)
    for i in range(N):
        M = (Y[i] - U) @ Sigma @ Phi @ X[i].T
        Qi = torch.zeros(T, T, dtype=torch.float64)
        for t in range(T):
            a = A0[t]
            J = torch.diag(a) - torch.outer(a, a)
            Qi[t] = J @ M[t]
        Q += X[i].T @ Qi @ X[i]
        for t in range(T):
            for k in range(t + 1):
                q_pos[k] += Qi[t, t - k]
    return B, Phi, Q / (N * T), q_pos / (N * T)


def test_bigram_map_by_hand():
    # one sequence "0 1 0 1" -> inputs 0 1 0, targets 1 0 1; V = 2, NT = 3
    inputs, targets = torch.tensor([[0, 1, 0]]), torch.tensor([[1, 0, 1]])
    B = lt.bigram_map(inputs, targets, 2)
    # B[j, k] = count(j -> k)/3 - count(j)/(3*2)
    expected = torch.tensor([[0 - 2 / 6, 2 / 3 - 2 / 6], [1 / 3 - 1 / 6, 0 - 1 / 6]], dtype=torch.float64)
    assert torch.allclose(B, expected, rtol=0, atol=1e-15)
    assert torch.allclose(B.sum(1), torch.zeros(2, dtype=torch.float64), atol=1e-15), "rows of Y - U_O sum to 0"


def test_maps_equal_the_literal_sums():
    inputs, targets = batch()
    stats = lt.leading_stats(inputs, targets, 9)
    B, Phi, Q, q_pos = literal_maps(inputs, targets, 9)
    for got, want in [(stats.B, B), (stats.Phi, Phi), (stats.Q, Q), (stats.q_pos, q_pos), (stats.Sigma_B, B.T @ B)]:
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-17)
    assert torch.allclose(stats.value_term(), Phi.T @ B.T, rtol=1e-12, atol=1e-17)
    # softmax shift invariance: every row of Q_i sums to zero, so the offsets' feature sums to zero
    assert abs(float(stats.q_pos.sum())) < 1e-15
    assert lt.leading_stats(inputs, targets, 9, attention=False).Q is None


def markov_closed_forms(chain: MarkovChain, T: int):
    P, pi = chain.P, chain.stationary()
    V = P.shape[0]
    B = torch.diag(pi) @ P - pi[:, None] / V
    # Phi[k, c] = (1/T) sum_t 1/(t+1) sum_{d=1}^{t+1} pi_c ((P^d)[c, k] - 1/V)
    powers = [torch.linalg.matrix_power(P, d) for d in range(T + 1)]
    acc = torch.zeros(V, V, dtype=torch.float64)
    for t in range(T):
        acc += sum(powers[d] for d in range(1, t + 2)) / (t + 1)
    Phi = (torch.diag(pi) @ (acc / T - 1.0 / V)).T
    return B, Phi


def test_markov_corpus_matches_closed_forms_within_sampling_error():
    chain = MarkovChain([[0.7, 0.2, 0.1, 0.0], [0.1, 0.5, 0.2, 0.2], [0.3, 0.0, 0.4, 0.3], [0.25, 0.25, 0.25, 0.25]])
    T, chunks, per_chunk = 8, 10, 2000
    seqs = chain.sample(chunks * per_chunk, T + 1, seed=11)
    B_true, Phi_true = markov_closed_forms(chain, T)
    parts = [lt.leading_stats(s[:, :-1], s[:, 1:], 4, attention=False) for s in seqs.split(per_chunk)]
    for name, true in (("B", B_true), ("Phi", Phi_true)):
        each = torch.stack([getattr(p, name) for p in parts])
        mean, se = each.mean(0), each.std(0) / math.sqrt(chunks)
        z = ((mean - true).abs() / se).max()
        assert z < 5, f"{name}: max |error| = {z:.1f} standard errors"
        # and the whole-batch estimate is the mean of equal-size chunks
        whole = lt.leading_stats(seqs[:, :-1], seqs[:, 1:], 4, attention=False)
        assert torch.allclose(getattr(whole, name), mean, atol=1e-15)
    # a wrong closed form (no 1/|V| centring) is many standard errors off: the test can fail
    each = torch.stack([p.B for p in parts])
    assert (((each.mean(0) - torch.diag(chain.stationary()) @ chain.P).abs()) / (each.std(0) / math.sqrt(chunks))).max() > 20


def test_coefficients_of_the_first_steps():
    eta = 0.1
    assert lt.coefficients(1, eta) == pytest.approx({"W_O": eta, "V": 0, "W": 0, "P": 0})
    assert lt.coefficients(2, eta) == pytest.approx({"W_O": 2 * eta, "V": eta ** 2, "W": 0, "P": 0})
    assert lt.coefficients(3, eta) == pytest.approx({"W_O": 3 * eta, "V": 3 * eta ** 2, "W": 2 * eta ** 4, "P": 2 * eta ** 4})
    assert lt.coefficients(4, eta) == pytest.approx({"W_O": 4 * eta, "V": 6 * eta ** 2, "W": 11 * eta ** 4, "P": 11 * eta ** 4})
    with pytest.raises(ValueError, match="steps"):
        lt.coefficients(-1, eta)


def sgd(model, inputs, targets, eta, steps):
    """Plain SGD on the mean cross-entropy over all N*T positions; weights after each step."""
    out = []
    for _ in range(steps):
        logits = model(inputs)
        loss = -logits.log_softmax(-1).gather(-1, targets[..., None]).mean()
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= eta * p.grad
        out.append({k: v.detach().clone() for k, v in model.weights().items()})
    return out


def test_first_sgd_step_from_zero_is_exactly_eta_B():
    inputs, targets = batch(V=10, T=7, N=25, seed=2)
    stats = lt.leading_stats(inputs, targets, 10)
    for eta in (0.005, 0.05, 0.5):
        w = sgd(OneHotConfig(10, 7, 3).build().double(), inputs, targets, eta, 1)[0]
        assert torch.allclose(w["W_O"], eta * stats.B, rtol=1e-13, atol=1e-18)
        assert all(w[k].abs().max() == 0 for k in w if k != "W_O"), "V, W and P do not move at step 1"


def relative_error(a, b):
    return float((a - b).norm() / b.norm())


def test_steps_two_to_four_match_the_leading_terms_to_the_next_order():
    """V after 2 steps, W and P after 3 and 4: the error of the prediction is O(eta) relative."""
    inputs, targets = batch(V=10, T=7, N=25, seed=3)
    stats = lt.leading_stats(inputs, targets, 10)
    errors = {}
    for eta in (1e-2, 1e-3):
        hist = sgd(OneHotConfig(10, 7, 3).build().double(), inputs, targets, eta, 4)
        assert all(hist[1][k].abs().max() == 0 for k in hist[1] if k[0] in "WP" and k != "W_O"), \
            "W and P are still exactly zero after 2 steps"
        for s in (2, 3, 4):
            pred = lt.predicted_weights(stats, s, eta, n_layers=3)
            for name in pred:
                if pred[name].abs().max() > 0:
                    errors[(eta, s, name)] = relative_error(hist[s - 1][name], pred[name])
    for (eta, s, name), err in errors.items():
        if eta == 1e-3:
            assert err < 20 * eta, (s, name, err)
            ratio = errors[(1e-2, s, name)] / err  # an O(eta) error shrinks 10x with eta
            assert 8 < ratio < 12, (s, name, ratio)
    assert {(s, n) for (_, s, n) in errors} >= {(2, "V0"), (2, "V2"), (3, "W0"), (3, "W2"), (3, "P1"), (4, "W1"), (4, "P2")}


def test_wrong_attention_coefficient_is_detected():
    """The step-4 attention weight is 11 eta^4 Q: 9 or 13 would be off by far more than O(eta)."""
    inputs, targets = batch(V=10, T=7, N=25, seed=4)
    stats = lt.leading_stats(inputs, targets, 10)
    eta = 1e-3
    W = sgd(OneHotConfig(10, 7, 2).build().double(), inputs, targets, eta, 4)[-1]["W1"]
    assert relative_error(W, 11 * eta ** 4 * stats.Q) < 0.05
    assert relative_error(W, 9 * eta ** 4 * stats.Q) > 0.1


def test_cosine_known_values():
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert lt.cosine(a, 3 * a) == pytest.approx(1.0)
    assert lt.cosine(a, -a) == pytest.approx(-1.0)
    assert lt.cosine(a, torch.tensor([[0.0, 1.0], [1.0, 0.0]])) == pytest.approx(0.0)
    assert lt.cosine(a, torch.tensor([[1.0, 1.0], [0.0, 0.0]])) == pytest.approx(1 / 2)  # tr = 1, norms sqrt2 sqrt2
    assert math.isnan(lt.cosine(a, torch.zeros(2, 2)))


def test_remove_projection():
    term = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    w = torch.tensor([[3.0, 2.0], [1.0, 4.0]], dtype=torch.float64)
    out = lt.remove_projection(w, term)
    assert torch.equal(out, torch.tensor([[0.0, 2.0], [1.0, 4.0]], dtype=torch.float64))
    g = torch.randn(5, 5, dtype=torch.float64)
    t = torch.randn(5, 5, dtype=torch.float64)
    r = lt.remove_projection(g, t)
    assert abs(lt.cosine(r, t)) < 1e-12
    assert torch.allclose(lt.remove_projection(r, t), r, atol=1e-12), "removing twice changes nothing"
    assert torch.allclose(lt.remove_projection(2 * t, t), torch.zeros(5, 5, dtype=torch.float64), atol=1e-12)
    with pytest.raises(ValueError, match="zero"):
        lt.remove_projection(g, torch.zeros(5, 5))


def test_cosines_to_leading_terms_by_weight_name():
    inputs, targets = batch()
    stats = lt.leading_stats(inputs, targets, 9)
    pred = lt.predicted_weights(stats, 5, 0.1, n_layers=2)
    cos = lt.cosines_to_leading_terms(pred, stats)
    assert set(cos) == {"W_O", "V0", "V1", "W0", "W1", "P0", "P1"}
    assert all(c == pytest.approx(1.0) for c in cos.values())
    assert lt.kind_of("W_O") == "W_O" and lt.kind_of("V12") == "V" and lt.kind_of("P0") == "P"


def test_hostile_inputs_are_refused():
    inputs, targets = batch(V=5)
    inputs, targets = inputs.clamp(max=3), targets.clamp(max=3)
    targets[0, 0] = 4
    with pytest.raises(ValueError, match=r"targets must be integer token ids in \[0, 4\)"):
        lt.bigram_map(inputs, targets, 4)
    with pytest.raises(ValueError, match="both be"):
        lt.context_map(inputs, targets[:, :-1], 5)
    with pytest.raises(ValueError, match="inputs must be integer"):
        lt.leading_stats(inputs.float(), targets, 5)
    stats = lt.leading_stats(inputs, targets, 5, attention=False)
    with pytest.raises(ValueError, match="attention=False"):
        stats.direction("W")
    with pytest.raises(ValueError, match="kind"):
        stats.direction("QK")


def test_shuffled_corpus_keeps_the_tokens_and_loses_the_order():
    """A corpus that cycles deterministically (t -> t+1 mod V): its B is a shifted diagonal; shuffled,
    the same tokens give B ~ P(j) (P(k) - 1/V), the frequency part, and the cycle is gone."""
    V, N, T = 6, 200, 11
    start = torch.randint(0, V, (N, 1), generator=torch.Generator().manual_seed(0))
    seqs = (start + torch.arange(T + 1)) % V
    x, y = seqs[:, :-1], seqs[:, 1:]
    sx, sy = lt.shuffled_corpus(x, y, seed=1)
    assert torch.equal(sx[:, 1:], sy[:, :-1]), "still a corpus: targets are the inputs shifted"
    both = lambda a, b: torch.cat([a[:, :1], b], 1).reshape(-1).sort().values
    assert torch.equal(both(sx, sy), both(x, y)), "the same multiset of tokens"
    B, Bs = lt.bigram_map(x, y, V), lt.bigram_map(sx, sy, V)
    assert lt.cosine(B, torch.roll(torch.eye(V, dtype=torch.float64), 1, 1) - 1 / V) > 0.99
    p = torch.bincount(sx.reshape(-1), minlength=V).double() / sx.numel()
    q = torch.bincount(sy.reshape(-1), minlength=V).double() / sy.numel()
    assert (Bs - torch.outer(p, q - 1 / V)).abs().max() < 0.01, "order gone: B is the product of frequencies"
    assert not torch.equal(lt.shuffled_corpus(x, y, seed=2)[0], sx)
    with pytest.raises(ValueError, match="shifted by one"):
        lt.shuffled_corpus(x, torch.roll(y, 1, 0))


def test_random_in_span_and_a_perturbation_of_the_removal_size():
    """A planted rank-3 term (singular values 3, 2, 1 and a small rest): the subspace holding 90% of
    its squared norm has rank 2 (9 + 4 of 14.0001), 99.9% needs 3; a random matrix in it stays in it;
    the perturbation is exactly as large as the projection removal."""
    gen = torch.Generator().manual_seed(0)
    U, _ = torch.linalg.qr(torch.randn(8, 8, generator=gen, dtype=torch.float64))
    W, _ = torch.linalg.qr(torch.randn(8, 8, generator=gen, dtype=torch.float64))
    s = torch.tensor([3.0, 2.0, 1.0, 0.01, 0, 0, 0, 0], dtype=torch.float64)
    term = U @ torch.diag(s) @ W.T
    assert lt.top_singular_subspace(term, 0.9)[0].shape == (8, 2)
    assert lt.top_singular_subspace(term, 0.999)[0].shape == (8, 3)
    R = lt.random_in_span(term, 0.999, seed=4)
    P_left, P_right = U[:, :3] @ U[:, :3].T, W[:, :3] @ W[:, :3].T
    assert torch.allclose(P_left @ R @ P_right, R, atol=1e-12) and float(R.norm()) == pytest.approx(1.0)
    assert not torch.allclose(R, lt.random_in_span(term, 0.999, seed=5))
    weight = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    moved = lt.perturb_like_removal(weight, term, R)
    removed = lt.remove_projection(weight, term)
    assert float((weight - moved).norm()) == pytest.approx(float((weight - removed).norm()), rel=1e-12)
    assert lt.cosine(weight - moved, R) == pytest.approx(1.0), "the change is along the direction"
    with pytest.raises(ValueError, match="share"):
        lt.top_singular_subspace(term, 0.0)
    with pytest.raises(ValueError, match="zero"):
        lt.perturb_like_removal(weight, term, torch.zeros(8, 8))


def test_weight_names():
    assert lt.weight_name("unembed.W_U") == "W_O"
    assert lt.weight_name("blocks.2.attn.W_QK") == "W2"
    assert lt.weight_name("blocks.0.attn.W_V") == "V0"
    assert lt.weight_name("blocks.1.attn.P") == "P1"
    assert lt.weight_name("blocks.1.attn.mask") is None


def test_context_lift_is_one_under_independence():
    joint = torch.outer(torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64), torch.tensor([0.6, 0.4], dtype=torch.float64))
    assert torch.allclose(lt.context_lift(joint), torch.ones(3, 2, dtype=torch.float64))
    joint = torch.tensor([[0.5, 0.0], [0.0, 0.5]], dtype=torch.float64)
    assert torch.equal(lt.context_lift(joint), torch.tensor([[2.0, 0.0], [0.0, 2.0]], dtype=torch.float64))


def test_embedding_agreement_of_a_displacement_along_the_prediction():
    torch.manual_seed(0)
    V, d = 12, 6
    B = torch.randn(V, V, dtype=torch.float64)
    W_E0, W_U0 = torch.randn(V, d, dtype=torch.float64), torch.randn(d, V, dtype=torch.float64)
    ids = torch.arange(8)
    out = lt.embedding_agreement(W_E0, W_E0 + 0.1 * B @ W_U0.T, W_U0, W_U0 + 0.1 * W_E0.T @ B, B, ids, n_perm=10)
    assert out["embed"] == pytest.approx(1.0) and out["unembed"] == pytest.approx(1.0)
    assert abs(out["embed_base_mean"]) < 0.5
    assert lt.agrees(out["embed"], out["embed_base_mean"], out["embed_base_std"])
    assert not lt.agrees(-0.5, 0.0, 0.1) and not lt.agrees(0.2, 0.0, 0.1)


def test_attention_token_scores_average_the_hooked_scores_by_token_pair():
    from circuitbook.models.toy import ToyConfig, ToyTransformer

    model = ToyTransformer(ToyConfig(d_vocab=5, n_ctx=4, d_model=8, n_layers=2, n_heads=2), seed=0)
    tokens = torch.tensor([[0, 1, 0, 2], [1, 1, 2, 0]])
    ids = torch.tensor([0, 1, 2])
    scores = lt.attention_token_scores(model, tokens, ids, chunk=1)
    _, cache = model.run_with_cache(tokens)
    s = cache["blocks.1.attn.hook_attn_scores"].double().mean(1)
    # query token 1, key token 0: (seq 0: q1 k0) + (seq 1: q3 is token 0 - no) ... collect by hand
    pairs = [(b, q, k) for b in range(2) for q in range(4) for k in range(q + 1)
             if tokens[b, q] == 1 and tokens[b, k] == 0]
    expected = sum(float(s[b, q, k]) for b, q, k in pairs) / len(pairs)
    assert scores[1, 1, 0].item() == pytest.approx(expected)
    assert torch.isnan(scores[0, 2, 2]) == (not any(tokens[b, q] == 2 and tokens[b, k] == 2
                                                     for b in range(2) for q in range(4) for k in range(q + 1)))


def test_similarity_is_the_cosine_of_the_columns_of_B():
    B = torch.tensor([[1.0, 2.0, 0.0], [0.0, 2.0, 3.0]], dtype=torch.float64)
    sim = lt.similarity(B.T @ B)
    cols = B / B.norm(dim=0)
    assert torch.allclose(sim, cols.T @ cols)
    assert torch.allclose(sim.diagonal(), torch.ones(3, dtype=torch.float64))
    assert sim[0, 2] == 0.0 and sim[0, 1] == pytest.approx(2 / math.sqrt(8))


def test_frequent_ids_are_the_most_frequent_in_id_order():
    x = torch.tensor([[5, 5, 5, 1], [1, 2, 2, 5]])
    assert lt.frequent_ids(x, 2).tolist() == [1, 5]
    assert lt.frequent_ids(x, 10).tolist() == [1, 2, 5], "no more ids than occur"


def test_centred_over_keys_ignores_missing_pairs():
    M = torch.tensor([[1.0, 3.0, float("nan")], [2.0, 2.0, 5.0]], dtype=torch.float64)
    assert torch.equal(lt.centred_over_keys(M), torch.tensor([[-1.0, 1.0, 0.0], [-1.0, -1.0, 2.0]], dtype=torch.float64))


def test_attention_agreement_of_a_score_change_along_Q():
    """A score change equal to Q (plus a per-query constant that softmax ignores) has cosine 1 in every
    layer; its negative, -1; the permutation baseline lies well inside."""
    gen = torch.Generator().manual_seed(0)
    V, ids = 10, torch.tensor([1, 3, 4, 7, 8, 9])
    Q = torch.randn(V, V, dtype=torch.float64, generator=gen)
    scores0 = torch.randn(2, 6, 6, dtype=torch.float64, generator=gen)
    change = Q[ids][:, ids] + torch.arange(6, dtype=torch.float64)[:, None]
    scores = torch.stack([scores0[0] + change, scores0[1] - change])
    scores[:, 0, 5] = float("nan")  # a pair that never occurs: left out of both
    table = lt.attention_agreement(scores, scores0, Q, ids, n_perm=10)
    assert list(table["layer"]) == [0, 1]
    assert table["cosine"].tolist() == pytest.approx([1.0, -1.0])
    assert (table["base_mean"].abs() < 0.6).all() and (table["base_std"] > 0).all()
    assert lt.agrees(table["cosine"][0], table["base_mean"][0], table["base_std"][0])
    assert not lt.agrees(table["cosine"][1], table["base_mean"][1], table["base_std"][1])
