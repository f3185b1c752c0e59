"""Chapter `leading_terms`: "How do transformers learn to associate tokens? Leading gradient terms
bring mechanistic interpretability" (Im, Oh, Fang, Li; ICLR 2026), from the spec in PAPERS.md.

Everything the notebooks share lives here, so every notebook gets the same corpus and the same
runs by calling the same function with the same Params.

Corpus and runs (all notebooks)
    `load_corpus(cfg)`       the TinyStories samples of the notebook's Params (word or BPE tokens);
    `model_config`, `train_config`, `main_run(cfg)`  the paper's model trained with plain SGD, one
                             ensemble member per learning rate (`lrs`), every member on the same
                             batches; `CosineEvaluator` (from analysis.leading_terms) logs the cosine of every weight to its
                             leading term during training (no checkpoint needed for the curves);
    `first_batch_stats`      B, Sigma_B, Phi, Q, q_pos of the first training batch (the paper's
                             theory takes its statistics from it).
Training curves (notebook 02, LT-1, LT-2; notebook 04, LT-5)
    `cosine_frame`, `min_cosines`, `s_eta_until_below`, `matrix_summary` (per matrix: which fail).
Ablation (notebook 03, LT-4)
    `mean_loss`, `loss_with`, `ablation_table`, `undone_fractions`, `baseline_table` (the same
    removal with the shuffled corpus's leading term, and a same-size change in the term's span).
Basis maps (notebook 01, LT-3)
    `top_successors`, `context_lift`, `top_context_partners`, `neighbours`; the word lists
    `ADJECTIVES`, `NOUNS`, `SETTINGS`, `WORD_CLASSES` (the book's, hand-made for TinyStories, so
    that the qualitative claim can be counted); `adjective_noun_share`, `setting_hit_rate`,
    `class_purity`, each with its chance baseline.
Early training of a language model (notebook 05, LT-6)
    `gpt_config`, `train_gpt`, `embedding_agreement`, `attention_token_scores`,
    `attention_agreement`, `early_agreement`.

Steps, epochs and s * eta: with n samples and batch b there are ceil(n / b) steps per epoch; what
the claims depend on is s * eta (steps times learning rate), so a profile that trains fewer steps
keeps the paper's s * eta by raising eta (see profiles.yml).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd
import torch

from ..analysis import leading_terms as lt
from ..models.onehot import OneHotConfig, OneHotTransformer
from ..tasks import corpus as corpus_lib
from ..tasks.base import derive_seed
from ..training import Run, TrainConfig
from ..training import train as _train

CHAPTER = "leading_terms"
PAPER_STEPS_PER_EPOCH = 65536 // 2048  # 32: the paper's SGD steps per epoch


# =============================================================================
# Corpus and runs
# =============================================================================

@functools.lru_cache(maxsize=4)
def _cached_corpus(path, vocab_size, seq_len, n_samples, sampling, tokenizer, repair):
    return corpus_lib.load_corpus(path, vocab_size=vocab_size, seq_len=seq_len, n_samples=n_samples,
                                  sampling=sampling, tokenizer=tokenizer, repair=repair)


def load_corpus(cfg) -> corpus_lib.Corpus:
    """The corpus of a notebook's Params (tinystories_path or $CIRCUITBOOK_TINYSTORIES)."""
    path = corpus_lib.resolve_source(cfg.get("tinystories_path"))
    return _cached_corpus(str(path), cfg.vocab_size, cfg.seq_len, cfg.get("n_samples"), cfg.sampling,
                          cfg.get("tokenizer") or "word", cfg.repair_mojibake)


def make_task(cfg, corpus: corpus_lib.Corpus | None = None) -> corpus_lib.CorpusTask:
    """Every member reads the same batches (epoch order from `seed`, the paper's 42)."""
    return corpus_lib.CorpusTask(corpus or load_corpus(cfg), shuffle_seed=cfg.seed)


def model_config(cfg, corpus: corpus_lib.Corpus) -> OneHotConfig:
    return OneHotConfig(d_vocab=len(corpus.vocab), n_ctx=corpus.seq_len, n_layers=cfg.n_layers)


def batch_size(cfg, corpus: corpus_lib.Corpus) -> int:
    """The SGD batch: the profile's, capped at the number of samples (then full batch)."""
    return min(cfg.batch_size, len(corpus.samples))


def steps_per_epoch(cfg, corpus: corpus_lib.Corpus) -> int:
    return -(-len(corpus.samples) // batch_size(cfg, corpus))


def train_config(cfg, corpus: corpus_lib.Corpus) -> TrainConfig:
    """Plain SGD (no momentum, no weight decay), one member per learning rate in `lrs`."""
    lrs = tuple(cfg.lrs)
    return TrainConfig(steps=cfg.epochs * steps_per_epoch(cfg, corpus), batch_size=batch_size(cfg, corpus),
                       seeds=tuple(cfg.seed + i for i in range(len(lrs))), lr=lrs, weight_decay=0.0,
                       optimizer="sgd", eval_every=cfg.eval_every, checkpoint_every=None,
                       log_checkpoints=cfg.log_checkpoints, micro_batch_size=cfg.get("micro_batch_size"))


def first_batch_stats(cfg, task: corpus_lib.CorpusTask, attention: bool = True) -> lt.LeadingStats:
    """The maps of the first training batch, as the paper computes them."""
    batch = task.first_batch(batch_size(cfg, task.corpus), seed=cfg.seed)
    return lt.leading_stats(batch.tokens, batch.labels, task.vocab_size, attention=attention)


# The training callback lives beside the maps it reads (analysis.leading_terms), so that editing this
# chapter module does not change the runs' keys.
weight_name = lt.weight_name
CosineEvaluator = lt.CosineEvaluator


@dataclass
class MainRun:
    """A trained run with the corpus, task and first-batch statistics it was judged against."""

    run: Run
    corpus: corpus_lib.Corpus
    task: corpus_lib.CorpusTask
    stats: lt.LeadingStats
    lrs: tuple[float, ...]

    @property
    def steps_per_epoch(self) -> int:
        return -(-len(self.task) // self.run.train_config.batch_size)


def main_run(cfg, name: str = "leading_terms/main", progress: bool | None = None) -> MainRun:
    """Train (or load) the paper's model on the Params' corpus, one member per lr."""
    corpus = load_corpus(cfg)
    task = make_task(cfg, corpus)
    stats = first_batch_stats(cfg, task)
    run = _train(name, model_config(cfg, corpus), task, train_config(cfg, corpus), evaluate=CosineEvaluator(stats),
                 progress=progress)
    return MainRun(run, corpus, task, stats, tuple(cfg.lrs))


# =============================================================================
# Training curves (LT-1, LT-2, LT-5)
# =============================================================================

def cosine_frame(main: MainRun) -> pd.DataFrame:
    """Long format: step, epoch, member, lr, s_eta, train_loss, weight, kind, layer, cosine."""
    m = main.run.metrics()
    cos_cols = [c for c in m.columns if c.startswith("cos_")]
    long = m.melt(id_vars=["step", "member", "train_loss"], value_vars=cos_cols, var_name="weight",
                  value_name="cosine")
    long["weight"] = long["weight"].str.removeprefix("cos_")
    long["kind"] = long["weight"].map(lt.kind_of)
    long["layer"] = long["weight"].map(lambda w: -1 if w == "W_O" else int(w[1:]))
    long["lr"] = long["member"].map(lambda k: main.lrs[int(k)])
    long["s_eta"] = long["step"] * long["lr"]
    long["epoch"] = long["step"] / main.steps_per_epoch
    return long.dropna(subset=["cosine"]).sort_values(["member", "step", "weight"]).reset_index(drop=True)


def min_cosines(frame: pd.DataFrame, lr: float) -> dict[str, float]:
    """The minimum over training (and over layers) of each kind's cosine, for one lr."""
    sub = frame[np.isclose(frame["lr"], lr)]
    return {kind: float(g["cosine"].min()) for kind, g in sub.groupby("kind")}


def s_eta_until_below(frame: pd.DataFrame, lr: float, level: float, kinds=("W_O", "V", "W")) -> float:
    """The largest evaluated s * eta up to which every weight of `kinds` keeps cosine >= level
    (the run's last s * eta if it never drops below)."""
    sub = frame[np.isclose(frame["lr"], lr) & frame["kind"].isin(kinds)]
    worst = sub.groupby("s_eta")["cosine"].min().sort_index()
    below = worst[worst < level]
    if below.empty:
        return float(worst.index.max())
    before = worst[worst.index < below.index[0]]
    return float(before.index.max()) if not before.empty else 0.0


def matrix_summary(frame: pd.DataFrame, lr: float, level: float = 0.7, band: float = 0.9,
                   kinds=("W", "V", "W_O")) -> pd.DataFrame:
    """One row per weight matrix of `kinds` for one lr: its cosine at the last evaluation, its lowest
    cosine, the largest s * eta up to which it stays >= `band` (`s_eta_until_below` of that matrix
    alone) and whether it ends at or below `level` (LT-2 asks every matrix to end above 0.7)."""
    sub = frame[np.isclose(frame["lr"], lr) & frame["kind"].isin(kinds)]
    rows = []
    for name, g in sub.groupby("weight", sort=False):
        g = g.sort_values("s_eta")
        worst = g.set_index("s_eta")["cosine"]
        below = worst[worst < band]
        if below.empty:
            until = float(worst.index.max())
        else:
            before = worst[worst.index < below.index[0]]
            until = float(before.index.max()) if not before.empty else 0.0
        final = float(g["cosine"].iloc[-1])
        rows.append({"weight": name, "kind": g["kind"].iloc[0], "layer": int(g["layer"].iloc[0]), "final": final,
                     "lowest": float(g["cosine"].min()), f"s_eta_above_{band:g}": until, "ends_below": final <= level})
    rows.sort(key=lambda r: (list(kinds).index(r["kind"]), r["layer"]))
    return pd.DataFrame(rows)


def names_or_none(names) -> str:
    """'W2, V0' or 'none': a list of weight names as a phrase for the scorecard row."""
    names = list(names)
    return ", ".join(names) if names else "none"


# =============================================================================
# Ablation (LT-4)
# =============================================================================

@torch.no_grad()
def mean_loss(model: OneHotTransformer, inputs: torch.Tensor, targets: torch.Tensor, chunk: int = 64) -> float:
    """Mean cross-entropy over all positions (the training loss), in chunks of sequences."""
    total, count = 0.0, 0
    for s in range(0, len(inputs), chunk):
        logits = model(inputs[s:s + chunk]).double()
        total += float(-logits.log_softmax(-1).gather(-1, targets[s:s + chunk, :, None]).sum())
        count += targets[s:s + chunk].numel()
    return total / count


def loss_with(model: OneHotTransformer, name: str, weight: torch.Tensor, inputs: torch.Tensor,
              targets: torch.Tensor) -> float:
    """The mean loss with weight `name` replaced by `weight` (the model is restored afterwards)."""
    w = model.weights()[name]
    original = w.detach().clone()
    with torch.no_grad():
        w.copy_(weight)
    try:
        return mean_loss(model, inputs, targets)
    finally:
        with torch.no_grad():
            w.copy_(original)


def ablation_table(model: OneHotTransformer, stats: lt.LeadingStats, inputs: torch.Tensor,
                   targets: torch.Tensor) -> pd.DataFrame:
    """The loss with each weight's leading-term projection removed (one weight at a time)."""
    rows = [{"removed": "none", "kind": "none", "layer": -1, "loss": mean_loss(model, inputs, targets)}]
    for name, w in model.weights().items():
        kind = lt.kind_of(name)
        if kind == "P":
            continue  # the paper ablates W, V and W_O
        without = lt.remove_projection(w.detach(), stats.direction(kind))
        rows.append({"removed": name, "kind": kind, "layer": -1 if name == "W_O" else int(name[1:]),
                     "loss": loss_with(model, name, without, inputs, targets)})
    return pd.DataFrame(rows)


def baseline_table(model: OneHotTransformer, stats: lt.LeadingStats, shuffled: lt.LeadingStats,
                   inputs: torch.Tensor, targets: torch.Tensor, initial_loss: float, share: float = 0.9,
                   seed: int = 0) -> pd.DataFrame:
    """Per weight (W, V, W_O): the share of the training gain undone by removing its leading-term
    projection ('leading term'), by removing instead the projection on the leading term of the
    shuffled corpus (`shuffled`: the same tokens in random order), and by a change of the removal's
    size in a random direction of the leading term's top singular span (`lt.random_in_span`)."""
    base = mean_loss(model, inputs, targets)
    undone = lambda loss: (loss - base) / (initial_loss - base)
    rows = []
    for name, w in model.weights().items():
        kind = lt.kind_of(name)
        if kind == "P":
            continue
        w, term = w.detach(), stats.direction(kind)
        direction = lt.random_in_span(term, share, seed=derive_seed("span-baseline", name, seed))
        changed = {"leading term": lt.remove_projection(w, term),
                   "shuffled-corpus leading term": lt.remove_projection(w, shuffled.direction(kind)),
                   "same-size change in its span": lt.perturb_like_removal(w, term, direction)}
        rows.append({"weight": name, "kind": kind, "cosine with leading term": lt.cosine(w, term),
                     "cosine with shuffled leading term": lt.cosine(w, shuffled.direction(kind)),
                     **{k: undone(loss_with(model, name, v, inputs, targets)) for k, v in changed.items()}})
    return pd.DataFrame(rows)


def undone_fractions(table: pd.DataFrame, initial_loss: float) -> pd.DataFrame:
    """Each removal's loss increase as a fraction of what training gained (initial - trained loss)."""
    base = float(table.loc[table["removed"] == "none", "loss"].iloc[0])
    out = table[table["removed"] != "none"].copy()
    out["increase"] = out["loss"] - base
    out["undone"] = out["increase"] / (initial_loss - base)
    return out.reset_index(drop=True)


# =============================================================================
# What the basis maps mean (LT-3)
# =============================================================================
# The book's word lists for TinyStories (hand-made, frequent words only; a word the vocabulary
# lacks is skipped). They make the paper's qualitative reading countable: B should pair
# adjectives with nouns, Phi should tie entities to their settings, Sigma_B should group words of
# one class.

ADJECTIVES = ("big", "little", "small", "tiny", "huge", "giant", "tall", "long", "old", "new", "red", "blue", "green",
              "yellow", "pink", "purple", "white", "black", "brown", "orange", "shiny", "pretty", "beautiful", "soft",
              "warm", "cold", "hot", "fluffy", "dark", "bright", "colorful", "scary", "loud", "wet", "dirty", "heavy",
              "yummy", "delicious", "sweet", "furry", "strong", "magical", "wild", "sunny", "round", "cute", "sharp",
              "juicy", "tasty", "sparkly", "wooden", "smelly", "friendly", "wise", "brave", "kind", "silly", "funny",
              "clever", "fast", "hungry", "lonely", "curious", "special", "favorite", "secret")

NOUNS = ("dog", "cat", "bird", "ball", "tree", "car", "house", "box", "park", "toy", "toys", "garden", "water", "sky",
         "bear", "sun", "room", "flower", "flowers", "boat", "truck", "fish", "store", "bed", "dress", "kitchen", "doll",
         "pond", "frog", "butterfly", "baby", "puppy", "rock", "fox", "leaves", "cake", "book", "squirrel", "hill",
         "beach", "lake", "table", "window", "bag", "swing", "blocks", "owl", "hair", "balloon", "picture", "castle",
         "river", "school", "cave", "dragon", "monster", "cookies", "duck", "pocket", "town", "bucket", "hat", "sea",
         "kite", "elephant", "animal", "animals", "apple", "shoes", "treasure", "blanket", "wall", "bush", "basket",
         "stars", "princess", "horse", "bowl", "forest", "woods", "tail", "ground", "door", "grass", "ice", "cream",
         "sand", "girl", "boy", "man", "lady", "friend", "friends", "mom", "dad", "dog", "bunny", "rabbit", "mouse",
         "lion", "bug", "bee", "cookie", "teddy", "train", "bike", "shirt", "hole", "stick", "cup", "candy", "rain",
         "snow", "wind", "light", "fire", "food", "flower", "trees", "car", "cars", "boat", "stone", "shell", "king",
         "queen", "prince", "dinosaur", "robot", "kitten", "monkey", "pig", "cow", "sheep", "horse", "turtle", "snake",
         "star", "moon", "cloud", "clouds", "heart", "smile", "voice", "eyes", "face", "hands", "song", "music",
         "adventure", "idea", "surprise", "friendship", "gift", "present", "party", "game", "games", "world", "day",
         "time", "plan", "noise", "sound", "bread", "milk", "juice", "apple", "pie", "sandwich", "lunch", "dinner")

SETTINGS = {  # entity -> places, surroundings or things it is usually found with
    "fish": ("pond", "water", "lake", "river", "sea", "ocean", "swim", "swam", "swimming"),
    "bird": ("sky", "tree", "trees", "nest", "fly", "flew", "flying", "wings", "branch"),
    "boat": ("water", "lake", "river", "sea", "ocean", "sail", "sailed", "waves", "shore"),
    "duck": ("pond", "water", "lake", "swim", "swam", "quack"),
    "frog": ("pond", "water", "lake", "jump", "jumped", "hopped", "hop"),
    "bee": ("flower", "flowers", "honey", "buzz", "garden", "hive"),
    "butterfly": ("flower", "flowers", "garden", "wings", "fly", "flew"),
    "squirrel": ("tree", "trees", "nuts", "nut", "branch", "park"),
    "owl": ("tree", "night", "wise", "branch", "hoot"),
    "car": ("road", "drive", "drove", "driving", "street", "fast", "wheels"),
    "truck": ("road", "drive", "drove", "driving", "street", "wheels"),
    "train": ("track", "tracks", "station", "choo"),
    "kite": ("sky", "wind", "fly", "flew", "flying", "string"),
    "snow": ("cold", "winter", "snowman", "white"),
    "sun": ("sky", "shining", "warm", "bright", "hot"),
    "star": ("sky", "night", "shining", "twinkle"),
    "moon": ("sky", "night", "stars"),
    "sand": ("beach", "castle", "sea", "ocean"),
    "shell": ("beach", "sea", "ocean", "sand"),
    "cake": ("birthday", "party", "eat", "ate", "candles", "oven"),
    "bed": ("sleep", "night", "asleep", "bedroom", "nap"),
    "doctor": ("sick", "hospital", "medicine", "hurt"),
    "teacher": ("school", "class", "learn", "students"),
    "farmer": ("farm", "cow", "cows", "pig", "field", "barn"),
    "lion": ("jungle", "roar", "roared", "zoo"),
    "monkey": ("jungle", "tree", "trees", "banana", "bananas", "zoo"),
    "dragon": ("fire", "cave", "castle", "fly", "flew"),
    "princess": ("castle", "king", "queen", "prince"),
    "rain": ("wet", "umbrella", "puddle", "clouds", "cloud"),
    "swing": ("park", "playground", "slide", "high"),
}

WORD_CLASSES = {
    "colour": ("red", "blue", "green", "yellow", "pink", "purple", "white", "black", "brown", "orange"),
    "animal": ("dog", "cat", "bird", "bear", "fish", "frog", "duck", "rabbit", "bunny", "mouse", "fox", "lion", "owl",
               "squirrel", "puppy", "kitten", "monkey", "elephant", "horse", "cow", "pig", "bee", "butterfly", "turtle"),
    "person": ("mom", "dad", "mommy", "daddy", "mum", "mama", "grandma", "grandpa", "brother", "sister", "teacher",
               "friend", "boy", "girl", "man", "lady", "woman", "farmer", "doctor", "king", "queen", "princess"),
    "name": ("lily", "timmy", "ben", "tom", "tim", "jack", "sam", "max", "lucy", "anna", "sara", "mia", "sue", "sarah",
             "bob", "jane", "joe", "molly", "daisy", "sally", "tommy", "amy", "billy", "jimmy", "emma", "mary"),
    "feeling": ("happy", "sad", "scared", "angry", "excited", "proud", "tired", "worried", "surprised", "upset",
                "curious", "afraid", "lonely", "grateful", "frustrated", "embarrassed", "nervous", "jealous"),
    "motion verb": ("ran", "walked", "jumped", "flew", "hopped", "swam", "climbed", "raced", "crawled", "rushed",
                    "danced", "skipped"),
    "speech verb": ("said", "asked", "replied", "shouted", "yelled", "whispered", "screamed", "exclaimed", "cried",
                    "answered", "called"),
    "number": ("one", "two", "three", "four", "five", "six", "ten"),
    "place": ("park", "house", "garden", "forest", "school", "store", "kitchen", "room", "beach", "lake", "pond",
              "river", "sea", "sky", "castle", "cave", "woods", "town", "farm", "yard", "backyard", "jungle", "zoo"),
}


def _in_vocab(words, vocab) -> list[str]:
    seen, out = set(), []
    for w in words:
        if w in vocab.index and w not in seen:
            seen.add(w)
            out.append(w)
    return out


def top_successors(B: torch.Tensor, vocab, word: str, k: int = 5) -> list[str]:
    """The k outputs with the largest B[word, :] (ranking a row of B is ranking P(next | word))."""
    row = B[vocab.index[word]]
    return vocab.decode(row.topk(min(k, len(row))).indices)


def adjective_noun_share(B: torch.Tensor, vocab, k: int = 5, n_baseline: int = 200) -> tuple[float, float, int]:
    """(share of listed nouns among the top-k B successors of the listed adjectives, the same share
    for the `n_baseline` most frequent words that are not listed adjectives (the baseline), number
    of adjectives in the vocabulary)."""
    adjectives = _in_vocab(ADJECTIVES, vocab)
    nouns = set(NOUNS)

    def share(words):
        hits = [w in nouns for word in words for w in top_successors(B, vocab, word, k)]
        return float(np.mean(hits)) if hits else float("nan")

    others = [w for w in vocab.tokens[:n_baseline + len(adjectives)] if w not in set(ADJECTIVES)][:n_baseline]
    return share(adjectives), share(others), len(adjectives)


def context_lift(joint: torch.Tensor) -> torch.Tensor:
    """J[k, c] / (J[k, :].sum() J[:, c].sum()) for the context joint J (`lt.context_joint`; Phi is J
    minus its 1/|V| part). A column of Phi ranks outputs mostly by their frequency; the lift ranks
    how much more often k follows c in the context than their frequencies alone imply."""
    outer = joint.sum(1, keepdim=True) * joint.sum(0, keepdim=True)
    return torch.where(outer > 0, joint / outer.clamp(min=1e-300), torch.zeros_like(joint))


def top_context_partners(lift: torch.Tensor, vocab, word: str, k: int = 10, min_count: int = 20) -> list[str]:
    """The k outputs whose lift with `word` in the context is largest (outputs seen >= min_count times)."""
    col = lift[:, vocab.index[word]].clone()
    rare = torch.tensor([c < min_count for c in vocab.counts])
    col[rare] = -float("inf")
    return vocab.decode(col.topk(min(k, len(col))).indices)


def setting_hit_rate(lift: torch.Tensor, vocab, k: int = 20, min_count: int = 20) -> tuple[float, float, int]:
    """(share of listed entities with one of their settings among their top-k context partners,
    the same share with every other entity's settings (the baseline: do settings words rank high
    anyway?), number of entities in the vocabulary)."""
    entities = [e for e in _in_vocab(SETTINGS, vocab) if vocab.counts[vocab.index[e]] >= min_count]
    tops = {e: set(top_context_partners(lift, vocab, e, k, min_count)) for e in entities}
    own = [bool(tops[e] & set(SETTINGS[e])) for e in entities]
    other = [bool(tops[e] & set(SETTINGS[f])) for e in entities for f in entities
             if f != e and not set(SETTINGS[f]) & set(SETTINGS[e])]
    mean = lambda xs: float(np.mean(xs)) if xs else float("nan")
    return mean(own), mean(other), len(entities)


def similarity(Sigma_B: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of the outputs' columns of B: Sigma_B[k, k'] / sqrt(Sigma_B[k, k] Sigma_B[k', k'])."""
    d = Sigma_B.diagonal().clamp(min=1e-300).sqrt()
    return Sigma_B / d[:, None] / d[None, :]


def neighbours(Sigma_B: torch.Tensor, vocab, word: str, k: int = 6, among: Sequence[str] | None = None) -> list[str]:
    """The k words most interchangeable with `word` (largest Sigma_B similarity), optionally among a list."""
    sim = similarity(Sigma_B)[vocab.index[word]].clone()
    sim[vocab.index[word]] = -float("inf")
    if among is not None:
        keep = torch.zeros_like(sim, dtype=torch.bool)
        keep[[vocab.index[w] for w in among if w in vocab.index]] = True
        sim[~keep] = -float("inf")
    return vocab.decode(sim.topk(k).indices)


def class_purity(Sigma_B: torch.Tensor, vocab) -> tuple[float, float, int]:
    """(share of listed words whose nearest Sigma_B neighbour among all listed words is in their
    own class, the share a random neighbour would give (the baseline), number of listed words)."""
    word_class = {}
    for name, words in WORD_CLASSES.items():
        for w in _in_vocab(words, vocab):
            word_class.setdefault(w, name)  # a word in two lists keeps its first class
    words = list(word_class)
    if len(words) < 3:
        return float("nan"), float("nan"), len(words)
    same = [word_class[neighbours(Sigma_B, vocab, w, 1, among=words)[0]] == word_class[w] for w in words]
    sizes = pd.Series(word_class).value_counts()
    chance = float(np.mean([(sizes[word_class[w]] - 1) / (len(words) - 1) for w in words]))
    return float(np.mean(same)), chance, len(words)


def top_pairs(M: torch.Tensor, vocab, k: int = 10, rows: Sequence[str] | None = None,
              cols: Sequence[str] | None = None) -> pd.DataFrame:
    """The k largest entries of a map (optionally restricted to listed row and column words)."""
    M = M.clone()
    if rows is not None:
        keep = torch.zeros(M.shape[0], dtype=torch.bool)
        keep[[vocab.index[w] for w in rows if w in vocab.index]] = True
        M[~keep] = -float("inf")
    if cols is not None:
        keep = torch.zeros(M.shape[1], dtype=torch.bool)
        keep[[vocab.index[w] for w in cols if w in vocab.index]] = True
        M[:, ~keep] = -float("inf")
    vals, idx = M.flatten().topk(k)
    r, c = idx // M.shape[1], idx % M.shape[1]
    return pd.DataFrame({"row": vocab.decode(r), "column": vocab.decode(c), "value": vals.tolist()})


# =============================================================================
# Early training of a language model (LT-6)
# =============================================================================
# The paper compares Pythia-1.4B's checkpoints step0..step512 with the leading-term features. The
# book's comparison, for any causal LM with untied embedding W_E [V, d] and unembedding W_U [d, V]
# (a TransformerBridge or the book's ToyTransformer):
#   embeddings   the first gradient step moves W_E by -eta dL/dW_E = eta B W_U(0)^T (up to the
#                layers between them) and W_U by eta W_E(0)^T B; we compare the displacement
#                W_E(s) - W_E(0) on the frequent tokens with B W_U(0)^T, and W_U(s) - W_U(0) with
#                W_E(0)^T B (cosines);
#   attention    per layer, the mean pre-softmax score from a query token a to a key token b on
#                corpus text (averaged over heads and positions), minus its value at step 0,
#                against the attention feature Q[a, b], both centred over keys (softmax ignores a
#                per-query constant), on the frequent tokens.
# Baselines: the same cosines with the feature's token labels permuted at random.

LM_CHECKPOINTS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # the paper's Pythia checkpoints
PAPER_LM = "pythia-1.4b"  # a checkpoint folder whose parent's name holds this is the paper's model


def gpt_config(cfg, vocab_size: int, seq_len: int):
    """A small GPT-style ToyTransformer (pre-LN, MLP, learned positions, untied unembedding)."""
    from ..models.toy import ToyConfig

    return ToyConfig(d_vocab=vocab_size, n_ctx=seq_len, d_model=cfg.lm_d_model, n_layers=cfg.lm_layers,
                     n_heads=cfg.lm_heads, d_mlp=4 * cfg.lm_d_model, normalization="LN", positional="learned",
                     bias=True)


def train_gpt(cfg, corpus: corpus_lib.Corpus, progress: bool | None = None) -> Run:
    """Train the substitute LM with AdamW (as Pythia) and checkpoints at 1, 2, 4, ..., lm_steps."""
    task = corpus_lib.CorpusTask(corpus, shuffle_seed=cfg.seed)
    n_log = 2 * int(round(math.log2(cfg.lm_steps)))  # round(steps^(i/n)) hits every power of 2
    tc = TrainConfig(steps=cfg.lm_steps, batch_size=min(cfg.lm_batch_size, len(task)), seeds=(cfg.seed,),
                     lr=cfg.lm_lr, weight_decay=0.01, optimizer="adamw", eval_every=max(1, cfg.lm_steps // 32),
                     log_checkpoints=n_log)
    return _train("leading_terms/early_lm", gpt_config(cfg, len(corpus.vocab), corpus.seq_len), task, tc,
                  progress=progress)


def frequent_ids(inputs: torch.Tensor, k: int) -> torch.Tensor:
    """The k most frequent token ids of a batch."""
    counts = torch.bincount(inputs.reshape(-1))
    return counts.topk(min(k, int((counts > 0).sum()))).indices.sort().values


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return lt.cosine(a, b)


def embedding_agreement(W_E0, W_E, W_U0, W_U, B: torch.Tensor, ids: torch.Tensor, n_perm: int = 20,
                        seed: int = 0) -> dict:
    """Cosines of the embedding and unembedding displacements with their first-step directions on
    the tokens `ids`, and their permutation baselines (mean and std over n_perm shuffles of the
    feature's token labels: B[perm][:, perm])."""
    B, W_E0, W_U0 = B.double(), W_E0.double(), W_U0.double()
    dE = (W_E.double() - W_E0)[ids]
    dU = (W_U.double() - W_U0)[:, ids]
    gen = torch.Generator().manual_seed(seed)
    base_E, base_U = [], []
    for _ in range(n_perm):
        perm = torch.randperm(len(B), generator=gen)
        base_E.append(_cos(dE, B[perm[ids]][:, perm] @ W_U0.T))
        base_U.append(_cos(dU, W_E0.T @ B[:, perm[ids]][perm]))
    return {"embed": _cos(dE, B[ids] @ W_U0.T), "embed_base_mean": float(np.mean(base_E)),
            "embed_base_std": float(np.std(base_E)), "unembed": _cos(dU, W_E0.T @ B[:, ids]),
            "unembed_base_mean": float(np.mean(base_U)), "unembed_base_std": float(np.std(base_U))}


@torch.no_grad()
def attention_token_scores(model, tokens: torch.Tensor, ids: torch.Tensor, chunk: int = 16) -> torch.Tensor:
    """[n_layers, K, K]: mean pre-softmax score (over heads, positions and occurrences) from a query
    token ids[a] to a key token ids[b], causal pairs only; NaN where a pair never occurs."""
    n_layers = model.cfg.n_layers
    K = len(ids)
    lookup = torch.full((max(int(tokens.max()), int(ids.max())) + 1,), -1, dtype=torch.long)
    lookup[ids] = torch.arange(K)
    sums = torch.zeros(n_layers, K * K, dtype=torch.float64)
    counts = torch.zeros(K * K, dtype=torch.float64)
    names = [f"blocks.{l}.attn.hook_attn_scores" for l in range(n_layers)]
    for s in range(0, len(tokens), chunk):
        x = tokens[s:s + chunk]
        n, T = x.shape
        _, cache = model.run_with_cache(x, names_filter=lambda name: name in names)
        q, k = lookup[x][:, :, None].expand(n, T, T), lookup[x][:, None, :].expand(n, T, T)
        keep = (q >= 0) & (k >= 0) & torch.tril(torch.ones(T, T, dtype=torch.bool))
        flat = (q * K + k)[keep]
        counts += torch.bincount(flat, minlength=K * K).double()
        for l, name in enumerate(names):
            scores = cache[name].double().mean(1)  # over heads: [n, T, T]
            sums[l] += torch.bincount(flat, weights=scores[keep], minlength=K * K)
    out = sums / counts
    out[:, counts == 0] = float("nan")
    return out.reshape(n_layers, K, K)


def _centred_over_keys(M: torch.Tensor) -> torch.Tensor:
    """Subtract each query row's mean over the keys it has (NaN entries ignored, then set to 0)."""
    mean = torch.nanmean(M, dim=-1, keepdim=True)
    return torch.nan_to_num(M - mean, nan=0.0)


def attention_agreement(scores: torch.Tensor, scores0: torch.Tensor, Q: torch.Tensor, ids: torch.Tensor,
                        n_perm: int = 20, seed: int = 0) -> pd.DataFrame:
    """Per layer: cosine of the score change (query x key, centred over keys) with Q on `ids`, and
    its permutation baseline (Q with its token labels shuffled)."""
    Q = Q.double()
    seen = ~torch.isnan(scores[0])
    gen = torch.Generator().manual_seed(seed)
    target = _centred_over_keys(torch.where(seen, Q[ids][:, ids], torch.nan))
    shuffled = []
    for _ in range(n_perm):
        pi = torch.randperm(len(Q), generator=gen)[ids]
        shuffled.append(_centred_over_keys(torch.where(seen, Q[pi][:, pi], torch.nan)))
    rows = []
    for l in range(scores.shape[0]):
        delta = _centred_over_keys(torch.where(seen, scores[l] - scores0[l], torch.nan))
        base = [_cos(delta, t) for t in shuffled]
        rows.append({"layer": l, "cosine": _cos(delta, target), "base_mean": float(np.mean(base)),
                     "base_std": float(np.std(base))})
    return pd.DataFrame(rows)


def agrees(value: float, base_mean: float, base_std: float, z: float = 3.0) -> bool:
    """A positive agreement beyond z standard deviations of its permutation baseline."""
    return bool(value > 0 and value > base_mean + z * max(base_std, 1e-12))


@dataclass
class EarlyLM:
    """Checkpoints of one language model and the corpus batch it is judged on."""

    name: str  # what the page and the scorecard row call the model
    substitute: bool  # True: the book's GPT-style model, not the paper's Pythia-1.4B
    steps: list[int]
    load: callable  # step -> model with W_E, W_U, cfg.n_layers and run_with_cache
    tokens: torch.Tensor  # [n, T] model token ids
    seen: torch.Tensor  # model ids of the tokens that occur in `tokens` (the compact vocabulary)
    n_vocab: int  # the model's vocabulary size
    run: Run | None = None  # the book's run (the substitute), None for loaded checkpoints


def _checkpoint_step(path: str) -> int:
    import re

    found = re.findall(r"step[_-]?(\d+)", str(path))
    if not found:
        raise ValueError(f"checkpoint_dirs: cannot read a step from {path!r}; name each folder after its step "
                         f"(e.g. .../step512), as Pythia's revisions are named")
    return int(found[-1])


def substitute_lm(cfg, progress: bool | None = None) -> EarlyLM:
    """The offline substitute: the book's GPT-style model trained here on the chapter's corpus."""
    corpus = load_corpus(cfg)
    run = train_gpt(cfg, corpus, progress=progress)
    steps = [s for s in run.checkpoint_steps() if s == 0 or (s & (s - 1)) == 0]  # 0 and the powers of 2
    tokens = corpus.inputs[:cfg.lm_eval_samples]
    return EarlyLM(f"book GPT-style ToyTransformer ({cfg.lm_layers} layers, d_model {cfg.lm_d_model})", True, steps,
                   lambda step: run.model(0, step), tokens, torch.arange(len(corpus.vocab)), len(corpus.vocab), run)


def pretrained_lm(cfg) -> EarlyLM:
    """Local checkpoints (e.g. Pythia-1.4B-deduped step0..step512), loaded through TransformerBridge."""
    from ..models import pretrained

    dirs = sorted(cfg.checkpoint_dirs, key=_checkpoint_step)
    missing = [d for d in dirs if not pretrained.availability(d)[0]]
    if missing:
        raise FileNotFoundError(f"checkpoint_dirs: {missing} are not local Hugging Face model folders")
    first = pretrained.load_bridge(dirs[0])
    stories = [corpus_lib.repair_mojibake(s) for s in corpus_lib.read_stories(cfg.get("tinystories_path"),
                                                                            max_stories=20 * cfg.lm_eval_samples)]
    ids: list[int] = []
    for story in stories:
        ids += first.tokenizer(story)["input_ids"]
        if len(ids) >= cfg.lm_eval_samples * cfg.seq_len:
            break
    n = len(ids) // cfg.seq_len
    tokens = torch.tensor(ids[:n * cfg.seq_len]).reshape(n, cfg.seq_len)
    by_step = {_checkpoint_step(d): d for d in dirs}
    from pathlib import Path

    name = ", ".join(sorted({Path(d).expanduser().resolve().parent.name for d in dirs}))
    return EarlyLM(name, PAPER_LM not in name.lower(), sorted(by_step),
                   lambda step: pretrained.load_bridge(by_step[step]).bridge, tokens, tokens.unique(),
                   int(first.bridge.cfg.d_vocab))


def early_agreement(lm: EarlyLM, n_frequent: int = 200, n_perm: int = 20) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(embedding frame: step, embed, unembed + baselines; attention frame: step, layer, cosine +
    baseline) of every checkpoint of `lm` against the leading-term features of its corpus batch."""
    compact = torch.full((lm.n_vocab,), -1, dtype=torch.long)
    compact[lm.seen] = torch.arange(len(lm.seen))
    x = compact[lm.tokens]
    stats = lt.leading_stats(x[:, :-1], x[:, 1:], len(lm.seen), n_classes=lm.n_vocab)
    frequent = frequent_ids(x[:, :-1], n_frequent)  # compact ids
    model_ids = lm.seen[frequent]
    m0 = lm.load(lm.steps[0])
    W_E0, W_U0 = m0.W_E.detach()[lm.seen], m0.W_U.detach()[:, lm.seen]
    scores0 = attention_token_scores(m0, lm.tokens, model_ids)
    emb_rows, att_rows = [], []
    for step in lm.steps[1:]:
        m = lm.load(step)
        e = embedding_agreement(W_E0, m.W_E.detach()[lm.seen], W_U0, m.W_U.detach()[:, lm.seen], stats.B, frequent,
                                n_perm=n_perm)
        emb_rows.append({"step": step, **e})
        att = attention_agreement(attention_token_scores(m, lm.tokens, model_ids), scores0, stats.Q, frequent,
                                  n_perm=n_perm)
        att["step"] = step
        att_rows.append(att)
    return pd.DataFrame(emb_rows), pd.concat(att_rows, ignore_index=True)


# =============================================================================
# Bookkeeping shown on the pages
# =============================================================================

# LT-4: the paper's losses after removing each weight's leading-term projection (its table, for
# the side-by-side comparison; the scorecard's rules never read these numbers).
PAPER_ABLATION = {"none": 5.349, "W0": 5.350, "W1": 5.352, "W2": 5.361, "V0": 6.192, "V1": 6.526, "V2": 6.520,
                  "W_O": 8.287}


def activation_gib(batch: int, seq_len: int, vocab_size: int, n_layers: int, members: int = 1) -> float:
    """Rough memory of one forward + backward pass: about 5 [batch, T, |V|] float32 tensors per
    layer (the dense residual, h W, h V, the read-out, their gradients' buffers) plus 3 for the
    logits and their log-softmax, per ensemble member."""
    per = batch * seq_len * vocab_size * 4
    return (5 * n_layers + 3) * per * members / 2 ** 30


def embedding_summary(emb: pd.DataFrame, key: str = "embed") -> dict:
    """The checkpoint where the (un)embedding agrees best: its cosine, its baseline there
    (shuffled-token mean + 3 sd) and whether any checkpoint agrees (`agrees`)."""
    best = emb.loc[emb[key].idxmax()]
    return {"step": int(best["step"]), "cosine": float(best[key]),
            "baseline": float(best[f"{key}_base_mean"] + 3 * best[f"{key}_base_std"]),
            "agrees": any(agrees(r[key], r[f"{key}_base_mean"], r[f"{key}_base_std"]) for _, r in emb.iterrows())}


def attention_summary(att: pd.DataFrame) -> pd.DataFrame:
    """Per layer: its best cosine with Q over the checkpoints and whether any checkpoint agrees."""
    flags = att.assign(agrees=[agrees(r.cosine, r.base_mean, r.base_std) for r in att.itertuples()])
    return flags.groupby("layer").agg(best_cosine=("cosine", "max"), agrees=("agrees", "any")).reset_index()


WEIGHT_TITLES = {"W": "attention W", "V": "value V", "P": "positional P", "W_O": "output W_O"}


def plot_cosines(frame: pd.DataFrame, lr: float, levels=(0.9,)):
    """One panel per weight kind (W, V, P, W_O), one line per layer: cosine with the leading term
    against s * eta for one learning rate, a dotted line at each of `levels`. Returns the figure."""
    from .. import plotting

    sub = frame[np.isclose(frame["lr"], lr)].copy()
    sub["layer"] = sub["layer"].map(lambda l: "output" if l < 0 else f"layer {l}")
    fig, axes = plotting.figure(ncols=2, nrows=2, height=6)
    for ax, kind in zip(axes.flat, ("W", "V", "P", "W_O")):
        plotting.curves(ax, sub[sub["kind"] == kind], x="s_eta", y="cosine", hue="layer", title=WEIGHT_TITLES[kind],
                        xlabel="$s\\eta$ (steps x learning rate)", ylabel="cosine with leading term")
        for level in levels:
            ax.axhline(level, color="0.5", lw=0.8, ls=":")
    fig.suptitle(f"learning rate {lr:g}")
    return fig
