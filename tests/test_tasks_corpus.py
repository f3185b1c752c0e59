"""The TinyStories corpus of the leading_terms chapter: sources, tokenizer, vocabulary, samples, BPE."""
import json

import pytest
import torch

from circuitbook.tasks import corpus as C
from conftest import SHARED_TINYSTORIES as SHARED

SAMPLE = ("once upon a time, there was a cat.\n\nthe cat was happy. the end.\n"
          "one day, a dog saw a cat.\n\nthe dog was happy.\n"
          "the cat and the dog played.")


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def test_word_tokenizer_lowercases_and_splits_punctuation():
    assert C.word_tokenize("Lily's Dog said, \"Hi!\"\n\nThe end.") == \
        ["lily", "'", "s", "dog", "said", ",", '"', "hi", "!", '"', "the", "end", "."]
    assert " " not in C.word_tokenize("a  b\n\nc") and "\n" not in C.word_tokenize("a\nb")


def test_mojibake_is_repaired_to_the_ascii_the_text_uses():
    assert C.repair_mojibake("â€œhi,â€ she said. itâ€™s a â€˜testâ€™ â€“ okâ€¦") == \
        "\"hi,\" she said. it's a 'test' - ok..."
    assert C.repair_mojibake("plain text") == "plain text"
    assert C.word_tokenize(C.repair_mojibake("â€œhiâ€")) == ['"', "hi", '"']


def test_the_books_sample_format_splits_stories_on_a_single_newline(tmp_path):
    p = write(tmp_path, "sample.txt", SAMPLE)
    stories = C.read_stories(p)
    assert len(stories) == 3
    assert stories[0] == "once upon a time, there was a cat.\n\nthe cat was happy. the end."


def test_full_dataset_formats(tmp_path):
    txt = write(tmp_path, "TinyStories-train.txt", "Story one.\nStill one.<|endoftext|>\nStory two.\n<|endoftext|>")
    assert C.read_stories(txt) == ["Story one.\nStill one.", "Story two."]
    js = write(tmp_path / "json" if (tmp_path / "json").mkdir() is None else tmp_path, "data00.json",
               json.dumps([{"story": "A json story."}, {"story": "Another."}]))
    assert C.read_stories(js) == ["A json story.", "Another."]
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "parquet"
    folder.mkdir()
    pq.write_table(pa.table({"text": ["First.", "Second."]}), folder / "train-00000-of-00001.parquet")
    pq.write_table(pa.table({"text": ["Held out."]}), folder / "validation-00000-of-00001.parquet")
    assert C.read_stories(folder) == ["First.", "Second."], "validation shards are not training data"


def test_missing_or_unknown_sources_fail_clearly(tmp_path, monkeypatch):
    monkeypatch.delenv(C.ENV_VAR, raising=False)
    with pytest.raises(C.CorpusError, match="tinystories_path.*CIRCUITBOOK_TINYSTORIES"):
        C.resolve_source(None)
    with pytest.raises(C.CorpusError, match="tinystories_path='/no/such/file.txt': no such file"):
        C.resolve_source("/no/such/file.txt")
    monkeypatch.setenv(C.ENV_VAR, "/no/such/env.txt")
    with pytest.raises(C.CorpusError, match="CIRCUITBOOK_TINYSTORIES='/no/such/env.txt'"):
        C.resolve_source(None)
    bad = write(tmp_path, "x.csv", "a,b")
    with pytest.raises(C.CorpusError, match="unknown format '.csv'"):
        C.read_stories(bad)
    badjson = write(tmp_path, "y.json", json.dumps({"text": "no"}))
    with pytest.raises(C.CorpusError, match="'story' field"):
        C.read_stories(badjson)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(C.CorpusError, match="holds no"):
        C.read_stories(empty)


def test_vocabulary_is_the_most_frequent_tokens():
    vocab = C.build_vocab([["a", "b", "a", "c"], ["a", "b", "d"]], 2)
    assert vocab.tokens == ["a", "b"] and vocab.counts == [3, 2]
    assert vocab.encode(["b", "z", "a"]) == [1, -1, 0]
    assert vocab.decode([0, 1]) == ["a", "b"]
    with pytest.raises(C.CorpusError, match="larger than the corpus's 4 distinct tokens"):
        C.build_vocab([["a", "b", "c", "d"]], 5)


def test_stories_and_windows_sampling():
    encoded = [[0, 1, 2, 3, 4], [0, 1, -1, 2, 3, 4, 5, 6, 7], [1, 2]]
    # stories: whole story in the vocabulary and long enough, truncated
    assert C.cut_samples(encoded, 3, "stories") == [[0, 1, 2]]
    # windows: non-overlapping runs of in-vocabulary ids, across stories
    assert C.cut_samples(encoded, 3, "windows") == [[0, 1, 2], [2, 3, 4], [5, 6, 7]]
    with pytest.raises(ValueError, match="sampling='chunks'"):
        C.cut_samples(encoded, 3, "chunks")


def test_load_corpus_samples_are_in_vocabulary_and_shifted(tmp_path):
    p = write(tmp_path, "s.txt", SAMPLE)
    c = C.load_corpus(p, vocab_size=12, seq_len=4, sampling="windows")
    assert c.samples.shape[1] == 5 and c.samples.max() < 12 and c.samples.min() >= 0
    assert torch.equal(c.inputs[:, 1:], c.targets[:, :-1])
    assert c.info["stories"] == 3 and c.info["samples"] == len(c.samples)
    assert c.vocab.tokens[0] in (".", "the", "a")
    assert C.load_corpus(p, vocab_size=12, seq_len=4, sampling="windows", n_samples=2).samples.shape[0] == 2
    with pytest.raises(C.CorpusError, match="no sample of 201 in-vocabulary tokens"):
        C.load_corpus(p, vocab_size=12, seq_len=200)
    available = C.load_corpus(p, vocab_size=12, seq_len=4, sampling="windows").info["samples_available"]
    with pytest.raises(C.CorpusError, match=rf"only {available} windows of 5 in-vocabulary tokens in .*s\.txt .*n_samples = {available + 1};"):
        C.load_corpus(p, vocab_size=12, seq_len=4, sampling="windows", n_samples=available + 1)
    for kw, msg in [({"sampling": "all"}, "sampling"), ({"tokenizer": "char"}, "tokenizer"),
                    ({"vocab_size": 1}, "vocab_size"), ({"seq_len": 0}, "seq_len"), ({"n_samples": 0}, "n_samples")]:
        args = {"vocab_size": 12, "seq_len": 4, **kw}
        with pytest.raises(ValueError, match=msg):
            C.load_corpus(p, **args)



def test_a_short_corpus_is_refused_or_taken_whole(tmp_path):
    """short_corpus="error" refuses fewer samples than n_samples (naming the switch); "all" keeps every
    sample there is and says how many were asked for; with enough samples both give the same corpus."""
    p = write(tmp_path, "s.txt", SAMPLE)
    args = {"vocab_size": 12, "seq_len": 4, "sampling": "windows"}
    available = C.load_corpus(p, **args).info["samples_available"]
    with pytest.raises(C.CorpusError, match=rf"n_samples = {available + 1};.*short_corpus='all'"):
        C.load_corpus(p, **args, n_samples=available + 1)
    short = C.load_corpus(p, **args, n_samples=available + 1, short_corpus="all")
    assert len(short.samples) == available == short.info["samples"]
    assert short.info["samples_asked"] == available + 1 and short.info["short"] is True
    for n in (available - 1, available):
        strict = C.load_corpus(p, **args, n_samples=n)
        lenient = C.load_corpus(p, **args, n_samples=n, short_corpus="all")
        assert torch.equal(strict.samples, lenient.samples) and len(lenient.samples) == n
        assert lenient.info == strict.info and strict.info["short"] is False
    assert C.load_corpus(p, **args).info["samples_asked"] is None
    with pytest.raises(ValueError, match=r"short_corpus='some' is not allowed; expected one of \('error', 'all'\)"):
        C.load_corpus(p, **args, short_corpus="some")

def test_bpe_vocabulary_covers_every_token(tmp_path):
    p = write(tmp_path, "s.txt", SAMPLE * 3)
    c = C.load_corpus(p, vocab_size=60, seq_len=8, tokenizer="bpe", sampling="windows")
    assert len(c.vocab) <= 60 and c.info["coverage"] == 1.0
    assert c.samples.max() < len(c.vocab)
    again = C.load_corpus(p, vocab_size=60, seq_len=8, tokenizer="bpe", sampling="windows")
    assert torch.equal(c.samples, again.samples), "BPE training is deterministic"
    assert "".join(c.vocab.decode(c.samples[0])).replace("##", "") != ""


def test_corpus_task_batches_and_shared_shuffle(tmp_path):
    c = C.load_corpus(write(tmp_path, "s.txt", SAMPLE * 4), vocab_size=12, seq_len=3, sampling="windows")
    task = C.CorpusTask(c, shuffle_seed=42)
    assert task.loss == "next_token" and task.vocab_size == 12 and task.seq_len == 3
    a, b = task.train_batch(0, 4, seed=1), task.train_batch(0, 4, seed=2)
    assert torch.equal(a.tokens, b.tokens), "with shuffle_seed, every member sees the same batches"
    assert torch.equal(task.first_batch(4, seed=9).tokens, a.tokens)
    free = C.CorpusTask(c)
    assert not torch.equal(free.train_batch(0, 4, seed=1).tokens, free.train_batch(0, 4, seed=2).tokens)
    full = task.train_batch(5, len(task), seed=0)
    assert torch.equal(full.tokens, c.inputs) and torch.equal(full.labels, c.targets)
    assert task.spec() != C.CorpusTask(c, shuffle_seed=0).spec()


@pytest.mark.skipif(not SHARED.exists(), reason="the shared TinyStories sample is not here")
def test_the_shared_sample():
    stories = C.read_stories(SHARED)
    assert len(stories) == 5511  # the README's regex also yields 33 blank "stories"
    c = C.load_corpus(SHARED, vocab_size=3000, seq_len=200, sampling="stories")
    assert c.info["tokens"] == 976229
    assert 100 < c.info["samples"] < 300  # far from the paper's 65,536
    assert c.vocab.tokens[:3] == [".", "the", ","]
