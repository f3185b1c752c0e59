"""benchmarks/onehot.py runs end to end at a tiny size; its fairness check (both forms compute the same
logits) holds. Timings are not checked (meaningless at this size)."""
import json
import subprocess
import sys

from conftest import ROOT


def test_onehot_benchmark_compares_equal_models(tmp_path):
    out = tmp_path / "onehot.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "onehot.py"), "--size", "cpu", "--vocab", "40",
                    "--seq-len", "8", "--batch", "4", "--repeats", "1", "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    report = json.loads(out.read_text())
    (result,) = report["results"]
    assert result["max_abs_logit_diff"] < 1e-4
    assert result["speedup_lookup_over_naive"] > 0 and result["gflops"]["matmul"] > 0
    # the FLOP model: the naive form does (2L + 1) N T V^2 + 2L N T^2 V multiply-adds forward
    N, T, V = 4, 8, 40
    assert result["flops"]["naive"] == 2 * 3 * (7 * N * T * V * V + 6 * N * T * T * V)
    assert out.with_suffix(".txt").read_text().count("\n") >= 3
