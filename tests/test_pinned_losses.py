"""The first three steps of sft, dpo, rm, grpo and ppo on the embedded tiny model log the losses recorded in
tests/data/pinned_losses.json (by scripts/pin_losses.py), so that a change to the loops that should not change what
they learn is seen to change nothing.

The tolerance allows for another CPU's kernels, no more. Measured 2026-12-03 between this machine's AVX-512 path
and `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2` (1, 2 and 8 threads alike; the
ONEDNN/MKL variables alone change nothing here): at most 3.7e-5 relative (rm's gradient norm at step 3; the
differences grow step by step) and 1.3e-8 absolute on the values near zero (grpo's loss, -2.3e-4, at step 3).
The bounds below are more than ten times those. On one machine, `python scripts/pin_losses.py --check` demands
bit-identical values instead.
"""

import importlib.util
import json
from pathlib import Path

import pytest

RELATIVE_TOLERANCE = 5e-4
ABSOLUTE_TOLERANCE = 1e-6

_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "pin_losses.py"
_spec = importlib.util.spec_from_file_location("pin_losses", _SCRIPT)
pin_losses = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pin_losses)

RECORDED = json.loads(pin_losses.FIXTURE.read_text())["recipes"]


def test_the_fixture_was_written_from_the_scripts_configs():
    """A config edited in the script without regenerating the fixture would pin values no config produces."""
    assert list(RECORDED) == list(pin_losses.RECIPES)
    for recipe, recorded in RECORDED.items():
        assert recorded["overrides"] == pin_losses.RECIPES[recipe], recipe
        assert recorded["keys"] == list(pin_losses.KEYS[recipe]), recipe
        assert [s["step"] for s in recorded["steps"]] == list(range(1, pin_losses.MAX_STEPS + 1)), recipe


@pytest.mark.parametrize("recipe", list(RECORDED))
def test_first_steps_log_the_pinned_losses(recipe, tmp_path, tiny_model_dir):
    recorded = RECORDED[recipe]
    fresh = pin_losses.run_recipe(recipe, recorded["overrides"], tuple(recorded["keys"]), tmp_path / recipe)
    assert [s["step"] for s in fresh] == [s["step"] for s in recorded["steps"]]
    for was, now in zip(recorded["steps"], fresh):
        for key in recorded["keys"]:
            assert now[key] == pytest.approx(was[key], rel=RELATIVE_TOLERANCE, abs=ABSOLUTE_TOLERANCE), \
                f"{recipe} step {was['step']} {key}"


@pytest.mark.parametrize("recipe", list(RECORDED))
def test_pickled_workers_stopped_and_resumed_log_the_pinned_losses(recipe, tmp_path, tiny_model_dir, monkeypatch):
    """Every worker call through pickle (tests/pickled_workers.py, a stand-in for an actor in another process), the
    run stopped after step 2 and resumed from its checkpoint for step 3: the same losses as the uninterrupted local
    run that wrote the fixture."""
    from pickled_workers import pickle_every_worker

    calls = pickle_every_worker(monkeypatch)
    recorded = RECORDED[recipe]
    keys = tuple(recorded["keys"])
    pin_losses.run_recipe(recipe, [*recorded["overrides"], "trainer.max_steps=2", "trainer.save_every=2"], keys,
                          tmp_path)
    steps = pin_losses.run_recipe(recipe, [*recorded["overrides"], "trainer.save_every=2"], keys, tmp_path)
    assert "forward_backward" in calls and "optim_step" in calls  # the pickled workers trained
    assert [s["step"] for s in steps] == [1, 2, 3]
    for got, pinned in zip(steps, recorded["steps"]):
        for key in keys:
            assert got[key] == pytest.approx(pinned[key], rel=RELATIVE_TOLERANCE, abs=ABSOLUTE_TOLERANCE), (got["step"],
                                                                                                            key)
