"""Templated subject-verb number-agreement prompts with attractor nouns.

Chapter `algorithmic_cores`, claim AC-9 (Schiffman, arXiv 2602.22600): a
language model reading

    The key to the cabinets      -> " is"   (singular subject, plural attractor)
    The keys to the cabinet      -> " are"  (plural subject, singular attractor)

must make the verb agree with the subject, not with the nearer attractor noun.
A prompt is `The {subject} {preposition} the {attractor}`; the subject and the
attractor always differ in number (the hard, "attractor" condition), and the
label is the subject's number: +1 singular (" is"), -1 plural (" are").

The split is by subject lemma: the test prompts' subjects never occur as
subjects in the training prompts, so a core fitted on the training prompts is
tested on new nouns.

Nouns are used only where both forms are a single token of the model's
tokenizer (with the leading space), so every prompt of one tokenizer has the
same length and the batch needs no padding.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

# (singular, plural): common count nouns with regular or frequent plurals.
NOUNS: tuple[tuple[str, str], ...] = (
    ("key", "keys"), ("dog", "dogs"), ("cat", "cats"), ("book", "books"), ("car", "cars"),
    ("house", "houses"), ("tree", "trees"), ("student", "students"), ("teacher", "teachers"),
    ("friend", "friends"), ("girl", "girls"), ("boy", "boys"), ("door", "doors"), ("table", "tables"),
    ("window", "windows"), ("road", "roads"), ("bird", "birds"), ("letter", "letters"), ("picture", "pictures"),
    ("player", "players"), ("doctor", "doctors"), ("farmer", "farmers"), ("worker", "workers"),
    ("officer", "officers"), ("author", "authors"), ("painting", "paintings"), ("garden", "gardens"),
    ("machine", "machines"), ("bottle", "bottles"), ("flower", "flowers"), ("box", "boxes"),
    ("church", "churches"), ("child", "children"), ("man", "men"), ("woman", "women"), ("horse", "horses"),
    ("river", "rivers"), ("building", "buildings"), ("computer", "computers"), ("manager", "managers"),
    ("singer", "singers"), ("lawyer", "lawyers"), ("pilot", "pilots"), ("chair", "chairs"), ("lamp", "lamps"),
    ("cabinet", "cabinets"), ("island", "islands"), ("village", "villages"), ("report", "reports"),
    ("song", "songs"),
)
PREPOSITIONS: tuple[str, ...] = ("near", "behind", "of", "beside", "with", "for", "from", "by")
SINGULAR_VERB, PLURAL_VERB = " is", " are"


@dataclass(frozen=True)
class AgreementPrompt:
    text: str
    subject: str  # the lemma (singular form) of the subject
    attractor: str
    singular: bool  # the subject's number; the correct verb is " is" if True
    split: str  # "train" or "test"

    @property
    def label(self) -> int:
        """+1 for a singular subject (" is"), -1 for a plural one (" are")."""
        return 1 if self.singular else -1


def single_token_id(tokenizer, text: str) -> int | None:
    """The id of `text` if the tokenizer encodes it as exactly one token (no special tokens), else None."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    unk = getattr(tokenizer, "unk_token_id", None)
    return ids[0] if len(ids) == 1 and ids[0] != unk else None


def filter_prompts(tokenizer, prompts: list["AgreementPrompt"]) -> list["AgreementPrompt"]:
    """The prompts that this tokenizer encodes with exactly one known token per word.

    Used to give every model the largest common-format subset of one shared prompt list, so
    that prompts (and core coordinates) can be matched across models by their text.
    """
    unk = getattr(tokenizer, "unk_token_id", None)
    kept = []
    for p in prompts:
        ids = tokenizer(p.text, add_special_tokens=False)["input_ids"]
        if len(ids) == len(p.text.split()) and unk not in ids:
            kept.append(p)
    return kept


def usable_nouns(tokenizer, nouns=NOUNS) -> list[tuple[str, str]]:
    """The (singular, plural) pairs whose forms are each one token with a leading space."""
    return [(s, p) for s, p in nouns
            if single_token_id(tokenizer, " " + s) is not None and single_token_id(tokenizer, " " + p) is not None]


def make_prompts(nouns, prepositions=PREPOSITIONS, test_fraction: float = 0.3, n_per_subject: int = 4,
                 seed: int = 0) -> list[AgreementPrompt]:
    """Prompts `The {subject} {prep} the {attractor}` with subject and attractor of opposite number.

    For each subject lemma and each number, `n_per_subject` prompts draw a preposition and an
    attractor lemma (a different noun) at random. Subjects are split into train and test by lemma
    (a `test_fraction` of them, at least one each). Balanced: every subject gives as many singular
    as plural prompts.
    """
    nouns = list(nouns)
    if len(nouns) < 3:
        raise ValueError(f"need at least 3 nouns (subjects for both splits and an attractor); got {len(nouns)}")
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    if n_per_subject < 1:
        raise ValueError(f"n_per_subject must be >= 1, got {n_per_subject!r}")
    rng = random.Random(seed)
    order = list(range(len(nouns)))
    rng.shuffle(order)
    n_test = min(max(1, round(test_fraction * len(nouns))), len(nouns) - 1)
    test_lemmas = {nouns[i][0] for i in order[:n_test]}
    prompts = []
    for i, (sing, plur) in enumerate(nouns):
        split = "test" if sing in test_lemmas else "train"
        for singular in (True, False):
            for _ in range(n_per_subject):
                j = rng.choice([k for k in range(len(nouns)) if k != i])
                prep = rng.choice(list(prepositions))
                subj = sing if singular else plur
                attr = nouns[j][1] if singular else nouns[j][0]  # the attractor has the other number
                prompts.append(AgreementPrompt(f"The {subj} {prep} the {attr}", sing, nouns[j][0], singular, split))
    return prompts


@dataclass
class AgreementData:
    """Token ids of a prompt set for one tokenizer: tokens [N, T], labels [N] (+1 / -1)."""

    prompts: list[AgreementPrompt]
    tokens: torch.Tensor
    labels: torch.Tensor
    singular_id: int
    plural_id: int

    def split(self, name: str) -> "AgreementData":
        keep = [i for i, p in enumerate(self.prompts) if p.split == name]
        return AgreementData([self.prompts[i] for i in keep], self.tokens[keep], self.labels[keep],
                             self.singular_id, self.plural_id)

    def subset(self, n: int) -> "AgreementData":
        """The first n prompts of each number, interleaved (balanced singular / plural)."""
        sing = [i for i, p in enumerate(self.prompts) if p.singular][: (n + 1) // 2]
        plur = [i for i, p in enumerate(self.prompts) if not p.singular][: n // 2]
        keep = sorted(sing + plur)
        return AgreementData([self.prompts[i] for i in keep], self.tokens[keep], self.labels[keep],
                             self.singular_id, self.plural_id)

    def __len__(self) -> int:
        return len(self.prompts)


def encode_prompts(tokenizer, prompts: list[AgreementPrompt], prepend_bos: bool = True) -> AgreementData:
    """Tokenize prompts into one [N, T] tensor (all prompts must have the same length).

    prepend_bos: put the tokenizer's BOS token (if it has one) in front, as TransformerLens does.
    """
    sing, plur = single_token_id(tokenizer, SINGULAR_VERB), single_token_id(tokenizer, PLURAL_VERB)
    if sing is None or plur is None:
        raise ValueError(f"the tokenizer must encode {SINGULAR_VERB!r} and {PLURAL_VERB!r} as one token each")
    bos = getattr(tokenizer, "bos_token_id", None) if prepend_bos else None
    rows = []
    for p in prompts:
        ids = tokenizer(p.text, add_special_tokens=False)["input_ids"]
        rows.append(([bos] if bos is not None else []) + list(ids))
    lengths = {len(r) for r in rows}
    if len(lengths) != 1:
        raise ValueError(f"prompts tokenize to different lengths {sorted(lengths)}; use usable_nouns() "
                         f"so that every noun is one token")
    labels = torch.tensor([p.label for p in prompts])
    return AgreementData(list(prompts), torch.tensor(rows), labels, sing, plur)
