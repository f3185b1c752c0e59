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
from .. import public_names
from . import evaluate, measure, records, runs

__all__ = public_names(globals(), evaluate, measure, runs, records)
