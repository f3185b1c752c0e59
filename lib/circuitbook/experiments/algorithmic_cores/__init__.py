"""Chapter `algorithmic_cores`: "Transformers converge to invariant algorithmic cores"
(Schiffman, arXiv 2602.22600), reimplemented from the chapter's spec in PAPERS.md.

Every notebook gets the same runs by calling `notebook_runs(cfg)` with its Params (`cb.notebook_runs`).
The package's map (`from circuitbook.experiments import algorithmic_cores as ac` gives every name below):

    evaluate.py  the evaluation callbacks: `NextTokenAccuracy` (Markov), `modular_evaluate` (grokking, sweeps)
    runs.py      builders of configs and tasks from `cfg`, the run functions, `notebook_runs(cfg)`
    measure.py   measurements: pure functions of models, runs and metrics
    records.py   claim-value dicts, tables and summaries the notebooks record

Generic tools live in `analysis`: ACE at the readout of a ToyTransformer (`analysis.readout`: `ace_final`,
`validate_readout`, `readout_jacobians`, ...), random baselines (`analysis.baselines`), crossings and power
laws (`analysis.curves`).

Definitions (all notebooks)
    `ace.PAPER` and `ace.BOOK` say what the core, "sufficient" and "necessary" mean (the paper's choices,
    judged on the scorecard, and the book's first choices, shown beside them); `with_threshold`, `dim_value`.
Planted system (notebook 01; measure)
    `planted_system`: a latent linear system with known core and known operator, embedded in a larger
    activation space with distracting directions; `PlantedModel` reads it out through a hook, so the whole
    ACE pipeline runs on it; `PlantedSystem.predicted_core` is the exact answer when nuisance directions
    correlate with the latents by chance.
Markov chains (notebook 02, AC-1..AC-4)
    runs: `MARKOV_SETUPS` ("paper": post-LN with dropout, "normal_init", "book": pre-LN), `markov_chain`,
    `markov_task`, `markov_model_config`, `markov_definition`, `train_markov(cfg, setup)`;
    measure: `markov_member_analysis`, `markov_model_analysis`, `markov_pairs`, `matched_eig_errors`,
    `eig_relative_error`, `state_conditional_operator`; records: `markov_claim_values`,
    `operator_diagnostic`, `compare_setups`.
Grokking (notebook 03, AC-5..AC-7)
    runs: `grokking_task`, `grokking_model_config`, `train_grokking(cfg)`, `choose_fork_step`, `fork_step`,
    `train_wd0_branch(cfg, run, fork_step)`; measure: `grokking_times`, `joint_crossing`, `auto_fork_step`,
    `modular_core_at`, `core_trajectory`, `shift_operator`, `unit_circle_deviation`, `dimension_growth`,
    `eigen_frequencies`; records: `grokking_summary`, `final_frequencies`.
Delay law (notebook 04, AC-8)
    runs: `train_omega_sweep(cfg)`, `omega_members(cfg)`, `train_p_sweep(cfg)`; measure: `grokking_times`,
    `per_seed_exponents`, `seed_mean_exponent`, `fit_power_law_or_none` (from `analysis.curves`).
Agreement in a language model (notebook 05, AC-9; measure)
    `agreement_margin`, `layer_cores`, `flip_effect`, `greedy_generate`, `first_verb_number`,
    `spearman_alignment`, `agreement_model_analysis`.
"""
from ...analysis.ace import (class_mean_operator, dim_value, unit_circle_deviation, unit_circle_share,
                             unit_circle_tolerance)
from ...analysis.curves import fit_power_law_or_none, pick_steps
from ...analysis.readout import core_dimensions
from .. import public_names
from . import evaluate, measure, records, runs

# first the tools of `analysis` the notebooks call by the chapter's name (they lived here before other chapters
# used them)
__all__ = ["class_mean_operator", "core_dimensions", "dim_value", "fit_power_law_or_none", "pick_steps",
           "unit_circle_deviation", "unit_circle_share", "unit_circle_tolerance",
           *public_names(globals(), evaluate, measure, runs, records)]
