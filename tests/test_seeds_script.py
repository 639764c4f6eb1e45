"""benchmarks/seeds.py: seed parsing and the worst-case summary every documented claim is checked against."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "seeds.py"


@pytest.fixture(scope="module")
def seeds():
    spec = importlib.util.spec_from_file_location("seeds_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def result(code_path: str, seed: int, exact_match: float, eval_loss: float) -> dict:
    return {"code_path": code_path, "seed": seed, "exact_match": exact_match, "eval_loss": eval_loss,
            "seconds": 10.0 + seed}


def test_parse_seeds(seeds):
    assert seeds.parse_seeds("0-4") == [0, 1, 2, 3, 4]
    assert seeds.parse_seeds("0,3,7-8") == [0, 3, 7, 8]


def test_a_claim_is_judged_on_the_worst_run(seeds):
    runs = [result("default", 0, 1.0, 0.01), result("avx2", 0, 0.875, 0.30), result("default", 1, 0.95, 0.02)]
    table, summary, all_hold = seeds.summarize("sft_arithmetic", runs)
    exact = summary["metrics"]["exact_match"]
    assert (exact["min"], exact["median"], exact["max"], exact["worst_run"]) == (0.875, 0.95, 1.0, "avx2-seed0")
    # For a loss (and for seconds) the worst run is the largest value.
    assert summary["metrics"]["eval_loss"]["worst_run"] == "avx2-seed0"
    assert summary["metrics"]["seconds"]["worst_run"] == "default-seed1"
    assert not all_hold and summary["claims"] == [
        {"claim": ">= 90% held-out exact match", "metric": "exact_match", "worst": 0.875, "holds": False}]
    assert "FAILS: >= 90% held-out exact match (worst exact_match 0.875)" in table

    _, summary, all_hold = seeds.summarize("sft_arithmetic", [r for r in runs if r["exact_match"] >= 0.9])
    assert all_hold and summary["claims"][0]["worst"] == 0.95


def test_gap_closed_and_the_distillation_presets_claim_it(seeds):
    assert seeds.gap_closed(0.65, 0.3, 1.0) == pytest.approx(0.5)
    assert seeds.gap_closed(0.2, 0.3, 1.0) < 0
    assert seeds.gap_closed(0.9, 0.95, 0.9) == 0.0
    for name in ("distill_gkd_arithmetic", "opd_arithmetic"):
        preset = seeds.PRESETS[name]
        assert preset.teacher == "posttrain/tiny-arithmetic-sft" and preset.start == "sft_arithmetic_small"
        assert [c.metric for c in preset.claims] == ["gap_closed"]
        assert (SCRIPT.parent.parent / "configs" / f"{name}.yaml").is_file()
        assert not preset.claims[0].holds(0.49) and preset.claims[0].holds(0.5)
    # Presets that start from the untrained student: the gap is from posttrain/tiny to the teacher, each scored on
    # the run's own code path.
    for name, teacher in (("distill_kd_arithmetic", "posttrain/tiny-2m-arithmetic-sft"),
                          ("distill_xtoken_arithmetic", "posttrain/tiny-bpe-arithmetic-sft")):
        preset = seeds.PRESETS[name]
        assert (preset.teacher, preset.start, preset.untrained) == (teacher, None, "posttrain/tiny")
        assert [c.metric for c in preset.claims] == ["gap_closed"]
        assert not preset.claims[0].holds(0.49) and preset.claims[0].holds(0.5)
