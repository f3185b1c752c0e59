"""Chapter `leading_terms`: "How do transformers learn to associate tokens? Leading gradient terms
bring mechanistic interpretability" (Im, Oh, Fang, Li; ICLR 2026), from the spec in PAPERS.md.

Every notebook gets the same corpus and the same runs by calling the same function with the same
Params (`cfg`). The chapter's map:

runs.py       the corpus and the runs, functions of `cfg`
    `load_corpus` (cached), `make_task`, `batch_size`, `steps_per_epoch`, `first_batch`,
    `first_batch_stats` (B, Sigma_B, Phi, Q, q_pos of the first training batch: the paper's theory
    takes its statistics from it), `cosine_evaluator`; `model_config`, `train_config`,
    `main_run(cfg)`: the paper's model trained with plain SGD, one ensemble member per learning rate
    (`lrs`), every member on the same batches (name BPE for notebook 04); the language model of
    notebook 05: `gpt_config`, `lm_train_config`, `substitute_lm` (trained here), `pretrained_lm`
    (released checkpoints read as `LocalCheckpoints`, a run-like reader), `early_lm`, `lm_name`,
    `lm_is_substitute`, `lm_steps`, `lm_batch`; `notebook_runs(cfg)`, the registry.
evaluate.py   `CosineEvaluator`: the cosine of every weight to its leading term during training (no
    checkpoint needed for the curves), identified by a digest of the first batch, its statistics
    computed on first use.
measure.py    training curves (02 LT-1, LT-2; 04 LT-5): `cosine_frame`, `min_cosines`,
    `s_eta_until_below`; ablation (03, LT-4): `mean_loss`, `loss_with`, `ablation_table`,
    `undone_fractions`, `baseline_table` (the same removal with the shuffled corpus's leading term,
    and a same-size change in the term's span); basis maps (01, LT-3): the word lists `ADJECTIVES`,
    `NOUNS`, `SETTINGS`, `WORD_CLASSES` (the book's, hand-made for TinyStories, so that the
    qualitative claim can be counted), `top_successors`, `top_context_partners`, `neighbours`,
    `top_pairs`, `adjective_noun_share`, `setting_hit_rate`, `class_purity`, each with its chance
    baseline; early training of a language model (05, LT-6): `early_agreement`.
records.py    `matrix_summary` (per matrix: which fail), `names_or_none`, `PAPER_ABLATION`,
    `activation_gib`, `embedding_summary`, `attention_summary`, `lm_label`, `WEIGHT_TITLES`,
    `plot_cosines`.

The generic tools (any corpus, any model) are in `circuitbook.analysis.leading_terms`: the maps,
`context_lift`, `similarity`, `embedding_agreement`, `attention_token_scores`, `attention_agreement`,
`frequent_ids`, `agrees`.
"""
from .. import public_names
from . import evaluate, measure, records, runs

__all__ = public_names(globals(), evaluate, measure, runs, records)
