"""Experiment definitions of the chapters: the runs a chapter's notebooks share (model and
training configs built from the notebook Params, the main run, sweeps as ensembles) and the
chapter-specific measurements. One module per chapter, e.g. `experiments.assign_add`."""
