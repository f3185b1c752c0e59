"""Chapter `inductive_manifold`: "Invariant learning dynamics of transformers in inductive reasoning
tasks" (Musat, Pimentel, Zucchet, Hofmann; arXiv 2607.11875), built from the spec in PAPERS.md
(the paper has no public code and its full text was not available).

Where things live (every public name is re-exported here, `im.<name>`):

    evaluate  the task family and its pools (`recall_task`, `two_hop_task`, `recall_pools`), the runs'
              evaluation callbacks (`DistanceProbe`, `Probe`, `ProgressProbe`, `CircuitProbe`) and Algorithm 1's
              scorer of flat IMIR coordinates (`CoordinateEvaluator`)
    measure   measurements of tasks, models, runs and metrics
    runs      tasks and designs of a notebook's cfg, the run functions (each takes cfg) and `notebook_runs(cfg)`
    records   tables and drawings the notebooks show
Generic tools live in `circuitbook.analysis`: `imir` (S, its coordinates, `s_dimensions`, `captured_fraction`,
`largest_other_coordinates`, `coordinates_of`), `fits` (`proportional_fit`, `logistic_fit`, `paired_gap`),
`curves` (`member_crossings`: every emergence step of the chapter).

What the notebooks use:

Tasks and symmetries (01)       `example_tasks`, `example_table`, `pvalue_table`, `power_curve`
The manifold, IM-1 (02)         `im1_task`, `EnumeratedTask`, `gradient_grid`, `broken_assumptions`,
                                `monte_carlo_outside`, `train_in_and_off_s`
Two layers, IM-2..IM-4 (03)     `two_layer_task`, `Probe`, `train_restricted_and_full`, `loss_gap`, `train_scaling`,
                                `scaling_table`, `icl_gradient`, `suppression_law`, `train_icl_trajectory`,
                                `train_suppression_sweep`, `suppression_members`, `emergence_table`,
                                `train_burstiness_sweep`, `burstiness_members`, `burstiness_table`, `train_standard`
Initialisation, IM-5 (04)       `three_layer_directions`, `CIRCUITS`, `InitTable`, `init_design`, `im5_design`,
                                `train_init_ensemble`, `winners`, `nested_fits`, `point_outcomes`,
                                `boundary_sharpness`
Circuit detection, IM-6 (05)    `train_two_hop`, `backward_elimination`, `aiding_split`, `circuit_graph`,
                                `finds_two_hop_circuit`, `random_chain_rate`

Conventions: every training run goes through `circuitbook.training.train` (ensembles of seeds and sweeps);
the loss is the library's last-position cross-entropy; "unit directions": an IMIRModel's phi and
`IMIRBasis.direction_value` are coefficients on directions of unit Frobenius norm in weight
space, so restricted and unrestricted models are read in the same units.
"""
from .evaluate import (CircuitProbe, CoordinateEvaluator, DistanceProbe, member_weights, Probe, ProgressProbe,
                       recall_pools, recall_task, two_hop_task)
from .measure import (aiding_split, backward_elimination, boundary_sharpness, broken_assumptions,
                      burstiness_at_points, burstiness_table, calibrated_factor, circuit_accuracy,
                      CIRCUIT_DIRECTIONS, CIRCUITS, emergence_table, finds_two_hop_circuit, gradient_grid,
                      ICL_DIRECTIONS, icl_gradient, icl_gradient_vector, learned_delta, loss_gap,
                      monte_carlo_outside, nested_fits, OTHER_DIRECTIONS, own_sizes, per_direction_errors,
                      per_direction_r2, point_outcomes, power_curve, pvalue_table, QUERY_TYPES, random_chain_rate,
                      relative_error, scaling_table, share_outside_directions, span_columns, suppression_law,
                      theory_factor, three_layer_directions, trajectory_points, type_gradients, type_weights,
                      WEIGHT_NAMES_2, winners, with_direction, with_point)
from .runs import (burstiness_members, EnumeratedTask, example_tasks, im1_task, im5_design, im5_task, im6_task,
                   init_design, InitTable, notebook_runs, suppression_grid, suppression_members, sweep_members,
                   train_burstiness_sweep, train_icl_trajectory, train_in_and_off_s, train_init_ensemble,
                   train_restricted_and_full, train_scaling, train_standard, train_suppression_sweep,
                   train_two_hop, two_layer_task)
from .records import (circuit_graph, draw_circuit, example_table, PAPER_AIDING_ACCURACY, survivors_table,
                      type_gradient_table)

__all__ = ["CircuitProbe", "CoordinateEvaluator", "DistanceProbe", "member_weights", "Probe", "ProgressProbe",
           "recall_pools", "recall_task", "two_hop_task", "aiding_split", "backward_elimination",
           "boundary_sharpness", "broken_assumptions", "burstiness_at_points", "burstiness_table",
           "calibrated_factor", "circuit_accuracy", "CIRCUIT_DIRECTIONS", "CIRCUITS", "emergence_table",
           "finds_two_hop_circuit", "gradient_grid", "ICL_DIRECTIONS", "icl_gradient", "icl_gradient_vector",
           "learned_delta", "loss_gap", "monte_carlo_outside", "nested_fits", "OTHER_DIRECTIONS", "own_sizes",
           "per_direction_errors", "per_direction_r2", "point_outcomes", "power_curve", "pvalue_table",
           "QUERY_TYPES", "random_chain_rate", "relative_error", "scaling_table", "share_outside_directions",
           "span_columns", "suppression_law", "theory_factor", "three_layer_directions", "trajectory_points",
           "type_gradients", "type_weights", "WEIGHT_NAMES_2", "winners", "with_direction", "with_point",
           "burstiness_members", "EnumeratedTask", "example_tasks", "im1_task", "im5_design", "im5_task",
           "im6_task", "init_design", "InitTable", "notebook_runs", "suppression_grid", "suppression_members",
           "sweep_members", "train_burstiness_sweep", "train_icl_trajectory", "train_in_and_off_s",
           "train_init_ensemble", "train_restricted_and_full", "train_scaling", "train_standard",
           "train_suppression_sweep", "train_two_hop", "two_layer_task", "circuit_graph", "draw_circuit",
           "example_table", "PAPER_AIDING_ACCURACY", "survivors_table", "type_gradient_table"]
