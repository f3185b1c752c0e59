"""The chapter's tasks and designs as functions of a notebook's `cfg`, its run functions (each takes `cfg`)
and `notebook_runs(cfg)`, the registry of every run each notebook trains (`circuitbook.notebook_runs`).

Every training run goes through `circuitbook.training.train` (ensembles of seeds and sweeps); the loss is
the library's last-position cross-entropy.
"""
from __future__ import annotations

import hashlib
import math
from typing import Mapping, Sequence

import numpy as np
import pandas as pd
import torch

from ...analysis import imir
from ...models.imir import IMIRConfig
from ...tasks.base import Batch, FixedDataset
from ...tasks.blocklist import KINDS, BlockListTask
from ...training import Evaluator, Run, TrainConfig, train
from .evaluate import CircuitProbe, DistanceProbe, Probe, ProgressProbe, recall_pools, recall_task, two_hop_task
from .measure import CIRCUITS, OTHER_DIRECTIONS, three_layer_directions


# =============================================================================== 01 tasks and symmetries

def example_tasks(n_pairs: int = 8, n_blocks: int = 4, n_rare: int = 4, f_r: float = 0.25, f_v: float = 0.25,
                  n_fill: int = 2) -> dict[str, BlockListTask]:
    """One task of every kind with the same knobs (k-hop: 2 hops; n-gram: trigrams)."""
    return {kind: BlockListTask(kind, n_pairs=n_pairs, n_rare=n_rare, n_blocks=n_blocks, hops=2, ngram=3,
                                f_r=f_r, f_v=f_v, n_fill=n_fill, bos=True) for kind in KINDS}



# =============================================================================== 02 the manifold (IM-1)

class EnumeratedTask(FixedDataset):
    """The whole distribution of a small task as a fixed training set (full-batch training on it
    is gradient descent on the exact expected loss). Every outcome must be equally likely."""

    def __init__(self, task: BlockListTask, max_outcomes: int = 200_000):
        s, prob = task.enumerate_outcomes(max_outcomes)
        if not torch.allclose(prob, prob[0].expand_as(prob), rtol=1e-9, atol=0):
            raise ValueError(f"EnumeratedTask: the outcomes of {task!r} are not equally likely (use f_r and f_v in "
                             "{0, 1} and zipf = 0), so a plain mean over them is not the expected loss")
        self.task = task
        super().__init__(task.model_inputs(s), s.targets, vocab_size=task.vocab_size, n_outputs=task.n_outputs)

    def spec(self) -> dict:
        return {"enumerated": self.task.spec(), "n": len(self)}



# =============================================================================== 04 initialisation (IM-5)

class InitTable:
    """init_fn(model, seed) that sets an IMIRModel's phi from a table {member seed: {direction: value}}."""

    def __init__(self, table: Mapping[int, Mapping[str, float]]):
        self.table = {int(k): {d: float(v) for d, v in row.items()} for k, row in table.items()}

    def spec(self) -> dict:
        blob = repr(sorted((k, sorted(v.items())) for k, v in self.table.items())).encode()
        return {"init_table": hashlib.sha256(blob).hexdigest()[:16], "members": len(self.table)}

    @torch.no_grad()
    def __call__(self, model, seed: int) -> None:
        if int(seed) not in self.table:
            raise ValueError(f"InitTable: no initial values for member seed {seed}")
        model.phi.zero_()
        for name, value in self.table[int(seed)].items():
            model.phi[model.direction_names.index(name)] = value


def init_design(grid: Sequence[float], base: float, jitter: float, seed: int = 0, slices: int = 1,
                replicates: int = 1) -> pd.DataFrame:
    """Initial coordinates: `slices` draws of the five directions other than alpha1 and alpha2 (each
    base * exp(U(-jitter, jitter))), each crossed with alpha1(0) x alpha2(0) on `grid` x `grid`, each
    initial point trained by `replicates` members that differ only in their data (member seed).

    A slice is a clean 2-d section of initialisation space (its phase diagram has boundaries one can
    measure); the slices make the other five coordinates vary (so the nested fits can tell whether
    they matter); the replicates tell whether the initialisation or the data picks the winner."""
    if slices < 1 or replicates < 1:
        raise ValueError(f"init_design: slices={slices}, replicates={replicates}; both must be >= 1")
    rng = np.random.default_rng(seed)
    rows = []
    for sl in range(slices):
        others = {d: float(base * math.exp(rng.uniform(-jitter, jitter))) for d in OTHER_DIRECTIONS}
        for a2 in grid:
            for a1 in grid:
                point = len(rows) // replicates
                for r in range(replicates):
                    rows.append({"point": point, "slice": sl, "replicate": r, "alpha1": float(a1), "alpha2": float(a2),
                                 **others})
    df = pd.DataFrame(rows)
    df.insert(0, "member_seed", np.arange(len(df)))
    return df


def sweep_members(grid: Sequence[tuple], seeds: Sequence[int]) -> list[tuple]:
    """Members of a sweep ensemble: every grid point with every seed, as (point, seed, member seed)."""
    out = []
    for i, point in enumerate(grid):
        for seed in seeds:
            out.append((point, seed, 1000 * i + seed))
    return out



# =============================================================================== tasks and designs of each notebook's cfg

def im1_task(cfg) -> BlockListTask:
    """02: the small recall task whose whole distribution is enumerated."""
    return recall_task(cfg.im1_n_pairs, cfg.im1_n_blocks, f_v=cfg.im1_f_v)


def two_layer_task(cfg) -> BlockListTask:
    """03: the recall task of the restricted / full-S / unrestricted trio."""
    return recall_task(cfg.tl_n_pairs, cfg.tl_n_blocks, f_v=cfg.tl_f_v)


def suppression_grid(cfg) -> list[tuple[float, float]]:
    """03: the (f_r, f_v) points of the suppression law and sweep."""
    return list(zip(cfg.im3_f_r, cfg.im3_f_v))


def suppression_members(cfg) -> list[tuple]:
    """03: the members of the suppression sweep, (point (f_r, f_v), seed, member seed) each."""
    return sweep_members(suppression_grid(cfg), cfg.im3_train_seeds)


def burstiness_members(cfg) -> list[tuple]:
    """03: the members of the burstiness sweep, ((b,), seed, member seed) each."""
    return sweep_members([(b,) for b in cfg.im4_bursts], cfg.im4_seeds)


def im5_task(cfg) -> BlockListTask:
    """04: the pure in-context recall task of the initialisation ensemble."""
    return recall_task(cfg.im5_n_pairs, cfg.im5_n_blocks, f_v=1.0)


def im5_design(cfg) -> pd.DataFrame:
    """04: the initial coordinates of every member (`init_design`)."""
    return init_design(cfg.im5_grid, cfg.im5_base, cfg.im5_jitter, seed=cfg.im5_design_seed,
                       slices=cfg.im5_slices, replicates=cfg.im5_replicates)


def im6_task(cfg) -> BlockListTask:
    """05: the 2-hop task."""
    return two_hop_task(cfg.im6_n_pairs, cfg.im6_n_blocks)


# =============================================================================== run functions (each takes cfg)

def train_in_and_off_s(cfg, name: str = "inductive_manifold/im1") -> dict[str, Run]:
    """02: full-parameter gradient descent on the theory's 2-layer model, started at random points of S
    (one per seed of `im1_seeds`): full batch on the enumerated distribution (the exact expected gradient),
    the same started off S, and SGD on sampled batches started in S."""
    task, n_layers, seeds = im1_task(cfg), 2, cfg.im1_seeds
    steps, lr, scale, off_s_std = cfg.im1_steps, cfg.im1_lr, cfg.im1_scale, cfg.im1_off_std
    sampled_batch, eval_every = cfg.im1_sampled_batch, cfg.im1_eval_every
    layout = imir.Layout.from_task(task)
    data = EnumeratedTask(task)
    basis = imir.IMIRBasis.concatenated(layout, n_layers, 1)
    probe = DistanceProbe(basis, Batch(data.tokens, data.labels))
    model = imir.theory_config(layout, n_layers, 1)
    full = TrainConfig(steps=steps, batch_size=len(data), seeds=tuple(seeds), lr=lr, optimizer="sgd",
                       eval_every=eval_every, log_checkpoints=4)
    sampled = TrainConfig(steps=steps, batch_size=sampled_batch, seeds=tuple(seeds), lr=lr, optimizer="sgd",
                          eval_every=eval_every, log_checkpoints=4)
    return {
        "in S, full batch": train(f"{name}/in_s", model, data, full, evaluate=probe,
                                  init_fn=imir.TheoryInit(layout, random_scale=scale)),
        "off S, full batch": train(f"{name}/off_s", model, data, full, evaluate=probe,
                                   init_fn=imir.TheoryInit(layout, random_scale=scale, off_s_std=off_s_std)),
        "in S, sampled batches": train(f"{name}/in_s_sampled", model, task, sampled, evaluate=probe,
                                       init_fn=imir.TheoryInit(layout, random_scale=scale)),
    }


def train_restricted_and_full(cfg, name: str = "inductive_manifold/im2") -> dict[str, Run]:
    """03: the 2-layer, 1-head theory model from zero init on `two_layer_task(cfg)`, three ways, plain SGD on
    the same batches: 'restricted' to (alpha, beta, gamma, delta); 'full S', restricted to every coordinate
    of S (an IMIRModel of the whole manifold: unrestricted training as Theorem 1 says it goes in
    expectation, without the minibatch noise that leaves S); 'unrestricted', every W_QK and W_U entry."""
    task = two_layer_task(cfg)
    layout = imir.Layout.from_task(task)
    basis = imir.IMIRBasis.concatenated(layout, 2, 1)
    dirs = imir.two_layer_directions(basis)
    probe = Probe(basis, dirs, recall_pools(task, cfg.tl_pool))
    tc = TrainConfig(steps=cfg.tl_steps, batch_size=cfg.tl_batch, seeds=tuple(cfg.tl_seeds), lr=cfg.tl_lr,
                     optimizer="sgd", eval_every=cfg.tl_eval_every, log_checkpoints=8)
    whole = IMIRConfig(layout.token_classes, layout.association, layout.seq_len, n_layers=2)
    return {"restricted": train(f"{name}/restricted", IMIRConfig.with_directions(layout, dirs), task, tc,
                                evaluate=probe),
            "full S": train(f"{name}/full_s", whole, task, tc, evaluate=probe),
            "unrestricted": train(f"{name}/unrestricted", imir.theory_config(layout, 2, 1), task, tc, evaluate=probe,
                                  init_fn=imir.TheoryInit(layout))}


def train_scaling(cfg, name: str = "inductive_manifold/scaling") -> dict[int, Run]:
    """03: the predecessor paper's special case: associative recall with N random pairs (f_v = 1, no
    in-weights answer), the restricted 2-layer model from zero init, one run (`sc_seeds`) per N of `sc_ns`."""
    out = {}
    for n in cfg.sc_ns:
        task = recall_task(max(cfg.sc_n_pairs, 2 * n), n, f_v=1.0)
        layout = imir.Layout.from_task(task)
        basis = imir.IMIRBasis.concatenated(layout, 2, 1)
        dirs = imir.two_layer_directions(basis)
        pools = recall_pools(task, cfg.tl_pool)
        probe = Probe(basis, dirs, {"icl": pools["icl"], "task": pools["task"]})
        tc = TrainConfig(steps=cfg.sc_steps, batch_size=cfg.tl_batch, seeds=tuple(cfg.sc_seeds), lr=cfg.tl_lr,
                         optimizer="sgd", eval_every=cfg.tl_eval_every, log_checkpoints=0)
        out[n] = train(f"{name}/N{n}", IMIRConfig.with_directions(layout, dirs), task, tc, evaluate=probe)
    return out


def train_icl_trajectory(cfg, name: str = "inductive_manifold/im3_trajectory") -> Run:
    """03: the restricted 2-layer model from zero on the pure in-context version of the suppression law's
    recall task (every query non-canonical: f_v = 1, f_r = 0), one member (the first of `im3_seeds`): its
    logged (alpha, beta, gamma) are the points along the trajectory where the gradient laws are measured
    beyond zero weights."""
    task = recall_task(cfg.im3_n_pairs, cfg.im3_n_blocks, f_v=1.0, f_r=0.0, n_rare=cfg.im3_n_rare)
    layout = imir.Layout.from_task(task)
    basis = imir.IMIRBasis.concatenated(layout, 2, 1)
    dirs = imir.two_layer_directions(basis)
    probe = Probe(basis, dirs, {"icl": recall_pools(task, cfg.tl_pool)["icl"]})
    tc = TrainConfig(steps=cfg.im3_traj_steps, batch_size=cfg.tl_batch, seeds=(cfg.im3_seeds[0],), lr=cfg.tl_lr,
                     optimizer="sgd", eval_every=cfg.tl_eval_every, log_checkpoints=0)
    return train(name, IMIRConfig.with_directions(layout, dirs), task, tc, evaluate=probe)


def train_suppression_sweep(cfg, name: str = "inductive_manifold/im3") -> Run:
    """03: one ensemble over (f_r, f_v) x seeds (`suppression_members(cfg)`): the restricted 2-layer model
    from zero init, each member on its own task."""
    members = suppression_members(cfg)
    tasks = [recall_task(cfg.im3_train_n_pairs, cfg.tl_n_blocks, f_v=fv, f_r=fr, n_rare=cfg.im3_train_n_rare)
             for (fr, fv), _, _ in members]
    layout = imir.Layout.from_task(tasks[0])
    basis = imir.IMIRBasis.concatenated(layout, 2, 1)
    dirs = imir.two_layer_directions(basis)
    probe = Probe(basis, dirs, recall_pools(tasks[0], cfg.tl_pool))
    tc = TrainConfig(steps=cfg.im3_train_steps, batch_size=cfg.tl_batch, seeds=tuple(m[2] for m in members),
                     lr=cfg.tl_lr, optimizer="sgd", eval_every=cfg.tl_eval_every,
                     checkpoint_every=cfg.tl_eval_every, log_checkpoints=0)
    return train(name, IMIRConfig.with_directions(layout, dirs), tasks, tc, evaluate=probe)


def train_burstiness_sweep(cfg, name: str = "inductive_manifold/im4") -> Run:
    """03: one ensemble over burstiness b x seeds (`burstiness_members(cfg)`; restricted 2-layer model, zero
    init, pure in-context task, f_v = 1)."""
    f_v = 1.0
    members = burstiness_members(cfg)
    tasks = [recall_task(cfg.im4_n_pairs, cfg.im4_n_blocks, f_v=f_v, burstiness=b) for (b,), _, _ in members]
    layout = imir.Layout.from_task(tasks[0])
    basis = imir.IMIRBasis.concatenated(layout, 2, 1)
    dirs = imir.two_layer_directions(basis)
    pools = recall_pools(recall_task(cfg.im4_n_pairs, cfg.im4_n_blocks, f_v=f_v, burstiness=1), cfg.tl_pool)
    probe = Probe(basis, dirs, {"icl": pools["icl"]})
    tc = TrainConfig(steps=cfg.im4_steps, batch_size=cfg.tl_batch, seeds=tuple(m[2] for m in members),
                     lr=cfg.tl_lr, optimizer="sgd", eval_every=cfg.tl_eval_every, log_checkpoints=0)
    return train(name, IMIRConfig.with_directions(layout, dirs), tasks, tc, evaluate=probe)


def train_standard(cfg, name: str = "inductive_manifold/standard") -> Run:
    """03: a standard 2-layer, 1-head attention-only ToyTransformer (learned absolute positions, separate
    W_Q and W_K, random init, AdamW) on associative recall with plain token ids (the trio's sizes, f_v = 1)."""
    from ...models.toy import ToyConfig

    task = BlockListTask("recall", n_pairs=cfg.tl_n_pairs, n_blocks=cfg.tl_n_blocks, f_v=1.0, bos=True,
                         offsets="fixed", input_ids="tokens")
    model = ToyConfig(d_vocab=task.vocab_size, n_ctx=task.seq_len, d_model=cfg.std_d_model, n_layers=2, n_heads=1,
                      mlp=False, d_mlp=0, bias=False, normalization=None, positional="learned")
    pools = recall_pools(task, cfg.tl_pool)
    probe = ProgressProbe({"icl": pools["icl"]}, list(range(task.n_common)))
    tc = TrainConfig(steps=cfg.std_steps, batch_size=cfg.tl_batch, seeds=tuple(cfg.std_seeds), lr=cfg.std_lr,
                     eval_every=cfg.tl_eval_every, log_checkpoints=0)
    return train(name, model, task, tc, evaluate=probe)


def train_init_ensemble(cfg, name: str = "inductive_manifold/im5") -> Run:
    """04: one ensemble: the 3-layer model restricted to the seven circuit directions, each member started
    at its row of `im5_design(cfg)`, trained by plain SGD on `im5_task(cfg)`."""
    task, design = im5_task(cfg), im5_design(cfg)
    layout = imir.Layout.from_task(task)
    basis = imir.IMIRBasis.concatenated(layout, 3, 1)
    dirs = three_layer_directions(basis)
    table = {int(r.member_seed): {d: getattr(r, d) for d in dirs} for r in design.itertuples()}
    probe = CircuitProbe(recall_pools(task, cfg.im5_pool)["icl"], CIRCUITS)
    tc = TrainConfig(steps=cfg.im5_steps, batch_size=cfg.im5_batch, seeds=tuple(int(s) for s in design.member_seed),
                     lr=cfg.im5_lr, optimizer="sgd", eval_every=cfg.im5_eval_every, log_checkpoints=0)
    return train(name, IMIRConfig.with_directions(layout, dirs, n_layers=3), task, tc, evaluate=probe,
                 init_fn=InitTable(table))


def train_two_hop(cfg, name: str = "inductive_manifold/im6") -> Run:
    """05: the 2-hop model (`im6_layers` layers): `im6_mode` 'imir' trains every coordinate of S (an
    IMIRModel, cheap), 'full' every entry of W_QK and W_U of the theory's ToyTransformer (projected on S
    afterwards); plain SGD from zero."""
    mode, n_layers, init_std = cfg.im6_mode, cfg.im6_layers, 0.0
    if mode not in ("imir", "full"):
        raise ValueError(f"train_two_hop: mode={mode!r}; expected 'imir' or 'full'")
    task = im6_task(cfg)
    layout = imir.Layout.from_task(task)
    pools = recall_pools(task, cfg.im6_pool)
    tc = TrainConfig(steps=cfg.im6_steps, batch_size=cfg.im6_batch, seeds=tuple(cfg.im6_seeds), lr=cfg.im6_lr,
                     optimizer="sgd", eval_every=cfg.im6_eval_every, log_checkpoints=4)
    evaluate = Evaluator({"task": pools["task"]}, loss=True)
    if mode == "imir":
        model = IMIRConfig(layout.token_classes, layout.association, layout.seq_len, n_layers=n_layers,
                           init_std=init_std)
        return train(f"{name}/imir", model, task, tc, evaluate=evaluate)
    return train(f"{name}/full", imir.theory_config(layout, n_layers, 1, init_std=init_std), task, tc,
                 evaluate=evaluate, init_fn=imir.TheoryInit(layout))


# =============================================================================== the registry

def notebook_runs(cfg) -> dict[str, Run]:
    """Every run the notebook `cfg.notebook` trains, by role (the chapter contract's registry):

    01_tasks              none
    02_manifold           'in S, full batch', 'off S, full batch', 'in S, sampled batches'
    03_two_layer          'restricted', 'full S', 'unrestricted', 'scaling/N<n>' for each n of sc_ns, 'trajectory',
                          'suppression', 'burstiness', 'standard'
    04_initialization     'ensemble'
    05_circuit_detection  'two_hop'
    """
    nb = cfg.notebook
    if nb == "02_manifold":
        return train_in_and_off_s(cfg)
    if nb == "03_two_layer":
        runs = dict(train_restricted_and_full(cfg))
        runs.update({f"scaling/N{n}": run for n, run in train_scaling(cfg).items()})
        runs["trajectory"] = train_icl_trajectory(cfg)
        runs["suppression"] = train_suppression_sweep(cfg)
        runs["burstiness"] = train_burstiness_sweep(cfg)
        runs["standard"] = train_standard(cfg)
        return runs
    if nb == "04_initialization":
        return {"ensemble": train_init_ensemble(cfg)}
    if nb == "05_circuit_detection":
        return {"two_hop": train_two_hop(cfg)}
    return {}
