"""Measurements of chapter leading_terms: pure functions of models, maps and metrics (known-answer
tests in tests/test_experiments_leading_terms.py).

Training curves (LT-1, LT-2, LT-5)   `cosine_frame`, `min_cosines`, `s_eta_until_below`
Ablation (LT-4)                      `mean_loss`, `loss_with`, `ablation_table`, `undone_fractions`,
                                     `baseline_table`
Basis maps (LT-3)                    the word lists `ADJECTIVES`, `NOUNS`, `SETTINGS`, `WORD_CLASSES`;
                                     `top_successors`, `top_context_partners`, `neighbours`, `top_pairs`,
                                     `adjective_noun_share`, `setting_hit_rate`, `class_purity`
Early training of an LM (LT-6)       `early_agreement` (through analysis.leading_terms'
                                     `embedding_agreement`, `attention_token_scores`, `attention_agreement`)
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import torch

from ...analysis import leading_terms as lt
from ...models.onehot import OneHotTransformer
from ...tasks.base import derive_seed


# =============================================================================
# Training curves (LT-1, LT-2, LT-5)
# =============================================================================

def cosine_frame(metrics: pd.DataFrame, lrs: Sequence[float], steps_per_epoch: int) -> pd.DataFrame:
    """Long format of a run's metrics (one member per learning rate `lrs`): step, epoch, member, lr,
    s_eta, train_loss, weight, kind, layer, cosine."""
    m = metrics
    cos_cols = [c for c in m.columns if c.startswith("cos_")]
    long = m.melt(id_vars=["step", "member", "train_loss"], value_vars=cos_cols, var_name="weight",
                  value_name="cosine")
    long["weight"] = long["weight"].str.removeprefix("cos_")
    long["kind"] = long["weight"].map(lt.kind_of)
    long["layer"] = long["weight"].map(lambda w: -1 if w == "W_O" else int(w[1:]))
    long["lr"] = long["member"].map(lambda k: lrs[int(k)])
    long["s_eta"] = long["step"] * long["lr"]
    long["epoch"] = long["step"] / steps_per_epoch
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


def neighbours(Sigma_B: torch.Tensor, vocab, word: str, k: int = 6, among: Sequence[str] | None = None) -> list[str]:
    """The k words most interchangeable with `word` (largest Sigma_B similarity), optionally among a list."""
    sim = lt.similarity(Sigma_B)[vocab.index[word]].clone()
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

def early_agreement(lm, steps: Sequence[int], tokens: torch.Tensor, seen: torch.Tensor, n_vocab: int,
                    n_frequent: int = 200, n_perm: int = 20) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(embedding frame: step, embed, unembed + baselines; attention frame: step, layer, cosine +
    baseline) of the checkpoints `steps` of a language model (run-like: `lm.model(0, step)` has W_E,
    W_U, cfg.n_layers and run_with_cache), each step against the first, compared with the
    leading-term features of the corpus batch `tokens` ([n, T] model token ids). seen: the model ids
    that occur in `tokens` (the compact vocabulary the features are computed on); n_vocab: the
    model's vocabulary size."""
    compact = torch.full((n_vocab,), -1, dtype=torch.long)
    compact[seen] = torch.arange(len(seen))
    x = compact[tokens]
    stats = lt.leading_stats(x[:, :-1], x[:, 1:], len(seen), n_classes=n_vocab)
    frequent = lt.frequent_ids(x[:, :-1], n_frequent)  # compact ids
    model_ids = seen[frequent]
    m0 = lm.model(0, steps[0])
    W_E0, W_U0 = m0.W_E.detach()[seen], m0.W_U.detach()[:, seen]
    scores0 = lt.attention_token_scores(m0, tokens, model_ids)
    emb_rows, att_rows = [], []
    for step in steps[1:]:
        m = lm.model(0, step)
        e = lt.embedding_agreement(W_E0, m.W_E.detach()[seen], W_U0, m.W_U.detach()[:, seen], stats.B, frequent,
                                   n_perm=n_perm)
        emb_rows.append({"step": step, **e})
        att = lt.attention_agreement(lt.attention_token_scores(m, tokens, model_ids), scores0, stats.Q, frequent,
                                     n_perm=n_perm)
        att["step"] = step
        att_rows.append(att)
    return pd.DataFrame(emb_rows), pd.concat(att_rows, ignore_index=True)
