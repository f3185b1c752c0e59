"""Leading terms of a loss read at the last position only, for a randomly initialised model.

`analysis.leading_terms` has the statistics of Im et al.'s setting: the next-token loss at every position, a
zero initialisation, plain SGD. The book's toy models differ on all three: the loss sits at the LAST position
only (a label k in K classes per sequence), the weights start random, and AdamW trains them. This module has
the statistics that the first gradients of such a loss see, and the agreement measures built on them.

The gradient at initialisation, outputs at their uniform value (the leading order of LT's expansion). With
one-hot labels Y_i [K] and uniform U = 1/K, the loss gradient with respect to the last position's logits of
sequence i is -(Y_i - U) at leading order. So, for the token embedding W_E [V, d] and the unembedding W_U [d, K],

    -dL/dW_E[c] = (1/N) sum_i sum_j [x_ij = c] J_ij^T (Y_i - U)
               ~= sum_j F_j[c] G_j^T                    (J_ij replaced by its mean over sequences, G_j)
    -dL/dW_U    = (1/N) H0^T (Y - U)                    (H0 [N, d]: the input of W_U at the last position)

with the position maps of the corpus (`position_label_maps`)

    F_j[c, k] = (1/N) sum_i [x_ij = c] (Y_ik - 1/K)        [T, V, K]

F at the last position is the last-token bigram map (`last_bigram_map`: LT's B with the label for the next
token); their mean over positions is the context map of the last position under uniform attention
(`last_context_map`: LT's Phi, laid out (context token, label)). G_j [d, K] (`mean_input_jacobian`) is the
initial model's mean Jacobian of the last logits with respect to the token embedding at position j: for a model
whose only path is the direct one, G_last = W_U(0) and G_j = 0 before it, and the embedding term is LT-6's
B W_U(0)^T; the unembedding term (`unembedding_term`) is LT-6's W_E(0)^T B when H0 = W_E(0)[x_last].

AdamW's decoupled decay shrinks the initialisation by prod_t (1 - eta_t lambda) whatever the data; what the
data moved is `decayed_displacement` W(s) - decay W(0) (exactly the decayed sum of Adam's steps).

Agreement (LT-6's cosines, with permutation baselines): `embedding_term_agreement` (the feature's token and
label ids shuffled, `permuted_embedding_terms`), `unembedding_term_agreement` (its label columns shuffled,
`permuted_unembedding_terms`), both through `agreement_with` (targets computed once, read at many checkpoints);
`z_score`; `agreement_span`
reads when a run of agreeing checkpoints ends. `varying_ids`: the tokens whose label statistics are not fixed
(a token at the same positions in every sequence carries no label information).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from .leading_terms import agrees, cosine


def _check(tokens: torch.Tensor, labels: torch.Tensor, vocab_size: int, n_classes: int) -> None:
    if tokens.dim() != 2 or labels.dim() != 1 or len(tokens) != len(labels):
        raise ValueError(f"tokens must be [N, T] and labels [N]; got {tuple(tokens.shape)} and {tuple(labels.shape)}")
    if tokens.dtype not in (torch.int64, torch.int32) or labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"tokens and labels must be integer ids; got {tokens.dtype} and {labels.dtype}")
    if len(tokens) == 0:
        raise ValueError("no sequences")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise ValueError(f"tokens must lie in [0, {vocab_size}); got [{int(tokens.min())}, {int(tokens.max())}]")
    if labels.min() < 0 or labels.max() >= n_classes:
        raise ValueError(f"labels must lie in [0, {n_classes}); got [{int(labels.min())}, {int(labels.max())}]")


def position_label_maps(tokens: torch.Tensor, labels: torch.Tensor, vocab_size: int, n_classes: int,
                        dtype=torch.float64) -> torch.Tensor:
    """F [T, V, K]: F[j, c, k] = (1/N) sum_i [x_ij = c] (Y_ik - 1/K), the label against the token at position j."""
    _check(tokens, labels, vocab_size, n_classes)
    N, T = tokens.shape
    pos = torch.arange(T).expand(N, T)
    flat = (pos * vocab_size + tokens) * n_classes + labels[:, None]
    joint = torch.bincount(flat.reshape(-1), minlength=T * vocab_size * n_classes).to(dtype)
    joint = joint.reshape(T, vocab_size, n_classes)
    return (joint - joint.sum(-1, keepdim=True) / n_classes) / N


def last_bigram_map(tokens, labels, vocab_size: int, n_classes: int, dtype=torch.float64) -> torch.Tensor:
    """[V, K]: the last token against the label (LT's bigram map B with the label in the next token's place)."""
    return position_label_maps(tokens, labels, vocab_size, n_classes, dtype)[-1]


def last_context_map(tokens, labels, vocab_size: int, n_classes: int, dtype=torch.float64) -> torch.Tensor:
    """[V, K]: the context tokens against the label under uniform attention at the last position (weight 1/T on
    each position, the last included): LT's context map Phi, laid out (context token, label)."""
    return position_label_maps(tokens, labels, vocab_size, n_classes, dtype).mean(0)


def varying_ids(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The token ids that occur and do not sit at the same positions in every sequence (increasing order)."""
    out = []
    for c in range(vocab_size):
        where = tokens == c
        if where.any() and not (where == where[0]).all():
            out.append(c)
    return torch.tensor(out, dtype=torch.long)


def _unembed_input(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits at the last position [n, K], the unembedding's input there [n, d]) with grad kept."""
    seen = {}
    handle = model.unembed.register_forward_pre_hook(lambda mod, args: seen.__setitem__("h", args[0]))
    try:
        logits = model(tokens)
    finally:
        handle.remove()
    return logits[:, -1], seen["h"][:, -1]


def mean_input_jacobian(model, tokens: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """G [T, d, K]: the mean over sequences of d logits[last, k] / d (token embedding at position j).

    `model` is a ToyTransformer (its token embedding passes `hook_embed`, its logits are [n, T, K]); it is run
    as it is (put it in eval mode for a model with dropout)."""
    T = tokens.shape[1]
    total = None
    for s in range(0, len(tokens), chunk):
        x = tokens[s:s + chunk]
        held = {}

        def leaf(act, hook):
            held["e"] = act.detach().requires_grad_(True)
            return held["e"]

        with torch.enable_grad():
            model.reset_hooks()
            model.add_hook("hook_embed", leaf)
            try:
                logits = model(x, last_only=True)[:, -1]  # [n, K]: only what the last position needs
            finally:
                model.reset_hooks()
            K = logits.shape[-1]
            rows = []
            for k in range(K):  # one backward pass per output (a batched one, is_grads_batched, is slower here)
                (g,) = torch.autograd.grad(logits[:, k].sum(), held["e"], retain_graph=k < K - 1)
                rows.append(g.sum(0).double())  # [T, d]
            part = torch.stack(rows, -1)  # [T, d, K]
        total = part if total is None else total + part
    if total is None or total.shape[0] != T:
        raise ValueError("mean_input_jacobian: no sequences")
    return total / len(tokens)


@torch.no_grad()
def unembedding_input(model, tokens: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """H [N, d]: the unembedding's input at the last position (float64)."""
    return torch.cat([_unembed_input(model, tokens[s:s + chunk])[1].double() for s in range(0, len(tokens), chunk)])


def embedding_term(maps: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """[V, d]: sum_j F_j G_j^T, the leading term of the embeddings' first gradient step (maps [T, V, K],
    G [T, d, K])."""
    if maps.dim() != 3 or G.dim() != 3 or maps.shape[0] != G.shape[0] or maps.shape[2] != G.shape[2]:
        raise ValueError(f"maps [T, V, K] and G [T, d, K] must agree; got {tuple(maps.shape)} and {tuple(G.shape)}")
    return torch.einsum("tvk,tdk->vd", maps.double(), G.double())


def unembedding_term(H0: torch.Tensor, labels: torch.Tensor, n_classes: int) -> torch.Tensor:
    """[d, K]: (1/N) H0^T (Y - U), the leading term of the unembedding's first gradient step."""
    if H0.dim() != 2 or len(H0) != len(labels):
        raise ValueError(f"H0 must be [N, d] with one label per row; got {tuple(H0.shape)}, {len(labels)} labels")
    Y = torch.nn.functional.one_hot(labels.long(), n_classes).double()
    return H0.double().T @ (Y - 1.0 / n_classes) / len(H0)


def decayed_displacement(W: torch.Tensor, W0: torch.Tensor, decay: float) -> torch.Tensor:
    """W - decay W0: the displacement without AdamW's decoupled decay of the initialisation (decay = prod_t
    (1 - eta_t lambda) over the steps taken; 1 without weight decay)."""
    return W.double() - decay * W0.double()


def z_score(value: float, base_mean: float, base_std: float) -> float:
    """(value - base_mean) / base_std (the baseline's spread floored at 1e-12, as `agrees` does)."""
    if any(math.isnan(v) for v in (value, base_mean, base_std)):
        return math.nan
    return (value - base_mean) / max(base_std, 1e-12)


def agreement_with(displacement: torch.Tensor, target: torch.Tensor, bases: Sequence[torch.Tensor],
                   z: float = 3.0) -> dict:
    """Cosine of a displacement with its leading-term `target` and with each baseline target (same shape):
    cosine, base_mean, base_std, z (`z_score`), agrees (`leading_terms.agrees` at `z`)."""
    d = displacement.double()
    base = [cosine(d, b) for b in bases]
    value = cosine(d, target)
    m, s = float(np.mean(base)), float(np.std(base))
    return {"cosine": value, "base_mean": m, "base_std": s, "z": z_score(value, m, s), "agrees": agrees(value, m, s, z)}


def permuted_embedding_terms(maps: torch.Tensor, G: torch.Tensor, n_perm: int, seed: int = 0) -> list[torch.Tensor]:
    """`embedding_term` of the maps with their token ids and label ids shuffled (one permutation of each per
    draw, the same at every position): the baseline targets of the embedding's agreement."""
    gen = torch.Generator().manual_seed(int(seed))
    V, K = maps.shape[1], maps.shape[2]
    out = []
    for _ in range(n_perm):
        pc, pk = torch.randperm(V, generator=gen), torch.randperm(K, generator=gen)
        out.append(embedding_term(maps[:, pc][:, :, pk], G))
    return out


def permuted_unembedding_terms(term: torch.Tensor, n_perm: int, seed: int = 0) -> list[torch.Tensor]:
    """The unembedding term [d, K] with its label columns shuffled: the baseline targets of its agreement."""
    gen = torch.Generator().manual_seed(int(seed))
    t = term.double()
    return [t[:, torch.randperm(t.shape[1], generator=gen)] for _ in range(n_perm)]


def embedding_term_agreement(dE: torch.Tensor, maps: torch.Tensor, G: torch.Tensor, ids: torch.Tensor,
                             n_perm: int = 20, seed: int = 0, z: float = 3.0) -> dict:
    """Cosine of the embedding displacement dE [V, d] with `embedding_term(maps, G)` on the tokens `ids`, and its
    permutation baseline (`permuted_embedding_terms`): cosine, base_mean, base_std, z, agrees."""
    bases = [b[ids] for b in permuted_embedding_terms(maps, G, n_perm, seed)]
    return agreement_with(dE.double()[ids], embedding_term(maps, G)[ids], bases, z)


def unembedding_term_agreement(dU: torch.Tensor, term: torch.Tensor, n_perm: int = 20, seed: int = 0,
                               z: float = 3.0) -> dict:
    """Cosine of the unembedding displacement dU [d, K] with its leading term [d, K] (`unembedding_term`), and
    its permutation baseline (`permuted_unembedding_terms`). Keys as `embedding_term_agreement`."""
    return agreement_with(dU, term.double(), permuted_unembedding_terms(term, n_perm, seed), z)


def agreement_span(times: Sequence[float], agree: Sequence[bool]) -> dict:
    """When a run of agreeing checkpoints from the first ends. times: increasing (s * eta of checkpoints after
    initialisation). span: the last time of the unbroken run of agreeing checkpoints from the first (0 when the
    first does not agree); lost: the first time that does not agree (inf when all agree)."""
    times = [float(t) for t in times]
    if len(times) != len(agree) or not times:
        raise ValueError(f"agreement_span: {len(times)} times and {len(agree)} flags; expected the same, at least one")
    if any(b <= a for a, b in zip(times, times[1:])):
        raise ValueError("agreement_span: times must increase")
    span, lost = 0.0, math.inf
    for t, ok in zip(times, agree):
        if not ok:
            lost = t
            break
        span = t
    return {"span": span, "lost": lost}


def ratio(a: float, b: float) -> float:
    """a / b for event times: inf over a finite positive b is inf, NaN when either is NaN."""
    if math.isnan(a) or math.isnan(b) or b <= 0:
        return math.nan
    return math.inf if math.isinf(a) else a / b
