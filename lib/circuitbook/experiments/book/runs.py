"""The tour's run (`book/tour.ipynb`): an ensemble of one-layer transformers on modular addition.

The tour shows these functions' code on its page (`plotting.show_code`), so what it teaches is what ran.
"""
from __future__ import annotations

from ...models.toy import ToyConfig
from ...tasks.modular import ModularAddition
from ...training import TrainConfig, pool_accuracy, train


def task(cfg) -> ModularAddition:
    """a + b mod p on tokens `a b =`; a seeded fraction of the p^2 pairs trains, the rest tests."""
    return ModularAddition(p=cfg.p, train_fraction=cfg.train_fraction, split_seed=0)


def model_config(cfg) -> ToyConfig:
    return ToyConfig(d_vocab=cfg.p + 1, n_ctx=3, d_model=cfg.d_model, n_layers=1, n_heads=cfg.n_heads,
                     d_mlp=cfg.d_mlp, d_vocab_out=cfg.p)


def train_config(cfg) -> TrainConfig:
    """One member per seed, each with its own weight decay."""
    if len(cfg.weight_decays) != len(cfg.seeds):
        raise ValueError(f"weight_decays must have one value per seed: {len(cfg.weight_decays)} values "
                         f"for {len(cfg.seeds)} seeds")
    return TrainConfig(steps=cfg.steps, batch_size=cfg.batch_size, seeds=tuple(cfg.seeds), lr=cfg.lr,
                       weight_decay=tuple(cfg.weight_decays), eval_every=cfg.eval_every)


def modular_addition_run(cfg):
    t = task(cfg)
    return train("tour/modular_addition", model_config(cfg), t, train_config(cfg),
                 evaluate=pool_accuracy({"train": t.train, "test": t.test}))


def notebook_runs(cfg) -> dict:
    """The runs of each book-level notebook (the chapter contract's registry)."""
    return {"modular_addition": modular_addition_run(cfg)} if cfg.notebook == "tour" else {}
