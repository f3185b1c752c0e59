"""How the loop takes a training step: eagerly, or replayed from one captured CUDA graph.

On a GPU the book's models are small: a training step is a few hundred kernel launches of a few microseconds
each, so the eager step is bound by launching them (9-12 ms on an H200 whatever the model and ensemble size,
measured on the first GPU visit). `GraphStep` records the whole step once, the batch (made on the device by
the task's sampler, from a step counter that lives on the device), the forward and backward passes and the
optimizer's update (its step count on the device too), and replays it with one launch per step.

The replayed step does what the eager step does, in the same order with the same kernels: the batch is the
same pure function of (member, step), dropout draws from the same generator (PyTorch advances a captured
graph's random offsets as the eager kernels would), Adam's corrections are computed from the same device
counter. tests/test_cuda.py checks N replayed steps against N eager ones and a killed, resumed captured run
against an uninterrupted one, on the GPU at hand.

Which one runs: eager, except on CUDA with $CIRCUITBOOK_CAPTURE=1, which a GPU visit sets only after the
CUDA tests of the captured step passed on that machine (`circuitbook.visit`); the run's log line says which.
A captured step is never part of a run's key (like the device and the chunking): the numbers are the
eager step's, to float rounding.
"""
from __future__ import annotations

import os
from typing import Callable

import torch

from .config import TrainConfig
from .ensemble import Ensemble, Optimizer, train_step

CAPTURE_ENV = "CIRCUITBOOK_CAPTURE"
WARMUP_STEPS = 3  # eager steps on a side stream before capturing (cuBLAS and the allocator settle); undone after

# sampler(step, batch_size) -> (tokens [K, B, ...], labels [K, B, ...]) on the ensemble's device; `step` is an
# int or a 0-dim int64 tensor on the device (tasks.draws)
Sampler = Callable[[object, int], tuple[torch.Tensor, torch.Tensor]]


def capture_choice(device: torch.device) -> tuple[bool, str]:
    """(capture?, why) for training on `device`."""
    if device.type != "cuda":
        return False, "eager step (no CUDA graphs on a CPU)"
    if os.environ.get(CAPTURE_ENV) != "1":
        return False, (f"eager step (${CAPTURE_ENV} is not 1: a GPU visit sets it once the captured step's CUDA "
                       "tests pass on the machine)")
    return True, "step replayed from one CUDA graph"


class EagerStep:
    """One training step as the loop always took it: the batch of `step`, then `train_step`."""

    def __init__(self, ens: Ensemble, opt: Optimizer, sampler: Sampler, kind: str, tc: TrainConfig):
        self.ens, self.opt, self.sampler, self.kind, self.tc = ens, opt, sampler, kind, tc

    def __call__(self, step: int) -> torch.Tensor:
        tokens, labels = self.sampler(step, self.tc.batch_size)
        return train_step(self.ens, self.opt, tokens, labels, self.kind, self.tc)


class GraphStep(EagerStep):
    """The same step captured once in a CUDA graph and replayed (see the module docstring).

    Capturing needs a few eager steps first (on a side stream); they are undone: the weights, the optimizer's
    state and count, and the generator's state are put back, so the run's first replayed step is the step
    it would have taken eagerly. Calls must come in order (step, step + 1, ...); another step recaptures.
    """

    def __init__(self, ens: Ensemble, opt: Optimizer, sampler: Sampler, kind: str, tc: TrainConfig):
        super().__init__(ens, opt, sampler, kind, tc)
        self.step_t = torch.zeros((), dtype=torch.int64, device=ens.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.losses: torch.Tensor | None = None
        self.next_step: int | None = None

    def _body(self) -> torch.Tensor:
        tokens, labels = self.sampler(self.step_t, self.tc.batch_size)
        losses = train_step(self.ens, self.opt, tokens, labels, self.kind, self.tc, autocast_cache=False)
        self.step_t.add_(1)
        return losses

    def _state(self) -> list[torch.Tensor]:
        return [*self.ens.params.values(), *self.opt.exp_avg.values(), *self.opt.exp_avg_sq.values(), self.opt._t]

    def capture(self, step: int) -> None:
        device = self.ens.device
        saved = [t.detach().clone() for t in self._state()]
        rng = torch.cuda.get_rng_state(device)
        self.step_t.fill_(step)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self._body()
        torch.cuda.current_stream(device).wait_stream(side)
        with torch.no_grad():
            for t, s in zip(self._state(), saved):
                t.copy_(s)
        torch.cuda.set_rng_state(rng, device)
        self.step_t.fill_(step)
        self.opt.zero_grad()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.losses = self._body()
        self.next_step = step

    def __call__(self, step: int) -> torch.Tensor:
        if self.graph is None or step != self.next_step:
            self.capture(step)
        self.graph.replay()
        self.next_step = step + 1
        return self.losses


def step_runner(ens: Ensemble, opt: Optimizer, sampler: Sampler, kind: str, tc: TrainConfig
                ) -> tuple[EagerStep, str]:
    """The step the loop takes on the ensemble's device, and what to say about it in the log."""
    captured, why = capture_choice(ens.device)
    if captured and not getattr(sampler, "capturable", False):
        captured, why = False, "eager step (the task's sampler makes its batches on the CPU: nothing to capture)"
    return (GraphStep if captured else EagerStep)(ens, opt, sampler, kind, tc), why
