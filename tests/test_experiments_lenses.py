"""The lenses chapter's own code: known answers for its measurements, the tasks it rebuilds from other chapters'
parameters, and the table's cells (every value cell names a key its notebook records)."""
import json
import math

import pandas as pd
import pytest
import torch

import circuitbook as cb
from circuitbook import params
from circuitbook.analysis import ace
from circuitbook.experiments import lenses as el
from circuitbook.models.toy import ToyConfig, ToyTransformer
from circuitbook.tasks.modular import ModularAddition
from conftest import ROOT


@pytest.mark.parametrize("profile", ["smoke", "cpu", "full"])
def test_the_tasks_are_those_the_other_chapters_train_on(profile):
    """The lenses rebuild Assign and Add's and the grokking run's tasks from those notebooks' parameters; the
    result must be the task those chapters build (compared through their specs, which enter the run keys)."""
    from circuitbook.experiments import algorithmic_cores as ac
    from circuitbook.experiments import assign_add as ea

    cfg = cb.load_params("lenses", "02_fourier_ace", profile)
    aa_cfg, gk_cfg = el.assign_add_params(cfg), el.grokking_params(cfg)
    assert aa_cfg.notebook == "02_training" and gk_cfg.notebook == "03_grokking" and aa_cfg.profile == profile
    assert el.assign_add_task(aa_cfg).spec() == ea.make_task(aa_cfg).spec()
    assert el.grokking_task(gk_cfg).spec() == ac.grokking_task(gk_cfg).spec()


def test_the_ace_pool_is_a_third_of_each_kind_of_training_query():
    cfg = cb.load_params("lenses", "01_ace_assign_add", "smoke")
    task = el.assign_add_task(el.assign_add_params(cfg))
    pool = el.assign_add_pool(task, 90, seed=3)
    assert pool.tokens.shape == (90, 16) and torch.equal(pool.tokens, el.assign_add_pool(task, 90, seed=3).tokens)
    kinds = task.parse(pool.tokens)["seq_type"]
    n_vars = (kinds > 0).long() + (kinds == 3).long()  # 0-var, 1-var (left or right), 2-var
    assert [int((n_vars == k).sum()) for k in range(3)] == [30, 30, 30]
    assert torch.equal(pool.labels, task.parse(pool.tokens)["label"])


def _traj(steps, core, suff, nec):
    return pd.DataFrame({"step": steps, "core_dim": core, "sufficient_dim": suff, "necessary_k": nec})


def test_crystallization_reads_ac5s_ratios_around_the_event():
    t = _traj([0, 100, 200, 300, 400], [40.0, 30.0, 20.0, 6.0, 8.0], [5.0, 5.0, 5.0, 4.0, 4.0], [30.0, 20.0, 10.0, 6.0, 9.0])
    out = el.crystallization(t, start=100, event=250)
    # at the first checkpoint at or after 250 (step 300): core 6 over the largest of steps 100, 200 (30)
    assert out["event_step"] == 300 and out["dim_ratio"] == pytest.approx(6 / 30)
    assert out["sufficient_over_core"] == pytest.approx(4 / 6) and out["necessary_over_core"] == pytest.approx(1.0)
    assert out["why"] is None
    inf = el.crystallization(_traj([0, 100, 200], [5.0, math.inf, math.inf], [1.0, 2.0, 2.0], [5.0, math.inf, math.inf]),
                             start=0, event=150)
    assert inf["dim_ratio"] == math.inf and inf["necessary_over_core"] == math.inf, "no finite core: not low-dim"
    zero = el.crystallization(_traj([0, 100, 200], [math.inf, 4.0, 4.0], [1.0, 2.0, 2.0], [5.0, 4.0, 4.0]),
                              start=0, event=150)
    assert zero["dim_ratio"] == 0.0, "AC-5's convention: finite over infinite"
    assert "no event step" in el.crystallization(t, start=100, event=math.nan)["why"]
    assert "no checkpoint after" in el.crystallization(t, start=100, event=1000)["why"]
    assert "between the addition step" in el.crystallization(t, start=400, event=400)["why"]


def test_settle_steps_of_a_constructed_trajectory():
    t = pd.DataFrame({"step": [0, 100, 200, 300, 400],
                      "key_frequencies": [(1,), (2, 3), (2, 3), (2, 3), (2, 3)],
                      "core_in_final_core": [0.2, 0.5, 0.95, 0.92, 1.0]})
    out = el.settle_steps(t, share=0.9)
    assert out == {"keys_settle": 100.0, "core_settle": 200.0, "gap": pytest.approx(100 / 400)}


def test_grid_lens_on_a_small_model_is_a_share_beside_its_random_share():
    task = ModularAddition(p=7, train_fraction=0.5, split_seed=0, equals_token=False)
    model = ToyTransformer(ToyConfig(d_vocab=7, n_ctx=2, d_model=12, n_layers=1, n_heads=2, d_mlp=24, d_vocab_out=7,
                                     normalization=None), seed=0).eval()
    lens = el.grid_lens(model, el.modular_tokens(task), 7, ace.PAPER, power_fraction=0.8)
    assert lens.key_frequencies and all(1 <= k <= 3 for k in lens.key_frequencies)
    assert 0 <= lens.core_in_fourier <= 1 + 1e-9 and lens.random_share == lens.fourier.shape[1] / 12
    a, b = torch.tensor([3, 6]), torch.tensor([5, 0])
    assert torch.equal(el.modular_tokens(task)(a, b), torch.stack([a, b], 1)), "task.all is a-major"


def test_seed_value_and_values_read_from_a_notebook_that_never_ran(runs_dir):
    assert el.seed_value([4.0], 2) == 4.0 and el.seed_value([1.0, 2.0], 1) == 2.0
    assert math.isnan(el.seed_value([1.0, 2.0], 5))
    values, why = el.recorded_per_seed("assign_add", "02_training", "aa2_jump_step_run", "smoke")
    assert math.isnan(values[0]) and "has not been executed at smoke" in why


def test_every_cell_of_the_table_names_a_key_its_notebook_records(runs_dir):
    """A value cell names a (chapter, notebook, key) that exists: the notebook is in the book and records the
    key (its name appears in the notebook's source); without any results every value cell says not recorded."""
    for cell in el.LENS_CELLS:
        assert cell.model in el.MODELS and cell.lens in el.LENSES
        if cell.not_applicable:
            continue
        assert cell.notebook in params.notebooks(cell.chapter), cell
        source = (ROOT / "chapters" / cell.chapter / f"{cell.notebook}.ipynb").read_text()
        assert cell.key in "".join("".join(c["source"]) for c in json.loads(source)["cells"]), cell
    cells = el.lens_cells("smoke")
    assert len(cells) == len(el.MODELS) * len(el.LENSES)
    assert set(cells.kind) <= {"not recorded", "not applicable", "not measured in this book"}
    table = el.lens_table(cells)
    assert list(table.index) == list(el.MODELS) and list(table.columns) == list(el.LENSES)
