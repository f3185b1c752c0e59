"""The claims ledger: rules, statuses, stale results, per-seed values, and every claim of PAPERS.md."""
import math
import re

import nbformat
import pytest

import circuitbook as cb
from circuitbook import build, claims, context, params
from conftest import ROOT


def test_rules():
    v = {"a": 0.5, "s": "x", "n": float("nan"), "seeds": [0.2, 0.6, 0.9]}
    assert claims.rule_holds("a >= 0.5", v) and not claims.rule_holds("a > 0.5", v)
    assert claims.rule_holds("a in [0.4, 0.6]", v) and not claims.rule_holds("a in [0.6, 1]", v)
    assert claims.rule_holds("a within 0.45 +- 0.06", v) and not claims.rule_holds("a within -1 +- 0.25", v)
    assert claims.rule_holds("a <= 5e-1", v) and claims.rule_holds("a > -1E+2", v)
    assert not claims.rule_holds("s >= 1", v), "a text value passes no numeric rule"
    assert not claims.rule_holds("n >= 0", v) and not claims.rule_holds("n <= 0", v)
    assert claims.rule_holds("seeds >= 0.6", v) and not claims.rule_holds("seeds > 0.6", v), "median of the seeds"


@pytest.mark.parametrize("rule", ["a is big", "a >= 0.5x", "a >= five", "a in [1, 0]", "a within 1 +- -1",
                                  "a in [0, 1", "a >= 0.5 and b <= 1", "a == 'x'"])
def test_malformed_rules_are_refused(rule):
    with pytest.raises(ValueError, match="claim rule"):
        claims.parse_rule(rule)


def test_every_claim_id_of_papers_md_has_exactly_one_row():
    papers = (ROOT.parent / "shared" / "PAPERS.md")
    expected = {f"AA-{i}" for i in range(1, 13)} | {f"LT-{i}" for i in range(1, 7)} | \
               {f"AC-{i}" for i in range(1, 10)} | {f"IM-{i}" for i in range(1, 7)}
    if papers.exists():
        assert set(re.findall(r"^- ((?:AA|LT|AC|IM)-\d+)", papers.read_text(), re.M)) == expected
    ids = [c["id"] for ch in claims.claim_chapters() if ch != "lenses" for c in claims.load_claims(ch)["claims"]]
    assert sorted(ids) == sorted(expected) and len(ids) == len(set(ids))


def test_the_books_own_questions_have_their_own_ids():
    """The lenses chapter asks the book's questions (no paper): ids LN-1, LN-2, ... numbered in order, every
    statement a hypothesis, no paper value claimed."""
    rows = claims.load_claims("lenses")["claims"]
    assert [c["id"] for c in rows] == [f"LN-{i}" for i in range(1, len(rows) + 1)]
    assert all(c["statement"].startswith("Hypothesis:") and c["paper"].startswith("no paper value") for c in rows)


def test_scorecard_rows_have_the_promised_fields(runs_dir):
    rows = claims.scorecard("smoke")
    assert len(rows) == 33 + len(claims.load_claims("lenses")["claims"])
    for r in rows:
        assert {"id", "status", "paper", "measured", "profile", "rule", "deviations", "baselines", "runs"} <= set(r)
        assert claims.status_kind(r["status"]) in claims.STATUSES


def _finish(chapter="demo", notebook="01_make", label="smoke"):
    """What the build does after a notebook ran to the end: mark its results ok and keep the executed
    notebook, which carries the digest of those results."""
    data = context.mark(chapter, notebook, label, "ok", "", context.current()["execution"])
    executed = nbformat.v4.new_notebook(metadata={"circuitbook": {"results_sha256": context.results_digest(data)}})
    tmp = context.runs_root() / "executed.tmp.ipynb"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(executed, tmp)
    nb = build.Notebook(context.notebook_source(chapter, notebook), chapter, notebook, data["input_hash"])
    build._store_execution(label, nb, tmp, 0.0)


def test_status_from_recorded_values(mini_book, runs_dir):
    cb.load_params("demo", "01_make", "smoke")
    claims.record("demo_value", 1.5)
    _finish()
    rows = {r["id"]: r for r in claims.scorecard("smoke")}
    assert rows["D-1"]["status"] == "partial"
    claims.record("demo_value", 0.5)
    _finish()
    assert claims.scorecard("smoke")[0]["status"] == "not reproduced"
    claims.record("demo_value", "not run: no weights here")
    _finish()
    assert claims.scorecard("smoke")[0]["status"] == "not run: no weights here"
    assert rows["D-2"]["status"] == "not run: demo/02_use not executed at smoke"
    assert {r["id"]: r for r in claims.scorecard("cpu")}["D-1"]["status"].startswith("not run: not expected at profile cpu")


def test_another_notebook_reads_recorded_values_only_while_they_are_current(mini_book, runs_dir):
    """recorded_values: what the scorecard would grade, or NotRecorded naming why (not executed, still running,
    stale); a value recorded as not measured is NaN with its reason in recorded_whys."""
    with pytest.raises(claims.NotRecorded, match="has not been executed at smoke"):
        claims.recorded_values("demo", "01_make", "smoke")
    cb.load_params("demo", "01_make", "smoke")
    claims.record("demo_value", 5.0)
    claims.record("demo_missing", float("nan"), why="no jump")
    with pytest.raises(claims.NotRecorded, match="did not finish"):
        claims.recorded_values("demo", "01_make", "smoke")
    _finish()
    values = claims.recorded_values("demo", "01_make", "smoke")
    assert values["demo_value"] == 5.0 and math.isnan(values["demo_missing"])
    assert claims.recorded_whys("demo", "01_make", "smoke") == {"demo_missing": "no jump"}
    nb = mini_book / "chapters" / "demo" / "01_make.ipynb"
    nb.write_text(nb.read_text().replace("demo_value", "demo_value "))
    with pytest.raises(claims.NotRecorded, match="stale at smoke: the notebook changed"):
        claims.recorded_values("demo", "01_make", "smoke")


def test_a_result_still_running_or_failed_is_never_graded(mini_book, runs_dir):
    cb.load_params("demo", "01_make", "smoke")
    claims.record("demo_value", 5.0)
    status = claims.scorecard("smoke")[0]["status"]
    assert status.startswith("not run: demo/01_make is still running or was interrupted"), status
    context.mark("demo", "01_make", "smoke", "failed", "KeyError: x", context.current()["execution"])
    assert claims.scorecard("smoke")[0]["status"] == "not run: demo/01_make failed at smoke (KeyError: x)"


def test_a_result_of_other_code_is_stale_and_says_what_changed(mini_book, runs_dir):
    cb.load_params("demo", "01_make", "smoke")
    claims.record("demo_value", 5.0)
    _finish()
    assert claims.scorecard("smoke")[0]["status"] == "reproduced"
    nb = mini_book / "chapters" / "demo" / "01_make.ipynb"
    nb.write_text(nb.read_text().replace("demo_value", "demo_value "))
    status = claims.scorecard("smoke")[0]["status"]
    assert status == "stale: the notebook changed since this result was recorded", status
    row2 = {r["id"]: r for r in claims.scorecard("smoke")}["D-1"]
    assert row2["measured"] == "demo_value = 5", "a stale row still shows what was measured"
    prof = mini_book / "chapters" / "demo" / "profiles.yml"
    prof.write_text(prof.read_text().replace("smoke: {value: 2.0}", "smoke: {value: 3.0}"))
    status = claims.scorecard("smoke")[0]["status"]
    assert "the notebook changed" in status and "its parameters changed" in status
    nb.write_text(nb.read_text().replace("demo_value ", "demo_value"))
    prof.write_text(prof.read_text().replace("smoke: {value: 3.0}", "smoke: {value: 2.0}") +
                    "paper: {value: 3.0}\ndeviations: {cpu: [a smaller corpus]}\n")
    assert claims.scorecard("smoke")[0]["status"] == "reproduced", "paper values and deviations change no result"


def test_a_result_of_another_environment_is_stale(mini_book, runs_dir):
    """requirements.lock is in every notebook's inputs: a result recorded under one lock file is stale under
    another (a torch upgrade is not graded as fresh), and current again when the lock file is put back."""
    lock = mini_book / "requirements.lock"
    lock.write_text("torch==2.13.0\n")
    cb.load_params("demo", "01_make", "smoke")
    claims.record("demo_value", 5.0)
    _finish()
    assert claims.scorecard("smoke")[0]["status"] == "reproduced"
    lock.write_text("torch==2.14.0\n")
    status = claims.scorecard("smoke")[0]["status"]
    assert status == "stale: the environment changed since this result was recorded", status
    lock.unlink()
    assert claims.scorecard("smoke")[0]["status"].startswith("stale: the environment changed")
    lock.write_text("torch==2.13.0\n")
    assert claims.scorecard("smoke")[0]["status"] == "reproduced"


def test_stale_when_the_library_or_an_upstream_notebook_changes(mini_book, runs_dir, monkeypatch):
    from circuitbook import book

    cb.load_params("demo", "02_use", "smoke")
    claims.record("demo_twice", 4.0)
    _finish("demo", "02_use")
    assert {r["id"]: r for r in claims.scorecard("smoke")}["D-2"]["status"] == "reproduced"
    recorded = book.library_hash("demo", "02_use")
    assert "claims.py" in recorded and "cli.py" not in recorded, "the modules the notebook's code imports"
    with monkeypatch.context() as m:
        m.setattr(book, "library_hash", lambda *a: {**recorded, "claims.py": "edited"})
        assert {r["id"]: r for r in claims.scorecard("smoke")}["D-2"]["status"] == (
            "stale: the library code changed (claims.py), upstream 01_make changed since this result was recorded")
    nb = mini_book / "chapters" / "demo" / "01_make.ipynb"
    nb.write_text(nb.read_text().replace("demo_value", "demo_value "))
    assert {r["id"]: r for r in claims.scorecard("smoke")}["D-2"]["status"] == (
        "stale: upstream 01_make changed since this result was recorded")


def _ledger(mini_book, claim_yaml: str):
    (mini_book / "chapters" / "demo" / "claims.yml").write_text("title: Demo\nclaims:\n" + claim_yaml)


def test_not_measured_is_not_not_reproduced(mini_book, runs_dir):
    _ledger(mini_book, "  - {id: D-1, statement: s, paper: p, notebook: 01_make, measured: [a],"
                       " reproduced_if: ['a >= 1'], expected: [smoke]}\n")
    cb.load_params("demo", "01_make", "smoke")
    claims.record("a", float("nan"), why="no jump detected")
    _finish()
    assert claims.scorecard("smoke")[0]["status"] == "not measured: no jump detected"
    claims.record("a", [float("nan")] * 3)
    _finish()
    assert claims.scorecard("smoke")[0]["status"] == "not measured: a could not be measured"


def test_parts_named_missing_part_and_worst_part(mini_book, runs_dir):
    _ledger(mini_book, """\
  - id: D-1
    statement: s
    paper: p
    notebook: 01_make
    measured: [a, b]
    parts:
      - {name: timing, reproduced_if: ['a in [4, 6]'], partial_if: ['a in [2, 8]']}
      - {name: cross-model alignment, reproduced_if: ['b >= 0.9'], partial_if: ['b >= 0.5']}
    expected: [smoke]
""")
    cb.load_params("demo", "01_make", "smoke")

    def status(a, b, why=None):
        claims.record("a", a)
        claims.record("b", b, why=why)
        _finish()
        return claims.scorecard("smoke")[0]["status"]

    assert status(5.0, 0.95) == "reproduced"
    assert status(7.0, 0.95) == "partial"
    assert status(7.0, 0.6) == "partial"
    assert status(9.0, 0.95) == "not reproduced", "a failing part fails the claim"
    assert status(5.0, float("nan"), "one model available") == (
        "partial: cross-model alignment not measured (one model available)")
    assert status(9.0, float("nan"), "one model available") == "not reproduced"


def test_per_seed_values_judge_the_median_and_count_the_seeds(mini_book, runs_dir):
    _ledger(mini_book, "  - {id: D-1, statement: s, paper: p, notebook: 01_make, measured: [step],"
                       " reproduced_if: ['step in [1000, 2000]'], partial_if: ['step in [500, 3000]'], expected: [smoke]}\n")
    cb.load_params("demo", "01_make", "smoke")
    claims.record("step", [900.0, 1100.0, 1300.0])
    _finish()
    row = claims.scorecard("smoke")[0]
    assert row["status"] == "reproduced"
    assert row["measured"] == "step = 1100 (median of 3: 900, 1100, 1300)"
    assert row["seeds"] == "2/3 seeds pass 'step in [1000, 2000]'"
    claims.record("step", [900.0, float("nan"), 2900.0])  # one seed never reached the event
    _finish()
    row = claims.scorecard("smoke")[0]
    assert row["status"] == "partial", "median 1900 is in [1000, 2000] but no seed is: at most partial"
    assert row["seeds"] == "0/3 seeds pass 'step in [1000, 2000]'"
    claims.record("step", [1500.0, 1600.0, 9000.0])
    _finish()
    assert claims.scorecard("smoke")[0]["status"] == "reproduced", "two seeds of three pass, and the median"


def test_baselines_are_shown_beside_the_value(mini_book, runs_dir):
    _ledger(mini_book, "  - {id: D-1, statement: s, paper: p, notebook: 01_make, measured: [overlap],"
                       " reproduced_if: ['overlap <= 0.1'], baselines: {overlap: random_overlap}, expected: [smoke]}\n")
    cb.load_params("demo", "01_make", "smoke")
    claims.record("overlap", 0.05)
    claims.record("random_overlap", 0.06)
    _finish()
    row = claims.scorecard("smoke")[0]
    assert row["baselines"] == "random_overlap = 0.06 (baseline for overlap)"


def test_record_names_its_run(mini_book, runs_dir):
    class FakeRun:
        def __init__(self, key):
            self.key, self.dir, self.path = key, type("D", (), {"name": f"r/{key}"})(), f"/x/{key}"

    cb.load_params("demo", "01_make", "smoke")
    claims.record("x", 1.0)
    assert context.current()["values"]["x"]["run"] is None, "no run used: no run named"
    context.note_run(FakeRun("aaa"))
    claims.record("x", 1.0)
    assert context.current()["values"]["x"]["run"] == "aaa"
    context.note_run(FakeRun("bbb"))
    with pytest.raises(ValueError, match="used 2 runs .*pass run="):
        claims.record("x", 1.0)
    claims.record("x", 1.0, run=FakeRun("bbb"))
    assert context.current()["values"]["x"]["run"] == "bbb"
    claims.record("x", 1.0, run=None)
    assert context.current()["values"]["x"]["run"] is None
    claims.record("x", 1.0, run=[FakeRun("aaa"), "bbb"])
    assert context.current()["values"]["x"]["run"] == ["aaa", "bbb"]
    with pytest.raises(ValueError, match="names no run"):
        claims.record("x", 1.0, run=[])


def test_record_rejects_bad_keys_and_values(mini_book, runs_dir):
    import numpy as np
    import torch

    cb.load_params("demo", "01_make", "smoke")
    assert claims.record("k", np.float32(0.25)) == 0.25 and claims.record("t", torch.tensor(2)) == 2.0
    assert claims.record("l", np.array([1, 2])) == [1.0, 2.0] and claims.record("m", torch.tensor([0.5])) == [0.5]
    with pytest.raises(ValueError, match="identifier"):
        claims.record("bad key", 1.0)
    with pytest.raises(TypeError, match="float or str"):
        claims.record("k", {"a": 1})
    with pytest.raises(ValueError, match="must not be empty"):
        claims.record("k", [])


BAD_LEDGERS = [
    ("claims: [\n  - {id: D-1\n", "not valid YAML"),
    ("claims:\n  - D-1\n", "claim #1 is a str, not a mapping"),
    ("claims: {D-1: x}\n", "needs a mapping with a 'claims' list"),
    ("claims:\n  - {id: D-1, statement: s, paper: p, notebook: 01_make, measured: [a], reproduced_if: 'a >= 1',"
     " expected: [smoke]}\n", "'reproduced_if' must be a non-empty list of strings"),
    ("claims:\n  - {id: D-1, statement: s, paper: p, notebook: 01_make, measured: [a], reproduced_if: ['a >= 0.5x'],"
     " expected: [smoke]}\n", "claim rule 'a >= 0.5x' is not of the form"),
    ("claims:\n  - {id: D-1, statement: s, paper: p, notebook: 01_make, measured: [a], reproduced_if: ['a >= 1'],"
     " expected: [smoke]}\n  - {id: D-1, statement: s, paper: p, notebook: 01_make, measured: [a],"
     " reproduced_if: ['a >= 1'], expected: [smoke]}\n", "claim id D-1 appears twice"),
    ("claims:\n  - id: D-1\n    id: D-2\n    statement: s\n", "duplicate key 'id'"),
    ("claims:\n  - {id: D-1, statement: s, paper: p, notebook: 01_make, measured: [a, b],"
     " reproduced_if: ['a >= 1', 'b >= 1'], partial_if: ['a >= 0.5'], expected: [smoke]}\n",
     "partial_if must be the whole part with a looser tolerance"),
    ("claims:\n  - {id: D-1, statement: s, paper: p, notebook: 01_make, measured: [a], reproduced_if: ['a >= 1'],"
     " expected: [laptop]}\n", "expected profiles ['laptop']"),
    ("claims:\n  - {id: D-1, statement: s, paper: p, notebook: 09_x, measured: [a], reproduced_if: ['a >= 1'],"
     " expected: [smoke]}\n", "notebook '09_x' is not one of"),
    ("claims:\n  - {id: D-1, statement: s, paper: p, notebook: 01_make, measured: [a], reproduced_if: ['a >= 1'],"
     " expected: [smoke], threshold: 3}\n", "unknown keys ['threshold']"),
    ("claims:\n  - {id: D-1, statement: s, paper: p, notebook: 01_make, measured: [a], reproduced_if: ['a >= 1'],"
     " baselines: {b: c}, expected: [smoke]}\n", "baselines for ['b'], which are not measured"),
]


@pytest.mark.parametrize("text, needle", BAD_LEDGERS, ids=[n for _, n in BAD_LEDGERS])
def test_malformed_claims_yml_is_refused_naming_file_and_claim(mini_book, text, needle):
    path = mini_book / "chapters" / "demo" / "claims.yml"
    path.write_text(text)
    with pytest.raises(params.ParameterError) as e:
        claims.load_claims("demo")
    assert needle in str(e.value) and str(path) in str(e.value), str(e.value)


def test_a_damaged_results_file_is_named_not_a_crash(mini_book, runs_dir):
    cb.load_params("demo", "01_make", "smoke")
    claims.record("demo_value", 5.0)
    _finish()
    path = context.results_path("demo", "01_make", "smoke")
    path.write_text(path.read_text()[:40])
    status = claims.scorecard("smoke")[0]["status"]
    assert status.startswith(f"not run: results file {path} is damaged"), status


def test_deviations_are_listed_from_profiles_yml(mini_book, runs_dir):
    prof = mini_book / "chapters" / "demo" / "profiles.yml"
    prof.write_text(prof.read_text() + "paper: {value: 3.0}\ndeviations:\n  smoke: [\"a smaller corpus\"]\n")
    assert params.deviations("demo", "01_make", "smoke") == ["value = 2 (paper: 3)", "a smaller corpus"]
    assert params.deviations("demo", "01_make", "full") == ["value = 1 (paper: 3)"]
    cb.load_params("demo", "01_make", "smoke")
    claims.record("demo_value", 2.0)
    _finish()
    assert claims.scorecard("smoke")[0]["deviations"] == ["value = 2 (paper: 3)", "a smaller corpus"]



def test_a_deviation_found_at_run_time_is_on_the_row_and_the_chapter_page(mini_book, runs_dir):
    """context.note_deviation(text): stored once in the results record, listed after profiles.yml's
    deviations on the notebook's rows and under it on the chapter page; nothing noted, nothing added."""
    from circuitbook import pages

    cb.load_params("demo", "01_make", "smoke")
    found = "only 165 of the 65,536 samples n_samples asks for exist"
    context.note_deviation(found)
    context.note_deviation(found)  # noted again by a second call of the same function: listed once
    claims.record("demo_value", 2.0)
    assert context.current()["deviations_found"] == [found]
    _finish()
    assert context.read_results("demo", "01_make", "smoke")["deviations_found"] == [found]
    row, other = claims.scorecard("smoke")
    assert row["deviations"] == [found], row["deviations"]
    assert found not in other["deviations"], "a note belongs to the notebook that made it"
    header = pages.chapter_header("demo", "smoke", {"01_make": 1.0}, built="2026-12-01 00:00", rows=[row])
    assert f"- `01_make` (1 s): {found}" in header
    assert found not in pages.chapter_header("demo", "cpu", {}, rows=[]), "another profile's results are not read"
    context._current = None
    context.note_deviation("outside a notebook")  # no context (a plan, a unit test): nothing to note into
    with pytest.raises(ValueError, match="note_deviation"):
        cb.load_params("demo", "01_make", "smoke")
        context.note_deviation("  ")


def test_scorecard_page_puts_the_verdict_first(runs_dir):
    from circuitbook import pages

    md = pages.scorecard_markdown("cpu")
    assert md.count('<tr id="claim-AA-') == 12 and md.count('<tr id="claim-AC-') == 9
    header = md[md.index("<thead>"):md.index("</thead>")]
    assert header.index("Claim") < header.index("Status") < header.index("Paper") < header.index("Measured")
    assert "<details>" in md and "cb-summary" in md


# ---------------------------------------------------------------- values with a sampling interval
def test_a_rule_reads_the_whole_sampling_interval():
    v = {"a": 0.91, "lag": 0.95, "s": [0.92, 0.95, 0.88]}
    iv = {"a": [0.885, 0.935], "lag": [0.90, 1.01], "s": [[0.90, 0.94], [0.93, 0.97], [0.86, 0.90]]}
    assert claims.rule_verdict("a >= 0.9", v) == "pass"  # no interval: the value as it is
    assert claims.rule_verdict("a >= 0.9", v, iv) == "straddles"
    assert claims.rule_verdict("a >= 0.88", v, iv) == "pass" and claims.rule_verdict("a >= 0.94", v, iv) == "fail"
    assert claims.rule_verdict("lag <= 1", v, iv) == "straddles" and claims.rule_verdict("lag <= 1.1", v, iv) == "pass"
    assert claims.rule_verdict("a in [0.88, 0.94]", v, iv) == "pass"
    assert claims.rule_verdict("a in [0.9, 0.94]", v, iv) == "straddles"
    assert claims.rule_verdict("a in [0.95, 1]", v, iv) == "fail"
    assert claims.rule_verdict("a within 0.91 +- 0.01", v, iv) == "straddles"
    assert claims.rule_verdict("a == 0.91", v, iv) == "straddles" and claims.rule_verdict("a != 0.5", v, iv) == "pass"
    # per seed: the median and the majority, at the worst and at the best point of every seed's interval
    assert claims.rule_verdict("s >= 0.9", v, iv) == "pass"  # at worst 0.90, 0.93, 0.86: median and 2/3 pass
    assert claims.rule_verdict("s >= 0.91", v, iv) == "straddles" and claims.rule_verdict("s >= 0.98", v, iv) == "fail"
    assert claims.rule_verdict("s >= 0.85", v, iv) == "pass"


def test_a_part_whose_interval_straddles_its_threshold_is_partial_and_says_so():
    part = claims.Part("hard cases fixed", ["a >= 0.9"], ["a >= 0.7"])
    v, whys = {"a": 0.91}, {}
    assert claims._part_status(part, v, whys) == ("reproduced", "")
    status, detail = claims._part_status(part, v, whys, {"a": [0.885, 0.935]})
    assert status == "partial" and detail == "the sampling interval [0.885, 0.935] of a straddles the threshold"
    assert claims._part_status(part, v, whys, {"a": [0.905, 0.92]}) == ("reproduced", "")
    assert claims._part_status(part, {"a": 0.8}, whys, {"a": [0.78, 0.82]}) == ("partial", "")
    assert claims._part_status(part, {"a": 0.6}, whys, {"a": [0.55, 0.65]}) == ("not reproduced", "")
    status, detail = claims._part_status(part, {"a": 0.7}, whys, {"a": [0.65, 0.75]})
    assert status == "partial" and "straddles" in detail  # between partial and not reproduced
    seeds = claims._seed_agreement([part], {"a": [0.91, 0.95, 0.8]}, {"a": [[0.88, 0.93], [0.94, 0.96], [0.78, 0.82]]})
    assert seeds == "2/3 seeds pass 'a >= 0.9' (1 with a sampling interval across the threshold)"


def test_record_stores_a_checked_interval_beside_the_value(mini_book, runs_dir):
    cb.load_params("demo", "01_make", "smoke")
    claims.record("a", 0.91, interval=(0.885, 0.935))
    claims.record("s", [0.5, float("nan")], interval=[(0.4, 0.6), (float("nan"), float("nan"))])
    claims.record("b", 0.5)
    values = context.current()["values"]
    assert values["a"]["interval"] == [0.885, 0.935] and values["s"]["interval"][0] == [0.4, 0.6]
    assert "interval" not in values["b"]
    with pytest.raises(ValueError, match="must hold the value"):
        claims.record("a", 0.95, interval=(0.885, 0.935))
    with pytest.raises(ValueError, match="one \\(lo, hi\\) per seed"):
        claims.record("s", [0.5, 0.6], interval=(0.4, 0.7))
    with pytest.raises(ValueError, match="pair \\(lo, hi\\)"):
        claims.record("a", 0.9, interval=(0.8,))
    with pytest.raises(ValueError, match="text value has no interval"):
        claims.record("t", "words", interval=(0, 1))


def test_entry_intervals_reads_the_intervals_a_results_file_holds():
    entries = {"a": {"value": 0.9, "run": None, "interval": [0.88, 0.92]}, "b": {"value": 1.0, "run": None}}
    assert claims.entry_intervals(entries) == {"a": [0.88, 0.92]}
