"""The lenses chapter's library package: every paper's tools (from `analysis/`) pointed at the other papers'
models, read through the chapter contract (`chapters.chapter_runs`), never by importing another chapter.

ACE on Assign and Add (notebook 01)
    runs: `assign_add_params`, `assign_add_task`, `assign_add_run`; measure: `assign_add_pool`, `core_at`,
    `core_trajectory`, `crystallization`, `final_cores`, `core_pairs`; records: `recorded_per_seed`.
Fourier meets ACE (notebook 02)
    runs: `grokking_params`, `grokking_task`, `grokking_run`; measure: `zero_var_tokens`, `modular_tokens`,
    `grid_lens`, `fourier_core_trajectory`, `settle_steps`.
IMIR progress measures on Assign and Add (notebook 03)
    runs: `bursty_task`, `burst_members`, `bursty_run`; evaluate: `BurstEvaluator`, `burst_init`; measure:
    `progress_trajectory`, `metric_at`, `order_of_rises`, `alpha_vs_routing`, `burst_times`.
Leading terms in the first steps (notebook 04)
    runs: `assign_add_run`, `grokking_run`; measure: `lr_segments`, `seta_at`, `decay_at`, `first_batches`,
    `initial_terms`, `leading_term_trajectory`, `agreement_summary` (statistics: analysis.loss_position_terms).
"""
from .. import public_names
from . import evaluate, measure, records, runs

__all__ = public_names(globals(), evaluate, measure, runs, records)
