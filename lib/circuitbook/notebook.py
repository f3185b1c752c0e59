"""What a notebook's setup cell calls: `load_params`, which makes the notebook the current context.

    cfg = cb.load_params("assign_add", "02_training", profile, **params)

checks the settings and the parameters before any compute, opens the results context that
`cb.record()` writes into (and, in a notebook the build executes, its log file), sets the torch
threads the notebook asks for (`torch_threads`), the book's figure style, and - in a notebook a Ray
build executes - the scheduler that sends the parts of split runs to the cluster.
"""
from __future__ import annotations

from . import context, params, settings
from .params import Params


def load_params(chapter: str, notebook: str, profile: str, **overrides) -> Params:
    """Resolve and validate a notebook's parameters and make it the current context."""
    import torch

    from . import plotting

    settings.check_environment()  # a kernel started by plain papermill checks them here
    cfg = params.resolve(chapter, notebook, profile, overrides)
    context.begin(cfg)
    if cfg.get("torch_threads"):
        torch.set_num_threads(int(cfg["torch_threads"]))
    plotting.use_style()
    if settings.ray_build():
        from . import cluster

        cluster.install_part_scheduler()
    return cfg
