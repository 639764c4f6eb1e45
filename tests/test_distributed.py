"""Data-parallel FSDP2 over gloo on CPU: two processes make the update one process makes from the same config.

Every run here is a real `posttrain RECIPE ... --nproc-per-node 2` (torchrun, two ranks of one thread each)
against the same command in one process, on rows of very different lengths, so that the loss normalizer (the
whole step's token or pair count, over every rank) matters.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from posttrain.checkpoint import latest_checkpoint, list_checkpoints

STEP_SPLIT = ["trainer.micro_batch_size=2", "trainer.gradient_accumulation_steps=4"]
COMMON = ["model.name_or_path=posttrain/tiny", *STEP_SPLIT, "trainer.learning_rate=1e-3", "trainer.warmup_steps=2",
          "logging.progress=none", "logging.plot=false", "trainer.num_threads=1"]


def _sft_rows(path: Path) -> Path:
    """64 completions of 1 to 30 numbers: micro-batches of 2 hold from 2 to 60 target tokens."""
    rng = random.Random(0)
    lines = []
    for i in range(64):
        numbers = " ".join(str(rng.randint(0, 99)) for _ in range(rng.choice([1, 2, 3, 12, 30])))
        lines.append(json.dumps({"prompt": f"echo {i}: ", "completion": numbers}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _pair_rows(path: Path) -> Path:
    rng = random.Random(1)
    lines = []
    for i in range(64):
        chosen = " ".join(str(rng.randint(0, 99)) for _ in range(rng.choice([1, 2, 10, 25])))
        rejected = " ".join(str(rng.randint(0, 99)) for _ in range(rng.choice([1, 3, 15])))
        lines.append(json.dumps({"prompt": f"say {i}: ", "chosen": chosen, "rejected": rejected}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(recipe: str, output_dir: Path, args: list[str], nproc: int = 1) -> None:
    command = [sys.executable, "-m", "posttrain", recipe, *args, f"output_dir={output_dir}"]
    if nproc > 1:
        command += ["--nproc-per-node", str(nproc)]
    process = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert process.returncode == 0, (process.stdout + process.stderr)[-4000:]


def _records(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_same_run(a: Path, b: Path, keys: tuple[str, ...] = ("loss", "grad_norm")) -> None:
    ra, rb = _records(a), _records(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    for x, y in zip(ra, rb):
        for key in keys + tuple(k for k in x if k.startswith("eval_")):
            assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-6), (x["step"], key)


def _assert_same_weights(a: Path, b: Path, auto_class=None, atol: float = 1e-5) -> None:
    from transformers import AutoModelForCausalLM

    auto_class = auto_class or AutoModelForCausalLM
    wa, wb = auto_class.from_pretrained(a).state_dict(), auto_class.from_pretrained(b).state_dict()
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], atol=atol, rtol=0, msg=name)


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory, tiny_model_dir) -> dict:
    """The same 6-step SFT config (checkpoints at 3 and 6) in one process and on two ranks."""
    root = tmp_path_factory.mktemp("sft-dp")
    args = [*COMMON, f"data.train_files=[{_sft_rows(root / 'rows.jsonl')}]", "trainer.max_steps=6",
            "trainer.save_every=3"]
    _run("sft", root / "one", args)
    _run("sft", root / "two", args, nproc=2)
    return {"root": root, "args": args, "one": root / "one", "two": root / "two"}


def test_sft_on_two_ranks_equals_one_process(sft_runs):
    _assert_same_run(sft_runs["one"], sft_runs["two"])
    _assert_same_weights(sft_runs["one"] / "final", sft_runs["two"] / "final")
    assert (sft_runs["two"] / "checkpoints" / "step_3" / "policy" / ".metadata").is_file()  # sharded
    assert (sft_runs["one"] / "checkpoints" / "step_3" / "policy" / "model.safetensors").is_file()


def test_averaging_per_rank_would_give_another_loss(sft_runs, tiny_model_dir):
    """The control: on these rows the mean of each rank's own per-token mean is not the step's mean, and the
    2-rank run logged the step's mean."""
    from posttrain.config import SFTConfig, load_config
    from posttrain.data import load_sft_examples
    from posttrain.data.collate import collate
    from posttrain.data.sampler import EpochSampler
    from posttrain.losses.nll import nll_loss
    from posttrain.models.loading import load_causal_lm, load_tokenizer
    from posttrain.workers.forward import forward_logits

    cfg = load_config(SFTConfig, None, [*sft_runs["args"], "output_dir=unused"])
    tokenizer = load_tokenizer(cfg.model)
    examples, _ = load_sft_examples(cfg.data.train_files, tokenizer, cfg.data)
    sampler = EpochSampler(len(examples), seed=cfg.seed, shuffle=cfg.data.shuffle)
    model = load_causal_lm(cfg.model).eval()
    sums, counts = [], []
    with torch.no_grad():
        for _ in range(cfg.trainer.gradient_accumulation_steps):
            batch = collate([examples[i] for i in sampler.next_indices(cfg.trainer.micro_batch_size)],
                            tokenizer.pad_token_id, cfg.data.packing, cfg.data.max_length)
            _, stats = nll_loss(forward_logits(model, batch), batch.input_ids, batch.loss_mask, 1.0)
            sums.append(stats["nll_sum"].item())
            counts.append(stats["target_tokens"].item())
    step_mean = sum(sums) / sum(counts)
    per_rank = [sum(sums[r::2]) / sum(counts[r::2]) for r in range(2)]
    logged = _records(sft_runs["two"])[0]["loss"]
    assert logged == pytest.approx(step_mean, rel=1e-5)
    # ~0.027 apart on these rows: 500 times the tolerance the parity checks above allow.
    assert abs(sum(per_rank) / 2 - step_mean) > 1e-2, (per_rank, step_mean)


def test_sharded_checkpoint_resumes_on_two_ranks_and_on_one(sft_runs, tmp_path):
    """Drop everything after step 3 and re-run: 2 -> 2, 2 -> 1 and 1 -> 2 continue to the uninterrupted losses."""
    for name, source, nproc in (("2to2", "two", 2), ("2to1", "two", 1), ("1to2", "one", 2)):
        target = tmp_path / name
        shutil.copytree(sft_runs[source], target)
        shutil.rmtree(target / "checkpoints" / "step_6")
        shutil.rmtree(target / "final")
        assert latest_checkpoint(target).step == 3
        _run("sft", target, sft_runs["args"], nproc=nproc)
        _assert_same_run(sft_runs["one"], target)
        _assert_same_weights(sft_runs["one"] / "final", target / "final")


def test_a_killed_rank_brings_the_job_down_and_the_rerun_resumes(tmp_path, tiny_model_dir):
    args = [*COMMON, f"data.train_files=[{_sft_rows(tmp_path / 'rows.jsonl')}]", "trainer.max_steps=60",
            "trainer.save_every=10"]
    output_dir = tmp_path / "killed"
    torchrun = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "posttrain", "sft",
         *args, f"output_dir={output_dir}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline, killed = time.monotonic() + 300, False
    metrics = output_dir / "metrics.jsonl"
    while time.monotonic() < deadline and torchrun.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= 13 and list_checkpoints(output_dir):
            ranks = Path(f"/proc/{torchrun.pid}/task/{torchrun.pid}/children").read_text().split()
            os.kill(int(ranks[-1]), signal.SIGKILL)
            killed = True
            break
        time.sleep(0.005)
    assert killed, "the run ended before a rank could be killed"
    assert torchrun.wait(timeout=120) != 0  # torchrun takes the other rank down and fails
    assert not (output_dir / "final").exists()
    step = latest_checkpoint(output_dir).step
    assert 10 <= step < 60

    _run("sft", output_dir, args, nproc=2)
    _run("sft", tmp_path / "reference", args)
    _assert_same_run(tmp_path / "reference", output_dir)
    assert [c.step for c in list_checkpoints(output_dir)][-1] == 60


@pytest.mark.parametrize("recipe", ["dpo", "rm"])
def test_pair_recipes_on_two_ranks_equal_one_process(recipe, tmp_path, tiny_model_dir):
    from transformers import AutoModelForSequenceClassification

    pairs = _pair_rows(tmp_path / "pairs.jsonl")
    args = [*COMMON, f"data.train_files=[{pairs}]", f"data.eval_files=[{pairs}]", "data.max_overlap_fraction=1",
            "data.max_eval_examples=16", "trainer.max_steps=5", "trainer.eval_every=3", "trainer.save_every=0"]
    if recipe == "dpo":  # each rank interpolates its own shards toward the same slices of the starting model
        args.append("final_interpolation=0.5")
    _run(recipe, tmp_path / "one", args)
    _run(recipe, tmp_path / "two", args, nproc=2)
    _assert_same_run(tmp_path / "one", tmp_path / "two")
    _assert_same_weights(tmp_path / "one" / "final", tmp_path / "two" / "final",
                         AutoModelForSequenceClassification if recipe == "rm" else None)


def test_a_one_process_lora_reward_model_checkpoint_resumes_on_two_ranks(tmp_path, tiny_model_dir):
    """A LoRA reward model's adapter file also holds its trained score head (peft's modules_to_save)."""
    pairs = _pair_rows(tmp_path / "pairs.jsonl")
    args = [*COMMON, "lora.enabled=true", "lora.r=4", "lora.alpha=8", "trainer.learning_rate=1e-2",
            f"data.train_files=[{pairs}]", "trainer.max_steps=4", "trainer.save_every=2"]
    _run("rm", tmp_path / "one", args)
    resumed = tmp_path / "resumed-on-two"
    shutil.copytree(tmp_path / "one", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_4")
    shutil.rmtree(resumed / "final")
    _run("rm", resumed, args, nproc=2)
    _assert_same_run(tmp_path / "one", resumed)


def test_a_step_that_does_not_split_over_the_ranks_is_refused(tmp_path, tiny_model_dir):
    args = [*COMMON, f"data.train_files=[{_sft_rows(tmp_path / 'rows.jsonl')}]", "trainer.max_steps=2",
            "trainer.gradient_accumulation_steps=3"]
    process = subprocess.run([sys.executable, "-m", "posttrain", "sft", *args, f"output_dir={tmp_path / 'x'}",
                              "--nproc-per-node", "2"], capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert process.returncode != 0
    assert "trainer.gradient_accumulation_steps=3 does not split over 2" in process.stderr
    assert "trainer.micro_batch_size" in process.stderr


def test_lora_on_two_ranks_equals_one_process_and_resumes(tmp_path, tiny_model_dir):
    lora = ["lora.enabled=true", "lora.r=4", "lora.alpha=8", "trainer.learning_rate=1e-2"]
    args = [*COMMON, *lora, f"data.train_files=[{_sft_rows(tmp_path / 'rows.jsonl')}]", "trainer.max_steps=6",
            "trainer.save_every=3"]
    _run("sft", tmp_path / "one", args)
    _run("sft", tmp_path / "two", args, nproc=2)
    _assert_same_run(tmp_path / "one", tmp_path / "two")
    _assert_same_weights(tmp_path / "one" / "final", tmp_path / "two" / "final")  # merged
    assert (tmp_path / "two" / "adapter" / "adapter_model.safetensors").is_file()
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "two", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_6")
    shutil.rmtree(resumed / "final")
    _run("sft", resumed, args)  # 2 -> 1
    _assert_same_run(tmp_path / "one", resumed)
    resumed_on_two = tmp_path / "resumed-on-two"
    shutil.copytree(tmp_path / "one", resumed_on_two)
    shutil.rmtree(resumed_on_two / "checkpoints" / "step_6")
    shutil.rmtree(resumed_on_two / "final")
    _run("sft", resumed_on_two, args, nproc=2)  # 1 -> 2: a one-process adapter checkpoint on two ranks
    _assert_same_run(tmp_path / "one", resumed_on_two)
    _assert_same_weights(tmp_path / "one" / "final", resumed_on_two / "final")


def test_lora_merged_weights_on_two_ranks_equal_one_process(tmp_path, tiny_model_dir):
    """What a data-parallel LoRA policy hands a generator (`named_weights()`, adapters merged) equals a local
    worker's, restored from the same one-process checkpoint."""
    from safetensors.torch import load_file

    from posttrain.config.schema import LoraSection, ModelConfig, TrainerConfig
    from posttrain.models.loading import load_tokenizer
    from posttrain.workers.local import build_policy

    args = [*COMMON, "lora.enabled=true", "lora.r=4", "lora.alpha=8", "trainer.learning_rate=1e-2",
            f"data.train_files=[{_sft_rows(tmp_path / 'rows.jsonl')}]", "trainer.max_steps=3", "trainer.save_every=3"]
    _run("sft", tmp_path / "run", args)
    policy_dir = tmp_path / "run" / "checkpoints" / "step_3" / "policy"
    out = tmp_path / "merged.safetensors"
    process = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              str(Path(__file__).with_name("lora_weights_on_ranks.py")), str(policy_dir), str(out)],
                             capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert process.returncode == 0, (process.stdout + process.stderr)[-4000:]
    model = ModelConfig(name_or_path="posttrain/tiny")
    local = build_policy(model, LoraSection(enabled=True, r=4, alpha=8), TrainerConfig(num_threads=1),
                         load_tokenizer(model, padding_side="right"), torch.device("cpu"), resume_dir=policy_dir)
    expected = dict(local.named_weights())
    gathered = load_file(out)
    assert gathered.keys() == expected.keys()
    assert not any("lora_" in name or "base_layer" in name for name in gathered)
    for name in expected:
        torch.testing.assert_close(gathered[name], expected[name], atol=1e-6, rtol=0, msg=name)
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    changed = [name for name in expected if not torch.equal(expected[name], start[name])]
    assert any(name.endswith("q_proj.weight") for name in changed), "the adapters were not merged in"


def test_grpo_on_two_ranks_equals_one_process_and_resumes(tmp_path, tiny_model_dir):
    """Every rank samples the step's groups with the same seeds from its own synced copy of the policy, and the
    ranks split the update's micro-batches: the same rewards, losses and weights as one process."""
    rewards = Path(__file__).with_name("reward_fns_for_tests.py")
    args = ["model.name_or_path=posttrain/tiny", "data.train_files=['posttrain/arithmetic[:256]']", "data.max_length=32",
            "rollout.prompts_per_step=8", "rollout.num_generations_per_prompt=4", "rollout.max_new_tokens=6",
            "trainer.learning_rate=1e-2", "trainer.lr_scheduler=constant", "trainer.micro_batch_size=8",
            "update.num_minibatches=2", "trainer.max_steps=4", "trainer.save_every=2", "trainer.num_threads=1",
            "logging.progress=none", "logging.plot=false", "environment.kind=python",
            f"environment.options={{functions: ['{rewards}:digit_fraction'], num_workers: 0}}"]
    _run("grpo", tmp_path / "one", args)
    _run("grpo", tmp_path / "two", args, nproc=2)
    _assert_same_run(tmp_path / "one", tmp_path / "two", keys=("loss", "grad_norm", "reward/mean", "ratio_max"))
    assert (tmp_path / "two" / "checkpoints" / "step_2" / "policy" / ".metadata").is_file()  # the ranks were sharded
    _assert_same_weights(tmp_path / "one" / "final", tmp_path / "two" / "final")
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "two", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_4")
    shutil.rmtree(resumed / "final")
    _run("grpo", resumed, args)  # 2 -> 1
    _assert_same_run(tmp_path / "one", resumed, keys=("loss", "grad_norm", "reward/mean"))


def test_grpo_seeded_per_group_divides_the_sampling_and_equals_one_process(tmp_path, tiny_model_dir):
    """With rollout.seed_per_group each rank samples and scores its own block of the step's groups (7 prompts:
    3 on rank 0, 4 on rank 1) and the episodes are gathered: the same rewards, losses and weights as one
    process sampling all seven."""
    rewards = Path(__file__).with_name("reward_fns_for_tests.py")
    args = ["model.name_or_path=posttrain/tiny", "data.train_files=['posttrain/arithmetic[:256]']", "data.max_length=32",
            "rollout.prompts_per_step=7", "rollout.num_generations_per_prompt=4", "rollout.max_new_tokens=6",
            "rollout.seed_per_group=true", "trainer.learning_rate=1e-2", "trainer.lr_scheduler=constant",
            "trainer.micro_batch_size=7", "update.num_minibatches=2", "trainer.max_steps=3", "trainer.num_threads=1",
            "logging.progress=none", "logging.plot=false", "environment.kind=python",
            f"environment.options={{functions: ['{rewards}:digit_fraction'], num_workers: 0}}"]
    _run("grpo", tmp_path / "one", args)
    _run("grpo", tmp_path / "two", args, nproc=2)
    _assert_same_run(tmp_path / "one", tmp_path / "two", keys=("loss", "grad_norm", "reward/mean", "ratio_max"))
    assert len({r["reward/mean"] for r in _records(tmp_path / "one")}) > 1
    _assert_same_weights(tmp_path / "one" / "final", tmp_path / "two" / "final")


def test_ppo_on_two_ranks_equals_one_process_and_resumes(tmp_path, tiny_model_dir):
    """PPO's critic is sharded like the policy and the ranks split its micro-batches too: the same rewards, policy
    and value losses, critic statistics and final weights as one process, and a 2 -> 1 resume continues both."""
    rewards = Path(__file__).with_name("reward_fns_for_tests.py")
    args = ["model.name_or_path=posttrain/tiny", "data.train_files=['posttrain/arithmetic[:256]']", "data.max_length=32",
            "rollout.prompts_per_step=4", "rollout.num_generations_per_prompt=4", "rollout.max_new_tokens=6",
            "trainer.learning_rate=2e-3", "trainer.lr_scheduler=constant", "trainer.micro_batch_size=4",
            "update.num_minibatches=2", "update.ppo_epochs=2", "critic.warmup_steps=1", "critic.learning_rate=1e-3",
            "trainer.max_steps=4", "trainer.save_every=2", "trainer.num_threads=1", "logging.progress=none",
            "logging.plot=false", "environment.kind=python",
            f"environment.options={{functions: ['{rewards}:digit_fraction'], num_workers: 0}}"]
    keys = ("reward/mean", "value/loss", "value/grad_norm", "value/explained_variance", "value/mean",
            "value/clip_fraction")
    _run("ppo", tmp_path / "one", args)
    _run("ppo", tmp_path / "two", args, nproc=2)
    _assert_same_run(tmp_path / "one", tmp_path / "two", keys=keys)
    one, two = _records(tmp_path / "one"), _records(tmp_path / "two")
    assert [r["step"] for r in one if "loss" in r] == [2, 3, 4]  # the policy waits one critic warm-up step
    # The policy loss is a mean of terms of size ~1 (whitened advantages) that nearly cancel to ~0.02, so the
    # ranks' other summation order shows in it at ~1e-6 absolute: compared to 1e-5 of the terms' scale.
    for x, y in zip(one[1:], two[1:]):
        for key in ("loss", "grad_norm", "ratio_max"):
            assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-5), (x["step"], key)
    for role in ("policy", "critic"):
        assert (tmp_path / "two" / "checkpoints" / "step_2" / role / ".metadata").is_file()  # sharded
    # 12 AdamW steps of 2e-3 (4 per RL step): a weight whose gradient is near zero moves by about the learning
    # rate whichever its sign, so the summation order shows in a few weights at ~1e-5.
    _assert_same_weights(tmp_path / "one" / "final", tmp_path / "two" / "final", atol=5e-5)
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "two", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_4")
    shutil.rmtree(resumed / "final")
    _run("ppo", resumed, args)  # 2 -> 1
    _assert_same_run(tmp_path / "one", resumed, keys=keys)
    assert [r["loss"] for r in _records(resumed)[2:]] == pytest.approx([r["loss"] for r in one[2:]], abs=1e-5)
