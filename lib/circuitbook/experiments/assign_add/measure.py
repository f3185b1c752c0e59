"""The chapter's measurements: pure functions of models, runs and metrics (known answers in
tests/test_experiments_assign_add.py). They know the task - where the bound value sits, which variables a
query names; what any model could be read with lives in `circuitbook.analysis`.

Phases (`detect_phases`, per member; rules in its docstring, never typed in)
    addition, then (searched after it) the variable-accuracy jump and the layer-2 circuit's emergence
    (QK identity, `=` reading the bound value over the other assigned values), the layer-1 previous-token
    head, the refinement; `stage_checkpoint`, `transition_checkpoints` name checkpoints around them.
Mechanisms (on any ToyTransformer, so an external checkpoint works the same way)
    `attention_by_role` (AA-11), `residual_cosines` (AA-8), `mlp_preactivation_grid` (AA-9),
    `variable_probe_data`, `qk_gradient` / `theory_qk_block` / `block_energy` (AA-12). The measures the
    main run logs over training (`routing_score`, `bound_over_values_share`, ...) are in `evaluate.py`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pandas as pd
import torch

from ...analysis import curves, fourier, representations
from ...analysis.ace import collect_activations
from ...models.toy import ToyTransformer
from ...tasks.assign_add import (
    N_VARS,
    NOT_LEFT,
    NOT_RIGHT,
    PREFIX_LEN,
    SEQ_LEN,
    TWO_VAR_LEFT,
    TWO_VAR_RIGHT,
    AssignAddTask,
)
from .evaluate import bound_targets, pool_accuracies, value_positions

VAR_POOLS = ("one_var_train", "two_var_train")  # "variable accuracy": training pairs and positions


HARD_POOLS = ("one_var_var_restricted", "two_var_var_restricted_one", "two_var_var_restricted_two")


ADD_POOLS = ("zero_var_add_restricted", "one_var_add_restricted", "two_var_add_restricted")


def random_init_model(model: ToyTransformer, seed: int = 0) -> ToyTransformer:
    """A model of the same architecture at a fresh random initialisation: the baseline a claim about
    trained weights must beat."""
    return ToyTransformer(model.cfg, seed=seed).eval()


def accuracy_by_variable_side(model: ToyTransformer, task: AssignAddTask, n: int = 250, seed: int = 3) -> pd.DataFrame:
    """1-var accuracy of each variable on each operand side (n training pairs per cell), with whether
    training holds that cell out (`a`, `b` on the right, `k`, `l` on the left)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for v, name in enumerate(task.token_names()[task.VAR0:]):
        for side in ("left", "right"):
            pair = task.train_pairs[torch.randint(len(task.train_pairs), (n,), generator=g)]
            kw = {"left_var": v} if side == "left" else {"right_var": v}
            batch = task.make_batch(pair // task.modulus, pair % task.modulus, seed=seed + len(rows), **kw)
            held = v in (NOT_RIGHT if side == "right" else NOT_LEFT)
            rows.append({"variable": name, "side": side, "held out": held,
                         "accuracy": pool_accuracies(model, {"cell": batch})["cell"]})
    return pd.DataFrame(rows)


ROLES = ("bound value", "other assigned value", "variable token", "PAD", "+", "left operand", "right operand", "=")


def key_roles(tokens: torch.Tensor, task: AssignAddTask) -> np.ndarray:
    """The role (`ROLES`) of every position [B, T] as a key: the bound value(s), other assigned values,
    variable tokens and PADs of the prefix, then the four tokens of the query core."""
    role = np.full(tokens.shape, "PAD", dtype=object)
    role[(tokens >= task.VAR0).numpy()] = "variable token"
    role[value_positions(tokens, task).numpy()] = "other assigned value"
    role[bound_targets(tokens, task).numpy()] = "bound value"
    role[:, PREFIX_LEN:] = ["+", "left operand", "right operand", "="]
    return role


def attention_by_role(pattern1: torch.Tensor, tokens: torch.Tensor, task: AssignAddTask, head: int = 0) -> pd.Series:
    """Mean layer-2 attention of `=` summed over the keys of each role (`key_roles`)."""
    rows, role = pattern1[:, head, -1].double().numpy(), key_roles(tokens, task)
    return pd.Series({name: float((rows * (role == name)).sum(1).mean()) for name in ROLES})


@dataclass(frozen=True)
class Phases:
    """Steps detected from the curves of one member (see `detect_phases`); NaN: not detected."""

    addition_step: float  # 0-var (training pairs) accuracy reaches `level`
    variable_step: float  # the first of the 1-var / 2-var training accuracies reaches `level`
    var_half_step: float  # the first of them reaches 0.5
    zero_at_var_half: float  # 0-var accuracy at var_half_step
    jump_from: float  # where the jump is searched from: the end of the addition phase
    jump_step: float  # where the variable accuracy rises most after jump_from (`detect_phases`)
    jump_rise: float  # its rise
    jump_share: float  # its rise / the variable accuracy's rise after jump_from
    qk_step: float  # the layer-2 QK identity cosine is half-way from its first to its last value
    bound_step: float  # the bound value beats the other assigned values in `=`'s attention: half-way of the
    # stage that holds the jump
    bound_lo: float  # bound_step's sampling interval (`analysis.curves.stage_half_way`)
    bound_hi: float
    routing_step: float  # the layer-1 previous-token score is half-way (a prerequisite)
    refine_step: float  # where the hard-case accuracy rises most after the jump
    refine_rise: float
    window: float

    def marks(self) -> dict[str, float]:
        marks = {"addition": self.addition_step, "jump": self.jump_step, "refinement": self.refine_step}
        return {k: v for k, v in marks.items() if not math.isnan(v)}


def default_window(steps) -> float:
    """1/20 of the run, and at least two evaluation intervals."""
    steps = np.sort(np.asarray(steps, float))
    return max(steps[-1] / 20, 2 * float(np.median(np.diff(steps))) if len(steps) > 1 else 1.0)


def phase_tolerances(pool_size: int | None, probe_size: int | None) -> dict[str, float]:
    """The sampling error of a rise of each curve the phase rules read (`analysis.curves.binomial_rise_tolerance`,
    two standard errors of a difference of two binomial proportions at 1/2): the variable accuracy is the mean of
    two pools of `pool_size` sequences (2 x pool_size), the hard cases of three (3 x pool_size), the bound
    value's lead a share over the probe's 1-var and 2-var sequences (at least 2 x probe_size bound values).
    None: an exact curve (tolerance 0, only exact ties)."""
    def tol(n):
        return curves.binomial_rise_tolerance(n) if n else 0.0

    return {"variable": tol(pool_size and 2 * pool_size), "hard": tol(pool_size and 3 * pool_size),
            "bound_over_values": tol(probe_size and 2 * probe_size)}


def detect_phases(metrics: pd.DataFrame, member: int = 0, window: float | None = None,
                  min_rise: float = 0.2, level: float = 0.9, pool_size: int | None = None,
                  probe_size: int | None = None) -> Phases:
    """The phases of training, detected from the evaluation curves of one member, in the paper's
    order of events (AA-1: addition first).

    - addition: first step where 0-var accuracy on training pairs reaches `level`; the first of
      the 1-var and 2-var training accuracies reaches `level` at `variable_step` and 0.5 at
      `var_half_step`, where the 0-var accuracy is `zero_at_var_half`;
    - jump: searched after the addition phase (`jump_from` = the addition step; the first step
      when 0-var accuracy never reaches `level`), because once addition is solved a model that adds
      a uniformly chosen assigned value is already right with probability E[1/k], so the variable
      accuracy first rises with addition to that plateau; the jump is the later rise from it.
      Its step is where the variable accuracy (mean of the 1-var and 2-var training pools,
      `VAR_POOLS`) rises (`analysis.curves.steepest_rise`): inside the steepest region of
      `window`-step windows starting at or after `jump_from` (every window whose rise is within the
      pools' sampling error of the steepest: `phase_tolerances(pool_size, ...)`), the middle of its
      largest single-evaluation rises, so a jump shorter than the window is placed at the jump, not
      at whichever window a draw of the pools makes steepest; `jump_rise` is the steepest window's
      rise and `jump_share` that rise over the curve's rise after `jump_from` (its highest value after
      it minus its value there): a sharp jump does most of that learning in one window;
    - the circuit (AA-2), after `jump_from` too: the half-way step of the stage of the share of bound
      values that `=` reads more than every other assigned value (`bound_over_values`, at every
      evaluation) that holds the jump (`analysis.curves.stage_half_way_step`: the share rises in
      stages, first with the layer-1 previous-token head, then at the jump; stages are separated by
      pauses over which it changes by less than its sampling error, `phase_tolerances(..., probe_size)`;
      a share that does not rise at the jump is timed by the half-way step of its whole change after
      `jump_from`), and the step at which the layer-2 QK identity cosine (`qk_identity`, a function of
      the weights: no sampling error, so one stage) has covered half of its change over the run; the
      layer-1 previous-token score (`routing`) likewise over the run, for comparison;
    - refinement: where the hard-case accuracy (mean of the var-restricted pools, `HARD_POOLS`) rises,
      by the jump's rule, among windows that start after the jump's window (`jump_step + window / 2`).
    pool_size / probe_size: the sequences behind each point (None: exact curves, exact ties only).
    A jump or refinement whose rise is below `min_rise` is not detected (NaN); without a jump
    there is no refinement. window defaults to `default_window` (1/20 of the run).
    """
    m = metrics[metrics.member == member].sort_values("step")
    if m.empty:
        raise ValueError(f"member={member} has no metrics; members: {sorted(metrics.member.unique())}")
    steps = m.step.to_numpy(float)
    window = default_window(steps) if window is None else float(window)
    zero = m["acc_zero_var_train"].to_numpy()
    var = m[[f"acc_{p}" for p in VAR_POOLS]].mean(axis=1).to_numpy()
    hard = m[[f"acc_{p}" for p in HARD_POOLS]].mean(axis=1).to_numpy()
    at_level = [curves.crossing_step(steps, m[f"acc_{p}"], level) for p in VAR_POOLS]
    at_half = [curves.crossing_step(steps, m[f"acc_{p}"], 0.5) for p in VAR_POOLS]
    variable_step, var_half = float(np.fmin(*at_level)), float(np.fmin(*at_half))

    addition = curves.crossing_step(steps, zero, level)
    start = addition if not math.isnan(addition) else float(steps[0])
    tol = phase_tolerances(pool_size, probe_size)
    jump, jump_rise = curves.steepest_rise(steps, var, window, after=start, tolerance=tol["variable"])
    later = steps >= start
    rise_after = float(var[later].max() - curves.value_at(steps, var, start)) if later.any() else float("nan")
    jump_share = jump_rise / rise_after if rise_after > 0 else float("nan")
    if not jump_rise >= min_rise:
        jump = float("nan")

    def half_way(columns, after=None):
        if not all(c in m for c in columns):
            return float("nan")
        keep = steps >= after if after is not None else np.ones(len(steps), bool)
        if keep.sum() < 2:
            return float("nan")
        return curves.half_way_step(steps[keep], m[list(columns)].mean(axis=1).to_numpy()[keep])

    def bound_stage(event):
        if "bound_over_values" not in m:
            return (float("nan"),) * 3
        if math.isnan(event):
            return (half_way(["bound_over_values"], after=start),) * 3
        return curves.stage_half_way(steps, m["bound_over_values"].to_numpy(), event, after=start,
                                     tolerance=tol["bound_over_values"])

    refine, refine_rise = (curves.steepest_rise(steps, hard, window, after=jump + window / 2,
                                                tolerance=tol["hard"])
                           if not math.isnan(jump) else (float("nan"), float("nan")))
    if not refine_rise >= min_rise:
        refine = float("nan")
    bound, bound_lo, bound_hi = bound_stage(jump)
    return Phases(addition_step=addition, variable_step=variable_step,
                  var_half_step=var_half, zero_at_var_half=curves.value_at(steps, zero, var_half),
                  jump_from=start, jump_step=jump, jump_rise=jump_rise, jump_share=jump_share,
                  qk_step=half_way(["qk_identity"]), bound_step=bound, bound_lo=bound_lo, bound_hi=bound_hi,
                  routing_step=half_way(["routing"]), refine_step=refine, refine_rise=refine_rise,
                  window=window)


def hard_final_accuracy(metrics: pd.DataFrame) -> pd.Series:
    """Per member: the lowest final accuracy of the three hard (var-restricted) pools."""
    last = metrics[metrics.step == metrics.step.max()].set_index("member").sort_index()
    return last[[f"acc_{p}" for p in HARD_POOLS]].min(axis=1)


def checkpoint_before(run, step: float) -> int:
    """The last checkpoint strictly before `step` (the first checkpoint if none)."""
    before = [s for s in run.checkpoint_steps() if s < step]
    return before[-1] if before else run.checkpoint_steps()[0]


def checkpoint_after(run, step: float) -> int:
    """The first checkpoint at or after `step` (the last checkpoint if none)."""
    after = [s for s in run.checkpoint_steps() if s >= step]
    return after[0] if after else run.checkpoint_steps()[-1]


def stage_checkpoint(run, phases: Phases) -> int | None:
    """AA-12's stage: the last checkpoint before the jump's window, where layer 2 does not match
    variables yet, and never before the addition phase has ended (`jump_from`): the stage the
    theory is about is the plateau from which the jump starts, not the start of training. None
    when no jump was detected, or no checkpoint lies between the two (there is then no such stage
    to name: see `stage_missing_why`)."""
    if math.isnan(phases.jump_step):
        return None
    inside = [s for s in run.checkpoint_steps() if phases.jump_from <= s < phases.jump_step - phases.window / 2]
    return inside[-1] if inside else None


def stage_missing_why(phases: Phases) -> str:
    """Why `stage_checkpoint` named no stage."""
    if math.isnan(phases.jump_step):
        return "no jump detected, so there is no stage before it"
    return (f"no checkpoint lies between the end of the addition phase (step {phases.jump_from:.0f}) and the "
            f"jump's window (from step {phases.jump_step - phases.window / 2:.0f})")


def transition_checkpoints(run, phases: Phases) -> dict[str, int]:
    """Checkpoints that bracket the phases: first, before and after the jump, after the refinement, final."""
    ckpts = run.checkpoint_steps()
    out = {"init": ckpts[0]}
    if not math.isnan(phases.jump_step):
        out["before jump"] = checkpoint_before(run, phases.jump_step - phases.window / 2)
        out["after jump"] = checkpoint_after(run, phases.jump_step + phases.window / 2)
    if not math.isnan(phases.refine_step):
        out["after refinement"] = checkpoint_after(run, phases.refine_step + phases.window / 2)
    out["final"] = ckpts[-1]
    seen, unique = set(), {}
    for k, v in out.items():  # keep the order, drop repeats of the same checkpoint
        if v not in seen:
            unique[k], _ = v, seen.add(v)
    return unique


def residual_at(model: ToyTransformer, tokens: torch.Tensor, hook: str = "blocks.1.hook_resid_mid",
                position: int | str = -1) -> torch.Tensor:
    return collect_activations(model, tokens, hook, position=position)


def residual_cosines(model: ToyTransformer | None, task: AssignAddTask, n: int = 1000, seed: int = 0,
                     hook: str = "blocks.1.hook_resid_mid",
                     residual: Callable[[torch.Tensor], torch.Tensor] | None = None) -> pd.DataFrame:
    """Residual vectors before the layer-2 MLP at `=`: variable vs constant additions (AA-8).

    n distinct training pairs (n1, n2) (cycled if n exceeds them), and for each pair one sequence
    of each variable form at training positions - 1-var left (x in a..j), 1-var right (y in c..l),
    2-var (x, y) drawn uniformly from the 92 training pairs of variables - and the 0-var sequence
    `+ n1 n2 =`. Per form, `analysis.representations.paired_cosines` of the variable vectors with
    the constant vectors: `matched` (same values), `mismatched` (the constant sequence of the
    next pair, a different one), and both `_centred` (the mean of the form's and the constant
    vectors subtracted). One row per (form, pair).

    residual(tokens) -> [B, d] replaces reading `hook` of `model` at the last position (a test
    gives a function with known residuals).
    """
    read = residual or (lambda tokens: residual_at(model, tokens, hook))
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(task.train_pairs), generator=g)
    pair = task.train_pairs[order[torch.arange(n) % len(order)]]
    n1, n2 = pair // task.modulus, pair % task.modulus
    left = torch.tensor(TWO_VAR_LEFT)[torch.randint(len(TWO_VAR_LEFT), (n,), generator=g)]
    right = torch.tensor(TWO_VAR_RIGHT)[torch.randint(len(TWO_VAR_RIGHT), (n,), generator=g)]
    xy = task._combos["train"][torch.randint(len(task._combos["train"]), (n,), generator=g)]
    const = task.make_batch(n1, n2, seed=seed).tokens
    forms = {"1-var left": task.make_batch(n1, n2, left_var=left, seed=seed + 1).tokens,
             "1-var right": task.make_batch(n1, n2, right_var=right, seed=seed + 2).tokens,
             "2-var": task.make_batch(n1, n2, left_var=xy[:, 0], right_var=xy[:, 1], seed=seed + 3).tokens}
    cos = representations.form_cosines(read, forms, const)
    item = cos.pop("item").to_numpy()
    cos.insert(1, "n1", n1.numpy()[item])
    cos.insert(2, "n2", n2.numpy()[item])
    return cos


def mlp_preactivation_grid(model: ToyTransformer, task: AssignAddTask, n_layouts: int = 4, seed: int = 0,
                           hook: str = "blocks.1.mlp.hook_pre") -> torch.Tensor:
    """Layer-2 MLP pre-activations at `=` for every 0-var sum `+ n m =`, as [N, N, d_mlp]
    (axis 0 = n, axis 1 = m), averaged over `n_layouts` random prefixes (distractors, padding);
    each layout is read by `analysis.fourier.collect_grid_activations`."""
    total = 0
    for s in range(n_layouts):
        total = total + fourier.collect_grid_activations(
            model, lambda n, m: task.make_batch(n, m, seed=seed + s).tokens, hook, task.modulus)
    return total / n_layouts


def variable_probe_data(model: ToyTransformer, task: AssignAddTask, tokens: torch.Tensor,
                        hook: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(activations, variable id) at every assigned number token: what a probe for "which variable
    is this number bound to" reads at `hook`."""
    acts = residual_at(model, tokens, hook, position="all")  # [B, T, D]
    b, p = value_positions(tokens, task).nonzero(as_tuple=True)
    return acts[b, p], tokens[b, p - 1] - task.VAR0


def qk_gradient(model: ToyTransformer, tokens: torch.Tensor, labels: torch.Tensor, layer: int = 1,
                batch_size: int = 1024) -> torch.Tensor:
    """-dL/dW_QK [heads, d_model, d_model] for the layer's bilinear query-key form.

    The scores are s(q, k) = x_q W_QK x_k^T / scale with W_QK = W_Q W_K^T, so treating W_QK as the
    parameter, dL/dW_QK = sum over sequences and (query, key) of dL/ds * x_q^T x_k / scale, with
    x the residual entering the layer. L is the training loss (mean cross-entropy at the last
    position). Factor-free: it is the direction gradient descent on a merged W_QK would take.
    """
    hook_x, hook_s = f"blocks.{layer}.hook_resid_pre", f"blocks.{layer}.attn.hook_attn_scores"
    scale = model.cfg.attn_scale if model.cfg.attn_scale is not None else math.sqrt(model.cfg.head_dim)
    H, d = model.cfg.n_heads, model.cfg.d_model
    total = torch.zeros(H, d, d, dtype=torch.float64)
    for start in range(0, len(tokens), batch_size):
        tok, lab = tokens[start:start + batch_size], labels[start:start + batch_size]
        store = {}

        def keep_x(x, hook):
            store["x"] = x.detach()

        def keep_s(s, hook):
            s.retain_grad()
            store["s"] = s

        logits = model.run_with_hooks(tok, fwd_hooks=[(hook_x, keep_x), (hook_s, keep_s)])
        loss = torch.nn.functional.cross_entropy(logits[:, -1].float(), lab, reduction="sum") / len(tokens)
        model.zero_grad(set_to_none=True)
        loss.backward()
        ds = store["s"].grad.nan_to_num(0.0).double()  # [B, H, Q, K]
        x = store["x"].double()
        total += torch.einsum("bhqk,bqd,bke->hde", ds, x, x) / scale
    model.zero_grad(set_to_none=True)
    return -total


GRADIENT_PARTS = 4  # AA-12: the gradient is measured on this many disjoint sub-batches to see its noise
GRADIENT_MIN_SNR = 3.0  # below this, the block's direction is mostly the draw of the sequences


def qk_gradient_block(model: ToyTransformer, tokens: torch.Tensor, labels: torch.Tensor, task: AssignAddTask,
                      parts: int = GRADIENT_PARTS) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(-dL/dW_QK of layer 2 [d, d], its variable block [12, 12], the block's signal-to-noise ratio).

    The gradient is the mean of `qk_gradient` over `parts` disjoint equal sub-batches of the sequences (the
    gradient on all of them, when they divide evenly); the block is read in `qk_basis` and double-centred (the
    part `template_cosine` reads) before `analysis.baselines.signal_to_noise` compares its size with its
    sampling error. Late in training the loss and its gradient shrink toward zero while the sampling error
    does not vanish as fast, so the block's direction, and any cosine read from it, becomes the draw's: a
    cosine is only measured where the ratio is at least `GRADIENT_MIN_SNR`."""
    from ...analysis.attention import double_centre
    from ...analysis.baselines import signal_to_noise

    size = len(tokens) // parts
    if size < 1:
        raise ValueError(f"{len(tokens)} sequences cannot be split into {parts} parts")
    grads = [qk_gradient(model, tokens[i * size:(i + 1) * size], labels[i * size:(i + 1) * size])[0]
             for i in range(parts)]
    blocks = [double_centre(variable_block(qk_in_basis(g, model, task)[0], task)) for g in grads]
    _, snr = signal_to_noise(blocks)
    grad = torch.stack(grads).mean(0)
    return grad, variable_block(qk_in_basis(grad, model, task)[0], task), snr


def qk_basis(model: ToyTransformer, task: AssignAddTask) -> tuple[torch.Tensor, list[str]]:
    """Rows of the embedding basis the QK forms are read in: every raw token embedding (74) and
    the 12 variable embeddings after the layer-1 OV circuit (`v'`), unit-normalised."""
    E = model.W_E.detach().double()
    a0 = model.blocks[0].attn
    moved = E[task.VAR0:task.VAR0 + N_VARS] @ torch.einsum("hde,hef->df", a0.W_V.detach(), a0.W_O.detach()).double()
    basis = torch.cat([E, moved])
    names = task.token_names() + [f"{v}'" for v in task.token_names()[task.VAR0:]]
    return basis / basis.norm(dim=1, keepdim=True).clamp(min=1e-12), names


def qk_in_basis(M: torch.Tensor, model: ToyTransformer, task: AssignAddTask) -> tuple[torch.Tensor, list[str]]:
    """A bilinear form M [d, d] (e.g. -dL/dW_QK of one head) read in `qk_basis` on both sides."""
    basis, names = qk_basis(model, task)
    return basis @ M.double() @ basis.T, names


def variable_block(M_basis: torch.Tensor, task: AssignAddTask) -> torch.Tensor:
    """The (moved variable) x (moved variable) block [12, 12] of a form read in `qk_basis`."""
    start = task.vocab_size
    return M_basis[start:start + N_VARS, start:start + N_VARS]


def block_energy(M_basis: torch.Tensor, task: AssignAddTask) -> pd.DataFrame:
    """Root-mean-square entry of each block of a form read in `qk_basis` (query group x key group):
    groups numbers, symbols (+ = PAD), variables, moved variables."""
    N, V = task.modulus, task.vocab_size
    groups = {"numbers": range(0, N), "symbols": range(N, task.VAR0), "variables": range(task.VAR0, V),
              "moved variables": range(V, V + N_VARS)}
    M = M_basis.abs()
    return pd.DataFrame({kg: {qg: float(M[list(qi)][:, list(ki)].pow(2).mean().sqrt()) for qg, qi in groups.items()}
                         for kg, ki in groups.items()})


def theory_qk_block(tokens: torch.Tensor, task: AssignAddTask) -> torch.Tensor:
    """The associative-memory block the gradient theory predicts [12, 12] (query variable x key variable),
    up to a positive factor, for the training sequences `tokens`.

    The idealised stage: layer 1 already routes (each assigned number carries its variable v',
    the query at `=` carries the variable operand(s)), layer 2 attends uniformly over the T = 16
    keys, and only the bound value(s) help the loss. Then -dL/ds_k is proportional to
    1[k bound] - B/T for a sequence with B bound values, and -dL/dW_QK sums, over sequences,
    (queried variable)^T (variable carried by key k) weighted by that coefficient: entry (u, v)
    adds 1 - B/T when v's value is bound and u is queried, and -B/T when v is an assigned
    distractor. A 2-var query carries both its variables, so each sees both bound values.
    """
    parsed = task.parse(tokens)
    values = value_positions(tokens, task)
    bound = bound_targets(tokens, task)
    n_bound = bound.sum(1, keepdim=True).double()
    coef = (bound.double() - n_bound / SEQ_LEN) * values.double()  # only assigned numbers carry a variable
    carried = torch.zeros(*tokens.shape, N_VARS, dtype=torch.float64)  # key position -> its variable, one-hot
    b, p = values.nonzero(as_tuple=True)
    carried[b, p, tokens[b, p - 1] - task.VAR0] = 1.0
    key_side = torch.einsum("bk,bkv->bv", coef, carried)  # [B, 12]
    query_side = torch.zeros(len(tokens), N_VARS, dtype=torch.float64)
    for side in ("left_var", "right_var"):
        v = parsed[side]
        ok = v >= 0
        query_side[ok.nonzero()[:, 0], v[ok]] += 1.0
    return query_side.T @ key_side / len(tokens)
