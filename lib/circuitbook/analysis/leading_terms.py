"""Leading gradient terms of an attention-only one-hot transformer (Im, Oh, Fang, Li 2026).

From a batch of N sequences (inputs X_i, one-hot [T, |V|]; next tokens Y_i, one-hot [T, |V|])
these are the corpus statistics of the paper's Theorem D.7, with the conventions that make the
first steps exact (the loss is the mean cross-entropy over all N*T positions, U_O = 1/|V| is the
uniform output distribution, A_0 the uniform causal attention: a_t[j] = 1/(t+1) for j <= t):

    B       = (1/NT) sum_i X_i^T (Y_i - U_O)                     bigram map      (context, output)
    Sigma_B = B^T B                                              interchangeability (output, output)
    Phi     = (1/NT) sum_i (Y_i - U_O)^T A_0 X_i                 context map     (output, context)
    Q       = (1/NT) sum_i X_i^T Q_i X_i                         attention feature (query, key)
              Q_i[t, j] = sum_k J_t[j, k] M_i[t, k],  M_i = (Y_i - U_O) Sigma_B Phi X_i^T,
              J_t = Diag(a_t) - a_t a_t^T
    q_pos   = (1/NT) sum_i sum_t Q_i[t, t - k]                   positional feature (offset k)

After s plain-SGD steps of size eta from zero (Theorem D.7's leading terms):

    W_O ~ s eta B,   V ~ C(s,2) eta^2 Phi^T B^T,   W ~ (3 C(s,4) + 2 C(s,3)) eta^4 Q,
    P ~ (3 C(s,4) + 2 C(s,3)) eta^4 q_pos          (every layer alike at this order).

During training the chapter's `CosineEvaluator` (`experiments.leading_terms.evaluate`) logs the
cosine of every weight with its leading-term direction (`weight_name`, `kind_of`, `cosine`).

Measures that read the maps (any corpus, any model):
    `context_lift`      the context joint against its marginals (what Phi ranks beyond frequency);
    `similarity`        Sigma_B as cosine similarities of the outputs' columns of B;
    `frequent_ids`, `embedding_agreement`, `attention_token_scores`, `centred_over_keys`,
    `attention_agreement`, `agrees`: a causal language model's early checkpoints against the
    features B and Q of a corpus batch, with permutation baselines.

Sign convention: the paper's loss gradient at zero is dL/dW_O = -B, so one SGD step gives
W_O = +eta B exactly; V and W are applied as h V and h W h^T. Everything here is computed with
index arithmetic on token ids (no [N, T, |V|] one-hot tensor), in float64 by default.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

WEIGHT_KINDS = ("W_O", "V", "W", "P")


@dataclass
class LeadingStats:
    """The basis maps of one batch (float64 by default)."""

    B: torch.Tensor  # [V, V] (context token, output token)
    Sigma_B: torch.Tensor  # [V, V]
    Phi: torch.Tensor  # [V, V] (output token, context token)
    Q: torch.Tensor | None  # [V, V] (query token, key token)
    q_pos: torch.Tensor | None  # [T] by offset k = t - j
    n_positions: int  # N * T

    @property
    def vocab_size(self) -> int:
        return self.B.shape[0]

    def value_term(self) -> torch.Tensor:
        """Phi^T B^T, the direction of every layer's V."""
        return self.Phi.T @ self.B.T

    def direction(self, kind: str) -> torch.Tensor:
        """The leading-term direction of a weight kind: W_O, V, W or P."""
        if kind not in WEIGHT_KINDS:
            raise ValueError(f"kind={kind!r} is not allowed; expected one of {WEIGHT_KINDS}")
        if kind in ("W", "P") and self.Q is None:
            raise ValueError("these stats were computed without the attention feature (attention=False)")
        return {"W_O": lambda: self.B, "V": self.value_term, "W": lambda: self.Q, "P": lambda: self.q_pos}[kind]()


def _check_batch(inputs: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> None:
    if inputs.dim() != 2 or inputs.shape != targets.shape:
        raise ValueError(f"inputs and targets must both be [N, T] token ids; got {tuple(inputs.shape)} and "
                         f"{tuple(targets.shape)}")
    for name, t in (("inputs", inputs), ("targets", targets)):
        if t.dtype not in (torch.int64, torch.int32) or t.min() < 0 or t.max() >= vocab_size:
            raise ValueError(f"{name} must be integer token ids in [0, {vocab_size}); got dtype {t.dtype}, "
                             f"range [{int(t.min())}, {int(t.max())}]")


def _pair_counts(rows: torch.Tensor, cols: torch.Tensor, weights: torch.Tensor, V: int) -> torch.Tensor:
    """sum over entries of weights at (rows, cols): a [V, V] matrix."""
    flat = (rows.reshape(-1) * V + cols.reshape(-1))
    return torch.bincount(flat, weights=weights.reshape(-1), minlength=V * V).reshape(V, V)


def bigram_map(inputs: torch.Tensor, targets: torch.Tensor, vocab_size: int, dtype=torch.float64,
               n_classes: int | None = None) -> torch.Tensor:
    """B = (1/NT) sum_i X_i^T (Y_i - 1/|V|): B[j, k] = P(j) P(k | j) - P(j)/|V|.

    n_classes: the |V| of the uniform output U_O when the ids index a subset of a larger
    vocabulary (a language model's tokens seen in a corpus); default vocab_size. B and Phi are
    then exact on the subset; Sigma_B and Q leave out the outputs outside it (an approximation,
    used only for the language-model comparison of LT-6)."""
    _check_batch(inputs, targets, vocab_size)
    V, NT = vocab_size, inputs.numel()
    counts = _pair_counts(inputs, targets, torch.ones(NT, dtype=dtype), V)
    p_context = torch.bincount(inputs.reshape(-1), minlength=V).to(dtype)
    return (counts - p_context[:, None] / (n_classes or V)) / NT


def _uniform_attention_weights(T: int, dtype) -> torch.Tensor:
    """a[t, j] = 1/(t+1) for j <= t, else 0: the uniform causal attention A_0."""
    a = torch.tril(torch.ones(T, T, dtype=dtype))
    return a / a.sum(-1, keepdim=True)


def context_joint(inputs: torch.Tensor, targets: torch.Tensor, vocab_size: int, dtype=torch.float64,
                  chunk: int = 256) -> torch.Tensor:
    """J = (1/NT) sum_i Y_i^T A_0 X_i: how often output k follows context token c under uniform
    causal attention (sums to 1). Phi is J with its 1/|V| part removed (`context_map`)."""
    _check_batch(inputs, targets, vocab_size)
    N, T = inputs.shape
    A0 = _uniform_attention_weights(T, dtype)
    total = torch.zeros(vocab_size, vocab_size, dtype=dtype)
    for s in range(0, N, chunk):
        x, y = inputs[s:s + chunk], targets[s:s + chunk]
        n = len(x)
        total += _pair_counts(y[:, :, None].expand(n, T, T), x[:, None, :].expand(n, T, T), A0.expand(n, T, T),
                              vocab_size)
    return total / (N * T)


def context_map(inputs: torch.Tensor, targets: torch.Tensor, vocab_size: int, dtype=torch.float64,
                n_classes: int | None = None) -> torch.Tensor:
    """Phi = (1/NT) sum_i (Y_i - U_O)^T A_0 X_i, laid out (output token, context token)."""
    J = context_joint(inputs, targets, vocab_size, dtype)
    return J - J.sum(0, keepdim=True) / (n_classes or vocab_size)


def attention_feature(inputs: torch.Tensor, targets: torch.Tensor, B: torch.Tensor, Phi: torch.Tensor,
                      chunk: int = 64, n_classes: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q, q_pos): the leading term of every layer's W and of its positional bias P.

    M_i[t, k] = R[y_t, x_k] - mean_a R[a, x_k] with R = Sigma_B Phi (the (Y_i - U_O) rows picked
    by index); Q_i[t, j] = a_t[j] (M_i[t, j] - sum_k a_t[k] M_i[t, k]) for j <= t, which is
    sum_k J_t[j, k] M_i[t, k] written out.
    """
    _check_batch(inputs, targets, B.shape[0])
    N, T = inputs.shape
    V, dtype = B.shape[0], B.dtype
    R = (B.T @ B) @ Phi
    r_mean = R.sum(0) / (n_classes or V)  # U_O R (outputs outside the ids left out, see bigram_map)
    A0 = _uniform_attention_weights(T, dtype)
    mask = A0 > 0
    offsets = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).clamp(min=0)
    Q = torch.zeros(V, V, dtype=dtype)
    q_pos = torch.zeros(T, dtype=dtype)
    for s in range(0, N, chunk):
        x, y = inputs[s:s + chunk], targets[s:s + chunk]
        n = len(x)
        M = R[y[:, :, None], x[:, None, :]] - r_mean[x][:, None, :]  # [n, T(query t), T(key k)]
        M = M * mask
        centred = (M - (M * A0).sum(-1, keepdim=True)) * A0  # Q_i[t, j]
        Q += _pair_counts(x[:, :, None].expand(n, T, T), x[:, None, :].expand(n, T, T), centred, V)
        q_pos += torch.bincount(offsets.expand(n, T, T).reshape(-1), weights=centred.reshape(-1), minlength=T)
    return Q / (N * T), q_pos / (N * T)


def leading_stats(inputs: torch.Tensor, targets: torch.Tensor, vocab_size: int, attention: bool = True,
                  dtype=torch.float64, n_classes: int | None = None) -> LeadingStats:
    """B, Sigma_B, Phi (and Q, q_pos unless attention=False) of one batch. n_classes: see bigram_map."""
    B = bigram_map(inputs, targets, vocab_size, dtype, n_classes)
    Phi = context_map(inputs, targets, vocab_size, dtype, n_classes)
    Q = q_pos = None
    if attention:
        Q, q_pos = attention_feature(inputs, targets, B, Phi, n_classes=n_classes)
    return LeadingStats(B=B, Sigma_B=B.T @ B, Phi=Phi, Q=Q, q_pos=q_pos, n_positions=inputs.numel())


def coefficients(steps: int, lr: float) -> dict[str, float]:
    """The scalar in front of each leading term after `steps` SGD steps of size `lr` from zero."""
    if steps < 0 or lr <= 0:
        raise ValueError(f"steps={steps}, lr={lr}: expected steps >= 0 and lr > 0")
    attn = (3 * math.comb(steps, 4) + 2 * math.comb(steps, 3)) * lr ** 4
    return {"W_O": steps * lr, "V": math.comb(steps, 2) * lr ** 2, "W": attn, "P": attn}


def predicted_weights(stats: LeadingStats, steps: int, lr: float, n_layers: int) -> dict[str, torch.Tensor]:
    """The leading-term prediction of every weight after `steps` steps, keyed like
    OneHotTransformer.weights(): W_O, W{l}, V{l}, P{l}."""
    c = coefficients(steps, lr)
    out = {"W_O": c["W_O"] * stats.B}
    value = stats.value_term()
    for l in range(n_layers):
        out[f"V{l}"] = c["V"] * value
        if stats.Q is not None:
            out[f"W{l}"] = c["W"] * stats.Q
            out[f"P{l}"] = c["P"] * stats.q_pos
    return out


def kind_of(name: str) -> str:
    """'W_O', 'V', 'W' or 'P' for a weight name of OneHotTransformer.weights()."""
    return "W_O" if name == "W_O" else name.rstrip("0123456789")


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """tr(A^T B) / (||A||_F ||B||_F) in float64, clipped to [-1, 1] (rounding); NaN when either is zero."""
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    na, nb = a.norm(), b.norm()
    if na == 0 or nb == 0:
        return float("nan")
    return max(-1.0, min(1.0, float(a @ b / (na * nb))))


def cosines_to_leading_terms(weights: dict[str, torch.Tensor], stats: LeadingStats) -> dict[str, float]:
    """The cosine of every weight to its leading-term direction."""
    return {name: cosine(w, stats.direction(kind_of(name))) for name, w in weights.items()}


def remove_projection(weight: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
    """weight - (tr(weight^T term) / ||term||_F^2) term: the weight without its leading-term component."""
    t = term.to(weight.dtype)
    denom = (t * t).sum()
    if denom == 0:
        raise ValueError("remove_projection: the leading term is zero")
    return weight - (weight * t).sum() / denom * t


# ---------------------------------------------------------------- baselines of a removal
# Removing the projection on a random direction of R^(|V| x |V|) takes away about 1/|V|^2 of a
# weight: it undoes nothing by construction. Two baselines that can undo something:
#   the leading term of a shuffled corpus: the same tokens in random order (same frequencies, no
#       sequence structure); its B is P(j) (P(k) - 1/|V|), the frequency part of the real B;
#   a same-size random change in the leading term's span: subtract, instead of the projection,
#       a random matrix of the projection's norm inside the span of the leading term's top
#       singular vectors (the subspace where the weight's leading-term part lives).

def shuffled_corpus(inputs: torch.Tensor, targets: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of the same samples with all their tokens permuted at random across the
    batch: the token frequencies stay, the order goes. targets must be inputs shifted by one."""
    if inputs.dim() != 2 or inputs.shape != targets.shape or not torch.equal(inputs[:, 1:], targets[:, :-1]):
        raise ValueError("shuffled_corpus: targets must be the inputs shifted by one position ([N, T] each, "
                         "targets[:, :-1] == inputs[:, 1:]), as the samples of a corpus are")
    seqs = torch.cat([inputs[:, :1], targets], 1)
    gen = torch.Generator().manual_seed(int(seed))
    flat = seqs.reshape(-1)[torch.randperm(seqs.numel(), generator=gen)].reshape(seqs.shape)
    return flat[:, :-1].contiguous(), flat[:, 1:].contiguous()


def top_singular_subspace(term: torch.Tensor, share: float = 0.9) -> tuple[torch.Tensor, torch.Tensor]:
    """(U_r, V_r): the left and right singular vectors of the fewest top singular values of a matrix
    that hold at least `share` of its squared Frobenius norm (float64)."""
    if not 0 < share <= 1:
        raise ValueError(f"top_singular_subspace: share={share}; expected 0 < share <= 1")
    if term.dim() != 2:
        raise ValueError(f"top_singular_subspace: expected a matrix, got shape {tuple(term.shape)}")
    U, S, Vh = torch.linalg.svd(term.double(), full_matrices=False)
    energy = (S ** 2).cumsum(0) / (S ** 2).sum()
    r = int((energy < share - 1e-12).sum()) + 1
    return U[:, :r], Vh[:r].T


def random_in_span(term: torch.Tensor, share: float = 0.9, seed: int = 0) -> torch.Tensor:
    """A random unit-norm matrix U_r G V_r^T (G standard normal) in the span of the term's top
    singular vectors (`top_singular_subspace`)."""
    U, V = top_singular_subspace(term, share)
    gen = torch.Generator().manual_seed(int(seed))
    G = torch.randn(U.shape[1], V.shape[1], generator=gen, dtype=torch.float64)
    R = U @ G @ V.T
    return R / R.norm()


def perturb_like_removal(weight: torch.Tensor, term: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """weight minus `direction` scaled to the norm of weight's projection on `term`: a change of the
    same size as `remove_projection(weight, term)`, in another direction."""
    t, d = term.double(), direction.double()
    size = (weight.double() * t).sum().abs() / t.norm()
    if d.norm() == 0:
        raise ValueError("perturb_like_removal: the direction is zero")
    return weight - (size * d / d.norm()).to(weight.dtype)


# ---------------------------------------------------------------- during training

PARAM_TO_WEIGHT = {"unembed.W_U": "W_O"}


def weight_name(param: str) -> str | None:
    """'blocks.1.attn.W_QK' -> 'W1', 'blocks.1.attn.W_V' -> 'V1', 'blocks.1.attn.P' -> 'P1', 'unembed.W_U' -> 'W_O'."""
    if param in PARAM_TO_WEIGHT:
        return PARAM_TO_WEIGHT[param]
    parts = param.split(".")
    if len(parts) == 4 and parts[0] == "blocks" and parts[2] == "attn":
        kind = {"W_QK": "W", "W_V": "V", "P": "P"}.get(parts[3])
        return f"{kind}{parts[1]}" if kind else None
    return None



# ---------------------------------------------------------------- reading the maps

def context_lift(joint: torch.Tensor) -> torch.Tensor:
    """J[k, c] / (J[k, :].sum() J[:, c].sum()) for the context joint J (`context_joint`; Phi is J
    minus its 1/|V| part). A column of Phi ranks outputs mostly by their frequency; the lift ranks
    how much more often k follows c in the context than their frequencies alone imply."""
    outer = joint.sum(1, keepdim=True) * joint.sum(0, keepdim=True)
    return torch.where(outer > 0, joint / outer.clamp(min=1e-300), torch.zeros_like(joint))


def similarity(Sigma_B: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of the outputs' columns of B: Sigma_B[k, k'] / sqrt(Sigma_B[k, k] Sigma_B[k', k'])."""
    d = Sigma_B.diagonal().clamp(min=1e-300).sqrt()
    return Sigma_B / d[:, None] / d[None, :]


# ---------------------------------------------------------------- a language model's early checkpoints
# The paper compares Pythia-1.4B's checkpoints step0..step512 with the leading-term features. For any
# causal LM with untied embedding W_E [V, d] and unembedding W_U [d, V] (a TransformerBridge or the
# book's ToyTransformer):
#   embeddings   the first gradient step moves W_E by -eta dL/dW_E = eta B W_U(0)^T (up to the
#                layers between them) and W_U by eta W_E(0)^T B; we compare the displacement
#                W_E(s) - W_E(0) on the frequent tokens with B W_U(0)^T, and W_U(s) - W_U(0) with
#                W_E(0)^T B (cosines);
#   attention    per layer, the mean pre-softmax score from a query token a to a key token b on
#                corpus text (averaged over heads and positions), minus its value at step 0,
#                against the attention feature Q[a, b], both centred over keys (softmax ignores a
#                per-query constant), on the frequent tokens.
# Baselines: the same cosines with the feature's token labels permuted at random.

def frequent_ids(inputs: torch.Tensor, k: int) -> torch.Tensor:
    """The k most frequent token ids of a batch (fewer if fewer occur), in increasing id order."""
    counts = torch.bincount(inputs.reshape(-1))
    return counts.topk(min(k, int((counts > 0).sum()))).indices.sort().values


def embedding_agreement(W_E0, W_E, W_U0, W_U, B: torch.Tensor, ids: torch.Tensor, n_perm: int = 20,
                        seed: int = 0) -> dict:
    """Cosines of the embedding and unembedding displacements with their first-step directions on
    the tokens `ids`, and their permutation baselines (mean and std over n_perm shuffles of the
    feature's token labels: B[perm][:, perm])."""
    B, W_E0, W_U0 = B.double(), W_E0.double(), W_U0.double()
    dE = (W_E.double() - W_E0)[ids]
    dU = (W_U.double() - W_U0)[:, ids]
    gen = torch.Generator().manual_seed(seed)
    base_E, base_U = [], []
    for _ in range(n_perm):
        perm = torch.randperm(len(B), generator=gen)
        base_E.append(cosine(dE, B[perm[ids]][:, perm] @ W_U0.T))
        base_U.append(cosine(dU, W_E0.T @ B[:, perm[ids]][perm]))
    return {"embed": cosine(dE, B[ids] @ W_U0.T), "embed_base_mean": float(np.mean(base_E)),
            "embed_base_std": float(np.std(base_E)), "unembed": cosine(dU, W_E0.T @ B[:, ids]),
            "unembed_base_mean": float(np.mean(base_U)), "unembed_base_std": float(np.std(base_U))}


@torch.no_grad()
def attention_token_scores(model, tokens: torch.Tensor, ids: torch.Tensor, chunk: int = 16) -> torch.Tensor:
    """[n_layers, K, K]: mean pre-softmax score (over heads, positions and occurrences) from a query
    token ids[a] to a key token ids[b], causal pairs only; NaN where a pair never occurs. `model`
    has `cfg.n_layers` and `run_with_cache` with hooks `blocks.{l}.attn.hook_attn_scores`."""
    n_layers = model.cfg.n_layers
    K = len(ids)
    lookup = torch.full((max(int(tokens.max()), int(ids.max())) + 1,), -1, dtype=torch.long)
    lookup[ids] = torch.arange(K)
    sums = torch.zeros(n_layers, K * K, dtype=torch.float64)
    counts = torch.zeros(K * K, dtype=torch.float64)
    names = [f"blocks.{l}.attn.hook_attn_scores" for l in range(n_layers)]
    for s in range(0, len(tokens), chunk):
        x = tokens[s:s + chunk]
        n, T = x.shape
        _, cache = model.run_with_cache(x, names_filter=lambda name: name in names)
        q, k = lookup[x][:, :, None].expand(n, T, T), lookup[x][:, None, :].expand(n, T, T)
        keep = (q >= 0) & (k >= 0) & torch.tril(torch.ones(T, T, dtype=torch.bool))
        flat = (q * K + k)[keep]
        counts += torch.bincount(flat, minlength=K * K).double()
        for l, name in enumerate(names):
            scores = cache[name].double().mean(1)  # over heads: [n, T, T]
            sums[l] += torch.bincount(flat, weights=scores[keep], minlength=K * K)
    out = sums / counts
    out[:, counts == 0] = float("nan")
    return out.reshape(n_layers, K, K)


def centred_over_keys(M: torch.Tensor) -> torch.Tensor:
    """Subtract each query row's mean over the keys it has (NaN entries ignored, then set to 0)."""
    mean = torch.nanmean(M, dim=-1, keepdim=True)
    return torch.nan_to_num(M - mean, nan=0.0)


def attention_agreement(scores: torch.Tensor, scores0: torch.Tensor, Q: torch.Tensor, ids: torch.Tensor,
                        n_perm: int = 20, seed: int = 0) -> pd.DataFrame:
    """Per layer: cosine of the score change (query x key, centred over keys) with Q on `ids`, and
    its permutation baseline (Q with its token labels shuffled). scores, scores0: [n_layers, K, K]
    from `attention_token_scores` (NaN: a pair that never occurs, left out)."""
    Q = Q.double()
    seen = ~torch.isnan(scores[0])
    gen = torch.Generator().manual_seed(seed)
    target = centred_over_keys(torch.where(seen, Q[ids][:, ids], torch.nan))
    shuffled = []
    for _ in range(n_perm):
        pi = torch.randperm(len(Q), generator=gen)[ids]
        shuffled.append(centred_over_keys(torch.where(seen, Q[pi][:, pi], torch.nan)))
    rows = []
    for l in range(scores.shape[0]):
        delta = centred_over_keys(torch.where(seen, scores[l] - scores0[l], torch.nan))
        base = [cosine(delta, t) for t in shuffled]
        rows.append({"layer": l, "cosine": cosine(delta, target), "base_mean": float(np.mean(base)),
                     "base_std": float(np.std(base))})
    return pd.DataFrame(rows)


def agrees(value: float, base_mean: float, base_std: float, z: float = 3.0) -> bool:
    """A positive agreement beyond z standard deviations of its permutation baseline."""
    return bool(value > 0 and value > base_mean + z * max(base_std, 1e-12))
