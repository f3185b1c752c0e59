"""ACE at the readout: the core at the last residual stream of a `ToyTransformer`, validated by re-running
only the readout after it (final LayerNorm, if any, and the unembedding).

Intervening at the last residual stream changes nothing upstream, so the intervened logits are just the
readout of the intervened activations: `validate_readout` gives exactly `ace.validate_core` at
`final_hook`, thousands of times faster, and `readout_jacobians` the Jacobians `ace.collect_ace_inputs`
gets by back-propagating through the whole model.

    final_hook, final_residual     the hook and activations of the last residual stream
    readout, affine_readout        logits from those activations; whether that map is affine
    readout_jacobians              d task outputs / d resid per row (raw or centred logits)
    ace_final                      ACE there: (core, inputs) with a definition's outputs and threshold
    validate_readout, validation_ks keep / remove / flip for every rank k, and which k to validate
    centred_logits                 logits minus their mean (the book's task outputs)
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..models.toy import ToyConfig, ToyTransformer
from . import ace


def centred_logits(logits: torch.Tensor) -> torch.Tensor:
    """Logits minus their mean (a common shift changes no prediction): the book's task outputs."""
    return logits - logits.mean(-1, keepdim=True)


def final_hook(model_cfg: ToyConfig) -> str:
    return f"blocks.{model_cfg.n_layers - 1}.hook_resid_post"


def readout(model: ToyTransformer, resid: torch.Tensor) -> torch.Tensor:
    """Logits from the last residual stream: final LayerNorm (pre-LN models only) and unembedding."""
    x = resid.to(model.W_U.dtype)
    if model.cfg.normalization == "LN":
        x = model.ln_final(x)
    return model.unembed(x)


def affine_readout(model: ToyTransformer) -> bool:
    """Whether the readout after the last residual stream is affine (no final LayerNorm)."""
    return model.cfg.normalization != "LN"


def final_residual(model: ToyTransformer, tokens: torch.Tensor, position: int | str = -1,
                   batch_size: int = 4096) -> torch.Tensor:
    """Activations of the last residual stream: [N, D] at one position, [N, pos, D] for 'all'."""
    return ace.collect_activations(model, tokens, final_hook(model.cfg), position=position, batch_size=batch_size)


@torch.no_grad()
def validate_readout(model: ToyTransformer, resid: torch.Tensor, labels: torch.Tensor, core: ace.AceCore,
                     chance: float, ks: Sequence[int] | None = None, modes: Sequence[str] = ace.INTERVENTIONS,
                     definition: ace.CoreDefinition = ace.BOOK, energy_rank: int | None = None) -> ace.CoreValidation:
    """`ace.validate_core` at the last residual stream, computed from its activations.

    resid [..., D] are the clean activations at `final_hook` (every position that is scored);
    labels [...] the targets. Intervening there changes nothing upstream, so the intervened
    logits are just `readout(intervened resid)`. keep / remove act about core.mu (definition.centered)
    or about the origin (the paper's), flip always about core.mu; modes not listed score NaN.
    """
    ks = list(range(1, core.rank + 1)) if ks is None else [int(k) for k in ks]
    if not ks or any(not 1 <= k <= core.rank for k in ks):
        raise ValueError(f"ks={ks!r} is not allowed; expected integers in [1, rank={core.rank}]")
    bad = [m for m in modes if m not in ace.INTERVENTIONS]
    if bad:
        raise ValueError(f"modes {bad} are not allowed; expected some of {ace.INTERVENTIONS}")
    h = resid.reshape(-1, resid.shape[-1]).float()
    y = labels.reshape(-1)
    Q, mu = core.Q.float(), core.mu.float()
    origin = mu if definition.centered else torch.zeros_like(mu)

    def acc(x):
        return (readout(model, x).argmax(-1) == y).float().mean().item()

    clean = acc(h)
    if affine_readout(model):
        scores = _affine_scores(model, h, y, Q, mu, origin, ks, modes)
    else:
        scores = {m: [acc(ace.apply_intervention(h, Q[:, :k], mu if m == "flip" else origin, m)) if m in modes
                      else float("nan") for k in ks] for m in ace.INTERVENTIONS}
    return ace.core_validation(ks, clean, scores, chance, definition, energy_rank)


def readout_jacobians(model: ToyTransformer, resid: torch.Tensor, outputs: str = "centred",
                      chunk: int = 8192) -> torch.Tensor:
    """d task outputs / d resid for every row of resid [N, D] -> [N, n_out, D]; outputs "raw" or
    "centred" logits.

    At the last residual stream only the readout (final LayerNorm, unembedding) lies downstream, so
    the Jacobian of the task outputs is the readout's Jacobian, computed per row with torch.func
    (the same numbers `ace.collect_ace_inputs` gets by back-propagating through the whole model).
    """
    from torch.func import jacrev, vmap

    if outputs not in ace.OUTPUTS:
        raise ValueError(f"outputs={outputs!r} is not allowed; expected one of {ace.OUTPUTS}")
    post = centred_logits if outputs == "centred" else (lambda z: z)

    def f(h):
        return post(readout(model, h[None])[0])

    with torch.no_grad():
        if affine_readout(model):  # one Jacobian for every row
            return jacrev(f)(resid[0].float()).expand(resid.shape[0], -1, -1)
        out = [vmap(jacrev(f))(resid[i:i + chunk].float()) for i in range(0, resid.shape[0], chunk)]
    return torch.cat(out)


@torch.no_grad()
def _affine_scores(model, h, y, Q, mu, origin, ks, modes) -> dict[str, list[float]]:
    """keep / remove / flip accuracies for every k when the readout is affine (no final LayerNorm).

    logits(h) = h W_U + b_U, so with z = (h - o) Q and u_j = q_j W_U the intervened logits are rank-one
    updates: keep_k = logits(o) + sum_{j<=k} z_j u_j, remove_k = logits(h) - sum_{j<=k} z_j u_j, with o the
    origin of keep / remove; flip_k = logits(h) - 2 sum_{j<=k} z'_j u_j with z' = (h - mu) Q. One pass over
    k instead of one readout per k.
    """
    W = model.W_U.float()
    U = Q.T @ W  # [K, n_out]
    z = (h - origin) @ Q  # [N, K]
    zf = (h - mu) @ Q
    full = readout(model, h)
    base = readout(model, origin[None])
    part = torch.zeros_like(full)
    part_f = torch.zeros_like(full)
    wanted = set(ks)
    scores = {m: {} for m in ace.INTERVENTIONS}
    for j in range(max(ks)):
        part += z[:, j:j + 1] * U[j]
        part_f += zf[:, j:j + 1] * U[j]
        if j + 1 not in wanted:
            continue
        for m, logits in (("keep", base + part), ("remove", full - part), ("flip", full - 2 * part_f)):
            scores[m][j + 1] = (logits.argmax(-1) == y).float().mean().item() if m in modes else float("nan")
    return {m: [v[k] for k in ks] for m, v in scores.items()}


def ace_final(model: ToyTransformer, tokens: torch.Tensor, position: int | str = -1,
              definition: ace.CoreDefinition = ace.BOOK, rank: int | None = None, batch_size: int = 4096):
    """(core, inputs) of ACE at the last residual stream, with the definition's task outputs (raw or
    centred logits) and energy threshold (unless `rank` fixes the rank).

    With position='all' every position of every sequence is a sample (sequence-major rows).
    """
    acts = final_residual(model, tokens, position=position, batch_size=batch_size)
    n_pos = acts.shape[1] if position == "all" else 1
    acts = acts.reshape(-1, acts.shape[-1])
    inputs = ace.AceInputs(activations=acts, jacobians=readout_jacobians(model, acts, definition.outputs),
                           n_sequences=tokens.shape[0], n_positions=n_pos)
    core = ace.extract_core(inputs.activations, inputs.jacobians, energy_threshold=definition.energy_threshold,
                            rank=rank)
    return core, inputs


def validation_ks(model: ToyTransformer, core: ace.AceCore, n_modes: int) -> list[int]:
    """The ranks k to validate: every ACE mode when the readout is affine (each k costs a rank-one
    update), else up to 2 r + 4 (each k costs one readout through the final LayerNorm)."""
    top = n_modes if affine_readout(model) else min(n_modes, 2 * core.rank + 4)
    return list(range(1, top + 1))


def core_dimensions(model: ToyTransformer, tokens: torch.Tensor, labels: torch.Tensor,
                    definition: ace.CoreDefinition, chance: float, max_rank: int | None = None) -> dict:
    """ACE at the last residual stream (last position) of `tokens` and the dimensions a definition reads off it:
    the energy rank r, the sufficient and necessary dimensions (keep / remove for every k up to `max_rank`,
    default every ACE mode; inf where no k qualifies), the core dimension max(r, necessary dimension), the
    bare necessary k (not raised to r), clean accuracy, keep and remove accuracy at r; and the core, its
    inputs and the validation. `chance` sets the necessary level (the definition's multiple of it)."""
    core, inputs = ace_final(model, tokens, position=-1, definition=definition, batch_size=4096)
    n_modes = core.sigma.numel()
    top = min(n_modes, max_rank or n_modes)
    full = ace.extract_core(inputs.activations, inputs.jacobians, rank=top)
    val = validate_readout(model, inputs.activations, labels, full, chance=chance, modes=("keep", "remove"),
                           definition=definition, energy_rank=core.rank)
    k = min(core.rank, full.rank)
    bare = ace.necessary_dimension(val.ks, val.remove, val.necessary_level)  # the smallest k, not raised to r
    return {"rank": core.rank, "sufficient_dim": ace.dim_value(val.sufficient_dim),
            "necessary_dim": ace.dim_value(val.necessary_dim), "necessary_k": ace.dim_value(bare),
            "core_dim": max(float(core.rank), ace.dim_value(val.necessary_dim)), "clean_acc": val.clean,
            "keep_acc_at_rank": val.keep[k - 1], "remove_acc_at_rank": val.remove[k - 1],
            "keep_ratio_at_rank": val.keep[k - 1] / max(val.clean, 1e-12), "validation": val, "core": core,
            "inputs": inputs}
