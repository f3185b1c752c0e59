"""presentation: labels and units, formatted values, the failed part in words, the summary figure, the re-run box."""
import math

import pytest

from circuitbook import claims, presentation

LABELS = {"acc": {"label": "held-out accuracy", "unit": "fraction"},
          "jump": {"label": "step of the jump", "unit": "steps"},
          "gap": {"label": "lag behind addition", "unit": "windows"}}
CLAIM = {"id": "X-1", "measured": ["acc", "jump"],
         "parts": [{"name": "accuracy", "reproduced_if": ["acc >= 0.9"], "partial_if": ["acc >= 0.8"]},
                   {"name": "timing", "reproduced_if": ["jump in [4000, 7000]", "gap <= 1"]}]}


def row(status, parts):
    return {"id": "X-1", "status": status, "measured": "acc = 0.8", "parts": [{"name": n, "status": s, "detail": d} for n, s, d in parts]}


def test_values_read_as_a_reader_reads_them():
    assert presentation.format_value(0.74512) == "0.745"
    assert presentation.format_value(5312.4, "steps") == "5,312"
    assert presentation.format_value(12.0) == "12"
    assert presentation.format_value(0.99973) == "0.9997" and presentation.format_value(1.0) == "1"
    assert presentation.format_value([0.9, float("nan"), 0.7, 0.8]) == "0.8"  # the median of the seeds that measured
    assert presentation.format_value(float("nan")) == "not measured"
    assert presentation.format_value(3.1e-14) == "3.10e-14"
    assert presentation.format_value("W2, V0") == "W2, V0"
    assert presentation.with_unit("5,312", "steps") == "5,312 steps" and presentation.with_unit("0.745", "fraction") == "0.745"


def test_rules_in_words_use_the_labels():
    assert presentation.rule_in_words("acc >= 0.974", LABELS) == "held-out accuracy >= 0.974"
    assert presentation.rule_in_words("jump in [4000, 7000]", LABELS) == "step of the jump in [4000, 7000]"
    assert presentation.rule_in_words("gap within 1 +- 0.6", LABELS) == "lag behind addition within 1 +- 0.6"


def test_the_failed_part_names_its_rule_and_the_measured_value():
    values = {"acc": [0.7, 0.75, 0.745], "jump": 5000.0, "gap": 0.5}
    failed = presentation.failed_parts(row("not reproduced", [("accuracy", "not reproduced", ""),
                                                              ("timing", "reproduced", "")]), CLAIM, LABELS, values)
    assert failed == ["accuracy: needs held-out accuracy >= 0.9; measured 0.745"]
    values = {"acc": 0.85, "jump": 9000.0, "gap": 0.5}
    failed = presentation.failed_parts(row("not reproduced", [("accuracy", "partial", ""),
                                                              ("timing", "not reproduced", "")]), CLAIM, LABELS, values)
    assert failed[0] == "accuracy: needs held-out accuracy >= 0.9; measured 0.85; passes the looser partial rule"
    assert failed[1] == "timing: needs step of the jump in [4000, 7000]; measured 9,000 steps"  # only the failing rule
    unmeasured = presentation.failed_parts(row("partial: timing not measured (no jump)", [
        ("accuracy", "reproduced", ""), ("timing", "not measured", "no jump detected")]), CLAIM, LABELS, {})
    assert unmeasured == ["timing: not measured (no jump detected)"]
    assert presentation.failed_parts(row("reproduced", [("accuracy", "reproduced", "")]), CLAIM, LABELS, {}) == []
    straddle = "the sampling interval [0.88, 0.93] of acc straddles the threshold"
    failed = presentation.failed_parts(row("partial", [("accuracy", "partial", straddle)]), CLAIM, LABELS,
                                       {"acc": 0.91})
    assert failed == [f"accuracy: needs held-out accuracy >= 0.9; measured 0.91; {straddle}"]


def test_measured_items_label_every_key_and_fold_the_seeds():
    items = presentation.measured_items(CLAIM, LABELS, {"acc": [0.7, 0.8, 0.9], "jump": 5300.0})
    assert items == [{"key": "acc", "label": "held-out accuracy", "value": "0.8", "seeds": "0.7, 0.8, 0.9",
                      "interval": ""},
                     {"key": "jump", "label": "step of the jump", "value": "5,300 steps", "seeds": "", "interval": ""}]


def test_measured_items_show_the_sampling_interval_where_one_was_recorded():
    items = presentation.measured_items(CLAIM, LABELS, {"acc": [0.7, 0.8], "jump": 5300.0},
                                        {"acc": [[0.65, 0.75], [0.78, 0.82]], "jump": [5251.0, 5351.0]})
    assert items[0]["interval"] == "[0.65, 0.75], [0.78, 0.82]" and items[1]["interval"] == "[5,251, 5,351]"


def test_every_key_a_row_shows_needs_a_label(mini_book):
    path = mini_book / "chapters" / "demo" / "claims.yml"
    assert set(presentation.chapter_labels("demo")) == {"demo_value", "demo_twice"}
    text = "\n".join(line for line in path.read_text().splitlines() if not line.startswith(("labels:", "  demo_"))) + "\n"
    path.write_text(text)
    with pytest.raises(claims.ClaimsError, match=r"claims.yml: labels: has no label for"):
        presentation.chapter_labels("demo")
    keys = sorted({k for c in claims.load_claims("demo")["claims"] for k in
                   c["measured"] + [k for p in claims.claim_parts(c) for k in p.keys()]})
    path.write_text("labels:\n" + "".join(f"  {k}: {{label: \"the {k}\", unit: \"\"}}\n" for k in keys) + text)
    assert set(presentation.chapter_labels("demo")) == set(keys)
    path.write_text("labels:\n" + "".join(f"  {k}: {{label: \"the {k}\", unit: \"furlongs\"}}\n" for k in keys) + text)
    with pytest.raises(claims.ClaimsError, match=r"labels\.\w+ must be .*unit: one of"):
        presentation.chapter_labels("demo")


def test_the_summary_figure_draws_one_line_per_numeric_rule(tmp_path, monkeypatch):
    claim = {**CLAIM, "id": "X-1"}
    monkeypatch.setattr(presentation, "chapter_labels", lambda chapter: LABELS)
    monkeypatch.setattr(claims, "load_claims", lambda chapter: {"claims": [claim]})
    monkeypatch.setattr(presentation, "row_values", lambda r: {"acc": [0.7, 0.8], "jump": 5000.0, "gap": math.nan})
    rows = [row("not reproduced", [("accuracy", "not reproduced", ""), ("timing", "reproduced", "")])]
    n = presentation.summary_figure("demo", rows, tmp_path / "summary.png")
    assert n == 3 and (tmp_path / "summary.png").stat().st_size > 1000
    assert presentation.summary_figure("demo", [], tmp_path / "empty.png") == 0 and (tmp_path / "empty.png").exists()


def test_the_rerun_box_gives_every_profiles_command_and_the_parameters():
    box = presentation.rerun_box("book", "tour", "cpu", "tour.ipynb")
    for p in ("smoke", "cpu", "full"):
        assert f"circuitbook run book/tour --profile {p}" in box
    assert "papermill book/tour.ipynb out.ipynb -p profile cpu" in box
    assert "| `steps` | int |" in box and "{download}`tour.ipynb <tour.ipynb>`" in box
    assert ":class: dropdown cb-rerun" in box
