"""The benchmark scripts run end to end at a tiny size and write what their README reads.

Timings are not checked here (they are meaningless at this size); the scripts' own
fairness checks are: the ensemble must train the same models as the sequential runs,
and the toy model must compute the same logits as TransformerLens's native model.
"""
import json
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT


def run_script(name: str, *args: str, out) -> dict:
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *args, "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    assert out.with_suffix(".txt").read_text().count("\n") >= 3
    return json.loads(out.read_text())


def test_ensemble_benchmark_trains_the_same_models(tmp_path):
    report = run_script("ensemble.py", "--setting", "markov", "--members", "2", "--steps", "3", "--repeats", "1",
                        out=tmp_path / "ensemble.json")
    (result,) = report["results"]
    assert result["agreement"]["agree"] and result["agreement_chunked"]["agree"]
    assert result["chosen_chunk"] in (1, 2) and set(result["calibration_step_s"]) == {"1", "2"}
    assert result["ratio_wall"] > 0 and result["ratio_wall_chunked"] > 0 and report["machine"]["cpu_count"] >= 1


def test_step_benchmark_compares_equal_models(tmp_path):
    report = run_script("step.py", "--size", "small", "--norm", "none", "--repeats", "1", out=tmp_path / "step.json")
    (result,) = report["results"]
    assert max(result["max_abs_logit_diff"].values()) < 1e-4
    assert result["ratio_toy_over_bridge"] > 0


def test_gpu_benchmark_times_each_chapter_model_on_the_device_at_hand(tmp_path):
    report = run_script("gpu.py", "--profile", "smoke", "--members", "2", "--matmul-size", "128", "--chapter",
                        "algorithmic_cores", out=tmp_path / "gpu.json")
    (result,) = report["results"]
    assert result["run"] == "algorithmic_cores/markov" and result["flops_per_member_step"] > 0
    (row,) = result["rows"]
    assert row["members"] == 2 and row["speedup"] > 0 and 0 < row["peak_share"]
    assert report["machine"]["matmul_peak_flops"]["fp32"] > 0


def test_data_benchmark_times_old_and_new_batches_and_the_step(tmp_path):
    report = run_script("data.py", "--profile", "smoke", "--chapter", "book", "--repeats", "2", "--step-repeats", "1",
                        out=tmp_path / "data.json")
    (row,) = report["results"]
    assert row["chapter"] == "book" and row["run"] == "tour/modular_addition" and row["capturable"]
    for key in ("data_ms_per_member_step", "old_data_ms_per_member_step", "step_ms", "data_share_of_step"):
        assert row[key] > 0, key
    assert row["members"] >= 1 and row["batch_size"] >= 1
    assert row["kernel"] is False and row["torch_data_ms"] is None, "a fixed dataset's sampler has no CPU kernel"


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the samplers run their torch form")
def test_data_benchmark_times_the_kernel_beside_the_torch_form(tmp_path):
    report = run_script("data.py", "--profile", "smoke", "--chapter", "lenses", "--repeats", "1", "--step-repeats",
                        "1", out=tmp_path / "data.json")
    rows = [r for r in report["results"] if r.get("kernel")]
    assert rows, "lenses' bursty Assign-and-Add run makes its batches with the kernel"
    for row in rows:
        assert row["torch_data_ms_per_member_step"] > 0 and row["data_ms_per_member_step"] > 0


def test_data_vs_times_this_tree_beside_another_checkout_and_compares_the_batches(tmp_path):
    """The checkout as its own baseline: every batch the same. A folder that is not a checkout is refused
    before any worker starts, and nothing is written."""
    report = run_script("data_vs.py", str(ROOT), "--profile", "smoke", "--chapter", "book", "--repeats", "1",
                        "--rounds", "2", out=tmp_path / "vs.json")
    (row,) = report["results"]
    assert row["run"] == "tour/modular_addition" and row["same_batches"] is True
    assert row["data_ms_per_member_step"] > 0 and row["baseline_data_ms_per_member_step"] > 0 and row["ratio"] > 0
    assert report["machine"]["baseline"] == str(ROOT)
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "data_vs.py"), str(tmp_path), "--out",
                          str(tmp_path / "bad.json")], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "not a circuitbook checkout" in bad.stderr
    assert not (tmp_path / "bad.json").exists()


def test_data_benchmark_times_the_data_of_a_run_whose_step_passes_max_step_s(tmp_path):
    report = run_script("data.py", "--profile", "smoke", "--chapter", "book", "--repeats", "1", "--step-repeats", "1",
                        "--max-step-s", "0.000001", out=tmp_path / "data.json")
    rows = [r for r in report["results"] if "error" not in r]
    assert rows
    for row in rows:
        assert row["step_ms"] is None and row["step_over_s"] == 1e-6 and row["data_share_of_step"] is None
        assert row["data_ms_per_member_step"] > 0
    assert ">1e-06 s" in (tmp_path / "data.txt").read_text()


PLAN_VS_SUMMARY = {  # a visit's summary: two groups side by side, one notebook under its plan, two over
    "profile": "cpu", "status": "done", "slots": 2,
    "plan": {"seconds_one_at_a_time": 400.0, "seconds_side_by_side": 400.0, "side_by_side": 2},
    "skipped": [],
    "groups": [
        {"name": "a/02 (+1)", "status": "done", "ended_s": 300.0, "estimate_s": 250.0,
         "notebooks": [{"notebook": "a/02", "status": "ok", "estimate_s": 200.0, "seconds": 250.0},
                       {"notebook": "a/03", "status": "ok", "estimate_s": 50.0, "seconds": 20.0}]},
        {"name": "b/01", "status": "done", "ended_s": 500.0, "estimate_s": 150.0,
         "notebooks": [{"notebook": "b/01", "status": "ok", "estimate_s": 150.0, "seconds": 100.0}]},
    ]}


def test_plan_vs_tabulates_the_plan_beside_what_each_notebook_took(tmp_path):
    summary = tmp_path / "groups.json"
    summary.write_text(json.dumps(PLAN_VS_SUMMARY))
    report = run_script("plan_vs.py", "--summary", str(summary), out=tmp_path / "plan_vs.json")
    rows = {r["notebook"]: r for r in report["rows"]}
    assert rows["a/02"]["plan_over_took"] == 0.8 and rows["a/02"]["within"]  # 200 / 250: 20% under
    assert rows["a/03"]["plan_over_took"] == 2.5 and not rows["a/03"]["within"]
    assert rows["b/01"]["plan_over_took"] == 1.5 and not rows["b/01"]["within"]
    assert report["whole"]["within"] == 1 and report["whole"]["notebooks"] == 3
    assert report["whole"]["wall_s"] == 500.0 and report["whole"]["plan_over_wall"] == 0.8
    # a summary with a skipped group: no whole-run comparison, and the text says why
    skipped = {**PLAN_VS_SUMMARY, "skipped": [{"name": "c/01", "why": "needs more time"}]}
    summary.write_text(json.dumps(skipped))
    report = run_script("plan_vs.py", "--summary", str(summary), out=tmp_path / "plan_vs2.json")
    assert "plan_over_wall" not in report["whole"]
    assert "not compared" in (tmp_path / "plan_vs2.txt").read_text()


@pytest.mark.parametrize("args, named", [(["--profile", "huge"], "huge"), (["--summary", "/nonexistent.json"], "--summary"),
                                         (["--minutes", "0"], "--minutes")])
def test_plan_vs_refuses_bad_input_before_running_anything(tmp_path, args, named):
    out = tmp_path / "plan_vs.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plan_vs.py"), *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and named in done.stderr and not out.exists()


def test_plan_vs_reports_a_damaged_summary_by_path(tmp_path):
    summary, out = tmp_path / "groups.json", tmp_path / "plan_vs.json"
    summary.write_text('{"groups": [')  # cut off mid-write
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plan_vs.py"), "--summary", str(summary),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and str(summary) in done.stderr and not out.exists()
