"""The chapter's evaluation: its task family (`recall_task`, `two_hop_task`) and the pools read on it
(`recall_pools`), the evaluation callbacks of its runs (`training.Evaluator` subclasses: pools in,
per-member `acc_<pool>` / `loss_<pool>` out, the chapter's own measures in `measures`), and the
held-out scorer of flat IMIR coordinates that Algorithm 1 (IM-6) removes coordinates against.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from ...analysis import imir
from ...models.imir import IMIRConfig, IMIRModel
from ...tasks.base import Batch
from ...tasks.blocklist import BlockListTask
from ...training import Evaluator, default_device

# The probes compute through the IMIR basis and coordinates of analysis/imir.py (distance to S, directions):
# that file is part of what every run they evaluate computes, so it enters those runs' keys with this one.
RUN_KEY_SOURCES = ("analysis/imir.py",)


def recall_task(n_pairs: int, n_blocks: int, f_v: float, f_r: float = 0.0, n_rare: int = 0, burstiness: int = 1,
                bos: bool = True) -> BlockListTask:
    return BlockListTask("recall", n_pairs=n_pairs, n_rare=n_rare, n_blocks=n_blocks, f_r=f_r, f_v=f_v,
                         burstiness=burstiness, bos=bos)


def two_hop_task(n_pairs: int, n_blocks: int) -> BlockListTask:
    return BlockListTask("khop", hops=2, n_pairs=n_pairs, n_blocks=n_blocks, f_v=1.0, bos=True)


def recall_pools(task: BlockListTask, n: int, seed: int = 12345) -> dict[str, Batch]:
    """Evaluation pools of the task's layout: 'icl' (non-canonical or rare queries: only the context
    answers), 'iw' (canonical common queries: the association answers) and 'task' (the task itself)."""
    icl = task.with_knobs(f_v=1.0, f_r=0.0)
    iw = task.with_knobs(f_v=0.0, f_r=0.0)
    return {"icl": icl.batch(icl.sample(n, seed)), "iw": iw.batch(iw.sample(n, seed + 1)),
            "task": task.batch(task.sample(n, seed + 2))}


def member_weights(ens, basis: imir.IMIRBasis, k: int) -> dict[str, torch.Tensor]:
    """(W_QK per layer, W_U) of ensemble member k, for a ToyTransformer or an IMIRModel ensemble."""
    if "phi" in ens.params:
        D = ens.buffers["directions"][k].detach().double().cpu()
        phi = ens.params["phi"][k].detach().double().cpu()
        theta = D * phi if D.dim() == 1 else D @ phi
        return basis.weights(theta)
    names = [f"blocks.{l}.attn.W_QK" for l in range(basis.n_layers)] + ["unembed.W_U"]
    return {n: ens.params[n][k].detach().double().cpu() for n in names}


class DistanceProbe(Evaluator):
    """Each member's relative distance of (W_QK, W_U) to S (`distance_to_s`), and its accuracy and loss
    on a pool (`acc_pool`, `loss_pool`; none without a pool)."""

    def __init__(self, basis: imir.IMIRBasis, pool: Batch | None = None):
        super().__init__({} if pool is None else {"pool": pool}, loss=True)
        self.basis = basis

    def settings(self) -> dict:
        return {"layout": imir.asdict(self.basis.layout), "layers": self.basis.n_layers}

    def measures(self, ens, step: int) -> dict:
        return {"distance_to_s": torch.tensor([
            imir.distance_to_s(self.basis, {n: p[k].detach().cpu() for n, p in ens.params.items()})
            for k in range(ens.n_members)])}


class Probe(Evaluator):
    """Accuracy on pools (and the loss on a 'task' pool, with every pool's when there is one), and the
    values of named unit directions, for ToyTransformer or IMIRModel ensembles alike."""

    def __init__(self, basis: imir.IMIRBasis, directions: Mapping[str, Mapping[str, float]],
                 pools: Mapping[str, Batch]):
        super().__init__(pools, loss="task" in pools)
        self.basis = basis
        self.directions = {k: dict(v) for k, v in directions.items()}
        self._units: dict | None = None  # built at the first evaluation (costly for a large basis; planning needs none)

    def settings(self) -> dict:
        return {"layout": imir.asdict(self.basis.layout), "layers": self.basis.n_layers,
                "directions": self.directions}

    def units(self) -> dict[str, dict[str, torch.Tensor]]:
        """Each named direction as weights (W_QK per layer, W_U) of unit Frobenius norm."""
        if self._units is None:
            self._units = {}
            for name, d in self.directions.items():
                W = self.basis.weights(self.basis.direction_weights(d))
                norm = math.sqrt(sum(w.pow(2).sum().item() for w in W.values()))
                self._units[name] = {n: w / norm for n, w in W.items()}
        return self._units

    def measures(self, ens, step: int) -> dict:
        units = self.units()
        values = {name: [] for name in units}
        for k in range(ens.n_members):
            W = member_weights(ens, self.basis, k)
            for name, unit in units.items():
                values[name].append(sum((W[n] * u).sum() for n, u in unit.items()).item())
        return {name: torch.tensor(v) for name, v in values.items()}


class ProgressProbe(Evaluator):
    """Pool accuracy and alpha~, beta~, gamma~ (`imir.progress_measures`) of each member of a standard
    2-layer ToyTransformer ensemble."""

    def __init__(self, pools: Mapping[str, Batch], token_ids: Sequence[int]):
        super().__init__(pools)
        self.token_ids = list(token_ids)

    def settings(self) -> dict:
        return {"token_ids": self.token_ids}

    def measures(self, ens, step: int) -> dict:
        vals = [imir.progress_measures(ens.member(k), self.token_ids) for k in range(ens.n_members)]
        return {f"{key}_tilde": torch.tensor([v[key] for v in vals]) for key in ("alpha", "beta", "gamma")}


class CircuitProbe(Evaluator):
    """For an ensemble of restricted IMIRModels: accuracy on a pool of the whole model (`acc_icl`) and of
    each circuit alone (`solo_<circuit>`: every direction outside it set to zero), per member."""

    def __init__(self, pool: Batch, circuits: Mapping[str, Sequence[str]]):
        super().__init__({"icl": pool})
        self.circuits = {k: tuple(v) for k, v in circuits.items()}
        self._solo = {c: Evaluator({c: pool}) for c in self.circuits}
        for ev in self._solo.values():
            ev.prefix = "solo_"

    def settings(self) -> dict:
        return {"circuits": self.circuits}

    def measures(self, ens, step: int) -> dict:
        names = ens.member(0).direction_names
        phi = ens.params["phi"]
        out = {}
        try:  # every member at once: the ensemble's phi is swapped for a masked copy, then restored
            for c, dirs in self.circuits.items():
                mask = torch.tensor([n in dirs for n in names], dtype=phi.dtype, device=phi.device)
                ens.params["phi"] = phi.detach() * mask
                out.update(self._solo[c](ens, step))
        finally:
            ens.params["phi"] = phi
        return out


class CoordinateEvaluator:
    """Held-out loss and accuracy of the theory's model at given flat IMIR coordinates (float64): one
    model, not an ensemble (Algorithm 1 scores each candidate removal with it)."""

    def __init__(self, layout: imir.Layout, n_layers: int, pool: Batch, device: str | torch.device | None = None):
        cfg = IMIRConfig(layout.token_classes, layout.association, layout.seq_len, n_layers=n_layers)
        self.device = torch.device(device) if device is not None else default_device()
        self.model = cfg.build(seed=None).double().to(self.device)
        self.scale = 1.0 / self.model.directions.double()  # phi = theta * ||basis element||
        self.pool = Batch(pool.tokens.to(self.device), pool.labels.to(self.device))

    @torch.no_grad()
    def __call__(self, theta: torch.Tensor) -> tuple[float, float]:
        self.model.phi.copy_(theta.double().to(self.device) * self.scale)
        logits = self.model(self.pool.tokens, last_only=True)[:, -1]
        logp = logits.log_softmax(-1)
        loss = float(-logp.gather(-1, self.pool.labels[:, None]).mean())
        acc = float((logits.argmax(-1) == self.pool.labels).double().mean())
        return loss, acc

    def gradient(self, theta: torch.Tensor) -> torch.Tensor:
        """d loss / d theta at theta (for ranking removals to first order)."""
        th = theta.double().to(self.device).clone().requires_grad_(True)
        with torch.enable_grad():
            logits = _forward_with_phi(self.model, th * self.scale, self.pool.tokens)
            loss = -logits.log_softmax(-1).gather(-1, self.pool.labels[:, None]).mean()
            (g,) = torch.autograd.grad(loss, th)
        return g.detach().cpu()


def _forward_with_phi(model: IMIRModel, phi: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    from torch.func import functional_call

    params = {"phi": phi}
    buffers = dict(model.named_buffers())
    return functional_call(model, (params, buffers), (tokens,), {"last_only": True})[:, -1]
