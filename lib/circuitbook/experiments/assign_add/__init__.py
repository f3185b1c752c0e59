"""Chapter `assign_add`: the experiments of "Assign and Add" (Exoo, Bietti, Sous; arXiv 2605.31497).

The chapter contract's four modules (CONTRIBUTING.md, "Adding a chapter"), re-exported here so that a
notebook reads `ea.detect_phases`, `ea.main_run`, ... whatever module defines them:

    runs.py      config builders, run functions and `notebook_runs(cfg)`, the registry of every run
    evaluate.py  the evaluation callbacks and the progress measures they log (in the runs' keys)
    measure.py   phases, attention roles, residual cosines, MLP grids, QK gradients (AA-2 .. AA-12)
    records.py   phase records, sweep tables, the pace caveat
"""
from ...analysis.baselines import random_directions_block
from ...training import ComposedRun, ReleasedRun
from ...tasks.assign_add import N_VARS, PAIR_SPLITS, SEQ_LEN
from .evaluate import (MEASURES_VERSION, TWO_VAR_POOLS, eval_pools, pool_accuracies, value_positions, bound_targets,
    routing_score, bound_attention, addend_targets, prefix_keys, addends_top_share, bound_over_values_share,
    variable_qk_matrix, ProgressEvaluator, sweep_evaluator)
from .measure import (VAR_POOLS, HARD_POOLS, ADD_POOLS, random_init_model, accuracy_by_variable_side, ROLES,
    key_roles, attention_by_role, Phases, default_window, detect_phases, hard_final_accuracy, checkpoint_before,
    checkpoint_after, stage_checkpoint, stage_missing_why, transition_checkpoints, residual_at, residual_cosines,
    mlp_preactivation_grid, variable_probe_data, qk_gradient, qk_basis, qk_in_basis, variable_block, block_energy,
    theory_qk_block)
from .runs import (SWEEP_SEED_STRIDE, model_config, train_config, make_task, main_run, check_chapter_model,
    released_run, note_release, source_run, load_model, final_step, final_models, sweep_members, sweep_init,
    sweep_split, f_sweep, r_sweep, notebook_runs)
from .records import (SCHEDULE_KNOBS, why_if_missing, schedule_deviations, phases_table, NO_JUMP, NO_REFINEMENT,
    phase_records, pace_phrase, sweep_table)

__all__ = ["ComposedRun", "ReleasedRun", "N_VARS", "PAIR_SPLITS", "SEQ_LEN", "MEASURES_VERSION", "TWO_VAR_POOLS",
           "eval_pools", "pool_accuracies", "value_positions", "bound_targets", "routing_score", "bound_attention",
           "addend_targets", "prefix_keys", "addends_top_share", "bound_over_values_share", "variable_qk_matrix",
           "ProgressEvaluator", "sweep_evaluator", "VAR_POOLS", "HARD_POOLS", "ADD_POOLS", "random_init_model",
           "accuracy_by_variable_side", "ROLES", "key_roles", "attention_by_role", "Phases", "default_window",
           "detect_phases", "hard_final_accuracy", "checkpoint_before", "checkpoint_after", "stage_checkpoint",
           "stage_missing_why", "transition_checkpoints", "residual_at", "residual_cosines", "mlp_preactivation_grid",
           "variable_probe_data", "qk_gradient", "qk_basis", "qk_in_basis", "variable_block", "block_energy",
           "random_directions_block", "theory_qk_block", "SWEEP_SEED_STRIDE", "model_config", "train_config",
           "make_task", "main_run", "check_chapter_model", "released_run", "note_release", "source_run", "load_model",
           "final_step", "final_models", "sweep_members", "sweep_init", "sweep_split", "f_sweep", "r_sweep",
           "notebook_runs", "SCHEDULE_KNOBS", "why_if_missing", "schedule_deviations", "phases_table", "NO_JUMP",
           "NO_REFINEMENT", "phase_records", "pace_phrase", "sweep_table"]
