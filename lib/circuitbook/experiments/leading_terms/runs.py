"""The corpus and the runs of chapter leading_terms, as functions of a notebook's Params (`cfg`).

Every notebook gets the same corpus and the same runs by calling the same function with the same
Params; `notebook_runs(cfg)` is the chapter's registry (what each notebook trains or reads).

Steps, epochs and s * eta: with n samples and batch b there are ceil(n / b) steps per epoch; what
the claims depend on is s * eta (steps times learning rate), so a profile that trains fewer steps
keeps the paper's s * eta by raising eta (see profiles.yml).

A short corpus (`short_corpus: all`, the full profile on the book's sample): the corpus holds fewer
samples than `n_samples` asks for, so every notebook uses all it has, and training keeps the steps
that `n_samples` would give (`train_steps`), so s * eta stays the profile's (the paper's at full);
the notebooks state it on their rows at run time (`context.note_deviation`).
"""
from __future__ import annotations

import functools
import math
import re
from pathlib import Path

import pandas as pd
import torch

from ... import context, params
from ...models.onehot import OneHotConfig
from ...tasks import corpus as corpus_lib
from ...tasks.base import Batch
from ...training import Run, TrainConfig, train
from .evaluate import CosineEvaluator

CHAPTER = "leading_terms"
MAIN, BPE, EARLY_LM = "leading_terms/main", "leading_terms/bpe", "leading_terms/early_lm"
PAPER_STEPS_PER_EPOCH = 65536 // 2048  # 32: the paper's SGD steps per epoch
LM_CHECKPOINTS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # the paper's Pythia checkpoints
PAPER_LM = "pythia-1.4b"  # a checkpoint folder whose parent's name holds this is the paper's model


# =============================================================================
# The corpus, its task and its first batch
# =============================================================================

@functools.lru_cache(maxsize=4)
def _cached_corpus(path, vocab_size, seq_len, n_samples, sampling, tokenizer, repair, short_corpus):
    return corpus_lib.load_corpus(path, vocab_size=vocab_size, seq_len=seq_len, n_samples=n_samples,
                                  sampling=sampling, tokenizer=tokenizer, repair=repair, short_corpus=short_corpus)


def _corpus_args(cfg) -> tuple:
    path = corpus_lib.resolve_source(cfg.get("tinystories_path"))
    return (str(path), cfg.vocab_size, cfg.seq_len, cfg.get("n_samples"), cfg.sampling,
            cfg.get("tokenizer") or "word", cfg.repair_mojibake, cfg.get("short_corpus") or "error")


def load_corpus(cfg) -> corpus_lib.Corpus:
    """The corpus of a notebook's Params (tinystories_path or $CIRCUITBOOK_TINYSTORIES), cached. A short
    corpus taken whole (`short_corpus: all`) is stated on the notebook's rows (`short_corpus_deviation`)."""
    corpus = _cached_corpus(*_corpus_args(cfg))
    if corpus.info["short"]:
        context.note_deviation(short_corpus_deviation(cfg, corpus))
    return corpus


def short_corpus_deviation(cfg, corpus: corpus_lib.Corpus) -> str:
    """What a short corpus changes, for the scorecard rows: samples used against samples asked for (the
    paper's count), and that the full data set restores the paper's setting."""
    kind = "whole stories" if corpus.info["sampling"] == "stories" else "windows"
    paper = params.paper_values(cfg.chapter, cfg.notebook).get("n_samples")
    paper_text = f"the paper's {paper:,} samples" if paper else "the samples n_samples asks for"
    return (f"only {corpus.info['samples']:,} {kind} of {corpus.seq_len + 1} in-vocabulary tokens (|V| = "
            f"{len(corpus.vocab):,}, {corpus.info['tokenizer']} tokens) are in {Path(corpus.info['source']).name}, "
            f"not the {corpus.info['samples_asked']:,} that n_samples asks for: short_corpus = all uses all of them; "
            f"the full TinyStories data set (tinystories_path) gives {paper_text}")


def make_task(cfg) -> corpus_lib.CorpusTask:
    """Every member reads the same batches (epoch order from `seed`, the paper's 42)."""
    return corpus_lib.CorpusTask(load_corpus(cfg), shuffle_seed=cfg.seed)


def batch_size(cfg) -> int:
    """The SGD batch: the profile's, capped at the number of samples (then full batch)."""
    return min(cfg.batch_size, len(load_corpus(cfg).samples))


def steps_per_epoch(cfg) -> int:
    """SGD steps per pass over the samples the corpus holds."""
    return -(-len(load_corpus(cfg).samples) // batch_size(cfg))


def train_steps(cfg) -> int:
    """epochs * ceil(n_samples / batch_size), n_samples as asked (all samples where null): a short corpus
    taken whole keeps the profile's steps, so s * eta is unchanged (3,200 steps at full: the paper's 100
    epochs of 32 batches of 2,048). With the samples asked for, epochs * steps_per_epoch."""
    asked = cfg.get("n_samples") or len(load_corpus(cfg).samples)
    return cfg.epochs * -(-asked // cfg.batch_size)


def first_batch(cfg) -> Batch:
    """The batch of step 0: the paper's theory takes its statistics from it."""
    return make_task(cfg).first_batch(batch_size(cfg), seed=cfg.seed)


_EVALUATORS: dict[tuple, CosineEvaluator] = {}  # (corpus, batch, seed) -> its evaluator (and its statistics)


def cosine_evaluator(cfg) -> CosineEvaluator:
    """The main run's evaluation callback on the first batch (cached: it holds the first-batch statistics,
    which it computes on first use)."""
    ident = (_corpus_args(cfg), batch_size(cfg), cfg.seed)
    if ident not in _EVALUATORS:
        if len(_EVALUATORS) >= 4:
            _EVALUATORS.pop(next(iter(_EVALUATORS)))
        batch = first_batch(cfg)
        _EVALUATORS[ident] = CosineEvaluator(batch.tokens, batch.labels, make_task(cfg).vocab_size)
    return _EVALUATORS[ident]


def first_batch_stats(cfg):
    """B, Sigma_B, Phi, Q, q_pos of the first training batch, as the paper computes them (`lt.leading_stats`;
    minutes at the full profile, computed once per process and shared with the training callback)."""
    return cosine_evaluator(cfg).stats


# =============================================================================
# The paper's model, trained with plain SGD (02, 03; 04 with BPE tokens)
# =============================================================================

def model_config(cfg) -> OneHotConfig:
    corpus = load_corpus(cfg)
    return OneHotConfig(d_vocab=len(corpus.vocab), n_ctx=corpus.seq_len, n_layers=cfg.n_layers)


def train_config(cfg) -> TrainConfig:
    """Plain SGD (no momentum, no weight decay), one member per learning rate in `lrs`."""
    lrs = tuple(cfg.lrs)
    return TrainConfig(steps=train_steps(cfg), batch_size=batch_size(cfg),
                       seeds=tuple(cfg.seed + i for i in range(len(lrs))), lr=lrs, weight_decay=0.0,
                       optimizer="sgd", eval_every=cfg.eval_every, checkpoint_every=None,
                       log_checkpoints=cfg.log_checkpoints, micro_batch_size=cfg.get("micro_batch_size"))


def main_run(cfg, name: str = MAIN) -> Run:
    """Train (or load) the paper's model on the Params' corpus, one member per lr (member k: `cfg.lrs[k]`),
    every member on the same batches; `CosineEvaluator` logs every weight's cosine with its leading term.
    name: MAIN (word tokens, 02 and 03) or BPE (04)."""
    tc = train_config(cfg)
    if load_corpus(cfg).info["short"]:
        context.note_deviation(short_corpus_steps(cfg, tc))
    return train(name, model_config(cfg), make_task(cfg), tc, evaluate=cosine_evaluator(cfg))


def short_corpus_steps(cfg, tc: TrainConfig) -> str:
    """How a run on a short corpus keeps s * eta: the steps n_samples would have given, on fewer samples."""
    s_eta = " and ".join(f"{tc.steps * lr:g}" for lr in tc.lr)
    return (f"on {len(load_corpus(cfg).samples):,} samples one epoch is {steps_per_epoch(cfg)} step(s) of "
            f"{tc.batch_size:,}: the run keeps the {tc.steps:,} SGD steps of {cfg.epochs} epochs of "
            f"{cfg.n_samples:,} samples in batches of {cfg.batch_size:,}, so s * eta ends at {s_eta}, as on "
            f"{cfg.n_samples:,} samples")


# =============================================================================
# A language model's early training (05): the substitute trained here, or released checkpoints read
# =============================================================================

def gpt_config(cfg):
    """A small GPT-style ToyTransformer (pre-LN, MLP, learned positions, untied unembedding)."""
    from ...models.toy import ToyConfig

    corpus = load_corpus(cfg)
    return ToyConfig(d_vocab=len(corpus.vocab), n_ctx=corpus.seq_len, d_model=cfg.lm_d_model,
                     n_layers=cfg.lm_layers, n_heads=cfg.lm_heads, d_mlp=4 * cfg.lm_d_model, normalization="LN",
                     positional="learned", bias=True)


def lm_train_config(cfg) -> TrainConfig:
    """AdamW (as Pythia), checkpoints at 1, 2, 4, ..., lm_steps."""
    n_log = 2 * int(round(math.log2(cfg.lm_steps)))  # round(steps^(i/n)) hits every power of 2
    return TrainConfig(steps=cfg.lm_steps, batch_size=min(cfg.lm_batch_size, len(make_task(cfg))), seeds=(cfg.seed,),
                       lr=cfg.lm_lr, weight_decay=0.01, optimizer="adamw", eval_every=max(1, cfg.lm_steps // 32),
                       log_checkpoints=n_log)


def substitute_lm(cfg) -> Run:
    """The offline substitute for Pythia-1.4B: the book's GPT-style model trained here on the chapter's corpus."""
    return train(EARLY_LM, gpt_config(cfg), make_task(cfg), lm_train_config(cfg))


def _checkpoint_step(path: str) -> int:
    found = re.findall(r"step[_-]?(\d+)", str(path))
    if not found:
        raise ValueError(f"checkpoint_dirs: cannot read a step from {path!r}; name each folder after its step "
                         f"(e.g. .../step512), as Pythia's revisions are named")
    return int(found[-1])


def _released_name(dirs) -> str:
    return ", ".join(sorted({Path(d).expanduser().resolve().parent.name for d in dirs}))


class LocalCheckpoints:
    """Released checkpoints of one language model (local Hugging Face folders named after their step), read
    through TransformerBridge with the run-like protocol of `training.Run`: one member, no key (they come
    from no run of the store), no metrics; each model is loaded when asked for."""

    key = None
    n_members = 1

    def __init__(self, dirs):
        self.by_step = {_checkpoint_step(d): d for d in sorted(dirs, key=_checkpoint_step)}
        self.name = _released_name(dirs)

    def __repr__(self):
        return f"LocalCheckpoints({self.name}, steps {self.checkpoint_steps()})"

    def metrics(self) -> pd.DataFrame:
        return pd.DataFrame(columns=["step", "member"])

    def checkpoint_steps(self) -> list[int]:
        return sorted(self.by_step)

    def model(self, member: int = 0, step: int | None = None):
        from ...models import pretrained

        if member != 0:
            raise ValueError(f"member={member} is out of range; released checkpoints have one member (0)")
        step = max(self.by_step) if step is None else step
        if step not in self.by_step:
            raise ValueError(f"step={step} is not a checkpoint of {self}")
        return pretrained.load_bridge(self.by_step[step]).bridge

    def models(self, step: int | None = None) -> list:
        return [self.model(0, step)]


def pretrained_lm(cfg) -> LocalCheckpoints:
    """Local checkpoints `cfg.checkpoint_dirs` (e.g. Pythia-1.4B-deduped step0..step512), checked, not loaded."""
    from ...models import pretrained

    missing = [d for d in sorted(cfg.checkpoint_dirs, key=_checkpoint_step) if not pretrained.availability(d)[0]]
    if missing:
        raise FileNotFoundError(f"checkpoint_dirs: {missing} are not local Hugging Face model folders")
    return LocalCheckpoints(cfg.checkpoint_dirs)


def early_lm(cfg):
    """The language model notebook 05 compares: released checkpoints where `checkpoint_dirs` names them,
    else the substitute (trained, or loaded from the store)."""
    return pretrained_lm(cfg) if cfg.checkpoint_dirs else substitute_lm(cfg)


def lm_name(cfg) -> str:
    """What the page and the scorecard row call the language model."""
    if cfg.checkpoint_dirs:
        return _released_name(cfg.checkpoint_dirs)
    return f"book GPT-style ToyTransformer ({cfg.lm_layers} layers, d_model {cfg.lm_d_model})"


def lm_is_substitute(cfg) -> bool:
    """True unless the checkpoints are the paper's Pythia-1.4B."""
    return not cfg.checkpoint_dirs or PAPER_LM not in lm_name(cfg).lower()


def lm_steps(cfg, lm) -> list[int]:
    """The checkpoints compared: every released one; of the substitute, 0 and the powers of 2."""
    steps = lm.checkpoint_steps()
    return steps if cfg.checkpoint_dirs else [s for s in steps if s == 0 or (s & (s - 1)) == 0]


def lm_batch(cfg) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(tokens [n, T] in the model's ids, the ids that occur in them, the model's vocabulary size): the
    corpus batch the language model is judged on. Released checkpoints: TinyStories text through the
    first checkpoint's tokenizer; the substitute: the first `lm_eval_samples` samples of the corpus."""
    if not cfg.checkpoint_dirs:
        corpus = load_corpus(cfg)
        return corpus.inputs[:cfg.lm_eval_samples], torch.arange(len(corpus.vocab)), len(corpus.vocab)
    from ...models import pretrained

    first = pretrained.load_bridge(sorted(cfg.checkpoint_dirs, key=_checkpoint_step)[0])
    stories = [corpus_lib.repair_mojibake(s) for s in corpus_lib.read_stories(cfg.get("tinystories_path"),
                                                                            max_stories=20 * cfg.lm_eval_samples)]
    ids: list[int] = []
    for story in stories:
        ids += first.tokenizer(story)["input_ids"]
        if len(ids) >= cfg.lm_eval_samples * cfg.seq_len:
            break
    n = len(ids) // cfg.seq_len
    tokens = torch.tensor(ids[:n * cfg.seq_len]).reshape(n, cfg.seq_len)
    return tokens, tokens.unique(), int(first.bridge.cfg.d_vocab)


# =============================================================================
# The registry
# =============================================================================

def notebook_runs(cfg) -> dict:
    """Every run the notebook `cfg.notebook` trains or reads, by role (the chapter contract's registry):
    01 none; 02 and 03 `main`; 04 `bpe`; 05 `lm` (the substitute's Run, or the released checkpoints)."""
    if cfg.notebook in ("02_training", "03_ablation"):
        return {"main": main_run(cfg)}
    if cfg.notebook == "04_bpe":
        return {"bpe": main_run(cfg, BPE)}
    if cfg.notebook == "05_early_lm":
        return {"lm": early_lm(cfg)}
    return {}
