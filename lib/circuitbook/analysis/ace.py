"""ACE: Algorithmic Core Extraction (Schiffman, arXiv 2602.22600), reimplemented.

The core of a layer is the low-dimensional subspace of its activation space
along which the activations both *vary* (covariance) and *matter* for the task
outputs (Jacobian). Four steps, one function each:

- extract:   `extract_core(H, J)` -> `AceCore` (orthonormal basis Q, mean mu, ...)
- collect:   `collect_activations`, `collect_ace_inputs` run a model with a hook
             and return H (and J) at one or all positions
- validate:  `validate_core` applies keep / remove / flip at a hook for each
             rank k and reads off the sufficient and necessary dimensions, by the
             paper's definitions (`PAPER`) or the book's (`BOOK`), see `CoreDefinition`
- identify:  `fit_core_operator` fits z_{t+1} ~ A z_t in core coordinates

Models: anything with TransformerLens-style `run_with_hooks(tokens,
fwd_hooks=[(name, fn)])` -- the book's `ToyTransformer` and a
`transformer_lens.TransformerBridge` both qualify. Activations at a hook must
be laid out [batch, pos, ...]; trailing dimensions are flattened into D.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Literal, Sequence, Union

import numpy as np
import torch

Position = Union[int, Literal["all"]]
OutputFn = Callable[[torch.Tensor], torch.Tensor]
Metric = Callable[[torch.Tensor, torch.Tensor], float]
INTERVENTIONS = ("keep", "remove", "flip")
# Hooks whose axis 1 is the head, not the position: a position cannot be picked.
_NOT_POSITION_MAJOR = ("hook_pattern", "hook_attn_scores")


# --------------------------------------------------------------------------- #
# Extraction
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class AceCore:
    """An extracted core.

    Q:      [D, r] orthonormal basis; span(Q[:, :k]) is the rank-k core (nested).
    mu:     [D] mean activation (the origin the core is measured from).
    sigma:  all singular values of Lc^T Lo, descending.
    energy: cumulative sigma^2 fraction, energy[i] = sum(sigma[:i+1]^2) / sum(sigma^2).
    rank:   r, the number of columns of Q.
    energy_threshold: the threshold r was chosen with (None if r was fixed).
    """

    Q: torch.Tensor
    mu: torch.Tensor
    sigma: torch.Tensor
    energy: torch.Tensor
    rank: int
    energy_threshold: float | None

    @property
    def dim(self) -> int:
        """D, the activation dimension."""
        return self.Q.shape[0]

    @property
    def projector(self) -> torch.Tensor:
        """[D, D] orthogonal projector Q Q^T onto the core."""
        return self.Q @ self.Q.T

    def coordinates(self, activations) -> torch.Tensor:
        """Core coordinates z = Q^T (h - mu) for activations [..., D] -> [..., r]."""
        h = _as_float64(activations, "activations")
        if h.shape[-1] != self.dim:
            raise ValueError(f"activations must end in D={self.dim}; got shape {tuple(h.shape)}")
        return (h - self.mu) @ self.Q

    def truncate(self, k: int) -> "AceCore":
        """The core restricted to its first k directions (1 <= k <= rank)."""
        if not 1 <= k <= self.rank:
            raise ValueError(f"k={k} is not allowed; expected 1 <= k <= rank={self.rank}")
        return replace(self, Q=self.Q[:, :k], rank=k, energy_threshold=None)


def _as_float64(x, name: str) -> torch.Tensor:
    """Any array-like -> float64 CPU tensor (linear algebra here wants the precision)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(device="cpu", dtype=torch.float64)
    try:
        return torch.as_tensor(np.asarray(x), dtype=torch.float64)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} must be a numeric array or tensor; got {type(x).__name__}") from err


def psd_factor(matrix: torch.Tensor, rtol: float = 1e-10) -> torch.Tensor:
    """L with L L^T = matrix for a symmetric PSD matrix, as [D, rank] (rank-revealing).

    Uses an eigendecomposition rather than Cholesky because covariances and
    Jacobian second moments are routinely rank-deficient (Cholesky fails there),
    and round-off makes tiny eigenvalues negative: eigenvalues below
    rtol * max eigenvalue are dropped.
    """
    sym = (matrix + matrix.T) / 2  # remove round-off asymmetry before eigh
    eigval, eigvec = torch.linalg.eigh(sym)
    keep = eigval > rtol * eigval.max().clamp(min=0)
    if not keep.any():
        return torch.zeros(matrix.shape[0], 0, dtype=matrix.dtype)
    return eigvec[:, keep] * eigval[keep].sqrt()


def select_rank(sigma: torch.Tensor, energy_threshold: float) -> int:
    """Smallest r with sum(sigma[:r]^2) / sum(sigma^2) >= energy_threshold."""
    _check_threshold(energy_threshold)
    energy = _cumulative_energy(sigma)
    # a tiny slack so that a threshold of exactly 1.0 survives round-off
    return int(torch.searchsorted(energy, torch.tensor(energy_threshold - 1e-12, dtype=energy.dtype)).item()) + 1


def _check_threshold(energy_threshold: float) -> None:
    if not (isinstance(energy_threshold, (int, float)) and 0 < energy_threshold <= 1):
        raise ValueError(f"energy_threshold={energy_threshold!r} is not allowed; expected a number in (0, 1]")


def _cumulative_energy(sigma: torch.Tensor) -> torch.Tensor:
    power = sigma.pow(2)
    return power.cumsum(0) / power.sum()


def _observability(jacobians: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Obs = E_n[J_n^T J_n] = sum over samples and outputs of outer(J, J) / N, in chunks."""
    n, _, d = jacobians.shape
    obs = torch.zeros(d, d, dtype=torch.float64)
    for start in range(0, n, chunk):  # chunked so float64 copies of a big J never coexist
        rows = jacobians[start:start + chunk].to(device="cpu", dtype=torch.float64).reshape(-1, d)
        obs += rows.T @ rows
    return obs / n


def extract_core(activations, jacobians, energy_threshold: float = 0.99, rank: int | None = None,
                 rtol: float = 1e-10) -> AceCore:
    """ACE extraction from activations H [N, D] and Jacobians J [N, n_out, D] (or [N, D]).

    Cov = Hc^T Hc / (N-1) with Hc = H - mean; Obs = mean_n J_n^T J_n.
    With Cov = Lc Lc^T, Obs = Lo Lo^T (`psd_factor`) and Lc^T Lo = U S V^T, the core is
    Q = orth(Lc U[:, :r]) by Gram-Schmidt (QR), so the first k columns span the
    rank-k core for every k. sigma^2 is the share of the linearised output variance
    tr(Cov Obs) = ||Lc^T Lo||_F^2 carried by each direction; r is the smallest rank
    whose cumulative sigma^2 share reaches `energy_threshold`, unless `rank` fixes it.
    """
    H = _as_float64(activations, "activations")
    J = jacobians if isinstance(jacobians, torch.Tensor) else _as_float64(jacobians, "jacobians")
    if H.ndim != 2 or H.shape[0] < 2:
        raise ValueError(f"activations must be [N, D] with N >= 2; got shape {tuple(H.shape)}")
    if J.ndim == 2:
        J = J[:, None, :]  # one scalar output per sample
    if J.ndim != 3 or J.shape[0] != H.shape[0] or J.shape[2] != H.shape[1]:
        raise ValueError(f"jacobians must be [N, n_out, D] = [{H.shape[0]}, n_out, {H.shape[1]}] "
                         f"(or [N, D]); got shape {tuple(J.shape)}")
    _check_threshold(energy_threshold)

    mu = H.mean(0)
    Hc = H - mu
    Lc = psd_factor(Hc.T @ Hc / (H.shape[0] - 1), rtol)
    Lo = psd_factor(_observability(J), rtol)
    U, S, _ = torch.linalg.svd(Lc.T @ Lo, full_matrices=False)
    if S.numel() == 0 or S[0] <= 0:
        raise ValueError("activations and jacobians share no direction (Cov Obs = 0): the outputs do not "
                         "depend on any direction the activations vary along; no core exists")
    S = S[S > rtol * S[0]]  # numerically zero modes carry no energy and no direction
    if rank is None:
        r = select_rank(S, energy_threshold)
    elif isinstance(rank, int) and 1 <= rank <= S.numel():
        r = rank
    else:
        raise ValueError(f"rank={rank!r} is not allowed; expected None or an integer in [1, {S.numel()}]")
    Q, R = torch.linalg.qr(Lc @ U[:, :r])
    Q = Q * torch.where(torch.diagonal(R) < 0, -1.0, 1.0)  # QR may flip signs; keep each column along Lc U
    return AceCore(Q=Q, mu=mu, sigma=S, energy=_cumulative_energy(S), rank=r,
                   energy_threshold=energy_threshold if rank is None else None)


def output_mode_share(activations, jacobians, directions) -> float:
    """The share of ACE's total energy tr(Cov Obs) = sum sigma^2 carried by some output directions.

    activations H [N, D], jacobians J [N, n_out, D]; directions [k, n_out] (or [n_out]) in output space,
    orthonormalised here. With P the projector onto them, the share is tr(Cov E[J^T P J]) / tr(Cov E[J^T J]):
    how much of the linearised output variance moves the outputs along those directions. E.g. the
    all-ones direction of raw logits is the mode that shifts every logit alike, which softmax ignores.
    """
    H = _as_float64(activations, "activations")
    J = jacobians if isinstance(jacobians, torch.Tensor) else _as_float64(jacobians, "jacobians")
    U = _as_float64(directions, "directions")
    U = U[None] if U.ndim == 1 else U
    if J.ndim != 3 or J.shape[0] != H.shape[0] or J.shape[2] != H.shape[1] or U.ndim != 2 \
            or U.shape[1] != J.shape[1]:
        raise ValueError(f"expected activations [N, D], jacobians [N, n_out, D] and directions [k, n_out]; got "
                         f"{tuple(H.shape)}, {tuple(J.shape)}, {tuple(U.shape)}")
    U = torch.linalg.qr(U.T).Q.T  # [k, n_out], orthonormal rows
    Hc = H - H.mean(0)
    cov = Hc.T @ Hc / (H.shape[0] - 1)
    projected = torch.einsum("ko,nod->nkd", U.to(J.dtype), J)
    total = torch.trace(cov @ _observability(J))
    if total <= 0:
        raise ValueError("the outputs do not vary with the activations (tr(Cov Obs) = 0): no energy to share")
    return float(torch.trace(cov @ _observability(projected)) / total)


# --------------------------------------------------------------------------- #
# Hooks: shared by collection and validation (and by fourier.py)
# --------------------------------------------------------------------------- #
def check_hook_name(model, hook_name: str) -> None:
    """Raise ValueError unless `hook_name` is a hook of `model` (aliases included for bridges)."""
    if not isinstance(hook_name, str):
        raise ValueError(f"hook_name must be a string; got {type(hook_name).__name__}")
    if hasattr(model, "get_hook_point"):  # TransformerBridge resolves TransformerLens aliases here
        found = model.get_hook_point(hook_name) is not None
    else:
        found = hook_name in getattr(model, "hook_dict", {})
    if not found:
        known = list(getattr(model, "hook_dict", {}))
        sample = ", ".join(known[:8]) + (", ..." if len(known) > 8 else "")
        raise ValueError(f"hook_name={hook_name!r} is not a hook of this model; allowed: its hook names "
                         f"(e.g. {sample})")
    if hook_name.rsplit(".", 1)[-1] in _NOT_POSITION_MAJOR:
        raise ValueError(f"hook_name={hook_name!r} is not allowed: its activation is [batch, head, query, key], "
                         f"not [batch, pos, ...]; use hook_z, hook_q/k/v or a residual/MLP hook")


def _check_position(position: Position, n_pos: int) -> None:
    ok = position == "all" or (isinstance(position, int) and -n_pos <= position < n_pos)
    if not ok:
        raise ValueError(f"position={position!r} is not allowed; expected 'all' or an integer in "
                         f"[{-n_pos}, {n_pos - 1}] (sequence length {n_pos})")


def _check_tokens(tokens) -> torch.Tensor:
    tokens = torch.as_tensor(tokens)
    if tokens.ndim != 2 or tokens.dtype in (torch.float16, torch.float32, torch.float64):
        raise ValueError(f"tokens must be an integer tensor [batch, pos]; got {tokens.dtype} {tuple(tokens.shape)}")
    return tokens


def _model_device(model) -> torch.device:
    param = next(iter(model.parameters()), None)
    return param.device if param is not None else torch.device("cpu")


def _logits_of(output) -> torch.Tensor:
    """Model output -> logits tensor (HF-style outputs carry `.logits`)."""
    return output if isinstance(output, torch.Tensor) else output.logits


@contextlib.contextmanager
def _eval_mode(model) -> Iterator[None]:
    """Run in eval mode (no dropout) and restore the caller's mode afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _check_layout(act: torch.Tensor, tokens: torch.Tensor, hook_name: str) -> None:
    if act.ndim < 3 or tuple(act.shape[:2]) != tuple(tokens.shape):
        raise ValueError(f"hook_name={hook_name!r} gives an activation of shape {tuple(act.shape)}; "
                         f"expected [batch, pos, ...] = [{tokens.shape[0]}, {tokens.shape[1]}, ...]")


def collect_activations(model, tokens, hook_name: str, position: Position = -1,
                        batch_size: int = 512) -> torch.Tensor:
    """Activations at `hook_name`: [N, D] at one position, [N, pos, D] for position='all'.

    Trailing dimensions (e.g. heads x d_head of hook_z) are flattened into D.
    """
    tokens = _check_tokens(tokens)
    check_hook_name(model, hook_name)
    _check_position(position, tokens.shape[1])
    chunks = []

    def capture(act, hook):
        _check_layout(act, batch, hook_name)
        flat = act.detach().reshape(*act.shape[:2], -1)
        chunks.append((flat if position == "all" else flat[:, position]).float().cpu())

    device = _model_device(model)
    with torch.no_grad(), _eval_mode(model):
        for start in range(0, tokens.shape[0], batch_size):
            batch = tokens[start:start + batch_size]
            model.run_with_hooks(batch.to(device), fwd_hooks=[(hook_name, capture)])
    return torch.cat(chunks)


@dataclass(frozen=True)
class AceInputs:
    """What `extract_core` needs, collected from a model.

    activations: [M, D]; jacobians: [M, n_out, D]. For position='all', M = n_sequences * n_positions
    ordered sequence-major, so `activations.reshape(n_sequences, n_positions, D)` recovers sequences.
    """

    activations: torch.Tensor
    jacobians: torch.Tensor
    n_sequences: int
    n_positions: int


def _jacobian_rows(out: torch.Tensor, leaves: Sequence[torch.Tensor], pos: int) -> list[torch.Tensor]:
    """d out[b, o] / d leaf[b, pos] for all b, o, for each leaf -> [B, n_out, D] per leaf.

    Samples in a batch do not interact, so the gradient of sum_b out[b, o] w.r.t. leaf[b]
    is sample b's Jacobian row o. With several outputs, the n_out backward passes run as one
    vmapped backward (is_grads_batched); a plain loop is the fallback for ops without
    batching rules. One backward pass serves every leaf at once.
    """
    n_out = out.shape[1]

    def backward(grad_out, batched):
        return torch.autograd.grad(out, leaves, grad_outputs=grad_out, retain_graph=True, is_grads_batched=batched,
                                   allow_unused=True, materialize_grads=True)

    basis = torch.eye(n_out, dtype=out.dtype, device=out.device)[:, None, :].expand(n_out, *out.shape)
    try:
        grads = backward(basis, True) if n_out > 1 else [g[None] for g in backward(basis[0], False)]
    except (RuntimeError, NotImplementedError):
        per_output = [backward(basis[o], False) for o in range(n_out)]
        grads = [torch.stack([g[i] for g in per_output]) for i in range(len(leaves))]
    return [g[:, :, pos].reshape(n_out, out.shape[0], -1).transpose(0, 1) for g in grads]


def collect_ace_inputs(model, tokens, hook_name: str, output_fn: OutputFn | None = None,
                       position: Position = -1, batch_size: int = 64) -> AceInputs:
    """Run `model` on `tokens`, capture the activation h at `hook_name` and the Jacobian of the
    task outputs w.r.t. h.

    output_fn(logits [B, vocab]) -> [B, n_out] (or [B] for one output) maps the logits *at the
    same position as the activation* to the task-relevant outputs (default: all logits), e.g.
    `lambda z: z[:, :59]` or the logit difference `lambda z: z[:, is_id] - z[:, are_id]`.
    The Jacobian is exact autograd.
    For position='all' each position is its own sample and its Jacobian is the same-position
    block d out[t] / d h[t] (other positions' activations held fixed; the cross-position
    terms d out[t'] / d h[t], t' > t, are not part of it).
    Cost per batch: one forward and, per position, one vmapped backward over n_out outputs;
    lower batch_size if n_out * batch * pos * D floats do not fit in memory.
    """
    return collect_ace_inputs_many(model, tokens, [hook_name], output_fn, position, batch_size)[hook_name]


def collect_ace_inputs_many(model, tokens, hook_names: Sequence[str], output_fn: OutputFn | None = None,
                            position: Position = -1, batch_size: int = 64) -> dict[str, AceInputs]:
    """`collect_ace_inputs` at several hooks (e.g. every layer's residual stream) in one pass per batch.

    One forward pass keeps the activation of every hook in the autograd graph, and each backward
    pass gives d out / d h at every hook at once (each Jacobian is the total derivative through
    everything downstream of that hook, exactly as for one hook). For a large model this is
    n_hooks times cheaper than calling `collect_ace_inputs` per hook.
    """
    tokens = _check_tokens(tokens)
    hook_names = list(hook_names)
    if not hook_names or len(set(hook_names)) != len(hook_names):
        raise ValueError(f"hook_names must be a non-empty list without repeats; got {hook_names!r}")
    for name in hook_names:
        check_hook_name(model, name)
    _check_position(position, tokens.shape[1])
    output_fn = output_fn or (lambda logits: logits)
    positions = range(tokens.shape[1]) if position == "all" else [position]
    acts = {name: [] for name in hook_names}
    jacs = {name: [] for name in hook_names}
    device = _model_device(model)
    with _eval_mode(model), torch.enable_grad():
        for start in range(0, tokens.shape[0], batch_size):
            batch = tokens[start:start + batch_size].to(device)
            captured: dict[str, torch.Tensor] = {}  # the zero each Jacobian is taken against
            values: dict[str, torch.Tensor] = {}  # the activations themselves

            def capture(name):  # by the requested name: a bridge's hook may carry another (aliased) name
                def hook_fn(act, hook):
                    _check_layout(act, batch, name)
                    if name in captured:
                        raise ValueError(f"hook_name={name!r} fired twice in one forward pass; expected once")
                    # Differentiate w.r.t. a zero added to the hook's output: that counts only the paths
                    # through what the hook returns (a bridge may use its input elsewhere too), and keeps
                    # the graph whole, so an earlier hook's Jacobian still flows through later ones.
                    values[name] = act.detach()
                    captured[name] = torch.zeros_like(act, requires_grad=True)
                    return act + captured[name]
                return hook_fn

            logits = _logits_of(model.run_with_hooks(batch, fwd_hooks=[(n, capture(n)) for n in hook_names]))
            missing = [n for n in hook_names if n not in captured]
            if missing:
                raise ValueError(f"hook_name(s) {missing} did not fire in the forward pass")
            leaves = [captured[n] for n in hook_names]
            per_pos = []  # [positions][hooks] of [B, n_out, D]
            for pos in positions:
                out = output_fn(logits[:, pos])
                out = out[:, None] if out.ndim == 1 else out  # one scalar output, e.g. a logit difference
                if out.ndim != 2 or out.shape[0] != batch.shape[0]:
                    raise ValueError(f"output_fn must return [batch, n_out] = [{batch.shape[0]}, n_out]; "
                                     f"got shape {tuple(out.shape)}")
                per_pos.append([rows.detach() for rows in _jacobian_rows(out, leaves, pos)])
            for i, name in enumerate(hook_names):
                flat = values[name].reshape(*batch.shape, -1)
                # stack positions on axis 1 so the result is sequence-major
                acts[name].append(flat[:, list(positions)].reshape(-1, flat.shape[-1]).float().cpu())
                rows = torch.stack([p[i] for p in per_pos], 1)
                jacs[name].append(rows.reshape(-1, *rows.shape[2:]).float().cpu())
    return {name: AceInputs(activations=torch.cat(acts[name]), jacobians=torch.cat(jacs[name]),
                            n_sequences=tokens.shape[0], n_positions=len(positions)) for name in hook_names}


# --------------------------------------------------------------------------- #
# Validation: keep / remove / flip
# --------------------------------------------------------------------------- #
def apply_intervention(h: torch.Tensor, Q: torch.Tensor, mu: torch.Tensor | None, mode: str) -> torch.Tensor:
    """Intervene on activations h [..., D] with the core basis Q [D, k] around origin mu [D].

    With x = h - mu (mu = None means the origin 0, the paper's literal keep/remove):
      keep:   h <- mu + Q Q^T x       (the non-core part is replaced by its mean)
      remove: h <- h - Q Q^T x        (the core part is replaced by its mean)
      flip:   h <- h - 2 Q Q^T x      (x <- x - 2 Q Q^T x, the core part is mirrored)
    """
    if mode not in INTERVENTIONS:
        raise ValueError(f"mode={mode!r} is not allowed; expected one of {INTERVENTIONS}")
    origin = torch.zeros_like(h[..., 0, None]) if mu is None else mu
    core_part = ((h - origin) @ Q) @ Q.T
    if mode == "keep":
        return origin + core_part
    if mode == "remove":
        return h - core_part
    return h - 2 * core_part


def intervention_hook(Q: torch.Tensor, mu: torch.Tensor | None, mode: str, position: Position = -1):
    """A TransformerLens hook fn applying `apply_intervention` at one position or all positions."""
    if mode not in INTERVENTIONS:
        raise ValueError(f"mode={mode!r} is not allowed; expected one of {INTERVENTIONS}")

    def hook_fn(act, hook):
        flat = act.reshape(*act.shape[:2], -1)
        basis = Q.to(device=act.device, dtype=act.dtype)
        origin = None if mu is None else mu.to(device=act.device, dtype=act.dtype)
        if position == "all":
            new = apply_intervention(flat, basis, origin, mode)
        else:
            new = flat.clone()
            new[:, position] = apply_intervention(flat[:, position], basis, origin, mode)
        return new.reshape(act.shape)

    return hook_fn


def accuracy_metric(position: Position = -1) -> Metric:
    """metric(logits [B, pos, V], labels) = fraction of argmax hits; labels [B] at one
    position, [B, pos] for position='all'."""

    def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
        chosen = logits if position == "all" else logits[:, position]
        return (chosen.argmax(-1) == labels.to(chosen.device)).float().mean().item()

    return accuracy


def evaluate(model, tokens, labels, metric: Metric, fwd_hooks: Sequence = (), batch_size: int = 512) -> float:
    """Batch-size-weighted mean of metric(logits, labels) over batches (metric must be a per-sample mean)."""
    tokens = _check_tokens(tokens)
    labels = torch.as_tensor(labels)
    device = _model_device(model)
    total = 0.0
    with torch.no_grad(), _eval_mode(model):
        for start in range(0, tokens.shape[0], batch_size):
            batch = tokens[start:start + batch_size].to(device)
            logits = _logits_of(model.run_with_hooks(batch, fwd_hooks=list(fwd_hooks)))
            total += metric(logits, labels[start:start + batch_size]) * batch.shape[0]
    return total / tokens.shape[0]


@dataclass(frozen=True)
class CoreDefinition:
    """What "the core", "sufficient" and "necessary" mean: the paper's choices or the book's.

    energy_threshold:  the ACE rank is the smallest r whose cumulative sigma^2 share reaches it.
    outputs:           the task outputs whose Jacobian ACE takes: "raw" logits, or "centred" logits
                       (minus their mean, which drops the direction that shifts every logit alike).
    centered:          keep / remove about the mean mu (mean ablations) or about the origin 0
                       (h <- Q Q^T h and h <- h - Q Q^T h); flip is always about mu.
    sufficient_tol:    sufficient dimension = smallest k whose keep score >= clean - sufficient_tol.
    necessary_factor, necessary_tol: necessary dimension = smallest k whose remove score
                       <= necessary_factor * chance + necessary_tol ...
    necessary_at_least_rank: ... reported as max(energy rank, k) when True.
    """

    name: str
    energy_threshold: float
    outputs: str
    centered: bool
    sufficient_tol: float
    necessary_factor: float
    necessary_tol: float
    necessary_at_least_rank: bool

    def __post_init__(self):
        _check_threshold(self.energy_threshold)
        if self.outputs not in OUTPUTS:
            raise ValueError(f"CoreDefinition.outputs={self.outputs!r} is not allowed; expected one of {OUTPUTS}")
        for name in ("sufficient_tol", "necessary_factor", "necessary_tol"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"CoreDefinition.{name}={getattr(self, name)!r} is not allowed; expected >= 0")

    def necessary_level(self, chance: float) -> float:
        """The remove score at or below which the removed directions count as necessary."""
        return self.necessary_factor * chance + self.necessary_tol


OUTPUTS = ("raw", "centred")
# The paper's (PAPERS.md, Markov experiment): threshold 0.999, J of the raw logits, uncentred keep/remove,
# sufficient within 1e-3 of clean, necessary at <= 2/p (twice chance), reported as max(energy rank, r).
PAPER = CoreDefinition("paper", energy_threshold=0.999, outputs="raw", centered=False, sufficient_tol=1e-3,
                       necessary_factor=2.0, necessary_tol=0.0, necessary_at_least_rank=True)
# The book's first choices, kept as a named alternative: threshold 0.99, centred logits, mean ablations,
# sufficient within 0.02 of clean, necessary within 0.05 of chance.
BOOK = CoreDefinition("book", energy_threshold=0.99, outputs="centred", centered=True, sufficient_tol=0.02,
                      necessary_factor=1.0, necessary_tol=0.05, necessary_at_least_rank=False)
DEFINITIONS = {d.name: d for d in (PAPER, BOOK)}


@dataclass(frozen=True)
class CoreValidation:
    """Scores of keep / remove / flip with the first k core directions, for each k in ks.

    sufficient_dim: smallest k with keep[k] >= clean - definition.sufficient_tol (None if no k qualifies).
    necessary_dim:  smallest k with remove[k] <= necessary_level (None if no k qualifies), raised to
                    the energy rank when the definition says so and the rank was given.
    """

    ks: list[int]
    clean: float
    keep: list[float]
    remove: list[float]
    flip: list[float]
    chance: float
    sufficient_dim: int | None
    necessary_dim: int | None
    centered: bool
    definition: str = BOOK.name
    necessary_level: float = float("nan")


def sufficient_dimension(ks: Sequence[int], keep: Sequence[float], clean: float, tol: float) -> int | None:
    """Smallest k whose keep score is within `tol` of the clean score (None if none)."""
    return next((k for k, score in zip(ks, keep) if score >= clean - tol), None)


def necessary_dimension(ks: Sequence[int], remove: Sequence[float], level: float,
                        at_least: int | None = None) -> int | None:
    """Smallest k whose remove score is at most `level` (None if none); max(at_least, k) if given."""
    k = next((k for k, score in zip(ks, remove) if score <= level), None)
    return k if k is None or at_least is None else max(int(at_least), k)


def core_validation(ks: Sequence[int], clean: float, scores: dict, chance: float, definition: CoreDefinition,
                    energy_rank: int | None = None) -> CoreValidation:
    """A CoreValidation from keep / remove / flip scores per k, judged by `definition`.

    A mode that was not scored holds NaNs; its dimension is then None.
    """
    nan_mode = {m: all(math.isnan(v) for v in scores[m]) for m in INTERVENTIONS}
    level = definition.necessary_level(chance)
    at_least = energy_rank if definition.necessary_at_least_rank else None
    return CoreValidation(
        ks=list(ks), clean=clean, keep=list(scores["keep"]), remove=list(scores["remove"]), flip=list(scores["flip"]),
        chance=chance, centered=definition.centered, definition=definition.name, necessary_level=level,
        sufficient_dim=None if nan_mode["keep"] else sufficient_dimension(ks, scores["keep"], clean,
                                                                            definition.sufficient_tol),
        necessary_dim=None if nan_mode["remove"] else necessary_dimension(ks, scores["remove"], level, at_least))


def validate_core(model, tokens, labels, hook_name: str, core: AceCore, *, chance: float,
                  position: Position = -1, metric: Metric | None = None, ks: Sequence[int] | None = None,
                  definition: CoreDefinition = BOOK, energy_rank: int | None = None,
                  batch_size: int = 512) -> CoreValidation:
    """Causal test of a core at `hook_name`: keep / remove / flip with Q[:, :k] for each k in ks.

    Interventions act at `position` (an int, or 'all'); `metric(logits [B, pos, V], labels)`
    defaults to argmax accuracy at the same position. `chance` is the score of a model
    that ignores its input (e.g. 1 / n_classes, or the majority-class rate).
    `definition` says whether keep / remove act about the mean (mean ablations, `BOOK`) or about
    the origin (the paper's literal keep h <- Q Q^T h and remove h <- h - Q Q^T h, `PAPER`; flip
    is always about mu), and how the sufficient and necessary dimensions are read off;
    energy_rank is the core's energy rank, for definitions that report max(energy rank, k).
    """
    check_hook_name(model, hook_name)
    ks = list(range(1, core.rank + 1)) if ks is None else list(ks)
    if not ks or any(not (isinstance(k, int) and 1 <= k <= core.rank) for k in ks):
        raise ValueError(f"ks={ks!r} is not allowed; expected integers in [1, rank={core.rank}]")
    if not isinstance(definition, CoreDefinition):
        raise ValueError(f"definition={definition!r} is not allowed; expected a CoreDefinition, e.g. ace.PAPER "
                         f"or ace.BOOK")
    metric = metric or accuracy_metric(position)
    Q, mu = core.Q, core.mu  # the hook casts them to the activation's dtype and device

    def score(mode: str, k: int) -> float:
        origin = mu if (definition.centered or mode == "flip") else None
        hook = intervention_hook(Q[:, :k], origin, mode, position)
        return evaluate(model, tokens, labels, metric, [(hook_name, hook)], batch_size)

    clean = evaluate(model, tokens, labels, metric, (), batch_size)
    scores = {mode: [score(mode, k) for k in ks] for mode in INTERVENTIONS}
    return core_validation(ks, clean, scores, chance, definition, energy_rank)


# --------------------------------------------------------------------------- #
# Identification: linear dynamics in the core
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class CoreOperator:
    """z_{t+1} ~ A z_t (+ b). eigenvalues sorted by modulus, descending; r2 is the fit's R^2."""

    A: torch.Tensor
    b: torch.Tensor | None
    eigenvalues: torch.Tensor
    r2: float


def _sequence_pairs(sequences) -> tuple[torch.Tensor, torch.Tensor]:
    """(z_t, z_{t+1}) pairs pooled over sequences given as [S, T, r] or a list of [T_i, r]."""
    if isinstance(sequences, (list, tuple)):
        seqs = [_as_float64(s, "sequences") for s in sequences]
    else:
        arr = _as_float64(sequences, "sequences")
        seqs = list(arr) if arr.ndim == 3 else [arr]
    if not seqs or any(s.ndim != 2 or s.shape[1] != seqs[0].shape[1] for s in seqs):
        raise ValueError("sequences must be [S, T, r], [T, r] or a list of [T_i, r] with one r")
    prev = torch.cat([s[:-1] for s in seqs])
    nxt = torch.cat([s[1:] for s in seqs])
    return prev, nxt


def fit_core_operator(sequences, intercept: bool = False) -> CoreOperator:
    """Least-squares fit of z_{t+1} = A z_t (+ b if intercept) from sequences of core coordinates."""
    prev, nxt = _sequence_pairs(sequences)
    r = prev.shape[1]
    if prev.shape[0] < r + int(intercept):
        raise ValueError(f"sequences give {prev.shape[0]} transitions; need at least {r + int(intercept)} "
                         f"to fit a {r}x{r} operator")
    design = torch.cat([prev, torch.ones(len(prev), 1, dtype=prev.dtype)], 1) if intercept else prev
    coef = torch.linalg.lstsq(design, nxt).solution  # nxt ~ design @ coef
    A = coef[:r].T
    residual = nxt - design @ coef
    r2 = 1 - residual.pow(2).sum() / (nxt - nxt.mean(0)).pow(2).sum()
    eig = torch.linalg.eigvals(A)
    eig = eig[torch.argsort(eig.abs(), descending=True, stable=True)]
    return CoreOperator(A=A, b=coef[r] if intercept else None, eigenvalues=eig, r2=float(r2))


# --------------------------------------------------------------------------- reading dimensions and operators
def dim_value(dim: int | None) -> float:
    """A sufficient or necessary dimension as a number: inf when no k qualified (no core that small
    or that large does the job), never NaN (NaN would read as "not measured")."""
    return math.inf if dim is None else float(dim)


def unit_circle_deviation(eigenvalues) -> float:
    """mean_i | |lambda_i| - 1 |: 0 when every eigenvalue lies on the unit circle."""
    eig = torch.as_tensor(eigenvalues)
    return float((eig.abs() - 1).abs().mean())


def unit_circle_share(eigenvalues, tol: float) -> float:
    """The share of eigenvalues within `tol` of the unit circle, | |lambda| - 1 | <= tol."""
    eig = torch.as_tensor(eigenvalues)
    return float(((eig.abs() - 1).abs() <= tol).double().mean()) if eig.numel() else float("nan")


def unit_circle_tolerance(p: int) -> float:
    """sin(pi / p): the paper's tolerance for an eigenvalue on the unit circle (half the chord between
    neighbouring p-th roots of unity)."""
    return math.sin(math.pi / p)


def class_mean_operator(core: AceCore, activations: torch.Tensor, labels: torch.Tensor, p: int
                        ) -> CoreOperator:
    """The paper's AC-6 operator: the shift c -> c + 1 of the per-answer mean core coordinates.

    m_c = mean of the core coordinates over the inputs with answer c; A is the least-squares fit of
    m_{c+1} = A m_c around the cycle c = 0, 1, ..., p - 1, 0 (no intercept: with every answer equally
    often, the means average to the core's origin). At most p - 1 core directions are used, so that the
    p transitions determine A.
    """
    z = core.coordinates(activations)[:, :max(1, min(core.rank, p - 1))]
    y = torch.as_tensor(labels).long()
    if y.shape[0] != z.shape[0] or y.min() < 0 or y.max() >= p or len(torch.unique(y)) != p:
        raise ValueError(f"labels must give every answer 0..{p - 1} for the {z.shape[0]} activations")
    means = torch.stack([z[y == c].mean(0) for c in range(p)])
    return fit_core_operator(torch.cat([means, means[:1]]), intercept=False)
