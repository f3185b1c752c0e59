"""Agreement prompts: labels, attractor numbers, the split by subject, encoding."""
import pytest
import torch

from circuitbook.models.pretrained import default_tiny_words, tiny_tokenizer
from circuitbook.tasks import agreement as ag

NOUNS = ag.NOUNS[:10]


def test_prompt_labels_and_attractors():
    prompts = ag.make_prompts(NOUNS, n_per_subject=3, seed=0)
    assert len(prompts) == 10 * 2 * 3
    forms = {s: p for s, p in NOUNS}
    plurals = set(forms.values())
    for p in prompts:
        words = p.text.split()
        assert words[0] == "The" and words[3] == "the" and words[2] in ag.PREPOSITIONS
        subj, attr = words[1], words[4]
        assert (subj == p.subject) == p.singular  # singular subject is the lemma itself
        assert (subj in plurals) == (not p.singular)
        assert (attr in plurals) == p.singular  # the attractor has the other number
        assert p.label == (1 if p.singular else -1)
        assert p.attractor != p.subject


def test_split_is_by_subject_and_balanced():
    prompts = ag.make_prompts(NOUNS, test_fraction=0.3, n_per_subject=2, seed=1)
    train = {p.subject for p in prompts if p.split == "train"}
    test = {p.subject for p in prompts if p.split == "test"}
    assert train and test and not (train & test) and len(test) == 3
    for split in ("train", "test"):
        labels = [p.label for p in prompts if p.split == split]
        assert sum(labels) == 0  # as many singular as plural
    assert ag.make_prompts(NOUNS, seed=1) == ag.make_prompts(NOUNS, seed=1)


def test_encode_with_word_tokenizer():
    tok = tiny_tokenizer(default_tiny_words())
    assert ag.usable_nouns(tok) == list(ag.NOUNS)
    prompts = ag.make_prompts(NOUNS, n_per_subject=1)
    data = ag.encode_prompts(tok, prompts)
    assert data.tokens.shape == (20, 6)  # BOS + 5 words
    assert (data.tokens[:, 0] == tok.bos_token_id).all()
    assert data.singular_id == tok.convert_tokens_to_ids("is") and data.plural_id == tok.convert_tokens_to_ids("are")
    assert torch.equal(data.labels, torch.tensor([p.label for p in prompts]))
    test = data.split("test")
    assert len(test) == sum(p.split == "test" for p in prompts) and all(p.split == "test" for p in test.prompts)


def test_filter_drops_multi_token_prompts():
    tok = tiny_tokenizer([w for w in default_tiny_words() if w not in ("dogs", "near")])
    prompts = ag.make_prompts(NOUNS, n_per_subject=2)
    kept = ag.filter_prompts(tok, prompts)
    assert kept and all("dogs" not in p.text.split() and "near" not in p.text.split() for p in kept)
    assert len(kept) < len(prompts)
    ag.encode_prompts(tok, kept)  # equal lengths now


def test_bad_arguments():
    with pytest.raises(ValueError):
        ag.make_prompts(NOUNS[:2])
    with pytest.raises(ValueError):
        ag.make_prompts(NOUNS, test_fraction=1.5)


def test_subset_is_balanced():
    tok = tiny_tokenizer(default_tiny_words())
    data = ag.encode_prompts(tok, ag.make_prompts(NOUNS, n_per_subject=2))
    sub = data.subset(7)
    assert len(sub) == 7 and sum(p.singular for p in sub.prompts) == 4
    assert torch.equal(sub.tokens, data.tokens[[data.prompts.index(p) for p in sub.prompts]])
