"""`circuitbook build --plan`: the runs each notebook trains, sized and timed, with nothing trained."""

from pathlib import Path

import pytest

from circuitbook import build, chapters, context, params
from circuitbook.book import book_notebooks
from circuitbook.cli import main
from circuitbook.plan import planned_runs
from circuitbook.tasks.modular import ModularAddition
from circuitbook.training import RunSpec, count_parameters, step_flops, TrainConfig
import circuitbook as cb


def test_every_chapter_defines_its_runs_in_its_package_and_the_plan_types_none():
    for chapter in sorted({nb.chapter for nb in book_notebooks()}):
        assert callable(getattr(chapters.package(chapter), "notebook_runs", None)), chapter
    source = (Path(build.__file__).parent / "plan.py").read_text()
    assert "experiments" not in source and "TRAINING_CALLS" not in source  # the registry is the one list


def test_planning_trains_nothing(runs_dir):
    runs = planned_runs("assign_add", "03_generalization", "smoke")
    assert [r.dir.name for r in runs] == ["assign_add/main", "assign_add/main_cooldown", "assign_add/f_sweep",
                                          "assign_add/r_sweep"][-len(runs):]
    assert all(not r.complete for r in runs)
    assert not runs_dir.exists() or not any(runs_dir.rglob("config.json"))


@pytest.mark.slow
def test_planned_keys_are_the_keys_the_notebook_trains(runs_dir):
    planned = {(r.dir.name, r.key) for r in planned_runs("assign_add", "02_training", "smoke")}
    build.run_one("assign_add/02_training", "smoke", {}, log=lambda m: None)
    recorded = context.read_results("assign_add", "02_training", "smoke")
    assert {(r["name"], r["key"]) for r in recorded["runs"]} == planned
    after = planned_runs("assign_add", "02_training", "smoke")
    assert all(r.complete for r in after), "the plan sees the runs the notebook trained"


def test_flops_and_parameters_known_answers():
    # one linear map: embedding lookups cost nothing; a model is priced by its matmuls
    model = cb.ToyConfig(d_vocab=8, n_ctx=3, d_model=16, n_layers=1, n_heads=2, d_mlp=32, d_vocab_out=7)
    built = model.build(seed=0)
    assert count_parameters(model) == sum(p.numel() for n, p in built.named_parameters() if n in set(built.trainable_names()))
    task = ModularAddition(p=7, train_fraction=0.5)

    def flops(**kw):
        tc = TrainConfig(**{"steps": 1, "batch_size": 8, "seeds": (0,), **kw})
        return step_flops(RunSpec(None, {}, model, [task] * tc.n_members, tc))

    one = flops()
    assert one > 0
    assert flops(seeds=(0, 1, 2)) == pytest.approx(3 * one)
    assert flops(batch_size=16) == pytest.approx(2 * one, rel=0.01)



def test_a_cpu_step_too_big_to_time_is_priced_by_its_flops(runs_dir, monkeypatch):
    """A run whose step at batch 1 exceeds PLAN_UNTIMED_FLOPS on a CPU is never built or stepped: its time is
    its FLOPs over the CPU's matrix-product rate, and the note says so. Below the limit it is timed as before."""
    import torch

    from circuitbook import plan

    (run,) = planned_runs("book", "tour", "smoke")
    cpu = torch.device("cpu")
    timed = plan.cost(run, cpu)
    assert timed.seconds > 0 and "FLOPs /" not in timed.note

    def never(*a, **k):
        raise AssertionError("a step too big to time was timed")

    monkeypatch.setattr(plan, "calibrate", never)
    monkeypatch.setattr(plan, "PLAN_UNTIMED_FLOPS", 0.0)
    monkeypatch.setattr(plan, "matmul_rate", lambda device: 2.0e9)
    big = plan.cost(run, cpu)
    assert big.flops == timed.flops and big.seconds == pytest.approx(big.flops / 2.0e9)
    assert "too big to time here: time = FLOPs / this CPU's matrix-product rate (2 GFLOP/s)" in big.note


def test_matmul_rate_is_measured_and_plausible():
    import torch

    from circuitbook import plan

    state = torch.random.get_rng_state()
    rate = plan.matmul_rate(torch.device("cpu"), n=256)
    assert 1e7 < rate < 1e14 and torch.equal(torch.random.get_rng_state(), state)


def test_plan_command_prints_runs_and_resources(runs_dir, capsys):
    assert main(["build", "--profile", "smoke", "--plan", "--chapter", "assign_add"]) == 0
    out = capsys.readouterr().out
    assert "assign_add/02_training  [resources: num_cpus=1]" in out
    assert "assign_add/main (" in out and "parameters each" in out and "FLOPs" in out and "here (chunk" in out
    assert "reads assign_add/main" in out and any(line.startswith("total: ") for line in out.splitlines())
    groups = out[out.index("\ngroups ("):]
    assert ("assign_add/02_training, assign_add/03_generalization, assign_add/04_mechanisms, "
            "assign_add/05_gradient_theory") in groups, "02-05 read the main run"
    assert "after assign_add/01_task" in groups, "02 needs 01, whose values it reads (01 trains nothing)"
    assert "one at a time" in groups and "side by side" in groups
    assert "one 8-minute call (480 s" in groups
    assert not any(runs_dir.rglob("config.json")) if runs_dir.exists() else True


@pytest.mark.parametrize("res, needle", [
    ("{num_gpu: 1}", "unknown resource 'num_gpu' (did you mean 'num_gpus'?)"),
    ("{num_cpus: 0}", "num_cpus must be a finite number >= 0 (num_cpus > 0)"),
    ("{full: {num_gpus: -1}}", "notebooks.02_use.resources.full: num_gpus must be"),
    ("{num_cpus: true}", "num_cpus must be a finite number"),
    ("[1]", "resources must be a mapping"),
])
def test_bad_resources_are_refused_naming_the_file(mini_book, runs_dir, capsys, res, needle):
    prof = mini_book / "chapters" / "demo" / "profiles.yml"
    prof.write_text(prof.read_text() + f"    resources: {res}\n")
    assert main(["build", "--profile", "smoke"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "profiles.yml" in err
    assert not (runs_dir / "results").exists()


def test_resources_flat_or_per_profile(mini_book):
    prof = mini_book / "chapters" / "demo" / "profiles.yml"
    base = prof.read_text()
    prof.write_text(base + "    resources: {num_cpus: 2, num_gpus: 0.25}\n")
    assert params.resources("demo", "02_use", "cpu") == {"num_cpus": 2, "num_gpus": 0.25}
    prof.write_text(base + "    resources: {full: {num_gpus: 0.5, memory_gb: 4}}\n")
    assert params.resources("demo", "02_use", "full") == {"num_cpus": 1, "num_gpus": 0.5, "memory_gb": 4}
    assert params.resources("demo", "02_use", "smoke") == {"num_cpus": 1}


def _cost(name, seconds, complete=False):
    from types import SimpleNamespace

    from circuitbook.plan import RunCost

    run = SimpleNamespace(dir=SimpleNamespace(name=name), key=f"key-{name}", complete=complete)
    return RunCost(run, 10, 1e9, seconds, 1)


def test_groups_join_notebooks_through_shared_runs_and_wait_for_values_they_read(mini_book):
    from circuitbook.plan import NOTEBOOK_OVERHEAD_S, NotebookPlan, groups

    shared = _cost("demo/run", 100.0)
    shared.eval_seconds = 10.0
    (both,) = groups([NotebookPlan("demo/01_make", {}, [shared]), NotebookPlan("demo/02_use", {}, [shared])], "smoke")
    assert both.notebooks == ["demo/01_make", "demo/02_use"] and both.claims == 2 and both.after == []
    assert both.seconds == pytest.approx(100 + 10 + 2 * NOTEBOOK_OVERHEAD_S), "a shared run counts once, evaluated"
    assert both.notebook_seconds["demo/02_use"] == NOTEBOOK_OVERHEAD_S, "the reader trains nothing"
    # 02 needs 01 but shares no run with it: it reads 01's recorded values, so it waits for them, not joined
    apart = groups([NotebookPlan("demo/01_make", {}, [_cost("demo/a", 10.0, complete=True)]),
                    NotebookPlan("demo/02_use", {"num_gpus": 0.25}, [], "cannot plan it: no data")], "smoke")
    assert [g.notebooks for g in apart] == [["demo/01_make"], ["demo/02_use"]]
    assert apart[1].after == ["demo/01_make"] and apart[0].after == []
    assert apart[0].seconds == NOTEBOOK_OVERHEAD_S, "a run complete in the store costs nothing"
    assert apart[1].problems == ["demo/02_use: cannot plan it: no data"]
    assert apart[1].resources == {"num_cpus": 0.0, "num_gpus": 0.25}


def _group(name, claims, seconds, problems=(), after=(), gpus=0.25):
    from circuitbook.plan import Group

    return Group([name], [], claims, seconds, {name: seconds}, list(problems), list(after),
                 {"num_cpus": 1, "num_gpus": gpus})


def test_choose_groups_takes_the_largest_value_that_still_fits():
    from circuitbook.plan import choose_groups

    big, cheap, dear, broken, small = (_group("big", 5, 200), _group("cheap", 2, 20), _group("dear", 2, 300),
                                       _group("broken", 9, 1, ["x: cannot plan it"]), _group("small", 0, 50))
    chosen, skipped = choose_groups([small, dear, cheap, big, broken], 300, 1, "cuda")
    assert [g.name for g in chosen] == ["big", "cheap", "small"]
    assert [g.name for g, _ in skipped] == ["broken", "dear"]
    assert skipped[0][1] == "x: cannot plan it" and "needs ~5m 00s" in skipped[1][1]
    assert choose_groups([big], 199, 1, "cuda")[0] == []
    # side by side (4 slots, throughput 2.9 at 4): big and dear together take (200 + 300) ... not 500 s
    chosen, _ = choose_groups([dear, big], 420, 4, "cuda")
    assert [g.name for g in chosen] == ["big", "dear"]
    # a CPU's processes share its cores: side by side they take as long as one after the other
    assert [g.name for g in choose_groups([dear, big], 420, 2, "cpu")[0]] == ["big"]


def test_a_group_comes_after_the_groups_whose_values_it_reads():
    from circuitbook.plan import by_value

    table = _group("lenses/05", 9, 10, after=["a/02", "b/03"])
    a, b = _group("a/02", 3, 100), _group("b/03", 1, 50)
    assert [g.name for g in by_value([table, b, a])] == ["a/02", "b/03", "lenses/05"]
    alone = _group("lenses/05", 9, 10, after=["published/elsewhere"])
    assert [g.name for g in by_value([alone, a])] == ["lenses/05", "a/02"], "a value not made here: by value"


def test_side_by_side_time_shares_the_device_as_measured():
    from circuitbook.plan import SIDE_BY_SIDE_THROUGHPUT, side_by_side_seconds, slots_for, throughput

    gpu = SIDE_BY_SIDE_THROUGHPUT["cuda"]
    assert throughput(1, "cuda") == 1.0 and throughput(4, "cuda") == gpu[4]
    assert throughput(2, "cuda") == pytest.approx(1 + (gpu[4] - 1) / 3)
    four = [_group(n, 1, 100.0) for n in "abcd"]
    assert side_by_side_seconds(four, 1, "cuda") == 400.0
    assert side_by_side_seconds(four, 4, "cuda") == pytest.approx(400 / gpu[4])
    # one long and one short group: the short one ends first, the long one then runs alone at full speed
    long, short = _group("long", 1, 300.0), _group("short", 1, 100.0)
    t2 = throughput(2, "cuda") / 2
    assert side_by_side_seconds([long, short], 2, "cuda") == pytest.approx(100 / t2 + (300 - 100) / 1.0)
    assert slots_for(four, "cuda", cpus=16) == 4 and slots_for(four, "cuda", cpus=2) == 2
    assert slots_for([_group("cpu only", 1, 1.0, gpus=0)], "cuda", cpus=16) == 1
    # a CPU: processes share its cores (one process's work gets done), two at a time at most
    assert throughput(1, "cpu") == throughput(2, "cpu") == throughput(4, "cpu") == 1.0
    assert throughput(3, "mps") == 1.0, "a device never measured is taken to share like a CPU"
    assert side_by_side_seconds(four, 2, "cpu") == pytest.approx(400.0)
    assert side_by_side_seconds([long, short], 2, "cpu") == pytest.approx(400.0)
    assert slots_for(four, "cpu", cpus=16) == 2 and slots_for(four, "cpu", cpus=1) == 1


def test_chapter_runs_resolves_that_chapters_parameters_and_calls_its_registry(runs_dir):
    from circuitbook.training.planning import planning

    with planning() as plan:
        runs = cb.chapter_runs("assign_add", "02_training", "smoke")
    assert list(runs) == ["main"]
    direct = planned_runs("assign_add", "02_training", "smoke")
    assert [(r.dir.name, r.key) for r in plan.runs] == [(r.dir.name, r.key) for r in direct]
    assert runs["main"].key == direct[-1].key  # the continuation's key names the composed run
    with planning():
        wider = cb.chapter_runs("assign_add", "02_training", "smoke", d_model=24)
    assert wider["main"].key != runs["main"].key  # overrides are that chapter's parameters
