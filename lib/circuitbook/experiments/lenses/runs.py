"""Where the lenses chapter's runs come from: other chapters' runs, read through the chapter contract
(`chapters.chapter_runs`, never by importing their packages), and the tasks those runs were trained on,
rebuilt from the other notebook's resolved parameters (`chapters.chapter_params`).

    assign_add_params / assign_add_task / assign_add_run     Assign and Add's main run (assign_add/02_training)
    grokking_params / grokking_task / grokking_run           the grokking run (algorithmic_cores/03_grokking)
    bursty_task / burst_members / bursty_run                 the bursty Assign-and-Add models (notebook 03)
    notebook_runs(cfg)                                       the registry (the notebooks' training cells, --plan)
"""
from __future__ import annotations

import pandas as pd

from ... import chapters
from ...models.toy import ToyConfig
from ...tasks.assign_add import PAIR_SPLITS, SEQ_LEN, AssignAddTask
from ...tasks.assign_add_bursty import BurstyAssignAddTask
from ...tasks.modular import ModularAddition
from ...training import Run, TrainConfig, train
from .evaluate import BURST_SEED_STRIDE, BurstEvaluator, burst_init

ASSIGN_ADD = ("assign_add", "02_training")
GROKKING = ("algorithmic_cores", "03_grokking")


def assign_add_params(cfg):
    """The parameters of assign_add/02_training at this notebook's profile."""
    return chapters.chapter_params(*ASSIGN_ADD, cfg.profile)


def assign_add_task(aa_cfg) -> AssignAddTask:
    """The task Assign and Add's main run trains on, from that notebook's parameters (as its chapter builds
    it: the pair split names the training pairs; a split file defines them by itself)."""
    split = aa_cfg.get("pair_split") or "authors"
    return AssignAddTask(train_fraction=aa_cfg.train_fraction if split in PAIR_SPLITS else None,
                         two_var_ratio=aa_cfg.get("two_var_ratio"), split_seed=aa_cfg.split_seed, pair_split=split)


def assign_add_run(cfg):
    """Assign and Add's main run (an ensemble, one member per seed) at this notebook's profile."""
    return chapters.chapter_runs(*ASSIGN_ADD, cfg.profile)["main"]


def grokking_params(cfg):
    return chapters.chapter_params(*GROKKING, cfg.profile)


def grokking_task(gk_cfg) -> ModularAddition:
    """The grokking run's data: p, the training fraction and the block's input (`a b`, or `a b =`)."""
    return ModularAddition(p=gk_cfg.grok_p, train_fraction=gk_cfg.grok_train_fraction, split_seed=0,
                           equals_token=gk_cfg.grok_block == "book")


def grokking_run(cfg):
    """algorithmic_cores' grokking run (weight decay on, one member per seed) at this notebook's profile."""
    return chapters.chapter_runs(*GROKKING, cfg.profile)["grokking"]


# --- IMIR progress measures (notebook 03)
def bursty_task(aa_cfg, repeats: int) -> BurstyAssignAddTask:
    """Assign and Add with each variable operand's assignment repeated `repeats` times, on the pairs of the
    main run's task (the same split rule as `assign_add_task`)."""
    split = aa_cfg.get("pair_split") or "authors"
    return BurstyAssignAddTask(repeats=int(repeats), train_fraction=aa_cfg.train_fraction if split in PAIR_SPLITS
                               else None, two_var_ratio=aa_cfg.get("two_var_ratio"), split_seed=aa_cfg.split_seed,
                               pair_split=split)


def burst_members(cfg) -> pd.DataFrame:
    """One row per member of the bursty run: member, b, seed, member_seed (= seed * 1000 + index of b)."""
    values = list(cfg.burst_values)
    return pd.DataFrame([{"member": i * len(values) + j, "b": int(b), "seed": int(s),
                          "member_seed": int(s) * BURST_SEED_STRIDE + j}
                         for i, s in enumerate(cfg.burst_seeds) for j, b in enumerate(values)])


def burst_model_config(cfg) -> ToyConfig:
    """Assign and Add's architecture (2 layers, 1 head, no biases, no LayerNorm, no layer-1 MLP, 74 inputs,
    59 outputs) at the notebook's width."""
    return ToyConfig(d_vocab=74, n_ctx=SEQ_LEN, d_model=cfg.burst_d_model, n_layers=2, n_heads=1,
                     d_mlp=cfg.burst_d_mlp, mlp=(False, True), bias=False, d_vocab_out=59)


def bursty_run(cfg) -> Run:
    """The bursty models: one ensemble, a member per (b, seed) (`burst_members`), each on its own
    `bursty_task`, all evaluated on the ordinary task's pools (`BurstEvaluator`)."""
    aa_cfg = assign_add_params(cfg)
    members = burst_members(cfg)
    tasks = [bursty_task(aa_cfg, b) for b in members.b]
    tc = TrainConfig(steps=cfg.burst_steps, batch_size=cfg.burst_batch_size, seeds=tuple(members.member_seed),
                     lr=cfg.burst_lr, weight_decay=cfg.burst_weight_decay, eval_every=cfg.burst_eval_every,
                     checkpoint_every=None, log_checkpoints=4)
    evaluate = BurstEvaluator(assign_add_task(aa_cfg), tasks, cfg.burst_pool_size)
    return train("lenses/bursty", burst_model_config(cfg), tasks, tc, evaluate=evaluate, init_fn=burst_init)


def notebook_runs(cfg) -> dict:
    """Every run the notebook `cfg.notebook` reads or trains, by role (the chapter contract's registry).

    01_ace_assign_add: "assign_add"; 02_fourier_ace: "assign_add" and "grokking"; 03_progress_measures:
    "assign_add" and "bursty" (trained here); 04_leading_terms: "assign_add" and "grokking"; 05_lenses_table reads
    recorded values only.
    """
    if cfg.notebook == "01_ace_assign_add":
        return {"assign_add": assign_add_run(cfg)}
    if cfg.notebook == "02_fourier_ace":
        return {"assign_add": assign_add_run(cfg), "grokking": grokking_run(cfg)}
    if cfg.notebook == "03_progress_measures":
        return {"assign_add": assign_add_run(cfg), "bursty": bursty_run(cfg)}
    if cfg.notebook == "04_leading_terms":
        return {"assign_add": assign_add_run(cfg), "grokking": grokking_run(cfg)}
    return {}
