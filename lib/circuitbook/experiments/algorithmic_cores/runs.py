"""The chapter's runs: config and task builders (functions of a notebook's resolved Params `cfg`), the run
functions (each takes `cfg` first), and `notebook_runs(cfg)`, every run a notebook trains or reads, by role.

    Markov chains (02)   MARKOV_SETUPS, markov_chain, markov_task, markov_model_config, markov_definition,
                         markov_train_config, markov_evaluator, train_markov(cfg, setup), train_markov_survey
    grokking (03)        MODULAR_BLOCKS, modular_task, modular_model_config, grokking_task,
                         grokking_model_config, grokking_train_config, train_grokking(cfg),
                         choose_fork_step, fork_step, train_wd0_branch(cfg, run, fork_step)
    delay law (04)       sweep_model_config, omega_members, train_omega_sweep(cfg), train_p_sweep(cfg)

Steps and epochs: the training loop counts optimizer steps. With a fixed training set of n examples and
batch B there are ceil(n / B) steps per epoch (`FixedDataset.steps_per_epoch`); a batch >= n is full-batch
training (one step per epoch). `epochs_to_steps` converts.
"""
from __future__ import annotations

from dataclasses import replace

import pandas as pd

from ...analysis import ace
from ...models.toy import ToyConfig
from ...tasks.base import Batch
from ...tasks.markov import MarkovChain, MarkovSequences
from ...tasks.modular import ModularAddition
from ...training import Run, TrainConfig, planning, train
from .evaluate import NextTokenAccuracy, modular_evaluate
from .measure import auto_fork_step, grokking_times, with_threshold


def epochs_to_steps(epochs: int, n_train: int, batch_size: int) -> int:
    """Optimizer steps of `epochs` passes over n_train examples at batch_size (ceil per epoch)."""
    return int(epochs) * max(1, -(-int(n_train) // int(batch_size)))


# --------------------------------------------------------------------------- Markov chains (notebook 02)
# The setups of the Markov experiment: the paper's model and definitions (judged), and two of the book's
# first choices (shown beside them). "paper": PyTorch's default encoder layer (post-LN, dropout in training)
# with PyTorch's default initialisation, ACE on the raw logits at the energy threshold of the notebook (0.999
# in the paper), uncentred keep / remove, the paper's sufficient / necessary dimensions. "normal_init": the
# same layer and definitions with the book's first initialisation (every W_* ~ N(0, 1/d_model), zero biases),
# which changes the readout's common mode. "book": pre-LN with a final LayerNorm, no dropout, the book's
# initialisation, ACE on the centred logits at 0.99, mean ablations, the book's tolerances.
MARKOV_SETUPS = ("paper", "normal_init", "book")
_MARKOV_LAYERS = {"paper": dict(normalization="postLN", init="pytorch"),
                  "normal_init": dict(normalization="postLN", init="normal"),
                  "book": dict(normalization="LN", init="normal")}


def _check_setup(setup: str) -> None:
    if setup not in MARKOV_SETUPS:
        raise ValueError(f"setup={setup!r} is not allowed; expected one of {MARKOV_SETUPS}")


def markov_chain(cfg) -> MarkovChain:
    """The circulant chain of the notebook's Params (every setup's)."""
    return MarkovChain.circulant(cfg.markov_states, cfg.markov_stay)


def markov_task(cfg) -> MarkovSequences:
    """The training sequences and the held-out test sequences (`.test`), shared by every setup."""
    return MarkovSequences(markov_chain(cfg), n_train=cfg.markov_n_train, n_test=cfg.markov_n_test,
                           length=cfg.markov_length, data_seed=0)


def markov_model_config(cfg, setup: str = "paper") -> ToyConfig:
    """One layer; the setup's normalization and initialisation; dropout only in the post-LN setups."""
    _check_setup(setup)
    layer = _MARKOV_LAYERS[setup]
    dropout = cfg.markov_dropout if layer["normalization"] == "postLN" else 0.0
    return ToyConfig(d_vocab=cfg.markov_states, n_ctx=cfg.markov_length - 1, d_model=cfg.markov_d_model,
                     n_layers=1, n_heads=cfg.markov_n_heads, d_mlp=cfg.markov_d_mlp, dropout=dropout, **layer)


def markov_definition(cfg, setup: str = "paper") -> ace.CoreDefinition:
    """The setup's core definition: the book's for "book", else the paper's at the notebook's energy threshold."""
    _check_setup(setup)
    return ace.BOOK if setup == "book" else with_threshold(ace.PAPER, cfg.energy_threshold)


def markov_train_config(cfg) -> TrainConfig:
    """One member per seed, one shared training set, no weight decay."""
    steps = epochs_to_steps(cfg.markov_epochs, cfg.markov_n_train, cfg.markov_batch)
    return TrainConfig(steps=steps, batch_size=cfg.markov_batch, seeds=tuple(cfg.markov_seeds), lr=cfg.markov_lr,
                       weight_decay=0.0, eval_every=max(1, steps // 20), log_checkpoints=8)


def markov_evaluator(cfg, task: MarkovSequences | None = None) -> NextTokenAccuracy:
    """Every-position accuracy on the first `markov_eval_sequences` training and test sequences."""
    task = markov_task(cfg) if task is None else task
    test = task.test
    n_eval = min(len(test.tokens), cfg.markov_eval_sequences)
    return NextTokenAccuracy({"train": Batch(task.tokens[:n_eval], task.labels[:n_eval]),
                              "test": Batch(test.tokens[:n_eval], test.labels[:n_eval])})


def train_markov(cfg, setup: str = "paper") -> Run:
    """Train (or load) one setup's Markov ensemble: one member per seed, one shared training set."""
    _check_setup(setup)
    task = markov_task(cfg)
    name = "algorithmic_cores/markov" if setup == "paper" else f"algorithmic_cores/markov_{setup}"
    return train(name, markov_model_config(cfg, setup), task, markov_train_config(cfg),
                 evaluate=markov_evaluator(cfg, task))


def train_markov_survey(cfg) -> Run:
    """The paper setup at the survey's seeds (`markov_survey_seeds`), one ensemble: how often other seeds agree
    with what the claims judge on the paper's seeds (`measure.seed_survey`)."""
    task = markov_task(cfg)
    tc = replace(markov_train_config(cfg), seeds=tuple(cfg.markov_survey_seeds), log_checkpoints=0)
    return train("algorithmic_cores/markov_survey", markov_model_config(cfg, "paper"), task, tc,
                 evaluate=markov_evaluator(cfg, task))


# --------------------------------------------------------------------------- grokking (notebook 03)
# The modular-addition blocks. "paper": the authors' model, the input `a b` (no `=` token) read at the last
# position, each layer PyTorch's default post-LN encoder layer (dropout in training, PyTorch's default
# initialisation). "book": the book's first choice, `a b =`, biases, learned positions, a ReLU MLP, no
# LayerNorm, no dropout, weights N(0, 1/d_model) (the usual grokking setups).
MODULAR_BLOCKS = ("paper", "book")


def _check_block(block: str) -> None:
    if block not in MODULAR_BLOCKS:
        raise ValueError(f"block={block!r} is not allowed; expected one of {MODULAR_BLOCKS}")


def modular_task(p: int, train_fraction: float, block: str = "paper") -> ModularAddition:
    """The modular-addition data of a block: `a b` for the paper's, `a b =` for the book's."""
    _check_block(block)
    return ModularAddition(p=p, train_fraction=train_fraction, split_seed=0, equals_token=block == "book")


def modular_model_config(p: int, n_layers: int, d_model: int, n_heads: int, d_mlp: int, block: str = "paper",
                         dropout: float = 0.1) -> ToyConfig:
    """The grokking transformer of a block (`MODULAR_BLOCKS`): (a + b) mod p at the last position.
    dropout: the paper block's (the book's has none)."""
    _check_block(block)
    if block == "book":
        return ToyConfig(d_vocab=p + 1, n_ctx=3, d_model=d_model, n_layers=n_layers, n_heads=n_heads, d_mlp=d_mlp,
                         d_vocab_out=p, normalization=None)
    return ToyConfig(d_vocab=p, n_ctx=2, d_model=d_model, n_layers=n_layers, n_heads=n_heads, d_mlp=d_mlp,
                     d_vocab_out=p, normalization="postLN", dropout=dropout, init="pytorch")


def grokking_task(cfg) -> ModularAddition:
    return modular_task(cfg.grok_p, cfg.grok_train_fraction, cfg.grok_block)


def grokking_model_config(cfg) -> ToyConfig:
    return modular_model_config(cfg.grok_p, cfg.grok_layers, cfg.grok_d_model, cfg.grok_heads, cfg.grok_d_mlp,
                                cfg.grok_block, cfg.grok_dropout)


def grokking_train_config(cfg) -> TrainConfig:
    """One member per seed at weight decay cfg.grok_wd; a checkpoint every cfg.grok_checkpoint_every_epochs."""
    n = len(grokking_task(cfg))
    steps = epochs_to_steps(cfg.grok_epochs, n, cfg.grok_batch)
    every = epochs_to_steps(cfg.grok_checkpoint_every_epochs, n, cfg.grok_batch)
    return TrainConfig(steps=steps, batch_size=cfg.grok_batch, seeds=tuple(cfg.grok_seeds), lr=cfg.grok_lr,
                       weight_decay=cfg.grok_wd, eval_every=max(1, min(every, steps // 100)),
                       checkpoint_every=every, log_checkpoints=12)


def train_grokking(cfg) -> Run:
    """Train (or load) the grokking ensemble (weight decay cfg.grok_wd), one member per seed."""
    task = grokking_task(cfg)
    return train("algorithmic_cores/grokking", grokking_model_config(cfg), task, grokking_train_config(cfg),
                 evaluate=modular_evaluate(task))


def choose_fork_step(cfg, run, member_times: pd.DataFrame | None) -> int:
    """The checkpoint the weight-decay-0 branch forks from: the last checkpoint at or before
    cfg.grok_fork_epoch (the paper's 900), or `auto_fork_step` of the members' times when it is None."""
    if cfg.grok_fork_epoch is None:
        return auto_fork_step(run, member_times)
    target = epochs_to_steps(cfg.grok_fork_epoch, len(grokking_task(cfg)), cfg.grok_batch)
    ckpts = run.checkpoint_steps()
    return max([s for s in ckpts if 0 < s <= target] or [ckpts[1]])


def fork_step(cfg, run) -> int:
    """The step the weight-decay-0 branch of the grokking run `run` forks at (`choose_fork_step`; the
    members' times from the run's curves when the rule needs them). While planning, where there are no
    curves, a rule that needs them is planned at the middle checkpoint (`planning.note` says so)."""
    if cfg.grok_fork_epoch is not None:
        return choose_fork_step(cfg, run, None)
    if planning.current() is not None:
        steps = run.checkpoint_steps()
        step = steps[len(steps) // 2]
        planning.note("algorithmic_cores/grokking_wd0", "fork step chosen from the trained curves; planned at the "
                      f"middle checkpoint ({step})")
        return step
    return choose_fork_step(cfg, run, grokking_times(run.metrics()))


def train_wd0_branch(cfg, run, fork_step: int) -> Run:
    """Fork every member of the grokking run `run` at `fork_step` and continue with weight decay 0 to the same
    final step."""
    task = grokking_task(cfg)
    tc = replace(grokking_train_config(cfg), weight_decay=0.0)
    return train("algorithmic_cores/grokking_wd0", grokking_model_config(cfg), task, tc,
                 evaluate=modular_evaluate(task), fork_from=(run, fork_step))


# --------------------------------------------------------------------------- delay law (notebook 04)
def sweep_model_config(p: int, cfg) -> ToyConfig:
    return modular_model_config(p, 1, cfg.sweep_d_model, cfg.sweep_heads, cfg.sweep_d_mlp, cfg.sweep_block,
                                cfg.sweep_dropout)


def _omega_grid(cfg) -> list[tuple[float, int]]:
    return [(w, s) for w in cfg.sweep_omegas for s in cfg.sweep_omega_seeds]


def omega_members(cfg) -> pd.DataFrame:
    """The weight-decay sweep's member table: member, omega, seed_index."""
    members = _omega_grid(cfg)
    return pd.DataFrame({"member": range(len(members)), "omega": [w for w, _ in members],
                         "seed_index": [s for _, s in members]})


def train_omega_sweep(cfg) -> Run:
    """The weight-decay sweep at p = cfg.sweep_omega_p: one ensemble, one member per (omega, seed)
    (`omega_members` says which)."""
    task = modular_task(cfg.sweep_omega_p, cfg.sweep_train_fraction, cfg.sweep_block)
    members = _omega_grid(cfg)
    seeds = tuple(1000 * s + i for i, (w, s) in enumerate(members))  # distinct seeds per member
    tc = TrainConfig(steps=cfg.sweep_omega_steps, batch_size=cfg.sweep_omega_batch, seeds=seeds,
                     lr=cfg.sweep_omega_lr, weight_decay=tuple(w for w, _ in members),
                     eval_every=cfg.sweep_eval_every, log_checkpoints=0)
    return train("algorithmic_cores/omega_sweep", sweep_model_config(task.p, cfg), task, tc,
                 evaluate=modular_evaluate(task))


def train_p_sweep(cfg) -> dict[int, Run]:
    """The modulus sweep at weight decay cfg.sweep_p_omega, full batch, learning rate cfg.sweep_p_lr:
    one ensemble (seeds cfg.sweep_p_seeds) per p."""
    runs = {}
    for p in cfg.sweep_ps:
        task = modular_task(p, cfg.sweep_train_fraction, cfg.sweep_block)
        tc = TrainConfig(steps=cfg.sweep_p_steps, batch_size=len(task), seeds=tuple(cfg.sweep_p_seeds),
                         lr=cfg.sweep_p_lr, weight_decay=cfg.sweep_p_omega, eval_every=cfg.sweep_eval_every,
                         log_checkpoints=0)
        runs[p] = train(f"algorithmic_cores/p_sweep_{p}", sweep_model_config(p, cfg), task, tc,
                         evaluate=modular_evaluate(task))
    return runs


# --------------------------------------------------------------------------- the registry
def notebook_runs(cfg) -> dict:
    """Every run the notebook `cfg.notebook` trains or reads, by role (the chapter contract's registry).

    02_markov: one run per setup of MARKOV_SETUPS ("paper", "normal_init", "book") and "survey" (the paper
    setup at `markov_survey_seeds`); 03_grokking: "grokking"
    and its weight-decay-0 branch "wd0" (forked at `fork_step`); 04_delay_law: "omega_sweep" and, with
    cfg.sweep_p_run, "p_sweep_<p>" per modulus; 01_planted and 05_agreement train nothing.
    """
    if cfg.notebook == "02_markov":
        return {**{setup: train_markov(cfg, setup) for setup in MARKOV_SETUPS}, "survey": train_markov_survey(cfg)}
    if cfg.notebook == "03_grokking":
        run = train_grokking(cfg)
        return {"grokking": run, "wd0": train_wd0_branch(cfg, run, fork_step(cfg, run))}
    if cfg.notebook == "04_delay_law":
        out = {"omega_sweep": train_omega_sweep(cfg)}
        if cfg.sweep_p_run:
            out.update({f"p_sweep_{p}": run for p, run in train_p_sweep(cfg).items()})
        return out
    return {}
