"""Training: one loop for every chapter, with an ensemble axis (see `runner.train`).

    config     TrainConfig                                   (in every run key)
    ensemble   Ensemble, Optimizer, train_step, data_sampler  (in every run key)
    loop       Trainer: checkpoints, exact resumption        (in every run key)
    evaluate   Evaluator, pool_accuracy, tensor_digest       (in the key of the runs it evaluates)
    run        Run, ComposedRun, ReleasedRun: the read side (one run-like protocol)
    chunks     parts of members, calibration, publishing, the part scheduler
    planning   PlannedRun, planning(), step_flops
    runner     train(): find the run in the store or train it
"""
from .chunks import RunSpec, best_chunk, calibrate, choose_chunk, chunk_candidates, events, split_members
from .config import LOSSES, OPTIMIZERS, PRECISIONS, TrainConfig
from .device import default_device, device_name
from .ensemble import (Ensemble, Optimizer, accumulate_gradients, data_sampler, per_member_loss, scored_labels,
                       summed_loss, train_step)
from .evaluate import EvalFn, Evaluator, pool_accuracy, tensor_digest
from .planning import PlannedRun, count_parameters, step_flops
from .run import ComposedRun, ReleasedRun, Run, checkpoint_rel
from .runner import fingerprint, train

__all__ = ["RunSpec", "best_chunk", "calibrate", "choose_chunk", "chunk_candidates", "events", "split_members",
           "LOSSES", "OPTIMIZERS", "PRECISIONS", "TrainConfig", "default_device", "device_name", "Ensemble",
           "Optimizer", "accumulate_gradients", "data_sampler", "per_member_loss", "scored_labels", "summed_loss",
           "train_step", "EvalFn", "Evaluator", "pool_accuracy", "tensor_digest", "PlannedRun", "count_parameters",
           "step_flops", "ComposedRun", "ReleasedRun", "Run", "checkpoint_rel", "fingerprint", "train"]
