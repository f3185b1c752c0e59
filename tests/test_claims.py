"""The claims ledger: rules, statuses, and that every claim of PAPERS.md has a row."""
import re

import pytest

from circuitbook import claims
from conftest import ROOT


def test_rules():
    v = {"a": 0.5, "s": "x", "n": float("nan")}
    assert claims.rule_holds("a >= 0.5", v) and not claims.rule_holds("a > 0.5", v)
    assert claims.rule_holds("a in [0.4, 0.6]", v) and not claims.rule_holds("a in [0.6, 1]", v)
    assert claims.rule_holds("a within 0.45 +- 0.06", v) and not claims.rule_holds("a within -1 +- 0.25", v)
    assert claims.rule_holds("s == 'x'", v) and not claims.rule_holds("s >= 1", v)
    assert not claims.rule_holds("n >= 0", v) and not claims.rule_holds("n <= 0", v)
    with pytest.raises(ValueError, match="not of the form"):
        claims.parse_rule("a is big")


def test_every_claim_id_of_papers_md_has_exactly_one_row():
    papers = (ROOT.parent / "shared" / "PAPERS.md")
    expected = {f"AA-{i}" for i in range(1, 13)} | {f"LT-{i}" for i in range(1, 7)} | \
               {f"AC-{i}" for i in range(1, 10)} | {f"IM-{i}" for i in range(1, 7)}
    if papers.exists():
        assert set(re.findall(r"^- ((?:AA|LT|AC|IM)-\d+)", papers.read_text(), re.M)) == expected
    ids = [c["id"] for ch in claims.claim_chapters() for c in claims.load_claims(ch)["claims"]]
    assert sorted(ids) == sorted(expected) and len(ids) == len(set(ids))


def test_scorecard_rows_have_the_promised_fields(runs_dir):
    rows = claims.scorecard("smoke")
    assert len(rows) == 33
    for r in rows:
        assert {"id", "status", "paper", "measured", "profile"} <= set(r)
        assert r["status"].split(":")[0] in claims.STATUSES


def test_status_from_recorded_values(mini_book, runs_dir):
    from circuitbook import context, params

    params.load_params("demo", "01_make", "smoke")
    claims.record("demo_value", 1.5)
    rows = {r["id"]: r for r in claims.scorecard("smoke")}
    assert rows["D-1"]["status"] == "partial"
    claims.record("demo_value", 0.5)
    assert claims.scorecard("smoke")[0]["status"] == "not reproduced"
    claims.record("demo_value", "not run: no weights here")
    assert claims.scorecard("smoke")[0]["status"] == "not run: no weights here"
    assert rows["D-2"]["status"] == "not run: demo/02_use not executed at profile smoke"
    assert {r["id"]: r for r in claims.scorecard("cpu")}["D-1"]["status"].startswith("not run: not expected at profile cpu")


def test_record_rejects_bad_keys_and_values(mini_book, runs_dir):
    from circuitbook import params
    import numpy as np
    import torch

    params.load_params("demo", "01_make", "smoke")
    assert claims.record("k", np.float32(0.25)) == 0.25 and claims.record("t", torch.tensor(2)) == 2.0
    with pytest.raises(ValueError, match="identifier"):
        claims.record("bad key", 1.0)
    with pytest.raises(TypeError, match="float or str"):
        claims.record("k", [1, 2])


def test_claims_tables_and_scorecard_markdown(runs_dir):
    md = claims.scorecard_markdown("cpu")
    assert md.count("| AA-") == 12 and md.count("| AC-") == 9
    assert "| AA-5 |" in claims.claims_table_markdown("assign_add")
