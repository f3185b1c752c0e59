"""circuitbook: the shared library of a Jupyter Book that reproduces papers on
how transformers learn circuits. Tasks, the toy transformer, one training loop
with an ensemble axis, an artifact store, analyses, and the claims ledger."""
from .chapters import chapter_params, chapter_runs, notebook_runs
from .claims import record
from .models.toy import ToyConfig, ToyTransformer
from .notebook import load_params
from .runs import Store, repo_root, runs_root
from .training import Ensemble, Run, TrainConfig, pool_accuracy, train

__version__ = "0.1.0"
__all__ = ["chapter_params", "chapter_runs", "notebook_runs", "record", "ToyConfig", "ToyTransformer", "load_params", "Store", "repo_root", "runs_root", "Ensemble",
           "Run", "TrainConfig", "pool_accuracy", "train", "__version__"]
