"""A run's key covers the code that computes it and nothing else (issue "The house").

Each case edits a copy of the package and asks `runs.code_version` for the key of the same run's code.
"""
import shutil

import pytest

import circuitbook as cb
from circuitbook import runs
from circuitbook.tasks.modular import ModularAddition
from circuitbook.training import pool_accuracy

TASK = ModularAddition(p=7, train_fraction=0.5)
OBJECTS = [TASK, pool_accuracy({"test": TASK.test}),
           cb.ToyConfig(d_vocab=8, n_ctx=3, d_model=8, n_layers=1, n_heads=1, d_mlp=8, d_vocab_out=7)]


@pytest.fixture
def package(tmp_path):
    copy = tmp_path / "circuitbook"
    shutil.copytree(runs.PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def _edit(path, old, new):
    text = path.read_text()
    assert old in text, f"{path.name} no longer holds {old!r}: update the test"
    path.write_text(text.replace(old, new, 1))


def key(package):
    return runs.code_version(OBJECTS, root=package)


NOT_IN_THE_KEY = [
    ("training/chunks.py", "SEQUENTIAL_MARGIN = 0.10", "SEQUENTIAL_MARGIN = 0.25"),
    ("training/planning.py", "def count_parameters(", "def _unused():\n    return 1\n\n\ndef count_parameters("),
    ("training/run.py", "return [self.model(k, step) for k in range(self.n_members)]",
     "return list(self.model(k, step) for k in range(self.n_members))"),
    ("training/device.py", '"cuda" if torch.cuda.is_available() else "cpu"', '"cpu" if not torch.cuda.is_available() else "cuda"'),
    ("analysis/ace.py", '"""', '"""Edited docstring.\n\n'),
    ("cluster.py", "CONNECT_TIMEOUT_S = 5.0", "CONNECT_TIMEOUT_S = 9.0"),
    # the key's own modules: explanations are not code
    ("training/loop.py", '"""The training loop:', '"""The training loop (edited):'),
    ("training/ensemble.py", "    opt.zero_grad()\n", "    opt.zero_grad()  # a new comment\n\n\n"),
]
IN_THE_KEY = [
    ("training/loop.py", "step += 1\n", "step += 1\n            _ = None\n"),
    ("training/ensemble.py", "p.mul_(1 - lr * wd)", "p.mul_(1.0 - lr * wd)"),
    ("training/config.py", "eps: float = 1e-8", "eps: float = 1e-7"),
    ("tasks/base.py", "IGNORE_INDEX = -100", "IGNORE_INDEX = -99"),
    ("tasks/draws.py", "_IV = (0x243F6A88, 0x85A308D3)", "_IV = (0x243F6A88, 0x85A308D4)"),  # every task's stream
    ("tasks/modular.py", "class ModularAddition", "X = 1\n\n\nclass ModularAddition"),  # the task's module
    ("training/evaluate.py", "CHUNK = 2048", "CHUNK = 1024"),  # the evaluator's module
    ("models/toy.py", "class LayerNorm(nn.Module):", "Y = 2\n\n\nclass LayerNorm(nn.Module):"),  # the model's module
]


def test_source_digest_ignores_comments_docstrings_and_blank_lines(tmp_path):
    a, b, c = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    a.write_text('"""Module."""\n\n\ndef f(x):\n    """Doc."""\n    return x + 1  # add one\n')
    b.write_text('"""Another text."""\ndef f(x):\n    """Other doc,\n    two lines."""\n\n    return x + 1\n')
    c.write_text('"""Module."""\n\n\ndef f(x):\n    """Doc."""\n    return x + 2  # add one\n')
    assert runs.source_digest(a) == runs.source_digest(b) != runs.source_digest(c)
    d = tmp_path / "d.py"
    d.write_text('def f():\n    x = "# not a comment"\n    return x\n')
    e = tmp_path / "e.py"
    e.write_text('def f():\n    x = "# not a comment, changed"\n    return x\n')
    assert runs.source_digest(d) != runs.source_digest(e), "a '#' inside a string is code"
    f, g = tmp_path / "f.c", tmp_path / "g.c"
    f.write_text("int f(void) { return 1; }\n")
    g.write_text("int f(void) { return 1; } /* other words */\n")
    assert runs.source_digest(f) != runs.source_digest(g), "a C file counts as it is (read by no Python parser)"


# A chapter's run: the main run of assign_add (its model, task and ProgressEvaluator) and a restricted IMIR model.
def chapter_key(package):
    from circuitbook.experiments import assign_add as ea
    from circuitbook.models.imir import IMIRConfig
    from circuitbook.tasks.assign_add import AssignAddTask

    task = AssignAddTask(train_fraction=0.7, split_seed=0)
    imir = IMIRConfig(tuple([0] * 4), (1, 0, 3, 2), 3)
    return runs.code_version([task, ea.ProgressEvaluator(task, pool_size=10, probe_size=8), imir], root=package)


CHAPTER_NOT_IN_THE_KEY = [
    ("experiments/assign_add/measure.py", "def residual_at(", "def _unused():\n    return 2\n\n\ndef residual_at("),
    ("experiments/assign_add/records.py", "def pace_phrase(", "def _unused():\n    return 3\n\n\ndef pace_phrase("),
    ("experiments/assign_add/runs.py", "SWEEP_SEED_STRIDE = 1000", "SWEEP_SEED_STRIDE = 1000\n_UNUSED = 4"),
    ("plan.py", "PLAN_BUDGET_S = 300", "PLAN_BUDGET_S = 301"),
]
CHAPTER_IN_THE_KEY = [
    ("experiments/assign_add/evaluate.py", "MEASURES_VERSION = 3", "MEASURES_VERSION = 30"),  # the evaluator's module
    ("analysis/attention.py", "def template_cosine(", "Z = 3\n\n\ndef template_cosine("),  # its RUN_KEY_SOURCES
    ("models/imir.py", "class IMIRModel(nn.Module):", "W = 5\n\n\nclass IMIRModel(nn.Module):"),
    ("analysis/imir.py", "    def direction_norm(", "    V = 6\n\n    def direction_norm("),  # IMIR's RUN_KEY_SOURCES
    ("tasks/native.c", "static inline u32 mix(u32 x) {", "static int unused;\nstatic inline u32 mix(u32 x) {"),  # the task's
    ("tasks/native.py", "MAX_ROW = 1024", "MAX_ROW = 1025"),  # CPU kernel: its RUN_KEY_SOURCES
]


KEEPS = [(key, *case) for case in NOT_IN_THE_KEY] + [(chapter_key, *case) for case in CHAPTER_NOT_IN_THE_KEY]
CHANGES = [(key, *case) for case in IN_THE_KEY] + [(chapter_key, *case) for case in CHAPTER_IN_THE_KEY]


@pytest.mark.parametrize("run_key, rel, old, new", KEEPS, ids=[f"{k.__name__}:{r}:{o[:20]}" for k, r, o, _ in KEEPS])
def test_editing_what_does_not_compute_the_run_keeps_its_key(package, run_key, rel, old, new):
    """The training core's own runs (`key`) and a chapter's (`chapter_key`): chunking, planning, the reader,
    a chapter's measures, records and run definitions never change a run's key."""
    before = run_key(package)
    _edit(package / rel, old, new)
    assert run_key(package) == before


@pytest.mark.parametrize("run_key, rel, old, new", CHANGES, ids=[f"{k.__name__}:{r}:{o[:20]}" for k, r, o, _ in CHANGES])
def test_editing_the_code_that_computes_the_run_changes_its_key(package, run_key, rel, old, new):
    """The loop, the task, the model, the evaluator and the files they name in RUN_KEY_SOURCES always do."""
    before = run_key(package)
    _edit(package / rel, old, new)
    assert run_key(package) != before
