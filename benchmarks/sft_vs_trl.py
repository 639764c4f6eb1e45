"""posttrain SFT vs TRL's SFTTrainer: throughput, wall time, peak memory and loss on the same job.

Run (CPU, offline; needs the bench extra: pip install 'trl>=1.0', which brings accelerate):

    .venv/bin/python benchmarks/sft_vs_trl.py --steps 60 --repeats 3
    .venv/bin/python benchmarks/sft_vs_trl.py --steps 20 --repeats 1 --json /tmp/sft_vs_trl.json   # quick check

What is compared
    posttrain.algorithms.sft.train_sft against trl.SFTTrainer(...).train(), on the same job:
    - the same model directory: the embedded tiny Llama (posttrain/tiny, ~1M parameters, byte-level
      tokenizer), loaded in float32 with SDPA attention by both;
    - the same data, in the same order: prompt/completion rows of posttrain/arithmetic:train, shuffled once
      here (seeded) and written to a JSONL file of exactly steps x examples-per-step rows. Both frameworks read
      that file: posttrain with data.shuffle=false, TRL as a datasets.Dataset with
      train_sampling_strategy="sequential". So every optimizer step sees the same examples in both;
    - the same tokens: both tokenize the prompt, then the completion followed by EOS (the tiny tokenizer has
      no BOS and every byte is a token, so TRL's prompt+completion tokenization gives the same ids), pad on
      the right per micro-batch (no packing, no padding-free), and train on the completion + EOS tokens only
      (posttrain data.completion_only_loss=true, TRL completion_only_loss=True). Step 1's loss, which
      depends only on the initial weights, the batch and the loss definition, is printed as a check;
    - the same loss: summed token NLL divided by the number of target tokens of the whole optimizer step,
      in both (TRL passes num_items_in_batch over the accumulated micro-batches), so the gradient does not
      depend on the micro-batch split;
    - the same optimization: AdamW (betas 0.9/0.999, eps 1e-8, no weight decay), gradient clipping at 1.0,
      the same learning rate and schedule (default: constant 1e-3, no warm-up), the same number of optimizer
      steps, micro-batch size and gradient accumulation (two settings by default: 64 x 1 and 16 x 4), seed 0,
      fp32 on CPU, torch's default thread count in both (or --threads N in both). TRL defaults that would
      differ are turned off: gradient_checkpointing=False, bf16=False, no packing;
    - the same bookkeeping: one metrics record per step (posttrain metrics.jsonl, TRL logging_steps=1), no
      progress bar, no evaluation, no tracker; a resumable checkpoint at the last step (posttrain always
      writes one; TRL save_steps=steps) and a final model directory (posttrain OUTPUT/final, TRL
      save_model()). posttrain's end-of-run plot (logging.plot) is turned off.

What is measured (each framework in its own fresh subprocess, one at a time; the order alternates
between repeats; medians over --repeats are reported)
    - throughput: non-padding tokens (prompt + completion + EOS; attention_mask ones) per second over the
      steady state, i.e. from the end of step --skip-steps to the end of the last step. A step's time is the
      interval between consecutive step ends, so it includes everything the framework does per step (data
      collation, forward/backward, clipping, optimizer, scheduler, per-step logging). Step ends are taken in
      TRL from a TrainerCallback's on_step_end, in posttrain by wrapping RunLogger.log/advance (called once
      per step, right after the optimizer step), in this benchmark process only. Tokens per step are counted
      by each framework (posttrain: tokens_per_second x step_seconds from metrics.jsonl; TRL: a wrapper
      around its data collator summing attention_mask) and checked against the benchmark's own count;
    - wall time of the whole training call: posttrain train_sft(cfg); TRL SFTTrainer(...) construction
      (model load, dataset preparation) + train() + save_model(). Both include reading and tokenizing the
      data, loading the model, training and writing the checkpoint and final model;
    - memory: peak resident set size of the worker process (VmHWM) at the end; and separately the baseline
      RSS after the framework's imports and one model + tokenizer load (then freed), and the peak's increase
      over that baseline (VmHWM is reset to the current RSS just before the training call when the kernel
      allows it);
    - loss: the training loss of step 1, of the last step, and the mean over the last 10 steps, the
      largest per-step difference between the two frameworks and the first step where they differ by more
      than 1e-3. Measured here (TRL 1.16, torch 2.13, 64 x 1 and 16 x 4): step 1 agrees to 1e-7 and, at the
      default lr 1e-3, every step of 60 to 1e-4. At 3e-3 without warm-up (the preset's peak lr), the run
      has gradient-norm spikes from step ~40 on that amplify float rounding differences (see below) into
      loss differences of a few 1e-2 by step 60, in either direction and whichever TRL optimizer is used:
      chaos, not a different computation, which is why the default lr is 1e-3. The lr does not change the
      work per step, so it does not affect the speed comparison.

Known remaining differences (not removed)
    - Both use torch's fused AdamW (TRL's default optim="adamw_torch_fused", posttrain's build_optimizer);
      --trl-optim adamw_torch gives TRL the non-fused implementation instead.
    - TRL computes the loss through its fused LM head (log-probabilities computed in chunks, never the full
      logits) and also computes per-token entropy and top-1 accuracy for its logged metrics every step;
      posttrain computes the full logits and cross-entropy. Per-step losses therefore agree closely but not
      bit for bit, and the difference grows over training.
    - (Removed) Learning-rate schedule: transformers' warm-up gives the first update lr 0 (posttrain gives
      it lr/warmup) and its cosine and linear decays end a step short of 0. So for any schedule other than
      the default (constant, no warm-up, where TRL's own is identical) TRL is given posttrain's schedule (the
      formula of posttrain.optim.lr_multiplier, through SFTTrainer.create_scheduler); nothing else of TRL's
      is replaced.
    - posttrain turns on torch.use_deterministic_algorithms(True, warn_only=True); TRL leaves it off.
    - The baseline memory differs because the imports differ (TRL brings in datasets and accelerate);
      compare the increase over the baseline for the training itself.
    - The default job is tiny (a ~1M-parameter model, ~10-token examples), so per-step framework overhead
      weighs heavily; the numbers say little about large models, where the kernels dominate.

Timing hygiene: run on an otherwise idle machine. With other processes busy on the same cores, torch's
OpenMP threads (2 on a 2-core machine) stall for seconds at a time, in either framework at random, making
single steps 20x slower; the benchmark prints a warning when the load average is high at the start and
records it after every run. The "median of per-step rates" row is robust to a few such stalls; --threads 1
avoids them almost entirely (both frameworks get the same setting).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
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
SHAPES = {
    # name: (model, training rows, max_length)
    "tiny": ("posttrain/tiny", "posttrain/arithmetic:train", 32),
    # A real vocabulary and real length spread: the 151,936-token LM head of Qwen2.5 on a 4-layer, 89M-parameter
    # model, prompts and completions of 16-1,024 tokens each (log-normal, median ~128).
    "vocab152k": ("posttrain/bench-vocab152k", "posttrain/bench-lengths:train", 2080),
}
LAST_N_LOSSES = 10
LOSS_TOLERANCE = 1e-3


# =========================================================================================================
# Workers: each runs in a fresh process, `sft_vs_trl.py --worker FRAMEWORK --spec SPEC.json`


def worker_posttrain(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    import posttrain
    from posttrain.algorithms.sft import train_sft
    from posttrain.config import load_config
    from posttrain.config.schema import ModelConfig, SFTConfig
    from posttrain.models.loading import load_causal_lm, load_tokenizer

    model_cfg = ModelConfig(name_or_path=spec["model_dir"], dtype="float32", attn_implementation="sdpa")
    baseline = _common.baseline_rss_mib(lambda: (load_causal_lm(model_cfg), load_tokenizer(model_cfg)))

    output_dir = Path(spec["output_dir"])
    if output_dir.exists():  # posttrain would resume from it
        raise FileExistsError(f"{output_dir} exists; every run needs a fresh directory")
    tree = {
        "output_dir": str(output_dir),
        "seed": spec["seed"],
        "model": model_cfg.model_dump(),
        "data": {
            "train_files": [spec["train_file"]],
            "eval_files": [],
            "format": "prompt_completion",
            "max_length": spec["max_length"],
            "completion_only_loss": True,
            "packing": False,
            "shuffle": False,
        },
        "trainer": _common.posttrain_trainer_section(spec),
        "logging": {"progress": "none", "plot": False},
    }
    cfg = load_config(SFTConfig, None, None, base=tree)

    step_ends = _common.record_posttrain_step_ends()

    with _common.measured_run("posttrain", posttrain.__version__ if hasattr(posttrain, "__version__") else None, baseline) as measured:
        train_sft(cfg)

    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    by_step = {r["step"]: r for r in records if "loss" in r}
    steps = range(1, spec["steps"] + 1)
    tokens = []
    for step in steps:
        record = by_step.get(step, {})
        if "tokens_per_second" in record and "step_seconds" in record:
            tokens.append(round(record["tokens_per_second"] * record["step_seconds"]))
        else:
            tokens.append(None)
    return {
        **measured,
        "step_end_times": [step_ends.get(s) for s in steps],
        "tokens_per_step": tokens,
        "losses": [by_step.get(s, {}).get("loss") for s in steps],
        "learning_rates": [by_step.get(s, {}).get("learning_rate") for s in steps],
        "grad_norms": [by_step.get(s, {}).get("grad_norm") for s in steps],
        # posttrain's own in-loop timer (collate + forward/backward + optimizer; no logging): for reference.
        "in_loop_step_seconds": [by_step.get(s, {}).get("step_seconds") for s in steps],
    }


def _lr_multiplier(max_steps: int, warmup_steps: int, kind: str):
    """posttrain's schedule (posttrain.optim.lr_multiplier, min_lr_ratio 0) as a LambdaLR factor of the
    0-based step: linear warm-up whose first update already gets 1/warmup_steps, then cosine or linear decay
    reaching 0 at the last step, or constant."""

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps - 1))
        return 0.5 * (1.0 + math.cos(math.pi * progress)) if kind == "cosine" else 1.0 - progress

    return multiplier


def worker_trl(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    import trl
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    model_dir = spec["model_dir"]
    baseline = _common.trl_baseline_rss_mib(model_dir)

    class CountingCollator:
        """Wraps TRL's own collator and records each batch's non-padding tokens (attention_mask ones)."""

        def __init__(self, inner):
            self.inner = inner
            self.batch_tokens: list[int] = []

        def __call__(self, examples):
            batch = self.inner(examples)
            mask = batch.get("attention_mask")
            self.batch_tokens.append(int(mask.sum()) if mask is not None else int(batch["input_ids"].numel()))
            return batch

    trainer_class = SFTTrainer
    if spec["lr_scheduler"] != "constant" or spec["warmup_steps"]:
        multiplier = _lr_multiplier(spec["steps"], spec["warmup_steps"], spec["lr_scheduler"])

        class SFTTrainerWithPosttrainSchedule(SFTTrainer):
            def create_scheduler(self, num_training_steps, optimizer=None):
                if self.lr_scheduler is None:
                    self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, multiplier)
                return self.lr_scheduler

        trainer_class = SFTTrainerWithPosttrainSchedule

    output_dir = Path(spec["output_dir"])
    if output_dir.exists():
        raise FileExistsError(f"{output_dir} exists; every run needs a fresh directory")
    config_fields = {f.name for f in dataclasses.fields(SFTConfig)}
    args = SFTConfig(
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
        max_length=spec["max_length"],
        packing=False,
        padding_free=False,
        completion_only_loss=True,
        shuffle_dataset=False,
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        # optimization (and bookkeeping: one record per step, no tracker, no eval, one checkpoint at the end)
        **_common.trl_optimization_and_bookkeeping(spec),
        per_device_train_batch_size=spec["micro_batch_size"],
        gradient_accumulation_steps=spec["accumulation"],
    )
    recorder = _common.trl_step_recorder("loss")

    with _common.measured_run("trl", trl.__version__, baseline) as measured:
        dataset = _common.jsonl_dataset(spec["train_file"])
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        trainer = trainer_class(
            model=model_dir, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[recorder]
        )
        collator = CountingCollator(trainer.data_collator)
        trainer.data_collator = collator
        _common.train_and_save_quietly(trainer, output_dir / "final")

    steps = spec["steps"]
    accumulation = spec["accumulation"]
    # The dataset holds exactly steps x accumulation micro-batches, consumed in order.
    batch_tokens = collator.batch_tokens[: steps * accumulation]
    tokens = [sum(batch_tokens[i * accumulation : (i + 1) * accumulation]) for i in range(steps)]
    logs = {entry["step"]: entry for entry in recorder.logs}
    cumulative = [logs.get(s, {}).get("num_tokens") for s in range(1, steps + 1)]
    return {
        **measured,
        "optimizer": type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__,
        "optimizer_defaults": {k: str(v) for k, v in getattr(trainer.optimizer, "defaults", {}).items()},
        "gradient_checkpointing": bool(getattr(trainer.model, "is_gradient_checkpointing", False)),
        "param_dtype": str(next(trainer.model.parameters()).dtype),
        "optim": str(args.optim),
        "collator_calls": len(collator.batch_tokens),
        "step_end_times": recorder.step_ends,
        "tokens_per_step": tokens,
        # TRL's own cumulative count (attention_mask ones), as a cross-check of the collator count.
        "trl_num_tokens_per_step": [
            (b - a) if a is not None and b is not None else None for a, b in zip([0, *cumulative[:-1]], cumulative)
        ],
        "losses": [logs.get(s, {}).get("loss") for s in range(1, steps + 1)],
        "learning_rates": [logs.get(s, {}).get("learning_rate") for s in range(1, steps + 1)],
        "grad_norms": [logs.get(s, {}).get("grad_norm") for s in range(1, steps + 1)],
        # on_step_begin -> on_step_end (forward/backward + optimizer; excludes collation and logging): reference.
        "in_loop_step_seconds": [b - a for a, b in zip(recorder.step_begins, recorder.step_ends)],
    }


WORKERS = {"posttrain": worker_posttrain, "trl": worker_trl}


def run_as_worker(framework: str, spec_path: str, result_path: str) -> None:
    _common.apply_offline_env()
    result = WORKERS[framework](_common.load_spec(spec_path))
    _common.write_json(Path(result_path), result)


# =========================================================================================================
# Parent: prepare the data, run the workers, summarize


def expected_tokens_per_step(train_file: Path, model_dir: Path, examples_per_step: int, steps: int) -> list[int]:
    """Non-padding tokens per step as both frameworks should see them: prompt + completion + EOS."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rows = [json.loads(line) for line in train_file.read_text().splitlines()]
    lengths = [
        len(tokenizer(r["prompt"])["input_ids"])
        + len(tokenizer(r["completion"], add_special_tokens=False)["input_ids"])
        + (tokenizer.eos_token_id is not None)
        for r in rows
    ]
    return [sum(lengths[s * examples_per_step : (s + 1) * examples_per_step]) for s in range(steps)]


def summarize_run(result: dict[str, Any], expected_tokens: list[int], skip: int) -> dict[str, Any]:
    """Derived numbers of one worker run."""
    tokens = [t if t is not None else e for t, e in zip(result["tokens_per_step"], expected_tokens)]
    times, timing = result["step_end_times"], "step ends"
    if len(times) != len(tokens) or any(t is None for t in times):
        # Fallback, should the step-end instrumentation stop matching the framework's code: its own in-loop
        # step timer, which leaves out part of the per-step work (so it flatters that framework).
        in_loop = result.get("in_loop_step_seconds") or []
        if len(in_loop) != len(tokens) or any(t is None for t in in_loop):
            raise RuntimeError(f"{result['framework']}: {len(times)} step times for {len(tokens)} steps")
        times, timing = list(itertools.accumulate(in_loop)), "in-loop timer (fallback)"
    steady = _common.steady_state_throughput(tokens, times, skip)
    losses = [l for l in result["losses"] if l is not None]
    peak, base = result["peak_rss_mib"], result["baseline_rss_mib"]
    return {
        **steady,
        "wall_seconds": result["wall_seconds"],
        "peak_rss_mib": peak,
        "baseline_rss_mib": base,
        "peak_increase_mib": peak - base if peak is not None and base is not None else None,
        "first_loss": result["losses"][0],
        "final_loss": result["losses"][-1],
        "mean_last_losses": statistics.fmean(losses[-LAST_N_LOSSES:]) if losses else None,
        "tokens_match_expected": list(result["tokens_per_step"]) == expected_tokens,
        "torch_threads": result["torch_threads"],
        "timing": timing,
    }


ROWS = [
    # (label, key, digits, ratio meaning)
    ("Throughput, steady state (non-pad tokens/s)", "tokens_per_second", 0, "> 1: posttrain faster"),
    ("Throughput, median of per-step rates (tok/s)", "median_step_tokens_per_second", 0, "> 1: posttrain faster"),
    ("Median step time (ms, step end to step end)", "median_step_ms", 1, "< 1: posttrain faster"),
    ("Wall time of the training call (s)", "wall_seconds", 2, "< 1: posttrain faster"),
    ("Peak RSS, VmHWM (MiB)", "peak_rss_mib", 0, "< 1: posttrain less"),
    ("Peak RSS increase over baseline (MiB)", "peak_increase_mib", 1, "< 1: posttrain less"),
    ("Baseline RSS after imports + model load (MiB)", "baseline_rss_mib", 0, ""),
    ("Loss at step 1", "first_loss", 4, "should be 1.00"),
    ("Loss at the last step", "final_loss", 4, "~1"),
    (f"Mean loss, last {LAST_N_LOSSES} steps", "mean_last_losses", 4, "~1"),
]


def setting_report(name: str, runs: dict[str, list[dict[str, Any]]], raw: dict[str, list[dict[str, Any]]]) -> tuple[str, dict[str, Any]]:
    medians = {fw: {key: _common.median(r[key] for r in runs[fw]) for _, key, _, _ in ROWS} for fw in FRAMEWORKS}
    table_rows = []
    for label, key, digits, meaning in ROWS:
        a, b = medians["posttrain"][key], medians["trl"][key]
        r = _common.ratio(a, b)
        table_rows.append([label, _common.fmt(a, digits), _common.fmt(b, digits), _common.fmt(r, 3), meaning])
    table = _common.markdown_table(["Metric (median)", "posttrain", "TRL", "posttrain/TRL", ""], table_rows)

    # Per-step loss agreement, repeat by repeat (each repeat ran both frameworks on identical batches).
    max_diffs, first_divergence = [], []
    for pt, tr in zip(raw["posttrain"], raw["trl"]):
        diffs = [abs(a - b) for a, b in zip(pt["losses"], tr["losses"]) if a is not None and b is not None]
        max_diffs.append(max(diffs) if diffs else None)
        first_divergence.append(next((i + 1 for i, d in enumerate(diffs) if d > LOSS_TOLERANCE), None))
    timings = sorted({r["timing"] for fw in FRAMEWORKS for r in runs[fw]})
    tokens_ok = all(r["tokens_match_expected"] for fw in FRAMEWORKS for r in runs[fw])
    trl_cross = all(
        all(a == b for a, b in zip(r["trl_num_tokens_per_step"], r["tokens_per_step"]) if a is not None)
        for r in raw["trl"]
    )
    threads = {fw: sorted({r["torch_threads"] for r in runs[fw]}) for fw in FRAMEWORKS}
    notes = [
        f"max |loss(posttrain) - loss(TRL)| over steps, per repeat: {', '.join('n/a' if d is None else f'{d:.1e}' for d in max_diffs)}"
        f"; first step differing by more than {LOSS_TOLERANCE:g}: "
        f"{', '.join('none' if d is None else str(d) for d in first_divergence)}",
        f"tokens per step identical to the benchmark's own count in every run: {'yes' if tokens_ok else 'NO'}"
        f" (TRL's logged num_tokens agrees with its collator: {'yes' if trl_cross else 'NO'})",
        f"torch threads during training: posttrain {threads['posttrain']}, TRL {threads['trl']}; "
        f"TRL optimizer: {raw['trl'][0].get('optimizer')} (optim={raw['trl'][0].get('optim')}), "
        f"gradient checkpointing {raw['trl'][0].get('gradient_checkpointing')}, weights {raw['trl'][0].get('param_dtype')}",
        *([f"step timing: {', '.join(timings)}"] if timings != ["step ends"] else []),
        "1-minute load average at the end of each run: "
        + "; ".join(f"{fw} {', '.join(_common.fmt(r.get('loadavg_at_end', [None])[0]) for r in raw[fw])}" for fw in FRAMEWORKS),
    ]
    text = f"### {name}\n\n{table}\n\n" + "\n".join(f"- {n}" for n in notes)
    summary = {
        "medians": medians,
        "ratios": {key: _common.ratio(medians["posttrain"][key], medians["trl"][key]) for _, key, _, _ in ROWS},
        "max_loss_diff_per_repeat": max_diffs,
        "first_step_loss_diff_over_tolerance": first_divergence,
        "tokens_match_expected": tokens_ok,
        "trl_num_tokens_cross_check": trl_cross,
        "torch_threads": threads,
    }
    return text, summary


def parse_settings(text: str) -> list[tuple[int, int]]:
    settings = []
    for item in text.split(","):
        micro, sep, accumulation = item.strip().lower().partition("x")
        if not sep or not micro.isdigit() or not accumulation.isdigit() or int(micro) < 1 or int(accumulation) < 1:
            raise argparse.ArgumentTypeError(f"bad setting {item!r}: expected MICROxACCUM, e.g. 64x1")
        settings.append((int(micro), int(accumulation)))
    return settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run (default 60)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per framework and setting; medians are reported (default 3)")
    parser.add_argument("--settings", type=parse_settings, default=parse_settings("64x1,16x4"),
                        help="comma-separated MICRO_BATCHxACCUMULATION settings (default 64x1,16x4)")
    parser.add_argument("--skip-steps", type=int, default=5, help="warm-up steps left out of the throughput (default 5)")
    parser.add_argument("--learning-rate", type=float, default=1e-3,
                        help="peak learning rate (default 1e-3; see the module docstring on 3e-3)")
    parser.add_argument("--lr-scheduler", choices=["constant", "cosine", "linear"], default="constant",
                        help="schedule after warm-up (default constant: identical in both frameworks)")
    parser.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up steps (default 0)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny",
                        help="tiny: posttrain/tiny on arithmetic (~10-token rows); vocab152k: posttrain/bench-vocab152k "
                             "on posttrain/bench-lengths (prompts and completions of 16-1,024 tokens)")
    parser.add_argument("--max-length", type=int, default=None,
                        help="max tokens per example (default: the shape's, 32 for tiny, 2080 for vocab152k)")
    _common.add_posttrain_trainer_flags(parser, compile_flag=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads in both workers (default: torch's default, the same in both)")
    parser.add_argument("--trl-optim", default=None,
                        help="TRL optim name (default: TRL's default, adamw_torch_fused); adamw_torch = non-fused")
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
    missing = [name for name, v in _common.package_versions(["trl", "accelerate"]).items() if v is None]
    if missing:
        parser.error(f"missing {', '.join(missing)}: pip install 'trl>=1.0' (or the project's bench extra)")

    _common.apply_offline_env()
    from posttrain.models.tiny import ensure_embedded_model

    versions, machine = _common.announce_environment()

    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="sft_vs_trl.", dir=args.keep))
    script = str(Path(__file__).resolve())
    benchmark_started = time.perf_counter()
    report: dict[str, Any] = {
        "benchmark": "sft_vs_trl",
        "argv": sys.argv,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("worker", "spec", "result")},
        "versions": versions,
        "machine": machine,
        "settings": {},
    }
    sections = []
    try:
        model_name, dataset, default_length = SHAPES[args.shape]
        args.max_length = args.max_length or default_length
        model_dir = ensure_embedded_model(model_name)
        for micro, accumulation in args.settings:
            name = f"micro-batch {micro} x accumulation {accumulation} ({micro * accumulation} examples/step, {args.steps} steps)"
            setting_dir = work_dir / f"{micro}x{accumulation}"
            setting_dir.mkdir()
            train_file = _common.write_prompt_completion_rows(setting_dir, dataset, args.steps * micro * accumulation,
                                                              args.seed, "sft_vs_trl")
            expected = expected_tokens_per_step(train_file, model_dir, micro * accumulation, args.steps)
            raw: dict[str, list[dict[str, Any]]] = {fw: [] for fw in FRAMEWORKS}
            runs: dict[str, list[dict[str, Any]]] = {fw: [] for fw in FRAMEWORKS}
            for repeat, order in enumerate(_common.alternating_orders(FRAMEWORKS, args.repeats)):
                for framework in order:
                    run_dir = setting_dir / f"{framework}-{repeat}"
                    spec = {
                        "framework": framework,
                        "model_dir": str(model_dir),
                        "train_file": str(train_file),
                        "output_dir": str(run_dir),
                        "steps": args.steps,
                        "micro_batch_size": micro,
                        "accumulation": accumulation,
                        "learning_rate": args.learning_rate,
                        "lr_scheduler": args.lr_scheduler,
                        "warmup_steps": args.warmup_steps,
                        "max_length": args.max_length,
                        "seed": args.seed,
                        "threads": args.threads,
                        "trl_optim": args.trl_optim,
                        "lm_head": args.lm_head,
                        "packing": args.packing,
                        "compile": args.compile,
                        "lm_head_chunk_size": args.lm_head_chunk_size,
                    }
                    spec_path = setting_dir / f"{framework}-{repeat}.spec.json"
                    result_path = setting_dir / f"{framework}-{repeat}.result.json"
                    _common.write_json(spec_path, spec)
                    print(f"[{micro}x{accumulation}] repeat {repeat + 1}/{args.repeats}: {framework} ...", end=" ", flush=True)
                    result = _common.run_worker(
                        [script, "--worker", framework, "--spec", str(spec_path), "--result", str(result_path)],
                        result_path, setting_dir / f"{framework}-{repeat}.log", args.timeout,
                    )
                    summary = summarize_run(result, expected, args.skip_steps)
                    print(f"{summary['tokens_per_second']:,.0f} tok/s, wall {summary['wall_seconds']:.1f}s, "
                          f"peak {summary['peak_rss_mib']:.0f} MiB, final loss {summary['final_loss']:.4f}")
                    raw[framework].append({**result, "repeat": repeat, "order": order.index(framework)})
                    runs[framework].append(summary)
                    if not args.keep:
                        shutil.rmtree(run_dir, ignore_errors=True)
            text, summary = setting_report(name, runs, raw)
            sections.append(text)
            report["settings"][f"{micro}x{accumulation}"] = {
                "micro_batch_size": micro,
                "accumulation": accumulation,
                "expected_tokens_per_step": expected,
                "summary": summary,
                "runs": runs,
                "raw": raw,
            }
    finally:
        if not args.keep:
            shutil.rmtree(work_dir, ignore_errors=True)
    total = time.perf_counter() - benchmark_started
    report["benchmark_seconds"] = total

    print()
    print(f"## posttrain SFT vs TRL {versions['trl']} SFTTrainer (torch {versions['torch']}, "
          f"transformers {versions['transformers']}, accelerate {versions['accelerate']})")
    print()
    print(f"{model_name}, {dataset}, fp32 on CPU, completion-only loss, no collation packing, posttrain trainer.lm_head="
          f"{args.lm_head} trainer.packing={str(args.packing).lower()} "
          f"trainer.compile={str(args.compile).lower()} "
          f"trainer.lm_head_chunk_size={args.lm_head_chunk_size}, lr {args.learning_rate} "
          f"{args.lr_scheduler} (warm-up {args.warmup_steps}), {args.steps} steps, throughput over steps "
          f"{args.skip_steps + 1}-{args.steps}, medians of {args.repeats} repeat(s), order alternating.")
    print()
    print("\n\n".join(sections))
    print()
    print(f"Benchmark took {total / 60:.1f} min.")
    if args.json:
        _common.write_json(args.json, report)
        print(f"Raw numbers: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
