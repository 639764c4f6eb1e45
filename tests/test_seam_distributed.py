"""The data-parallel invariance through the pickling stand-in: two FSDP2 ranks whose every worker call crosses
pickle (tests/pickled_site/sitecustomize.py wraps them in each rank torchrun starts) make the update one process
with local workers makes, and ask nothing of their workers outside the protocols."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_distributed import COMMON, _assert_same_run, _assert_same_weights, _sft_rows
from test_seam import PROTOCOL_NAMES

SITE = Path(__file__).with_name("pickled_site")


def _run(recipe: str, output_dir: Path, args: list[str], nproc: int = 1, record: Path | None = None) -> None:
    command = [sys.executable, "-m", "posttrain", recipe, *args, f"output_dir={output_dir}"]
    if nproc > 1:
        command += ["--nproc-per-node", str(nproc)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if record is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(SITE), *filter(None, [env.get("PYTHONPATH")])])
        env["POSTTRAIN_PICKLED_WORKERS"] = str(record)
    process = subprocess.run(command, capture_output=True, text=True, env=env)
    assert process.returncode == 0, (process.stdout + process.stderr)[-4000:]


def _names(record: Path) -> list[set[str]]:
    return [set(json.loads(line)) for line in record.read_text().splitlines()]


@pytest.mark.slow
def test_sft_on_two_pickled_ranks_equals_one_local_process(tmp_path, tiny_model_dir):
    args = [*COMMON, f"data.train_files=[{_sft_rows(tmp_path / 'rows.jsonl')}]", "trainer.max_steps=4"]
    _run("sft", tmp_path / "one", args)
    _run("sft", tmp_path / "two", args, nproc=2, record=tmp_path / "calls.jsonl")
    _assert_same_run(tmp_path / "one", tmp_path / "two")
    _assert_same_weights(tmp_path / "one" / "final", tmp_path / "two" / "final")
    ranks = [names for names in _names(tmp_path / "calls.jsonl") if names]
    assert len(ranks) == 2 and all("forward_backward" in names and names <= PROTOCOL_NAMES for names in ranks)


@pytest.mark.slow
def test_grpo_on_two_pickled_ranks_equals_one_local_process(tmp_path, tiny_model_dir):
    rewards = Path(__file__).with_name("reward_fns_for_tests.py")
    args = ["model.name_or_path=posttrain/tiny", "data.train_files=['posttrain/arithmetic[:256]']", "data.max_length=32",
            "rollout.prompts_per_step=8", "rollout.num_generations_per_prompt=4", "rollout.max_new_tokens=6",
            "trainer.learning_rate=1e-2", "trainer.lr_scheduler=constant", "trainer.micro_batch_size=8",
            "update.num_minibatches=2", "trainer.max_steps=3", "trainer.num_threads=1", "loss.reference_kl_penalty=0.1",
            "logging.progress=none", "logging.plot=false", "environment.kind=python",
            f"environment.options={{functions: ['{rewards}:digit_fraction'], num_workers: 0}}"]
    _run("grpo", tmp_path / "one", args)
    _run("grpo", tmp_path / "two", args, nproc=2, record=tmp_path / "calls.jsonl")
    _assert_same_run(tmp_path / "one", tmp_path / "two", keys=("loss", "grad_norm", "reward/mean", "kl"))
    _assert_same_weights(tmp_path / "one" / "final", tmp_path / "two" / "final")
    ranks = [names for names in _names(tmp_path / "calls.jsonl") if names]
    assert len(ranks) == 2 and all({"push_weights", "logprobs"} <= names <= PROTOCOL_NAMES for names in ranks)
