"""benchmarks/agents.py: its quantiles, and a small run whose counts show what it timed (one tool call per episode,
every episode scored) and that a broken tool call stops it instead of being timed."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "agents.py"


@pytest.fixture(scope="module")
def agents():
    spec = importlib.util.spec_from_file_location("agents_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_quantiles_interpolate_between_order_statistics(agents):
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert agents.quantile(values, 0.5) == 3.0
    assert agents.quantile(values, 0.9) == pytest.approx(4.6)  # numpy.quantile's default gives the same
    assert agents.quantile(values, 0.0) == 1.0 and agents.quantile(values, 1.0) == 5.0
    assert agents.summary_ms([0.001, 0.003, 0.002]) == {"median_ms": 2.0, "p90_ms": pytest.approx(2.8), "n": 3}


def test_a_small_run_times_one_tool_call_per_episode_and_scores_every_episode(agents, tmp_path, capsys):
    output = tmp_path / "agents.json"
    assert agents.main(["--calls", "2", "--episodes", "5", "--concurrency", "1,4", "--episode-tools", "calculator",
                        "--output", str(output)]) == 0
    results = json.loads(output.read_text())
    assert list(results["tool_latency"]) == ["calculator", "python", "write_file", "read_file", "search"]
    assert all(row["tool_run"]["n"] == 2 and row["environment_step"]["n"] == 2
               for row in results["tool_latency"].values())
    # 5 episodes in rounds of 1 (5 rounds) and of 4 (2 rounds: 8 episodes); the tool-call timer saw exactly the
    # steps that answered a call, one per episode, and every episode earned the scripted answer's reward.
    assert [(r["concurrency"], r["rounds"], r["episodes"], r["tool_call"]["n"]) for r in results["episodes"]] == \
        [(1, 5, 5, 5), (4, 2, 8, 8)]
    assert all(r["mean_reward"] == 1.0 and r["episodes_per_second"] > 0 for r in results["episodes"])
    assert "| calculator | 4 |" in capsys.readouterr().out


def test_a_tool_call_that_errs_stops_the_benchmark(agents, monkeypatch):
    broken = agents.ToolCall("calculator", {"formula": "1 + 2"})  # not the calculator's argument
    monkeypatch.setitem(agents.EPISODE_CALLS, "calculator", broken)
    with pytest.raises(RuntimeError, match="calculator, 2 in flight: 0 episodes did not call the tool, 2 tool errors"):
        agents.episodes_per_second(agents.build_tokenizer(), "calculator", 2, 2)
