"""Word-level (and BPE) TinyStories for the `leading_terms` chapter.

The paper's pipeline (Im, Oh, Fang, Li 2026): lowercase the stories, split them into words and
punctuation, keep the |V| most frequent tokens (space and newline are never tokens here: the
splitter drops whitespace), and cut samples of T + 1 tokens that lie entirely in the vocabulary;
the model reads tokens 0..T-1 and predicts tokens 1..T.

Sources (nothing is downloaded):

- the book's TinyStories sample (one story per line-block; stories separated by a single
  newline between two non-empty lines, paragraphs by a blank line), given as a file path by the
  chapter's `tinystories_path` parameter or `$CIRCUITBOOK_TINYSTORIES`;
- a local copy of the full data set as its publishers ship it: `TinyStories-*.txt` /
  `TinyStoriesV2-*.txt` (stories separated by `<|endoftext|>`), the Hugging Face parquet shards
  (`train-*.parquet`, column `text`), or the `TinyStories_all_data` JSON files (field `story`);
  a folder holding any of these works too.

Mojibake: the source text holds UTF-8 quotes, apostrophes and dashes decoded as Latin-1/cp1252
(`â€œ`, `â€™`, ...). `repair_mojibake` maps them (and the proper Unicode quotes) to the ASCII
characters the rest of the text uses, so that `"` and `'` are one token each instead of three
junk tokens (`â`, `€`, `œ`). It is on by default (`repair=True`) and a parameter of the chapter.

Sampling (`sampling`): "stories", as in the paper -- every story that is entirely in the
vocabulary and at least T + 1 tokens long, truncated to its first T + 1 tokens; or "windows" --
consecutive non-overlapping windows of T + 1 tokens cut from each story's in-vocabulary runs
(many more samples from a small corpus, but some windows start mid-sentence).

A short corpus (`short_corpus`): when the source holds fewer samples than `n_samples` asks for,
"error" refuses it (CorpusError), so that a profile naming the paper's n_samples is never run on
a fraction of its data without a word; "all" keeps every sample there is and says so in the
corpus's `info` (`short`, `samples_asked`), for the chapter to state the deviation on its rows.
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch

from .base import Batch, EpochSampler, FixedDataset

ENV_VAR = "CIRCUITBOOK_TINYSTORIES"
SAMPLINGS = ("stories", "windows")
TOKENIZERS = ("word", "bpe")
SHORT_CORPUS = ("error", "all")  # fewer samples than n_samples: refuse, or keep all there are
END_OF_TEXT = "<|endoftext|>"
WORD_PATTERN = re.compile(r"\w+|[^\w\s]")
STORY_BOUNDARY = re.compile(r"(?<=[^\n])\n(?=[^\n])")  # the sample's story separator

# UTF-8 punctuation decoded as cp1252, longest first; the closing quote's last byte (0x9d) has no
# cp1252 character and is missing in the source, so a lone "â€" is a closing quote.
MOJIBAKE = [("â€œ", '"'), ("â€\x9d", '"'), ("â€™", "'"), ("â€˜", "'"), ("â€“", "-"), ("â€”", "-"),
            ("â€¦", "..."), ("â€", '"'), ("“", '"'), ("”", '"'), ("’", "'"), ("‘", "'"), ("–", "-"),
            ("—", "-"), ("…", "...")]


class CorpusError(ValueError):
    """A corpus source that is missing or not in a known format."""


# ---------------------------------------------------------------- reading

def resolve_source(path: str | os.PathLike | None = None) -> Path:
    """The corpus path: the argument, else $CIRCUITBOOK_TINYSTORIES; a clear error if neither exists."""
    raw = path if path not in (None, "") else os.environ.get(ENV_VAR)
    if raw in (None, ""):
        raise CorpusError(f"no TinyStories source: set the chapter parameter `tinystories_path` or the environment "
                          f"variable {ENV_VAR} to the book's sample (tinystories_lower_4MB.txt) or to a local copy "
                          f"of the full data set (TinyStories-*.txt, train-*.parquet or TinyStories_all_data/*.json)")
    p = Path(raw).expanduser()
    if not p.exists():
        where = "tinystories_path" if path not in (None, "") else ENV_VAR
        raise CorpusError(f"{where}={str(raw)!r}: no such file or folder")
    return p


def _source_files(p: Path) -> list[Path]:
    if p.is_file():
        return [p]
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in (".txt", ".parquet", ".json")
                   and "valid" not in f.name.lower())
    if not files:
        raise CorpusError(f"{p}: the folder holds no .txt, .parquet or .json TinyStories files")
    return files


def _read_file(f: Path) -> list[str]:
    if f.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(f)
        if "text" not in table.column_names:
            raise CorpusError(f"{f}: a TinyStories parquet shard needs a 'text' column; it has {table.column_names}")
        return [s for s in table.column("text").to_pylist() if s]
    if f.suffix == ".json":
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise CorpusError(f"{f}: not valid JSON ({e})") from None
        if not isinstance(data, list) or (data and not isinstance(data[0], dict)) or \
                (data and "story" not in data[0]):
            raise CorpusError(f"{f}: expected the TinyStories_all_data format, a list of objects with a 'story' field")
        return [d["story"] for d in data if d.get("story")]
    if f.suffix != ".txt":
        raise CorpusError(f"{f}: unknown format {f.suffix!r}; expected .txt, .parquet or .json")
    try:
        text = f.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(f"{f}: not UTF-8 text ({e})") from None
    parts = text.split(END_OF_TEXT) if END_OF_TEXT in text else STORY_BOUNDARY.split(text)
    return [s.strip() for s in parts if s.strip()]


def read_stories(path: str | os.PathLike | None = None, max_stories: int | None = None) -> list[str]:
    """The stories of a TinyStories source (see the module docstring), in file order."""
    stories: list[str] = []
    for f in _source_files(resolve_source(path)):
        stories += _read_file(f)
        if max_stories is not None and len(stories) >= max_stories:
            return stories[:max_stories]
    if not stories:
        raise CorpusError(f"{resolve_source(path)}: no stories found")
    return stories


def repair_mojibake(text: str) -> str:
    for bad, good in MOJIBAKE:
        text = text.replace(bad, good)
    return text


def word_tokenize(text: str) -> list[str]:
    """Lowercased words and single punctuation marks; whitespace is never a token."""
    return WORD_PATTERN.findall(text.lower())


# ---------------------------------------------------------------- vocabulary

@dataclass
class Vocab:
    """Tokens by id (most frequent first) and their corpus counts."""

    tokens: list[str]
    counts: list[int]
    index: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self):
        self.index = {t: i for i, t in enumerate(self.tokens)}

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, words: Sequence[str]) -> list[int]:
        """Ids, -1 for a word outside the vocabulary."""
        return [self.index.get(w, -1) for w in words]

    def decode(self, ids: Iterable[int]) -> list[str]:
        return [self.tokens[int(i)] for i in ids]


def build_vocab(tokenized: Iterable[Sequence[str]], size: int) -> Vocab:
    """The `size` most frequent tokens; ties broken by first appearance (Counter order)."""
    if size < 1:
        raise ValueError(f"vocab_size={size} is not allowed; expected an integer >= 1")
    counts = collections.Counter()
    for words in tokenized:
        counts.update(words)
    counts.pop(" ", None), counts.pop("\n", None)
    if len(counts) < size:
        raise CorpusError(f"vocab_size={size} is larger than the corpus's {len(counts)} distinct tokens")
    top = counts.most_common(size)
    return Vocab([t for t, _ in top], [c for _, c in top])


# ---------------------------------------------------------------- sampling

def cut_samples(encoded: Iterable[Sequence[int]], length: int, sampling: str) -> list[list[int]]:
    """Samples of `length` ids, all in the vocabulary (ids >= 0), in corpus order."""
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling={sampling!r} is not allowed; expected one of {SAMPLINGS}")
    out = []
    for ids in encoded:
        if sampling == "stories":
            if len(ids) >= length and min(ids) >= 0:
                out.append(list(ids[:length]))
            continue
        run: list[int] = []
        for i in list(ids) + [-1]:  # a trailing out-of-vocabulary marker flushes the last run
            if i >= 0:
                run.append(i)
                if len(run) == length:
                    out.append(run)
                    run = []
            else:
                run = []
    return out


# ---------------------------------------------------------------- the corpus

@dataclass
class Corpus:
    """Samples [n, T + 1] (int64) and the vocabulary they index."""

    samples: torch.Tensor
    vocab: Vocab
    info: dict

    @property
    def seq_len(self) -> int:
        return self.samples.shape[1] - 1

    @property
    def inputs(self) -> torch.Tensor:
        return self.samples[:, :-1]

    @property
    def targets(self) -> torch.Tensor:
        return self.samples[:, 1:]

    def decode(self, ids) -> str:
        return " ".join(self.vocab.decode(ids))


def _check(name, value, ok, allowed):
    if not ok:
        raise ValueError(f"{name}={value!r} is not allowed; expected {allowed}")


def load_corpus(path: str | os.PathLike | None = None, *, vocab_size: int, seq_len: int, n_samples: int | None = None,
                sampling: str = "stories", tokenizer: str = "word", repair: bool = True,
                max_stories: int | None = None, short_corpus: str = "error") -> Corpus:
    """Tokenize a TinyStories source and cut samples of seq_len + 1 tokens.

    tokenizer "word": the paper's word-level vocabulary of the `vocab_size` most frequent
    tokens. "bpe": a byte-pair-encoding vocabulary of `vocab_size` tokens trained on the same
    stories with the `tokenizers` library (every token is in its vocabulary). n_samples keeps
    the first samples in corpus order (None: all); a source with fewer is refused (CorpusError)
    unless short_corpus="all", which keeps all it has (info["short"] True, info["samples_asked"]
    the n_samples asked for).
    """
    _check("sampling", sampling, sampling in SAMPLINGS, f"one of {SAMPLINGS}")
    _check("tokenizer", tokenizer, tokenizer in TOKENIZERS, f"one of {TOKENIZERS}")
    _check("vocab_size", vocab_size, isinstance(vocab_size, int) and vocab_size >= 2, "an integer >= 2")
    _check("seq_len", seq_len, isinstance(seq_len, int) and seq_len >= 1, "an integer >= 1")
    _check("n_samples", n_samples, n_samples is None or (isinstance(n_samples, int) and n_samples >= 1),
           "None or an integer >= 1")
    _check("short_corpus", short_corpus, short_corpus in SHORT_CORPUS, f"one of {SHORT_CORPUS}")
    source = resolve_source(path)
    stories = read_stories(source, max_stories)
    if repair:
        stories = [repair_mojibake(s) for s in stories]
    if tokenizer == "word":
        tokenized = [word_tokenize(s) for s in stories]
        vocab = build_vocab(tokenized, vocab_size)
        encoded = [vocab.encode(w) for w in tokenized]
    else:
        vocab, encoded = bpe_encode(stories, vocab_size)
    samples = cut_samples(encoded, seq_len + 1, sampling)
    available = len(samples)
    if not samples:
        raise CorpusError(f"no sample of {seq_len + 1} in-vocabulary tokens in {source} with vocab_size={vocab_size} "
                          f"and sampling={sampling!r}; try a smaller seq_len, a larger vocab_size or "
                          f"sampling='windows'")
    short = n_samples is not None and available < n_samples
    if short and short_corpus == "error":
        # Never train on fewer samples than asked for without a word: a profile that names the paper's
        # n_samples would otherwise be graded as the paper's setting on a fraction of its data.
        kind = "whole stories" if sampling == "stories" else "windows"
        raise CorpusError(f"only {available} {kind} of {seq_len + 1} in-vocabulary tokens in {source} "
                          f"(vocab_size={vocab_size}), but n_samples = {n_samples}; point tinystories_path or "
                          f"CIRCUITBOOK_TINYSTORIES at the full data set, or set n_samples (null: all, "
                          f"shown on the scorecard as a deviation), sampling='windows' or short_corpus='all' "
                          f"(all there are, the deviation stated on the rows)")
    if n_samples is not None:
        samples = samples[:n_samples]
    n_tokens = sum(len(e) for e in encoded)
    in_vocab = sum(sum(i >= 0 for i in e) for e in encoded)
    info = {"source": str(source), "stories": len(stories), "tokens": n_tokens,
            "coverage": in_vocab / max(n_tokens, 1), "samples_available": available, "samples": len(samples),
            "samples_asked": n_samples, "short": short, "sampling": sampling, "tokenizer": tokenizer,
            "repair": repair}
    return Corpus(torch.tensor(samples, dtype=torch.long), vocab, info)


def bpe_encode(stories: Sequence[str], vocab_size: int) -> tuple[Vocab, list[list[int]]]:
    """Train a BPE vocabulary of `vocab_size` tokens on the lowercased stories and encode them.

    Pre-tokenization splits on whitespace and punctuation (as the word-level tokenizer does), so
    spaces and newlines are never tokens and merges stay inside words. Deterministic for a given
    corpus (tokenizers' BPE trainer breaks ties by order).
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=[])
    tok.train_from_iterator(stories, trainer=trainer)
    encoded = [e.ids for e in tok.encode_batch(list(stories))]
    size = tok.get_vocab_size()
    counts = [0] * size
    for ids in encoded:
        for i in ids:
            counts[i] += 1
    id_to_token = {i: t for t, i in tok.get_vocab().items()}
    return Vocab([id_to_token[i] for i in range(size)], counts), encoded


# ---------------------------------------------------------------- the training task

class CorpusTask(FixedDataset):
    """Next-token prediction on a Corpus's samples, shuffled once per epoch.

    shuffle_seed: when given, the epoch order comes from it and not from each member's seed, so
    that ensemble members with other learning rates see the very same batches (the paper trains
    both learning rates with seed 42); the batch is still a pure function of (step, batch_size).
    """

    def __init__(self, corpus: Corpus, shuffle_seed: int | None = None):
        super().__init__(corpus.inputs, corpus.targets, vocab_size=len(corpus.vocab), n_outputs=len(corpus.vocab),
                         loss="next_token")
        self.corpus = corpus
        self.shuffle_seed = shuffle_seed

    @classmethod
    def batch_sampler(cls, tasks, keys, device="cpu") -> EpochSampler:
        """Members with a shuffle_seed take their epoch orders from it (the same batches), the others from
        their own keys."""
        return EpochSampler(tasks, [k if t.shuffle_seed is None else t.shuffle_seed for t, k in zip(tasks, keys)],
                            device)

    def reference_batch(self, step: int, batch_size: int, seed: int) -> Batch:
        return super().reference_batch(step, batch_size, seed if self.shuffle_seed is None else self.shuffle_seed)

    def first_batch(self, batch_size: int, seed: int) -> Batch:
        """The batch of step 0: the paper's theory takes its statistics from it."""
        return self.train_batch(0, batch_size, seed)

    def spec(self) -> dict:
        digest = hashlib.sha256(self.corpus.samples.numpy().tobytes()).hexdigest()[:16]
        return {"task": "corpus", "samples": digest, "n": len(self), "seq_len": self.seq_len,
                "vocab_size": self.vocab_size, "shuffle_seed": self.shuffle_seed,
                "sampling": self.corpus.info.get("sampling"), "tokenizer": self.corpus.info.get("tokenizer")}
