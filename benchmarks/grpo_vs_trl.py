"""posttrain GRPO vs TRL's GRPOTrainer: seconds per step, wall time and peak memory on the same job.

Run (CPU, offline; needs the bench extra: pip install 'trl>=1.0', which brings accelerate):

    .venv/bin/python benchmarks/grpo_vs_trl.py     # 40 steps x 3 repeats: 2-3 minutes on 2 idle cores (+~90 s to build the model once)
    .venv/bin/python benchmarks/grpo_vs_trl.py --steps 5 --skip-steps 2 --repeats 1   # quick check
    .venv/bin/python benchmarks/grpo_vs_trl.py --shape vocab152k --prompts-per-step 8 --num-generations 8 \
        --max-new-tokens 128 --steps 4 --skip-steps 1 --repeats 1 --threads 2   # a 151,936-token vocabulary

What is compared
    posttrain.algorithms.grpo.train_grpo against trl.GRPOTrainer(...).train(), on the same job:
    - the same model directory: the embedded tiny Llama after a short SFT on arithmetic
      (posttrain/tiny-arithmetic-sft-small, resolved once here with posttrain.models.loading.resolve_model_path,
      so its one-time build on first use happens before any worker starts and is not measured), loaded in
      float32 with SDPA attention by both. Its exact-match rate is neither 0 nor 1, so most groups have
      rewards that differ and the advantages are not all zero; --model picks another directory or name;
    - the same prompts, in the same order: the prompt and answer columns of the first steps x prompts-per-step
      rows of posttrain/arithmetic:train (a split stored in a seeded random order) are written once to a
      JSONL file. posttrain reads it with data.shuffle=false; TRL gets it as a datasets.Dataset with
      shuffle_dataset=False, so its RepeatSampler walks it in order, prompts-per-step rows per generation
      batch, each repeated num_generations times. The prompts each framework scored are recorded every step
      and compared (they must be the same set, step by step). Both tokenize a prompt as tokenizer(prompt), the
      same ids;
    - the same rollout: prompts-per-step prompts (default 16) x num_generations completions (default 8) per
      optimizer step, at most --max-new-tokens tokens each (default 8), temperature 1.0, top_p 1, no top-k,
      one generation call for the whole batch (posttrain rollout.generation_batch_size >= the batch; TRL's
      generation batch is the batch), stopping at EOS. TRL: num_generations=8,
      per_device_train_batch_size=128 (TRL counts completions, not prompts), gradient_accumulation_steps=1,
      steps_per_generation=1, so generation_batch_size=128 = 16 prompts x 8; max_completion_length=8,
      use_vllm=False (transformers generate), no continuous batching;
    - the same reward: exact match of the completion's first line with the row's answer
      (posttrain.envs.arithmetic.exact_match): posttrain environment.kind=arithmetic, TRL a reward function
      calling the same exact_match on its decoded completions (plain strings: the dataset is not
      conversational); both decode with skip_special_tokens=True;
    - the same advantages: group mean baseline divided by the group's unbiased reward std (posttrain
      advantage.estimator=grpo with normalize_std=true; TRL scale_rewards="group"), no KL term and no
      reference model (posttrain loss.reference_kl_penalty=0; TRL beta=0.0);
    - the same loss: the PPO-clipped token-level surrogate with epsilon 0.2 on both sides (posttrain
      ratio_clip_low=ratio_clip_high=0.2, ratio_level=token; TRL epsilon=epsilon_high=0.2,
      importance_sampling_level="token"), summed over completion tokens (EOS included) and divided by the
      number of completion tokens of the whole batch (posttrain loss.aggregation=token-mean; TRL
      loss_type="dapo"); truncated completions keep their loss (posttrain rollout.overlong_filtering=false;
      TRL mask_truncated_completions=False). No entropy bonus, no entropy masking;
    - on-policy updates: one optimizer step per rollout batch, computed as one forward/backward over all 128
      completions (posttrain update.ppo_epochs=1, num_minibatches=1, trainer.micro_batch_size=128; TRL
      num_iterations=1, steps_per_generation=1, gradient_accumulation_steps=1), so neither runs a separate
      old-logprob pass (both use the training pass's own detached logprobs; the ratio is 1);
    - the same optimization: torch's fused AdamW in both (posttrain's build_optimizer; TRL's default
      optim="adamw_torch_fused"), lr 1e-4 constant, no warm-up, betas 0.9/0.999, eps 1e-8, no weight decay,
      gradient clipping at 1.0, seed 0, fp32 on CPU, torch's default thread count in both (or --threads N in
      both). TRL defaults that would differ are turned off: gradient_checkpointing=False, bf16=False;
    - the same bookkeeping: one metrics record per step (posttrain metrics.jsonl, TRL logging_steps=1), no
      progress bar, no evaluation or validation (posttrain data.eval_files=[], TRL eval_strategy="no"), no
      tracker (TRL report_to="none"), no completion logging (TRL log_completions=False); a resumable
      checkpoint at the last step (posttrain always writes one, also with trainer.save_every=0; TRL
      save_steps=steps; TRL also writes a model card beside it) and a final model directory (posttrain
      OUTPUT/final, TRL save_model()). posttrain's end-of-run plot (logging.plot) is turned off.

What is measured (each framework in its own fresh subprocess, one at a time; the order alternates
between repeats; medians over --repeats are reported; ratios are TRL / posttrain, so > 1 means posttrain is
faster or lighter)
    - seconds per step: the median, and the mean, of the intervals between consecutive step ends over the
      steady state (steps --skip-steps + 1 to the last). A step's time includes everything the framework does
      per step: sampling, scoring, advantages, the forward/backward, clipping, the optimizer step and the
      per-step logging. Step ends are taken in TRL from a TrainerCallback's on_step_end, in posttrain by
      wrapping RunLogger.log/advance (called once per step, right after the optimizer step), in this
      benchmark process only. The work per step is not a fixed token count: it depends on how long the
      sampled completions are (generation stops once every row has reached EOS), so the mean completion
      length of each framework is reported beside the times;
    - wall time of the whole training call: posttrain train_grpo(cfg); TRL GRPOTrainer(...) construction
      (model load, dataset) + train() + save_model(). Both include loading the model and prompts, training,
      and writing the checkpoint and final model;
    - memory: peak resident set size of the worker process (VmHWM) at the end; and separately the baseline
      RSS after the framework's imports and one model + tokenizer load (then freed), and the peak's increase
      over that baseline (VmHWM is reset to the current RSS just before the training call when the kernel
      allows it);
    - a sanity check, not a comparison: the mean reward (exact-match rate) over the run and over its last
      steps, which should be similar in both but not identical, because the two sample with different random
      number streams (posttrain seeds its own sampler per rollout; TRL samples with torch's global generator
      through transformers generate).

Known remaining differences (not removed)
    - Sampling: posttrain samples with its own KV-cached loop (TransformersGenerator: one forward per new
      token, multinomial from softmax(logits / T)); TRL calls transformers' model.generate (logits processors,
      stopping criteria, a DynamicCache). Same distribution, different code and random streams, so the
      completions, their lengths and the rewards differ run to run.
    - Model mode while sampling: posttrain switches the model to eval() for sampling, TRL samples in train
      mode. The tiny Llama has no dropout, so the distributions are the same.
    - The training forward: TRL computes log-probabilities (and entropies, for its metrics) of the completion
      tokens only, through its fused LM head (chunked, never the full logits); posttrain with trainer.lm_head=auto
      computes the full logits of prompt and completion where they are small (the tiny shape), then the sampled
      tokens' log-probabilities and entropies, and at the vocab152k shape runs its LM head in chunks on the
      sampled tokens only. TRL shuffles the 128 rows before its update (no effect with one minibatch).
    - Advantages: TRL divides by std + 1e-4, posttrain by std + 1e-6 (a group of 8 exact-match rewards that
      is not constant has std >= 0.35, so the relative difference is below 3e-4).
    - posttrain turns on torch.use_deterministic_algorithms(True, warn_only=True); TRL leaves it off.
    - Per-step metrics differ in what they compute: TRL logs clip ratios, completion length statistics and
      per-function reward statistics; posttrain logs reward, accuracy, length, truncation, ratio and
      gradient statistics.
    - The baseline memory differs because the imports differ (TRL brings in datasets and accelerate);
      compare the increase over the baseline for the training itself.
    - The default job is tiny (a ~1M-parameter model, 128 completions of at most 8 tokens per step), so
      per-step framework overhead weighs heavily; the numbers say little about large models or long
      completions, where generation and the kernels dominate (and where both would use vLLM).

Timing hygiene: run on an otherwise idle machine. With other processes busy on the same cores, torch's
OpenMP threads (2 on a 2-core machine) stall for seconds at a time, in either framework at random; the
benchmark prints a warning when the load average is high at the start and records it after every run. The
median step time is robust to a few such stalls; --threads 1 avoids them almost entirely (both frameworks get
the same setting).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

FRAMEWORKS = ("posttrain", "trl")
DATASET = "posttrain/arithmetic:train"
MODEL = "posttrain/tiny-arithmetic-sft-small"
SHAPES = {
    # name: (model, prompts, posttrain data.max_length, prompt length band in characters or None)
    "tiny": (MODEL, DATASET, 32, None),
    # The 151,936-token LM head of Qwen2.5 on a 4-layer, 89M-parameter random model, prompts of ~256 tokens
    # (192-320 characters of posttrain/bench-lengths, one token each). The random model's completions decode to
    # almost nothing, so every reward is 0: the work per step (sampling to the token budget, the forward/backward
    # over every completion) is what is compared, not learning.
    "vocab152k": ("posttrain/bench-vocab152k", "posttrain/bench-lengths:train", 512, (192, 320)),
}
LAST_N_REWARDS = 10


# =========================================================================================================
# Workers: each runs in a fresh process, `grpo_vs_trl.py --worker FRAMEWORK --spec SPEC.json`


def worker_posttrain(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    import posttrain
    from posttrain.algorithms.grpo import train_grpo
    from posttrain.config import load_config
    from posttrain.config.schema import GRPOConfig, ModelConfig
    from posttrain.envs.arithmetic_env import ArithmeticEnvironment
    from posttrain.models.loading import load_causal_lm, load_tokenizer

    model_cfg = ModelConfig(name_or_path=spec["model_dir"], dtype="float32", attn_implementation="sdpa")
    baseline = _common.baseline_rss_mib(lambda: (load_causal_lm(model_cfg), load_tokenizer(model_cfg)))

    output_dir = Path(spec["output_dir"])
    if output_dir.exists():  # posttrain would resume from it
        raise FileExistsError(f"{output_dir} exists; every run needs a fresh directory")
    rollout_size = spec["prompts_per_step"] * spec["num_generations"]
    tree = {
        "output_dir": str(output_dir),
        "seed": spec["seed"],
        "model": model_cfg.model_dump(),
        "data": {
            "train_files": [spec["prompts_file"]],
            "eval_files": [],
            "format": "prompt_only",
            "max_length": spec.get("max_prompt_length", 32),
            "shuffle": False,
        },
        "prompt": {"template": "{prompt}", "use_chat_template": False, "system_prompt": None},
        "rollout": {
            "prompts_per_step": spec["prompts_per_step"],
            "num_generations_per_prompt": spec["num_generations"],
            "max_new_tokens": spec["max_new_tokens"],
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "stop_strings": [],
            "backend": "transformers",
            "generation_batch_size": max(256, rollout_size),
            "max_turns": 1,
            "dynamic_sampling": False,
            "overlong_filtering": False,
            "overlong_buffer_length": 0,
        },
        "environment": {"kind": "arithmetic"},
        "advantage": {"estimator": "grpo", "normalize_std": True, "leave_one_out": False},
        "loss": {
            "ratio_level": "token",
            "clip_mode": "ppo",
            "ratio_clip_low": 0.2,
            "ratio_clip_high": 0.2,
            "ratio_clip_c": None,
            "reference_kl_penalty": 0.0,
            "importance_correction": "none",
            "aggregation": "token-mean",
        },
        "update": {"ppo_epochs": 1, "num_minibatches": 1},
        "trainer": {
            "max_steps": spec["steps"],
            "learning_rate": spec["learning_rate"],
            "lr_scheduler": "constant",
            "warmup_steps": 0,
            "min_lr_ratio": 0.0,
            "weight_decay": 0.0,
            "adam_beta1": 0.9,
            "adam_beta2": 0.999,
            "adam_epsilon": 1e-8,
            "max_grad_norm": 1.0,
            "micro_batch_size": rollout_size,
            "gradient_accumulation_steps": 1,
            "precision": "fp32",
            "log_every": 1,
            "eval_every": 0,
            "save_every": 0,  # still saves at the last step
            "keep_last": 1,
            "num_threads": spec["threads"],
            "lm_head": spec.get("lm_head", "auto"),
            "packing": spec.get("packing", False),
            "lm_head_chunk_size": spec.get("lm_head_chunk_size", 1024),
        },
        "logging": {"progress": "none", "plot": False},
    }
    cfg = load_config(GRPOConfig, None, None, base=tree)

    step_ends = _common.record_posttrain_step_ends()

    # The prompts scored each step (the first message of each episode), to check both frameworks saw the same.
    scored_prompts: list[list[str]] = []
    original_step = ArithmeticEnvironment.step

    def environment_step(self, message_logs, metadata):
        scored_prompts.append(sorted({log[0]["content"] for log in message_logs}))
        return original_step(self, message_logs, metadata)

    ArithmeticEnvironment.step = environment_step

    with _common.measured_run("posttrain", posttrain.__version__, baseline) as measured:
        train_grpo(cfg)

    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    by_step = {r["step"]: r for r in records if "reward/mean" in r}
    steps = range(1, spec["steps"] + 1)
    return {
        **measured,
        "step_end_times": [step_ends.get(s) for s in steps],
        "scored_prompts": scored_prompts,
        "rewards": [by_step.get(s, {}).get("reward/mean") for s in steps],
        "completion_lengths": [by_step.get(s, {}).get("response_length/mean") for s in steps],
        "losses": [by_step.get(s, {}).get("loss") for s in steps],
        "grad_norms": [by_step.get(s, {}).get("grad_norm") for s in steps],
        "learning_rates": [by_step.get(s, {}).get("learning_rate") for s in steps],
        # posttrain's own in-loop timer (sample + score + update; no logging or checkpoint): for reference.
        "in_loop_step_seconds": [by_step.get(s, {}).get("time/step") for s in steps],
    }


def worker_trl(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    import trl
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.envs import arithmetic

    model_dir = spec["model_dir"]
    baseline = _common.trl_baseline_rss_mib(model_dir)

    scored_prompts: list[list[str]] = []

    def exact_match(prompts, completions, answer, **kwargs):
        """The arithmetic environment's reward, as a TRL reward function (plain-string completions)."""
        scored_prompts.append(sorted(set(prompts)))
        return [arithmetic.exact_match(completion, str(gold)) for completion, gold in zip(completions, answer, strict=True)]

    output_dir = Path(spec["output_dir"])
    if output_dir.exists():
        raise FileExistsError(f"{output_dir} exists; every run needs a fresh directory")
    config_fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    rollout_size = spec["prompts_per_step"] * spec["num_generations"]
    args = GRPOConfig(
        output_dir=str(output_dir / "trainer"),
        seed=spec["seed"],
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,  # TRL's default is True
        # transformers >= 5.x renamed it; setting both avoids the deprecation path.
        **({"activation_checkpointing": False} if "activation_checkpointing" in config_fields else {}),
        model_init_kwargs={"dtype": "float32", "attn_implementation": "sdpa"},
        # data
        shuffle_dataset=False,
        remove_unused_columns=False,  # the reward reads the answer column
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        # rollout: per_device_train_batch_size counts completions; one generation batch per optimizer step
        num_generations=spec["num_generations"],
        per_device_train_batch_size=rollout_size,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=spec["max_new_tokens"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        use_vllm=False,
        use_transformers_continuous_batching=False,
        # advantages and loss
        scale_rewards="group",
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.2,
        importance_sampling_level="token",
        loss_type="dapo",
        mask_truncated_completions=False,
        top_entropy_quantile=1.0,
        entropy_coef=0.0,
        # optimization (and bookkeeping: one record per step, no tracker, no eval, one checkpoint at the end)
        **_common.trl_optimization_and_bookkeeping(spec),
        log_completions=False,
    )
    recorder = _common.trl_step_recorder("reward")

    with _common.measured_run("trl", trl.__version__, baseline) as measured:
        dataset = _common.jsonl_dataset(spec["prompts_file"])
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        trainer = GRPOTrainer(
            model=model_dir, reward_funcs=[exact_match], args=args, train_dataset=dataset, processing_class=tokenizer,
            callbacks=[recorder],
        )
        _common.train_and_save_quietly(trainer, output_dir / "final")

    steps = range(1, spec["steps"] + 1)
    logs = {entry["step"]: entry for entry in recorder.logs}
    return {
        **measured,
        "optimizer": type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__,
        # Per parameter group (the constructor's defaults say weight_decay 0.01; the groups get args.weight_decay).
        "optimizer_param_groups": [{k: str(v) for k, v in group.items() if k != "params"}
                                   for group in trainer.optimizer.param_groups],
        # transformers 5.x renamed is_gradient_checkpointing (now deprecated) to is_activation_checkpointing.
        "gradient_checkpointing": bool(
            trainer.model.is_activation_checkpointing if hasattr(trainer.model, "is_activation_checkpointing")
            else trainer.model.is_gradient_checkpointing
        ),
        "param_dtype": str(next(trainer.model.parameters()).dtype),
        "optim": str(args.optim),
        "generation_batch_size": args.generation_batch_size,
        "step_end_times": recorder.step_ends,
        "scored_prompts": scored_prompts,
        "rewards": [logs.get(s, {}).get("reward") for s in steps],
        "completion_lengths": [logs.get(s, {}).get("completions/mean_length") for s in steps],
        "losses": [logs.get(s, {}).get("loss") for s in steps],
        "grad_norms": [logs.get(s, {}).get("grad_norm") for s in steps],
        "learning_rates": [logs.get(s, {}).get("learning_rate") for s in steps],
        # TRL's own timer of training_step (generation + scoring + forward/backward; no optimizer step): reference.
        "in_loop_step_seconds": [logs.get(s, {}).get("step_time") for s in steps],
    }


WORKERS = {"posttrain": worker_posttrain, "trl": worker_trl}


def run_as_worker(framework: str, spec_path: str, result_path: str) -> None:
    _common.apply_offline_env()
    result = WORKERS[framework](_common.load_spec(spec_path))
    _common.write_json(Path(result_path), result)


# =========================================================================================================
# Parent: prepare the prompts, run the workers, summarize


def prepare_prompts(work_dir: Path, num_rows: int, dataset: str = DATASET,
                    band: tuple[int, int] | None = None) -> Path:
    """Write the prompt and answer columns of the first num_rows rows of a training split (stored in a seeded
    random order; started over if it runs out) to work_dir/prompts.jsonl: only prompts of `band` characters when
    given, and a row without an answer column gets its completion's first line (never matched by a random model)."""
    from posttrain.data import iter_records

    rows = [{"prompt": r["prompt"], "answer": r.get("answer", r.get("completion", "").split("\n")[0])}
            for _, r in iter_records(dataset) if band is None or band[0] <= len(r["prompt"]) <= band[1]]
    ordered = [rows[i % len(rows)] for i in range(num_rows)]
    path = work_dir / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ordered))
    return path


def expected_prompts_per_step(prompts_file: Path, prompts_per_step: int, steps: int) -> list[list[str]]:
    prompts = [json.loads(line)["prompt"] for line in prompts_file.read_text().splitlines()]
    return [sorted(set(prompts[s * prompts_per_step : (s + 1) * prompts_per_step])) for s in range(steps)]


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def summarize_run(result: dict[str, Any], skip: int, steps: int) -> dict[str, Any]:
    """Derived numbers of one worker run."""
    times = result["step_end_times"]
    if len(times) != steps or any(t is None for t in times):
        raise RuntimeError(f"{result['framework']}: {len(times)} step end times for {steps} steps (the step-end "
                           "instrumentation no longer matches the framework's code)")
    peak, base = result["peak_rss_mib"], result["baseline_rss_mib"]
    return {
        **_common.steady_state_step_seconds(times, skip),
        "wall_seconds": result["wall_seconds"],
        "peak_rss_mib": peak,
        "baseline_rss_mib": base,
        "peak_increase_mib": peak - base if peak is not None and base is not None else None,
        "mean_reward": _mean(result["rewards"]),
        "mean_last_rewards": _mean(result["rewards"][-LAST_N_REWARDS:]),
        "mean_completion_length": _mean(result["completion_lengths"]),
        "torch_threads": result["torch_threads"],
    }


ROWS = [
    # (label, key, digits, ratio meaning)
    ("Median seconds per step (step end to step end)", "median_step_seconds", 3, "> 1: posttrain faster"),
    ("Mean seconds per step, steady state", "mean_step_seconds", 3, "> 1: posttrain faster"),
    ("Wall time of the training call (s)", "wall_seconds", 2, "> 1: posttrain faster"),
    ("Peak RSS, VmHWM (MiB)", "peak_rss_mib", 0, "> 1: posttrain less"),
    ("Peak RSS increase over baseline (MiB)", "peak_increase_mib", 1, "> 1: posttrain less"),
    ("Baseline RSS after imports + model load (MiB)", "baseline_rss_mib", 0, ""),
    ("Mean completion length (tokens)", "mean_completion_length", 2, "~1: similar generation work"),
    ("Mean reward over the run", "mean_reward", 3, "~1 (different sampling streams)"),
    (f"Mean reward, last {LAST_N_REWARDS} steps", "mean_last_rewards", 3, "~1"),
]


def report(runs: dict[str, list[dict[str, Any]]], raw: dict[str, list[dict[str, Any]]],
           expected_prompts: list[list[str]]) -> tuple[str, dict[str, Any]]:
    medians = {fw: {key: _common.median(r[key] for r in runs[fw]) for _, key, _, _ in ROWS} for fw in FRAMEWORKS}
    table_rows = []
    for label, key, digits, meaning in ROWS:
        a, b = medians["posttrain"][key], medians["trl"][key]
        table_rows.append([label, _common.fmt(a, digits), _common.fmt(b, digits), _common.fmt(_common.ratio(b, a), 3),
                           meaning])
    table = _common.markdown_table(["Metric (median)", "posttrain", "TRL", "TRL/posttrain", ""], table_rows)

    same_prompts = {fw: all(r["scored_prompts"] == expected_prompts for r in raw[fw]) for fw in FRAMEWORKS}
    threads = {fw: sorted({r["torch_threads"] for r in runs[fw]}) for fw in FRAMEWORKS}
    trl = raw["trl"][0]
    notes = [
        f"prompts scored each step identical to the prompts file's, step by step: posttrain "
        f"{'yes' if same_prompts['posttrain'] else 'NO'}, TRL {'yes' if same_prompts['trl'] else 'NO'}",
        f"torch threads during training: posttrain {threads['posttrain']}, TRL {threads['trl']}; "
        f"TRL optimizer: {trl.get('optimizer')} (optim={trl.get('optim')}), gradient checkpointing "
        f"{trl.get('gradient_checkpointing')}, weights {trl.get('param_dtype')}, generation batch "
        f"{trl.get('generation_batch_size')} completions",
        "mean reward per run: "
        + "; ".join(f"{fw} {', '.join(_common.fmt(r['mean_reward'], 3) for r in runs[fw])}" for fw in FRAMEWORKS),
        "1-minute load average at the end of each run: "
        + "; ".join(f"{fw} {', '.join(_common.fmt((r.get('loadavg_at_end') or [None])[0]) for r in raw[fw])}"
                    for fw in FRAMEWORKS),
    ]
    text = f"{table}\n\n" + "\n".join(f"- {n}" for n in notes)
    summary = {
        "medians": medians,
        "ratios_trl_over_posttrain": {key: _common.ratio(medians["trl"][key], medians["posttrain"][key])
                                      for _, key, _, _ in ROWS},
        "same_prompts_as_file": same_prompts,
        "torch_threads": threads,
    }
    return text, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default 40)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per framework; medians are reported (default 3)")
    parser.add_argument("--skip-steps", type=int, default=5, help="warm-up steps left out of the step times (default 5)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny",
                        help="tiny: posttrain/tiny-arithmetic-sft-small on arithmetic prompts; vocab152k: "
                             "posttrain/bench-vocab152k on ~256-token posttrain/bench-lengths prompts")
    parser.add_argument("--model", default=None, help="model directory or embedded name (default: the shape's)")
    _common.add_posttrain_trainer_flags(parser, compile_flag=False)
    parser.add_argument("--prompts-per-step", type=int, default=16, help="prompts per optimizer step (default 16)")
    parser.add_argument("--num-generations", type=int, default=8, help="completions per prompt (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="completion budget in tokens (default 8)")
    parser.add_argument("--learning-rate", type=float, default=1e-4, help="constant learning rate (default 1e-4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads in both workers (default: torch's default, the same in both)")
    parser.add_argument("--trl-optim", default=None,
                        help="TRL optim name (default: TRL's default, adamw_torch_fused, as posttrain's)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed per worker run (default 1800)")
    parser.add_argument("--json", type=Path, default=None, help="write every raw number to this JSON file")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directories and worker logs here")
    parser.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        run_as_worker(args.worker, args.spec, args.result)
        return 0
    if args.steps < args.skip_steps + 2:
        parser.error(f"--steps must be at least --skip-steps + 2 = {args.skip_steps + 2}")
    if args.repeats < 1 or args.skip_steps < 1:
        parser.error("--repeats and --skip-steps must be at least 1")
    if args.num_generations < 2:
        parser.error("--num-generations must be at least 2 (group-relative advantages)")
    missing = [name for name, v in _common.package_versions(["trl", "accelerate"]).items() if v is None]
    if missing:
        parser.error(f"missing {', '.join(missing)}: pip install 'trl>=1.0' (or the project's bench extra)")

    default_model, dataset, max_prompt_length, band = SHAPES[args.shape]
    args.model = args.model or default_model

    _common.apply_offline_env()
    from posttrain.models.loading import resolve_model_path

    versions, machine = _common.announce_environment()

    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="grpo_vs_trl.", dir=args.keep))
    script = str(Path(__file__).resolve())
    benchmark_started = time.perf_counter()
    result_report: dict[str, Any] = {
        "benchmark": "grpo_vs_trl",
        "argv": sys.argv,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("worker", "spec", "result")},
        "versions": versions,
        "machine": machine,
    }
    try:
        model_dir = resolve_model_path(args.model)  # builds an embedded model once, before any worker starts
        prompts_file = prepare_prompts(work_dir, args.steps * args.prompts_per_step, dataset, band)
        expected_prompts = expected_prompts_per_step(prompts_file, args.prompts_per_step, args.steps)
        raw: dict[str, list[dict[str, Any]]] = {fw: [] for fw in FRAMEWORKS}
        runs: dict[str, list[dict[str, Any]]] = {fw: [] for fw in FRAMEWORKS}
        for repeat, order in enumerate(_common.alternating_orders(FRAMEWORKS, args.repeats)):
            for framework in order:
                spec = {
                    "framework": framework,
                    "model_dir": str(model_dir),
                    "prompts_file": str(prompts_file),
                    "output_dir": str(work_dir / f"{framework}-{repeat}"),
                    "steps": args.steps,
                    "prompts_per_step": args.prompts_per_step,
                    "num_generations": args.num_generations,
                    "max_new_tokens": args.max_new_tokens,
                    "learning_rate": args.learning_rate,
                    "seed": args.seed,
                    "threads": args.threads,
                    "max_prompt_length": max_prompt_length,
                    "lm_head": args.lm_head,
                    "packing": args.packing,
                    "lm_head_chunk_size": args.lm_head_chunk_size,
                    "trl_optim": args.trl_optim,
                }
                spec_path = work_dir / f"{framework}-{repeat}.spec.json"
                result_path = work_dir / f"{framework}-{repeat}.result.json"
                _common.write_json(spec_path, spec)
                print(f"repeat {repeat + 1}/{args.repeats}: {framework} ...", end=" ", flush=True)
                result = _common.run_worker(
                    [script, "--worker", framework, "--spec", str(spec_path), "--result", str(result_path)],
                    result_path, work_dir / f"{framework}-{repeat}.log", args.timeout,
                )
                summary = summarize_run(result, args.skip_steps, args.steps)
                print(f"{summary['median_step_seconds']:.3f} s/step (median), wall {summary['wall_seconds']:.1f}s, "
                      f"peak {summary['peak_rss_mib']:.0f} MiB, mean reward {_common.fmt(summary['mean_reward'], 3)}")
                raw[framework].append({**result, "repeat": repeat, "order": order.index(framework)})
                runs[framework].append(summary)
                if not args.keep:
                    shutil.rmtree(work_dir / f"{framework}-{repeat}", ignore_errors=True)
        text, summary = report(runs, raw, expected_prompts)
        result_report.update({"model_dir": str(model_dir), "summary": summary, "runs": runs, "raw": raw})
    finally:
        if not args.keep:
            shutil.rmtree(work_dir, ignore_errors=True)
    total = time.perf_counter() - benchmark_started
    result_report["benchmark_seconds"] = total

    print()
    print(f"## posttrain GRPO vs TRL {versions['trl']} GRPOTrainer (torch {versions['torch']}, "
          f"transformers {versions['transformers']}, accelerate {versions['accelerate']})")
    print()
    print(f"{args.model}, {dataset} prompts in order, {args.prompts_per_step} prompts x {args.num_generations} "
          f"completions of at most {args.max_new_tokens} tokens per step, exact-match reward, group-normalized "
          f"advantages, token-mean clipped loss, no KL, lr {args.learning_rate} constant, fp32 on CPU, "
          f"{args.steps} steps, step times over steps {args.skip_steps + 1}-{args.steps}, medians of "
          f"{args.repeats} repeat(s), order alternating, posttrain trainer.lm_head={args.lm_head} trainer.packing="
          f"{str(args.packing).lower()} trainer.lm_head_chunk_size={args.lm_head_chunk_size}. Ratios are "
          "TRL/posttrain.")
    print()
    print(text)
    print()
    print(f"Benchmark took {total / 60:.1f} min.")
    if args.json:
        _common.write_json(args.json, result_report)
        print(f"Raw numbers: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
