"""The book-level notebooks' library package (the tour): see `runs`."""
from .runs import model_config, modular_addition_run, notebook_runs, task, train_config

__all__ = ["model_config", "modular_addition_run", "notebook_runs", "task", "train_config"]
