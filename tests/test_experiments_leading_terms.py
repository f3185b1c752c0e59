"""Chapter package leading_terms: the cosine callback, curve summaries, ablation, LT-3 counts, LT-6 measures, the registry."""
import math

import pandas as pd
import pytest
import torch

from circuitbook.analysis import leading_terms as lt
from circuitbook.experiments import leading_terms as el
from circuitbook.models.onehot import OneHotConfig
from circuitbook.tasks.corpus import Vocab
from circuitbook.training import Ensemble


def batch(V=8, T=5, N=20, seed=0):
    x = torch.randint(0, V, (N, T + 1), generator=torch.Generator().manual_seed(seed))
    return x[:, :-1], x[:, 1:]


def test_cosine_evaluator_on_an_ensemble_that_sits_on_the_leading_terms():
    x, y = batch()
    stats = lt.leading_stats(x, y, 8)
    ens = Ensemble(OneHotConfig(8, 5, 2), seeds=(0, 1))
    pred = lt.predicted_weights(stats, 5, 0.1, 2)
    name_of = {"unembed.W_U": "W_O", **{f"blocks.{l}.attn.{p}": f"{k}{l}" for l in range(2)
                                       for p, k in (("W_QK", "W"), ("W_V", "V"), ("P", "P"))}}
    with torch.no_grad():
        for param, name in name_of.items():
            ens.params[param][0] = pred[name].float()
            ens.params[param][1] = -pred[name].float()
    out = el.CosineEvaluator(x, y, 8)(ens, 5)
    assert set(out) == {f"cos_{n}" for n in name_of.values()}
    for v in out.values():
        assert v[0] == pytest.approx(1.0, abs=1e-5) and v[1] == pytest.approx(-1.0, abs=1e-5)
    zero = el.CosineEvaluator(x, y, 8)(Ensemble(OneHotConfig(8, 5, 2), seeds=(0,)), 0)
    assert all(math.isnan(float(v[0])) for v in zero.values()), "a zero weight has no direction"


def test_cosine_evaluator_is_identified_by_its_first_batch_and_computes_the_statistics_lazily():
    x, y = batch()
    ev = el.CosineEvaluator(x, y, 8)
    assert ev.spec() == el.CosineEvaluator(x.clone(), y.clone(), 8).spec()
    assert ev._stats is None, "the identity needs no statistics"
    assert ev.spec() != el.CosineEvaluator(*batch(seed=1), 8).spec()
    assert ev.spec() != el.CosineEvaluator(x, y, 9).spec()
    assert ev.spec() != el.CosineEvaluator(x, y, 8, attention=False).spec()
    stats = lt.leading_stats(x, y, 8)
    assert torch.equal(ev.stats.B, stats.B) and torch.equal(ev.stats.Q, stats.Q)
    assert ev.stats is ev.stats, "computed once"
    assert set(el.CosineEvaluator(x, y, 8, attention=False).directions) == {"W_O", "V"}


def frame(rows):
    return pd.DataFrame(rows, columns=["lr", "step", "s_eta", "kind", "cosine"])


def test_curve_summaries():
    f = frame([(0.5, s, 0.5 * s, k, c) for s, cs in ((1, (1.0, 0.99, 0.95)), (2, (0.95, 0.92, 0.91)),
                                                      (3, (0.93, 0.85, 0.9)), (4, (0.8, 0.7, 0.6)))
               for k, c in zip(("W_O", "V", "W"), cs)])
    f = pd.concat([f, frame([(0.5, 1, 0.5, "P", 0.1)])])
    assert el.min_cosines(f, 0.5) == {"P": 0.1, "V": 0.7, "W": 0.6, "W_O": 0.8}
    # every kind >= 0.9 up to s*eta = 1.0 (step 2); step 3 has V at 0.85; P is not among the kinds
    assert el.s_eta_until_below(f, 0.5, 0.9) == 1.0
    assert el.s_eta_until_below(f, 0.5, 0.5) == 2.0, "never below: the last s*eta"
    assert el.s_eta_until_below(f, 0.5, 0.999) == 0.0, "below at the first evaluation"


def test_ablation_removes_one_projection_at_a_time_and_restores_the_weights():
    x, y = batch(V=8, T=5, N=30)
    stats = lt.leading_stats(x, y, 8)
    model = OneHotConfig(8, 5, 2).build().double()
    with torch.no_grad():  # weights = leading terms + an orthogonal part: removal leaves the orthogonal part
        for name, w in model.weights().items():
            if lt.kind_of(name) != "P":
                w.copy_(lt.predicted_weights(stats, 20, 0.5, 2)[name])
    before = {k: v.detach().clone() for k, v in model.weights().items()}
    table = el.ablation_table(model, stats, x, y)
    assert list(table["removed"]) == ["none", "W_O", "W0", "V0", "W1", "V1"]
    assert all(torch.equal(before[k], v) for k, v in model.weights().items()), "weights restored"
    # a weight equal to its leading term becomes zero: removing W_O gives the uniform output
    assert table.loc[table.removed == "W_O", "loss"].iloc[0] == pytest.approx(math.log(8), abs=1e-12)
    assert table.loc[table.removed == "none", "loss"].iloc[0] == pytest.approx(el.mean_loss(model, x, y))
    undone = el.undone_fractions(table, math.log(8))
    assert undone.loc[undone.removed == "W_O", "undone"].iloc[0] == pytest.approx(1.0)


def test_baseline_table_known_answers():
    """Only W_O is non-zero and equals 10 B: its leading-term removal gives the uniform output
    (undone 1); with the true statistics passed as the 'shuffled' ones that column repeats it; the
    same-size change in B's span gives the loss of W_O - 10 ||B|| R (computed here by hand); zero
    weights (V, W) change nothing under any of the three."""
    x, y = batch(V=8, T=5, N=30)
    stats = lt.leading_stats(x, y, 8)
    model = OneHotConfig(8, 5, 2).build().double()
    with torch.no_grad():
        model.weights()["W_O"].copy_(10 * stats.B)
    before = {k: v.detach().clone() for k, v in model.weights().items()}
    table = el.baseline_table(model, stats, stats, x, y, math.log(8), share=0.9, seed=3).set_index("weight")
    assert all(torch.equal(before[k], v) for k, v in model.weights().items()), "weights restored"
    assert table.loc["W_O", "leading term"] == pytest.approx(1.0)
    assert table.loc["W_O", "shuffled-corpus leading term"] == pytest.approx(1.0)
    R = lt.random_in_span(stats.B, 0.9, seed=lt_seed("W_O", 3))
    W = 10 * stats.B - 10 * stats.B.norm() * R
    loss = float(-(W[x]).log_softmax(-1).gather(-1, y[..., None]).mean())
    base = el.mean_loss(model, x, y)
    assert table.loc["W_O", "same-size change in its span"] == pytest.approx((loss - base) / (math.log(8) - base))
    assert (table.drop("W_O")[["leading term", "same-size change in its span"]].abs() < 1e-12).all().all()
    assert table.loc["W_O", "cosine with leading term"] == pytest.approx(1.0)


def lt_seed(name, seed):
    from circuitbook.tasks.base import derive_seed

    return derive_seed("span-baseline", name, seed)


def test_mean_loss_of_a_zero_model_is_log_vocab():
    x, y = batch(V=13)
    assert el.mean_loss(OneHotConfig(13, 5, 3).build(), x, y, chunk=7) == pytest.approx(math.log(13))


def toy_vocab(words):
    return Vocab(list(words), [100] * len(words))


def test_adjective_noun_share_counts_listed_nouns_among_top_successors():
    vocab = toy_vocab(["big", "red", "dog", "ball", "the", "and", "."])
    B = torch.zeros(7, 7, dtype=torch.float64)
    ix = vocab.index
    B[ix["big"], ix["dog"]], B[ix["big"], ix["."]] = 3, 2  # top-2 of big: dog, .
    B[ix["red"], ix["ball"]], B[ix["red"], ix["dog"]] = 3, 2  # top-2 of red: ball, dog
    B[ix["the"], ix["dog"]], B[ix["the"], ix["and"]] = 3, 2
    B[ix["and"], ix["the"]], B[ix["and"], ix["."]] = 3, 2
    B[ix["."], ix["the"]], B[ix["."], ix["and"]] = 3, 2
    share, baseline, n = el.adjective_noun_share(B, vocab, k=2, n_baseline=3)
    assert n == 2 and share == pytest.approx(3 / 4)
    assert baseline == pytest.approx(1 / 6)  # the, and, . -> only "the dog"


def test_class_purity_and_its_chance():
    # colours red/blue/green, animals dog/cat: B columns make colours alike and animals alike
    vocab = toy_vocab(["red", "blue", "green", "dog", "cat", "the"])
    B = torch.zeros(6, 6, dtype=torch.float64)
    for w in ("red", "blue", "green"):
        B[0, vocab.index[w]] = 1.0
    for w in ("dog", "cat"):
        B[1, vocab.index[w]] = 1.0
    B[2, vocab.index["the"]] = 1.0
    purity, chance, n = el.class_purity(B.T @ B, vocab)
    assert n == 5 and purity == 1.0
    assert chance == pytest.approx((3 * 2 / 4 + 2 * 1 / 4) / 5)
    assert el.neighbours(B.T @ B, vocab, "dog", 1) == ["cat"]


def test_setting_hit_rate_against_other_entities_settings():
    vocab = toy_vocab(["fish", "pond", "bird", "sky", "the"])
    lift = torch.zeros(5, 5, dtype=torch.float64)
    lift[vocab.index["pond"], vocab.index["fish"]] = 5.0  # fish in context -> pond later
    lift[vocab.index["the"], vocab.index["bird"]] = 5.0  # bird -> the (no setting)
    hits, base, n = el.setting_hit_rate(lift, vocab, k=1, min_count=1)
    assert n == 2 and hits == 0.5 and base == 0.0


def test_checkpoint_steps_are_read_from_folder_names():
    from circuitbook.experiments.leading_terms import runs

    assert runs._checkpoint_step("/models/pythia-1.4b-deduped/step512") == 512
    assert runs._checkpoint_step("ckpt_step-16") == 16
    with pytest.raises(ValueError, match="name each folder after its step"):
        runs._checkpoint_step("/models/pythia/final")


def test_activation_memory_estimate():
    # one [2048, 200, 3000] float32 tensor is 4.58 GiB; 18 of them for 3 layers, 2 members
    assert el.activation_gib(2048, 200, 3000, 3, members=2) == pytest.approx(2048 * 200 * 3000 * 4 * 18 * 2 / 2 ** 30)


def test_local_checkpoints_go_through_transformer_bridge(tmp_path):
    """The Pythia path, on two tiny Llama checkpoints saved as step folders: loaded through
    TransformerBridge, compared with the features of a local text; not the paper's model."""
    from circuitbook.models import pretrained

    text = ("the cat sat on the mat . the dog ran to the park . the bird flew to the tree .\n" * 3).strip()
    (tmp_path / "stories.txt").write_text("\n".join([text] * 6))
    tok = pretrained.tiny_tokenizer(text.split())
    for step, seed in ((0, 0), (4, 1)):
        folder = tmp_path / "tiny-run" / f"step{step}"
        pretrained.tiny_random_llama(len(tok), seed=seed).save_pretrained(folder)
        tok.save_pretrained(folder)

    class P(dict):
        __getattr__ = dict.__getitem__

    cfg = P(checkpoint_dirs=[str(tmp_path / "tiny-run" / "step4"), str(tmp_path / "tiny-run" / "step0")],
            tinystories_path=str(tmp_path / "stories.txt"), seq_len=8, lm_eval_samples=6, notebook="05_early_lm")
    lm = el.pretrained_lm(cfg)
    assert lm.key is None and lm.n_members == 1 and lm.checkpoint_steps() == [0, 4] and lm.name == "tiny-run"
    assert lm.metrics().empty and len(lm.models(4)) == 1
    assert el.lm_steps(cfg, lm) == [0, 4] and el.lm_is_substitute(cfg) and el.lm_name(cfg) == "tiny-run"
    assert el.lm_label(cfg) == "tiny-run (substitute for Pythia-1.4B)"
    assert isinstance(el.notebook_runs(cfg)["lm"], el.LocalCheckpoints)
    tokens, seen, n_vocab = el.lm_batch(cfg)
    assert tokens.shape[1] == 8 and n_vocab == len(tok) and torch.equal(seen, tokens.unique())
    emb, att = el.early_agreement(lm, el.lm_steps(cfg, lm), tokens, seen, n_vocab, n_frequent=5, n_perm=3)
    assert list(emb["step"]) == [4] and sorted(att["layer"]) == [0, 1]
    assert emb[["embed", "unembed"]].abs().max().max() <= 1.0
    with pytest.raises(FileNotFoundError, match="not local Hugging Face model folders"):
        el.pretrained_lm(P(cfg, checkpoint_dirs=[str(tmp_path / "nothing" / "step0")]))


def test_plot_cosines_draws_one_labelled_panel_per_weight_kind():
    rows = [{"lr": 0.1, "step": s, "s_eta": 0.1 * s, "kind": lt.kind_of(w), "layer": -1 if w == "W_O" else int(w[1]),
             "weight": w, "cosine": 1 - 0.01 * s} for s in (1, 2, 3) for w in ("W_O", "W0", "V0", "P0", "W1")]
    fig = el.plot_cosines(pd.DataFrame(rows), 0.1)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["attention W", "value V", "positional P", "output W_O"]
    assert all(ax.get_ylabel() == "cosine with leading term" for ax in fig.axes)
    assert len(fig.axes[0].get_lines()) >= 2  # two layers of W (+ the 0.9 line)


def test_cosine_evaluator_is_float64_and_never_above_one():
    """Planted cosines on a large float32 weight: the callback computes in float64, so a weight equal
    to its (float32-rounded) leading term gives a cosine within 1e-7 of 1 and never above it, and a
    weight at a planted angle gives cos(angle) to float32 rounding of the weight (1e-7)."""
    V = 300
    x, y = batch(V=V, T=6, N=400)
    stats = lt.leading_stats(x, y, V)
    ens = Ensemble(OneHotConfig(V, 6, 1), seeds=(0, 1, 2))
    B = stats.B / stats.B.norm()
    noise = torch.randn(V, V, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    noise -= (noise * B).sum() * B  # orthogonal to B
    noise /= noise.norm()
    angle = 0.3
    with torch.no_grad():
        ens.params["unembed.W_U"][0] = (1e3 * B).float()
        ens.params["unembed.W_U"][1] = (1e-3 * B).float()
        ens.params["unembed.W_U"][2] = (math.cos(angle) * B + math.sin(angle) * noise).float()
    cos = el.CosineEvaluator(x, y, V)(ens, 1)["cos_W_O"]
    assert cos.dtype == torch.float64
    assert 1 - 1e-7 < cos[0] <= 1 and 1 - 1e-7 < cos[1] <= 1
    assert float(cos[2]) == pytest.approx(math.cos(angle), abs=1e-7)


def test_matrix_summary_names_the_matrices_that_fail():
    """Planted curves for three matrices at lr 0.5 (and a decoy at another lr): W1 ends at 0.6, V0
    at exactly 0.7 (not above it), W_O at 0.95; V0 first drops below 0.9 after s*eta = 1."""
    curves = {("W1", "W", 1): (1.0, 0.95, 0.92, 0.6), ("V0", "V", 0): (1.0, 0.91, 0.85, 0.7),
              ("W_O", "W_O", -1): (1.0, 0.99, 0.97, 0.95)}
    rows = [{"lr": 0.5, "step": s, "s_eta": 0.5 * s, "weight": w, "kind": k, "layer": l, "cosine": c}
            for (w, k, l), cs in curves.items() for s, c in zip((1, 2, 3, 4), cs)]
    rows.append({"lr": 0.1, "step": 4, "s_eta": 0.4, "weight": "W_O", "kind": "W_O", "layer": -1, "cosine": 0.1})
    table = el.matrix_summary(pd.DataFrame(rows), 0.5)
    assert list(table["weight"]) == ["W1", "V0", "W_O"], "ordered by kind (W, V, W_O), then layer"
    assert list(table["final"]) == [0.6, 0.7, 0.95]
    assert list(table["ends_below"]) == [True, True, False]
    assert list(table["s_eta_above_0.9"]) == [1.5, 1.0, 2.0]
    assert el.names_or_none(table.loc[table.ends_below, "weight"]) == "W1, V0"
    assert el.names_or_none([]) == "none"


def test_cosine_frame_long_format_with_lr_s_eta_and_epoch():
    metrics = pd.DataFrame([{"step": s, "member": k, "train_loss": 1.0 / (s + 1), "cos_W_O": 0.5 + 0.1 * s,
                             "cos_V1": float("nan") if s == 0 else 0.9}
                            for s in (0, 2, 4) for k in (0, 1)])
    f = el.cosine_frame(metrics, (0.1, 1.0), steps_per_epoch=2)
    assert len(f) == 2 * 3 + 2 * 2, "NaN cosines are dropped"
    row = f[(f.member == 1) & (f.step == 4) & (f.weight == "W_O")].iloc[0]
    assert (row.lr, row.s_eta, row.epoch, row.kind, row.layer) == (1.0, 4.0, 2.0, "W_O", -1)
    assert row.cosine == pytest.approx(0.9)
    v = f[f.weight == "V1"].iloc[0]
    assert (v.kind, v.layer, v.lr) == ("V", 1, 0.1)


WORDS = ("the cat dog bird ball park tree red big little happy sad ran saw played with and a to in on was "
         "they day sun sky mom dad friend toy box water fish boat hat cake bed book said liked home .").split()


def smoke_cfg(tmp_path, notebook, **extra):
    """The smoke profile on a small made-up text of 40 distinct tokens (vocabulary 40)."""
    from circuitbook import params

    text = tmp_path / "stories.txt"
    if not text.exists():
        gen = torch.Generator().manual_seed(0)
        lines = [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (60,), generator=gen)) for _ in range(50)]
        text.write_text("\n".join(lines))
    return params.resolve("leading_terms", notebook, "smoke",
                          {"tinystories_path": str(text), "vocab_size": len(WORDS), **extra})


def test_notebook_runs_names_each_notebooks_runs(tmp_path, runs_dir):
    from circuitbook.training.planning import planning

    assert el.notebook_runs(smoke_cfg(tmp_path, "01_corpus")) == {}
    with planning() as plan:
        roles = {nb: list(el.notebook_runs(smoke_cfg(tmp_path, nb))) for nb in
                 ("02_training", "03_ablation", "04_bpe", "05_early_lm")}
    assert roles == {"02_training": ["main"], "03_ablation": ["main"], "04_bpe": ["bpe"], "05_early_lm": ["lm"]}
    assert [r.dir.name for r in plan.runs] == [el.MAIN, el.BPE, el.EARLY_LM]
    assert not any(r.complete for r in plan.runs)


def test_the_planned_main_run_is_the_trained_one(tmp_path, runs_dir):
    """The callback is identified by its first batch, not by its statistics: planning gives the key the
    notebook then trains, and the statistics are computed only when the run trains (or when asked for)."""
    from circuitbook.training.planning import planning

    cfg = smoke_cfg(tmp_path, "02_training")
    el.runs._EVALUATORS.clear()
    with planning() as plan:
        planned = el.notebook_runs(cfg)["main"]
    assert el.cosine_evaluator(cfg)._stats is None, "planning computes no statistics"
    trained = el.notebook_runs(cfg)["main"]
    assert [r.key for r in plan.runs] == [planned.key] and trained.key == planned.key
    m = trained.metrics()
    assert m.loc[m.step > 0, "cos_W_O"].notna().all(), "logged from the first step on (at step 0 every weight is 0)"
    again = smoke_cfg(tmp_path, "03_ablation")
    assert el.notebook_runs(again)["main"].key == trained.key, "03 reads 02's run"
    stats = el.first_batch_stats(again)
    batch = el.first_batch(cfg)
    assert torch.equal(stats.B, lt.leading_stats(batch.tokens, batch.labels, el.make_task(cfg).vocab_size).B)


def test_a_short_corpus_taken_whole_keeps_the_steps_and_says_so(tmp_path, runs_dir):
    """short_corpus: all on a corpus of 50 whole stories asked for 200: every story, full batch, and the
    12 steps that 200 samples in batches of 100 give in 6 epochs (not 6 full-batch steps), so s * eta is
    kept; the notebook's results record says so. short_corpus: error refuses the corpus."""
    from circuitbook import context
    from circuitbook.tasks.corpus import CorpusError
    from circuitbook.training.planning import planning

    short = {"sampling": "stories", "n_samples": 200, "batch_size": 100}
    with pytest.raises(CorpusError, match="only 50 whole stories .* n_samples = 200"):
        el.load_corpus(smoke_cfg(tmp_path, "02_training", **short))
    cfg = smoke_cfg(tmp_path, "02_training", **short, short_corpus="all")
    assert len(el.load_corpus(cfg).samples) == 50 and el.steps_per_epoch(cfg) == 1
    tc = el.train_config(cfg)
    assert (tc.steps, tc.batch_size) == (cfg.epochs * 2, 50) == (12, 50)
    assert [tc.steps * lr for lr in tc.lr] == [6.0, 12.0], "the s * eta of 200 samples in batches of 100"
    import circuitbook as cb

    cb.load_params("leading_terms", "02_training", "smoke", **cfg.overrides)
    with planning():
        el.notebook_runs(cfg)
    corpus_note, steps_note = context.current()["deviations_found"]
    assert f"only 50 whole stories of 9 in-vocabulary tokens (|V| = {len(WORDS)}, word tokens) are in stories.txt, " \
           "not the 200 that n_samples asks for" in corpus_note and "the paper's 65,536 samples" in corpus_note
    assert "keeps the 12 SGD steps of 6 epochs of 200 samples in batches of 100, so s * eta ends at 6 and 12" \
        in steps_note
    context._current = None


def test_a_corpus_with_enough_samples_is_the_same_under_either_short_corpus(tmp_path, runs_dir):
    """With the samples asked for, short_corpus: all changes nothing: the same run key, no deviation noted."""
    import circuitbook as cb
    from circuitbook import context
    from circuitbook.training.planning import planning

    enough = {"sampling": "stories", "n_samples": 40, "batch_size": 20}
    keys = []
    for mode in ("error", "all"):
        cfg = smoke_cfg(tmp_path, "02_training", **enough, short_corpus=mode)
        cb.load_params("leading_terms", "02_training", "smoke", **cfg.overrides)
        with planning() as plan:
            el.notebook_runs(cfg)
        keys.append(plan.runs[0].key)
        assert el.train_config(cfg).steps == cfg.epochs * 2 == el.train_steps(cfg)
        assert not context.current().get("deviations_found")
    assert keys[0] == keys[1]
    context._current = None


def write_enough_stories(path, n_stories: int, length: int, vocab_size: int) -> None:
    """n_stories stories of `length` words drawn from `vocab_size` distinct words (with enough stories every
    word occurs, so a vocabulary of that size holds every story), one story per line."""
    import itertools
    import string

    words = ["".join(t) for t in itertools.product(string.ascii_lowercase, repeat=3)][:vocab_size]
    gen = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for i in range(n_stories):
            ids = torch.randint(0, vocab_size, (length,), generator=gen).tolist()
            f.write(" ".join(words[j] for j in ids) + "\n")


@pytest.mark.slow
def test_the_full_profile_with_the_full_data_set_is_the_papers_setting(tmp_path, runs_dir):
    """A corpus with 65,536 whole stories of 201 in-vocabulary tokens at |V| = 3,000 (as the full TinyStories
    has): the full profile trains the paper's 100 epochs of 32 batches of 2,048 (3,200 steps, s * eta 16 and
    160) on 65,536 samples and notes no deviation."""
    import circuitbook as cb
    from circuitbook import context, params
    from circuitbook.training.planning import planning

    text = tmp_path / "TinyStories-train.txt"
    write_enough_stories(text, 65536, 201, 3000)
    cb.load_params("leading_terms", "02_training", "full", tinystories_path=str(text))
    cfg = params.resolve("leading_terms", "02_training", "full", {"tinystories_path": str(text)})
    assert cfg.short_corpus == "all" and cfg.n_samples == 65536
    with planning() as plan:
        el.notebook_runs(cfg)
    tc = plan.runs[0].train_config
    assert (tc.steps, tc.batch_size, tuple(tc.lr)) == (3200, 2048, (0.005, 0.05))
    assert len(el.load_corpus(cfg).samples) == 65536 and el.steps_per_epoch(cfg) == 32
    assert not context.current().get("deviations_found")
    assert not params.deviations("leading_terms", "02_training", "full", {"tinystories_path": str(text)}), \
        "with the full data set the full profile lists no deviation from the paper"
    context._current = None
