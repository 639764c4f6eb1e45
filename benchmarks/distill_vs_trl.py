"""posttrain distill vs TRL's GKDTrainer / DistillationTrainer: seconds per step, peak memory, loss and held-out
accuracy on the same distillation job, off-policy (lambda = 0) or on-policy (lambda = 1).

Run (CPU, offline; needs the bench extra: pip install 'trl>=1.0', which brings accelerate):

    .venv/bin/python benchmarks/distill_vs_trl.py      # lambda 0, tiny: 300 steps x 2 repeats + eval, ~6 min
    .venv/bin/python benchmarks/distill_vs_trl.py --steps 6 --skip-steps 2 --repeats 1       # quick check
    .venv/bin/python benchmarks/distill_vs_trl.py --shape vocab152k --steps 4 --skip-steps 1 --repeats 2 --threads 2
    .venv/bin/python benchmarks/distill_vs_trl.py --lmbda 1 --steps 20 --repeats 1          # on-policy

What is compared
    lambda = 0 (off-policy: the dataset's completions are distilled): posttrain.algorithms.distill.train_distill
    (mode off_policy) against trl.experimental.gkd.GKDTrainer with lmbda=0 and seq_kd=False, the only TRL trainer
    that distils a dataset's completions. lambda = 1 (on-policy: the student's own samples are distilled):
    posttrain distill with mode on_policy and lmbda 1.0 against trl.DistillationTrainer (TRL's stable on-policy
    trainer, which GKDTrainer itself recommends at lmbda=1; --trl-trainer gkd runs GKDTrainer with lmbda=1
    instead). On the same job:
    - the same student and teacher directories, resolved once here (an embedded model's one-time build happens
      before any worker starts and is not measured), loaded in float32 with SDPA attention by both. tiny: the
      untrained posttrain/tiny learns from posttrain/tiny-arithmetic-sft (a teacher of the student's own shape,
      vocabulary 260; the distill_kd_arithmetic preset's teacher is the larger posttrain/tiny-2m-arithmetic-sft).
      vocab152k: posttrain/bench-vocab152k (89M parameters, 151,936-token tied LM head, random weights) is both
      student and teacher (two copies of the same weights, so the divergence starts at 0: this shape measures the
      work of a step, not learning);
    - the same rows in the same order: prompt/completion rows of posttrain/arithmetic:train (tiny) or
      posttrain/bench-lengths:train (vocab152k, prompts and completions of 16-1,024 tokens each, log-normal; only
      rows of at most --max-length tokens are used, so neither framework truncates), shuffled once here (seeded)
      and written to a JSONL file of exactly steps x examples-per-step rows. posttrain reads it with
      data.shuffle=false; TRL gets it as a datasets.Dataset with train_sampling_strategy="sequential" (GKD) or
      shuffle_dataset=False (DistillationTrainer);
    - the same tokens (lambda 0): the prompt as the tokenizer encodes it, the completion without special tokens,
      then EOS, right-padded per micro-batch; the loss on the completion + EOS targets only. posttrain tokenizes
      its own way (data.format=prompt_completion, completion_only_loss=true); TRL gets a collator written here
      that encodes the same way (GKD's own DataCollatorForChatML needs chat messages). Non-padding and target
      tokens per step are counted by both and checked against the parent's own count;
    - the same divergence: GKD's generalized JSD with beta = --beta (0: forward KL(teacher || student), the
      default; 1: reverse KL), posttrain loss.jsd_beta = --beta, summed over the step's target tokens and divided
      by their count (TRL passes num_items_in_batch over the accumulated micro-batches; posttrain normalizes by the
      step's target count), no SFT term (posttrain loss.nll_weight=0, TRL seq_kd=False);
    - the same optimization: torch's fused AdamW in both, --learning-rate constant, no warm-up, betas 0.9/0.999,
      eps 1e-8, no weight decay, clipping at 1.0, the same micro-batch size and accumulation, seed 0, fp32 on CPU,
      torch's default thread count in both (or --threads N in both); gradient checkpointing and bf16 (TRL's
      defaults) off;
    - the same bookkeeping: one metrics record per step, no progress bar, no evaluation during training, a
      checkpoint at the last step and a final model directory (posttrain OUTPUT/final, TRL save_model()).
    - lambda = 1: the same prompts; each samples --max-new-tokens tokens per prompt at --temperature (top-k 0,
      top-p 1) from the current student, once per optimizer step for all its micro-batches, and distils along the
      samples with the same beta.

What differs and cannot be matched
    - The teacher's distribution. TRL compares full-vocabulary logits; posttrain uses the teacher's top-k
      (loss.topk = --topk, renormalized on the top-k, loss.outside_topk=renormalize by default). GKDTrainer runs
      the teacher's and the student's full [B, T, V] logits through log-softmax (at 152k: 0.6 GB per 1,000
      positions, per copy); DistillationTrainer projects both heads chunk by chunk (on CPU at every completion
      position, padding included). posttrain's teacher keeps only
      [B, T, k] (with trainer.lm_head=auto, chunked at the target positions where the vocabulary is large). At the
      tiny shape, --topk 260 (the whole vocabulary) makes posttrain's loss the full forward KL, TRL's: a check that
      both compute the same thing. Measured (TRL 1.16, torch 2.13, 300 steps): the losses of steps 1-20 agree to
      1e-6, the first difference above 1e-3 is at step 64 (float rounding amplified by training, as in
      sft_vs_trl.py), and the held-out exact match ends alike (7.0% and 5.0% of 400); with the default top-16 it
      is 50% against TRL's 5%: the renormalized top-k loss, not the evaluation, makes that difference.
    - vocab152k's teacher is the student's own weights: the loss at step 1 is 0 and its gradient is float rounding
      (gradient norm 6e-8 in posttrain, 9e-9 in GKDTrainer, exactly 0 in DistillationTrainer), which AdamW's per-coordinate
      normalization turns into full-size steps wherever it is not exactly 0. So the students drift apart by
      noise and the losses after step 1 say nothing; the shape compares the work of a step.
    - The temperature at lambda = 0: GKDTrainer's temperature is for sampling only; its loss is always at
      temperature 1. posttrain applies loss.temperature to both distributions. So --temperature other than 1 is
      refused at lambda 0. DistillationTrainer (lambda 1) uses it for sampling and the loss, as posttrain does.
    - Sampling (lambda 1): different code and random streams, so the sampled completions, their lengths and the
      losses differ; the work per step is of the same size, not identical.
    - GKDTrainer at lmbda > 0 (--trl-trainer gkd) divides the divergence summed over the sampled tokens by the
      dataset's target count (transformers computes num_items_in_batch from the batch's labels before GKD replaces
      them with the samples), so its logged loss is scaled by sampled / dataset targets per step (about 2.2x at the
      tiny shape: 11.64 against DistillationTrainer's 5.26 at step 1); DistillationTrainer recounts.
    - posttrain's teacher.precompute (--precompute) scores the whole training set once before the first step and
      frees the teacher, so the teacher's cost leaves the step times (it stays in the wall time); TRL has no such
      mode. Off by default: then posttrain's teacher scores each micro-batch, as TRL's does.
    - TRL logs other metrics; posttrain logs top-k masses, top-1 agreement and the gradient norm.
    - posttrain turns on torch.use_deterministic_algorithms(True, warn_only=True); TRL leaves it off.

What is measured (each framework in its own fresh subprocess, one at a time; the order alternates between
repeats; medians over --repeats are reported; ratios are TRL / posttrain, so > 1 means posttrain is faster or
lighter)
    - seconds per step: the median and mean interval between consecutive step ends over steps --skip-steps + 1
      to the last (everything the framework does per step: collation, teacher scoring, sampling at lambda 1,
      forward/backward, optimizer, logging). Step ends: TRL's TrainerCallback.on_step_end; posttrain's
      RunLogger.log/advance (called once per step, after the optimizer step);
    - wall time of the whole training call (model and data loading, training, saving);
    - memory: peak RSS (VmHWM) of the worker, the baseline after imports and one model load, and the increase;
    - loss at step 1 and the last step (agreement at step 1 is a check at lambda 0 with --topk = vocabulary);
    - at the tiny shape, the student's held-out greedy exact match after the equal steps: both final models (and,
      for reference, the teacher and the untrained student) scored in one more fresh process by posttrain's own
      `posttrain eval --task arithmetic` (posttrain.algorithms.evaluate.run_eval), on --eval-examples held-out
      problems, so the metric is computed identically.

posttrain's on-policy distill (mode on_policy, lmbda) may not be built in the posttrain under test: its config
is then refused at load, and the report says so and gives TRL's numbers alone. Nothing is substituted for it.

Timing hygiene: run on an otherwise idle machine. With other processes busy on the same cores, torch's OpenMP
threads stall at random; the benchmark warns when the load average is high at the start and records it after
every run; --threads 1 avoids most stalls (both frameworks get the same setting).
"""

from __future__ import annotations

import argparse
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
SHAPES = {
    # name: (student, teacher, training rows, max_length, top-k, max_new_tokens, micro-batch, accumulation)
    "tiny": ("posttrain/tiny", "posttrain/tiny-arithmetic-sft", "posttrain/arithmetic:train", 32, 16, 8, 64, 1),
    # A real vocabulary and real lengths; rows of at most 1,024 tokens (93% of bench-lengths:train, median 301), one
    # per micro-batch, so that GKDTrainer's full [T, V] logits stay within a few GB.
    "vocab152k": ("posttrain/bench-vocab152k", "posttrain/bench-vocab152k", "posttrain/bench-lengths:train", 1024, 64,
                  64, 1, 4),
}
# The section of posttrain's distill config that holds on-policy sampling (max_new_tokens, temperature; its top_p 1
# and top_k 0 defaults are TRL's).
POSTTRAIN_SAMPLING_SECTION = "rollout"
CONFIG_REFUSED = "posttrain refused the config: "
LAST_N_LOSSES = 10
LOSS_TOLERANCE = 1e-3


# =========================================================================================================
# Workers: each runs in a fresh process, `distill_vs_trl.py --worker FRAMEWORK --spec SPEC.json`


def posttrain_tree(spec: dict[str, Any], model_cfg: dict[str, Any]) -> dict[str, Any]:
    """The posttrain distill config of the spec's job."""
    tree: dict[str, Any] = {
        "output_dir": spec["output_dir"],
        "seed": spec["seed"],
        "model": model_cfg,
        "teachers": [{"name_or_path": spec["teacher_dir"], "dtype": "float32", "precompute": spec["precompute"]}],
        "loss": {
            "jsd_beta": spec["beta"],
            "temperature": spec["temperature"],
            "topk": spec["topk"],
            "outside_topk": spec["outside_topk"],
            "nll_weight": 0.0,
        },
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
    if spec["lmbda"] > 0:
        tree["mode"] = "on_policy"
        tree["lmbda"] = spec["lmbda"]
        tree[POSTTRAIN_SAMPLING_SECTION] = {"max_new_tokens": spec["max_new_tokens"],
                                            "temperature": spec["temperature"]}
    return tree


def worker_posttrain(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    import posttrain
    from posttrain.algorithms.distill import train_distill
    from posttrain.config import ConfigError, load_config
    from posttrain.config.schema import DistillConfig, ModelConfig
    from posttrain.models.loading import load_causal_lm, load_tokenizer

    output_dir = Path(spec["output_dir"])
    if output_dir.exists():  # posttrain would resume from it
        raise FileExistsError(f"{output_dir} exists; every run needs a fresh directory")
    model_cfg = ModelConfig(name_or_path=spec["model_dir"], dtype="float32", attn_implementation="sdpa")
    try:
        cfg = load_config(DistillConfig, None, None, base=posttrain_tree(spec, model_cfg.model_dump()))
    except ConfigError as error:  # the parent reports a refused config (on-policy not built) and carries on
        print(CONFIG_REFUSED + " ".join(str(error).split()), file=sys.stderr, flush=True)
        raise
    baseline = _common.baseline_rss_mib(lambda: (load_causal_lm(model_cfg), load_tokenizer(model_cfg)))

    step_ends = _common.record_posttrain_step_ends()
    with _common.measured_run("posttrain", getattr(posttrain, "__version__", None), baseline) as measured:
        train_distill(cfg)

    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    by_step = {r["step"]: r for r in records if "loss" in r}
    steps = range(1, spec["steps"] + 1)

    def series(key: str) -> list[Any]:
        return [by_step.get(s, {}).get(key) for s in steps]

    return {
        **measured,
        "step_end_times": [step_ends.get(s) for s in steps],
        "losses": series("loss"),
        "target_tokens_per_step": [None if t is None else round(t) for t in series("target_tokens")],
        "tokens_per_step": [None if r.get("tokens_per_second") is None else round(r["tokens_per_second"] * r["step_seconds"])
                            for r in (by_step.get(s, {}) for s in steps)],
        "teacher_topk_mass": series("distill/teacher_topk_mass"),
        "top1_agreement": series("distill/top1_agreement"),
        "grad_norms": series("grad_norm"),
        "learning_rates": series("learning_rate"),
        "teacher_seconds": series("teacher_seconds"),
        # posttrain's own in-loop timer (collate + teacher + forward/backward + optimizer; no logging): reference.
        "in_loop_step_seconds": series("step_seconds"),
        "final_dir": str(output_dir / "final"),
    }


def encode_row(tokenizer: Any, row: dict[str, str]) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids + EOS) as both frameworks train on them: the prompt as the tokenizer encodes it,
    the completion without special tokens, then EOS."""
    prompt = list(tokenizer(row["prompt"])["input_ids"])
    completion = list(tokenizer(row["completion"], add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
    return prompt, completion


class PromptCompletionCollator:
    """GKDTrainer's inputs from prompt/completion rows, encoded as posttrain encodes them: input_ids and
    attention_mask right-padded, labels -100 outside the completion + EOS; prompts and prompt_attention_mask
    left-padded (GKD samples from them at lmbda > 0). Counts each batch's non-padding and target tokens."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.batch_tokens: list[int] = []
        self.batch_targets: list[int] = []

    def __call__(self, examples: list[dict[str, str]]) -> dict[str, Any]:
        import torch

        pad = self.tokenizer.pad_token_id
        encoded = [encode_row(self.tokenizer, e) for e in examples]
        width = max(len(p) + len(c) for p, c in encoded)
        prompt_width = max(len(p) for p, _ in encoded)
        input_ids = torch.full((len(encoded), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)
        labels = torch.full((len(encoded), width), -100, dtype=torch.long)
        prompts = torch.full((len(encoded), prompt_width), pad, dtype=torch.long)
        prompt_attention_mask = torch.zeros((len(encoded), prompt_width), dtype=torch.long)
        for row, (prompt, completion) in enumerate(encoded):
            ids = torch.tensor(prompt + completion)
            input_ids[row, : len(ids)] = ids
            attention_mask[row, : len(ids)] = 1
            labels[row, len(prompt) : len(ids)] = torch.tensor(completion)
            prompts[row, prompt_width - len(prompt) :] = torch.tensor(prompt)
            prompt_attention_mask[row, prompt_width - len(prompt) :] = 1
        self.batch_tokens.append(int(attention_mask.sum()))
        self.batch_targets.append(int((labels != -100).sum()))
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "prompts": prompts,
                "prompt_attention_mask": prompt_attention_mask}


def per_step(per_micro_batch: list[int], accumulation: int, steps: int) -> list[int | None]:
    return [sum(per_micro_batch[i * accumulation : (i + 1) * accumulation])
            if len(per_micro_batch) >= (i + 1) * accumulation else None for i in range(steps)]


def worker_trl(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DistillationConfig, DistillationTrainer
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    model_dir = spec["model_dir"]
    baseline = _common.trl_baseline_rss_mib(model_dir)
    output_dir = Path(spec["output_dir"])
    if output_dir.exists():
        raise FileExistsError(f"{output_dir} exists; every run needs a fresh directory")
    shared = {
        "output_dir": str(output_dir / "trainer"),
        "seed": spec["seed"],
        "beta": spec["beta"],
        "temperature": spec["temperature"],
        "disable_dropout": True,
        "dataloader_num_workers": 0,
        "dataloader_pin_memory": False,
        **_common.trl_fp32_cpu_args(GKDConfig if spec["trl_trainer"] == "gkd" else DistillationConfig),
        **_common.trl_optimization_and_bookkeeping(spec),
        "per_device_train_batch_size": spec["micro_batch_size"],
        "gradient_accumulation_steps": spec["accumulation"],
    }
    recorder = _common.trl_step_recorder("loss")
    collator = None
    with _common.measured_run("trl", trl.__version__, baseline) as measured:
        dataset = _common.jsonl_dataset(spec["train_file"])
        # The teacher is loaded here as TRL loads the student (float32, SDPA) and handed over as a model.
        teacher = AutoModelForCausalLM.from_pretrained(spec["teacher_dir"], dtype=torch.float32,
                                                       attn_implementation="sdpa")
        if spec["trl_trainer"] == "gkd":
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            args = GKDConfig(**shared, lmbda=spec["lmbda"], seq_kd=False, max_new_tokens=spec["max_new_tokens"],
                             max_length=spec["max_length"], packing=False, padding_free=False,
                             train_sampling_strategy="sequential", shuffle_dataset=False, use_liger_kernel=False)
            collator = PromptCompletionCollator(tokenizer)
            trainer = GKDTrainer(model=model_dir, teacher_model=teacher, args=args, data_collator=collator,
                                 train_dataset=dataset, processing_class=tokenizer, callbacks=[recorder])
        else:
            tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
            args = DistillationConfig(**shared, max_completion_length=spec["max_new_tokens"], top_k=0, top_p=1.0,
                                      shuffle_dataset=False)
            trainer = DistillationTrainer(model=model_dir, teacher_model=teacher, args=args,
                                          train_dataset=dataset.remove_columns(["completion"]),
                                          processing_class=tokenizer, callbacks=[recorder])
        _common.train_and_save_quietly(trainer, output_dir / "final")

    steps, accumulation = spec["steps"], spec["accumulation"]
    logs = {entry["step"]: entry for entry in recorder.logs}
    step_range = range(1, steps + 1)
    return {
        **measured,
        "trainer_class": type(trainer).__name__,
        "optimizer": type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__,
        "optim": str(args.optim),
        "gradient_checkpointing": bool(getattr(trainer.model, "is_gradient_checkpointing", False)),
        "param_dtype": str(next(trainer.model.parameters()).dtype),
        "teacher_dtype": str(next(trainer.teacher_model.parameters()).dtype),
        "train_sampler": type(trainer._get_train_sampler()).__name__,
        "step_end_times": recorder.step_ends,
        "tokens_per_step": per_step(collator.batch_tokens, accumulation, steps) if collator else [None] * steps,
        "target_tokens_per_step": (per_step(collator.batch_targets, accumulation, steps) if collator
                                   else [None] * steps),
        "losses": [logs.get(s, {}).get("loss") for s in step_range],
        "grad_norms": [logs.get(s, {}).get("grad_norm") for s in step_range],
        "learning_rates": [logs.get(s, {}).get("learning_rate") for s in step_range],
        "in_loop_step_seconds": [b - a for a, b in zip(recorder.step_begins, recorder.step_ends)],
        "final_dir": str(output_dir / "final"),
    }


def worker_eval(spec: dict[str, Any]) -> dict[str, Any]:
    """posttrain eval --task arithmetic on each model of the spec (greedy exact match on held-out problems)."""
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    from posttrain.algorithms.evaluate import run_eval
    from posttrain.config.schema import EvalConfig

    scores = {}
    for label, model_dir in spec["models"].items():
        cfg = EvalConfig(model={"name_or_path": model_dir}, task="arithmetic", num_examples=spec["num_examples"],
                         seed=spec["seed"])
        result = run_eval(cfg)
        scores[label] = {"accuracy": result.accuracy, "num_examples": result.num_examples,
                         "mean_response_tokens": result.mean_response_tokens, "samples": result.samples[:3]}
    return {"scores": scores}


WORKERS = {"posttrain": worker_posttrain, "trl": worker_trl, "eval": worker_eval}


def run_as_worker(framework: str, spec_path: str, result_path: str) -> None:
    _common.apply_offline_env()
    result = WORKERS[framework](_common.load_spec(spec_path))
    _common.write_json(Path(result_path), result)


# =========================================================================================================
# Parent: prepare the rows, run the workers, summarize


def prepare_rows(work_dir: Path, dataset: str, num_rows: int, seed: int, tokenizer: Any, max_length: int
                 ) -> tuple[Path, list[tuple[list[int], list[int]]]]:
    """The training file (rows that fit max_length, seeded order) and each row's (prompt, completion + EOS) ids."""
    train_file = _common.write_prompt_completion_rows(
        work_dir, dataset, num_rows, seed, "distill_vs_trl",
        keep=lambda row: sum(map(len, encode_row(tokenizer, row))) <= max_length)
    encoded = [encode_row(tokenizer, json.loads(line)) for line in train_file.read_text().splitlines()]
    return train_file, encoded


def summarize_run(result: dict[str, Any], skip: int, steps: int) -> dict[str, Any]:
    times = result["step_end_times"]
    if len(times) != steps or any(t is None for t in times):
        raise RuntimeError(f"{result['framework']}: {len(times)} step end times for {steps} steps (the step-end "
                           "instrumentation no longer matches the framework's code)")
    losses = [v for v in result["losses"] if v is not None]
    peak, base = result["peak_rss_mib"], result["baseline_rss_mib"]
    return {
        **_common.steady_state_step_seconds(times, skip),
        "wall_seconds": result["wall_seconds"],
        "peak_rss_mib": peak,
        "baseline_rss_mib": base,
        "peak_increase_mib": peak - base if peak is not None and base is not None else None,
        "first_loss": result["losses"][0],
        "final_loss": result["losses"][-1],
        "mean_last_losses": statistics.fmean(losses[-LAST_N_LOSSES:]) if losses else None,
        "torch_threads": result["torch_threads"],
    }


ROWS = [
    # (label, key, digits, ratio meaning)
    ("Median seconds per step (step end to step end)", "median_step_seconds", 4, "> 1: posttrain faster"),
    ("Mean seconds per step, steady state", "mean_step_seconds", 4, "> 1: posttrain faster"),
    ("Wall time of the training call (s)", "wall_seconds", 2, "> 1: posttrain faster"),
    ("Peak RSS, VmHWM (MiB)", "peak_rss_mib", 0, "> 1: posttrain less"),
    ("Peak RSS increase over baseline (MiB)", "peak_increase_mib", 1, "> 1: posttrain less"),
    ("Baseline RSS after imports + model load (MiB)", "baseline_rss_mib", 0, ""),
    ("Loss at step 1", "first_loss", 4, ""),
    ("Loss at the last step", "final_loss", 4, ""),
    (f"Mean loss, last {LAST_N_LOSSES} steps", "mean_last_losses", 4, ""),
]
SPEED_GOAL, MEMORY_GOAL = 1.5, 0.8  # posttrain >= 1.5x TRL's speed at <= 0.8x its peak RSS


def report(runs: dict[str, list[dict[str, Any]]], raw: dict[str, list[dict[str, Any]]], refused: str | None,
           expected: dict[str, list[int]] | None, scores: dict[str, Any] | None, full_vocabulary: bool
           ) -> tuple[str, dict[str, Any]]:
    medians = {fw: ({key: _common.median(r[key] for r in runs[fw]) for _, key, _, _ in ROWS} if runs[fw] else None)
               for fw in FRAMEWORKS}
    posttrain, trl = medians["posttrain"] or {}, medians["trl"] or {}
    table_rows = []
    for label, key, digits, meaning in ROWS:
        a, b = posttrain.get(key), trl.get(key)
        ratio = "" if key in ("first_loss", "final_loss", "mean_last_losses") else _common.fmt(_common.ratio(b, a), 3)
        table_rows.append([label, "not run" if refused else _common.fmt(a, digits), _common.fmt(b, digits), ratio,
                           meaning])
    if scores:
        table_rows.append(["Held-out greedy exact match (median)",
                           "not run" if refused else _common.fmt(_common.median(s["posttrain"] for s in scores["runs"]), 3),
                           _common.fmt(_common.median(s["trl"] for s in scores["runs"]), 3), "", "same eval for both"])
    table = _common.markdown_table(["Metric (median)", "posttrain", "TRL", "TRL/posttrain", ""], table_rows)

    notes = []
    if refused:
        notes.append(f"posttrain NOT MEASURED: its config was refused at load ({refused}). TRL's numbers alone.")
    speed = _common.ratio(trl.get("median_step_seconds"), posttrain.get("median_step_seconds"))
    memory = _common.ratio(posttrain.get("peak_rss_mib"), trl.get("peak_rss_mib"))
    if speed is not None and memory is not None:
        met = speed >= SPEED_GOAL and memory <= MEMORY_GOAL
        notes.append(f"goal (>= {SPEED_GOAL}x TRL's speed at <= {MEMORY_GOAL}x its peak RSS): speed {speed:.2f}x, "
                     f"peak RSS {memory:.2f}x: {'met' if met else 'NOT met'} on the medians")
    agreement = []  # per repeat: |loss difference| at step 1, and the largest over all steps
    for pt, tr in zip(raw["posttrain"], raw["trl"]):
        diffs = [abs(a - b) for a, b in zip(pt["losses"], tr["losses"]) if a is not None and b is not None]
        if diffs and pt["losses"][0] is not None and tr["losses"][0] is not None:
            agreement.append({"step1": abs(pt["losses"][0] - tr["losses"][0]), "max": max(diffs),
                              "first_over_tolerance": next((i + 1 for i, d in enumerate(diffs) if d > LOSS_TOLERANCE),
                                                           None)})
    if agreement and expected is not None:  # at lambda 1 the two distil different samples
        notes.append(f"|loss(posttrain) - loss(TRL)| per repeat, at step 1 / largest over the steps / first step over "
                     f"{LOSS_TOLERANCE:g}: "
                     + ", ".join(f"{a['step1']:.1e} / {a['max']:.1e} / {a['first_over_tolerance'] or 'none'}"
                                 for a in agreement)
                     + (" (the same loss: posttrain's top-k is the whole vocabulary)" if full_vocabulary else
                        " (not the same loss: posttrain's top-k is not the whole vocabulary; --topk V makes it so)"))
    if expected is not None:
        checks = []
        for fw in FRAMEWORKS:
            for key, label in (("tokens_per_step", "non-padding tokens"), ("target_tokens_per_step", "target tokens")):
                if raw[fw]:
                    same = all(r[key] == expected[key] for r in raw[fw])
                    checks.append(f"{fw} {label} {'yes' if same else 'NO'}")
        notes.append("tokens per step as the parent counts them: " + ", ".join(checks))
    if scores:
        reference = scores["reference"]
        notes.append("held-out exact match per repeat: " + "; ".join(
            f"posttrain {_common.fmt(s['posttrain'], 3)}, TRL {_common.fmt(s['trl'], 3)}" for s in scores["runs"])
            + f" (teacher {_common.fmt(reference.get('teacher'), 3)}, untrained student "
            f"{_common.fmt(reference.get('student_start'), 3)}; {scores['num_examples']} problems)")
    if raw["trl"]:
        t = raw["trl"][0]
        notes.append(f"TRL trainer {t['trainer_class']}, optimizer {t['optimizer']} (optim={t['optim']}), gradient "
                     f"checkpointing {t['gradient_checkpointing']}, weights {t['param_dtype']} / teacher "
                     f"{t['teacher_dtype']}, sampler {t['train_sampler']}")
    threads = {fw: sorted({r["torch_threads"] for r in runs[fw]}) for fw in FRAMEWORKS}
    notes.append(f"torch threads: posttrain {threads['posttrain']}, TRL {threads['trl']}; 1-minute load average at the "
                 "end of each run: " + "; ".join(
                     f"{fw} {', '.join(_common.fmt((r.get('loadavg_at_end') or [None])[0]) for r in raw[fw])}"
                     for fw in FRAMEWORKS if raw[fw]))
    text = f"{table}\n\n" + "\n".join(f"- {n}" for n in notes)
    summary = {
        "medians": medians,
        "ratios_trl_over_posttrain": {key: _common.ratio(trl.get(key), posttrain.get(key)) for _, key, _, _ in ROWS},
        "speed_ratio": speed,
        "peak_rss_ratio_posttrain_over_trl": memory,
        "posttrain_refused": refused,
        "loss_diff_per_repeat": agreement,
        "heldout": scores,
        "torch_threads": threads,
    }
    return text, summary


def refusal(log_path: Path) -> str | None:
    """The config error a posttrain worker printed before failing, or None when it failed otherwise."""
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith(CONFIG_REFUSED):
            return line[len(CONFIG_REFUSED):]
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lmbda", type=float, choices=[0.0, 1.0], default=0.0,
                        help="fraction of on-policy batches: 0 distils the dataset's completions (default), 1 the "
                             "student's own samples")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny",
                        help="tiny: posttrain/tiny learns from posttrain/tiny-arithmetic-sft on arithmetic; vocab152k: "
                             "posttrain/bench-vocab152k from a copy of itself on posttrain/bench-lengths")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 300 tiny, 4 vocab152k)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per framework; medians are reported (default 2)")
    parser.add_argument("--skip-steps", type=int, default=None, help="warm-up steps left out of the step times "
                        "(default 5 tiny, 1 vocab152k)")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="examples per micro-batch (default 64 tiny, "
                        "1 vocab152k)")
    parser.add_argument("--accumulation", type=int, default=None, help="micro-batches per step (default 1 tiny, "
                        "4 vocab152k)")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="constant learning rate (default 1e-3)")
    parser.add_argument("--beta", type=float, default=0.0,
                        help="GKD's generalized-JSD beta (posttrain loss.jsd_beta): 0 forward KL (default), 1 reverse")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="sampling temperature at lambda 1, and the loss's (default 1; must be 1 at lambda 0)")
    parser.add_argument("--topk", type=int, default=None,
                        help="posttrain loss.topk (default 16 tiny as the distill_kd_arithmetic preset, 64 vocab152k)")
    parser.add_argument("--outside-topk", choices=["renormalize", "zero_outside", "tail"], default="renormalize",
                        help="posttrain loss.outside_topk (default renormalize)")
    parser.add_argument("--precompute", action="store_true",
                        help="posttrain teacher.precompute=true: the teacher scores the training set before step 1")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="tokens sampled per prompt at lambda 1 (default 8 tiny, 64 vocab152k)")
    parser.add_argument("--max-length", type=int, default=None,
                        help="longest row used, in tokens (default 32 tiny, 1024 vocab152k); longer rows are left out")
    parser.add_argument("--trl-trainer", choices=["auto", "gkd", "distillation"], default="auto",
                        help="TRL trainer: auto = GKDTrainer at lambda 0, DistillationTrainer at lambda 1")
    parser.add_argument("--eval-examples", type=int, default=400,
                        help="held-out problems for the exact match (tiny shape; 0: no evaluation; default 400)")
    _common.add_posttrain_trainer_flags(parser, compile_flag=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads in both workers (default: torch's default, the same in both)")
    parser.add_argument("--trl-optim", default=None,
                        help="TRL optim name (default: TRL's default, adamw_torch_fused, as posttrain's)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds allowed per worker run (default 3600)")
    parser.add_argument("--json", type=Path, default=None, help="write every raw number to this JSON file")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directories, specs and worker logs here")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        run_as_worker(args.worker, args.spec, args.result)
        return 0
    student, teacher, dataset, default_length, default_topk, default_new, default_micro, default_accumulation = (
        SHAPES[args.shape])
    tiny = args.shape == "tiny"
    args.steps = args.steps or (300 if tiny else 4)
    args.skip_steps = args.skip_steps or (5 if tiny else 1)
    args.micro_batch_size = args.micro_batch_size or default_micro
    args.accumulation = args.accumulation or default_accumulation
    args.topk = args.topk or default_topk
    args.max_new_tokens = args.max_new_tokens or default_new
    args.max_length = args.max_length or default_length
    if args.trl_trainer == "auto":
        args.trl_trainer = "gkd" if args.lmbda == 0 else "distillation"
    if args.steps < args.skip_steps + 2:
        parser.error(f"--steps must be at least --skip-steps + 2 = {args.skip_steps + 2}")
    if args.repeats < 1 or args.skip_steps < 1:
        parser.error("--repeats and --skip-steps must be at least 1")
    if args.lmbda == 0 and args.temperature != 1.0:
        parser.error("--temperature must be 1 at --lmbda 0: GKDTrainer's loss is always at temperature 1")
    if args.lmbda > 0 and args.precompute:
        parser.error("--precompute scores the dataset's completions once; at --lmbda 1 the teacher scores the "
                     "student's new samples every step")
    if args.lmbda == 0 and args.trl_trainer == "distillation":
        parser.error("--trl-trainer distillation is on-policy only (lambda 1); GKDTrainer distils at lambda 0")
    missing = [name for name, v in _common.package_versions(["trl", "accelerate"]).items() if v is None]
    if missing:
        parser.error(f"missing {', '.join(missing)}: pip install 'trl>=1.0' (or the project's bench extra)")

    _common.apply_offline_env()
    from posttrain.models.loading import resolve_model_path
    from transformers import AutoTokenizer

    versions, machine = _common.announce_environment()
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="distill_vs_trl.", dir=args.keep))
    script = str(Path(__file__).resolve())
    started = time.perf_counter()
    result_report: dict[str, Any] = {
        "benchmark": "distill_vs_trl",
        "argv": sys.argv,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("worker", "spec", "result")},
        "versions": versions,
        "machine": machine,
    }
    examples_per_step = args.micro_batch_size * args.accumulation
    try:
        student_dir, teacher_dir = resolve_model_path(student), resolve_model_path(teacher)  # built once, here
        tokenizer = AutoTokenizer.from_pretrained(student_dir)
        train_file, encoded = prepare_rows(work_dir, dataset, args.steps * examples_per_step, args.seed, tokenizer,
                                           args.max_length)
        expected = None
        if args.lmbda == 0:
            groups = [encoded[i * examples_per_step : (i + 1) * examples_per_step] for i in range(args.steps)]
            expected = {"tokens_per_step": [sum(len(p) + len(c) for p, c in g) for g in groups],
                        "target_tokens_per_step": [sum(len(c) for _, c in g) for g in groups]}
        raw: dict[str, list[dict[str, Any]]] = {fw: [] for fw in FRAMEWORKS}
        runs: dict[str, list[dict[str, Any]]] = {fw: [] for fw in FRAMEWORKS}
        refused = None
        for repeat, order in enumerate(_common.alternating_orders(FRAMEWORKS, args.repeats)):
            for framework in order:
                if framework == "posttrain" and refused:
                    continue
                name = f"{framework}-{repeat}"
                spec = {
                    "framework": framework, "model_dir": student_dir, "teacher_dir": teacher_dir,
                    "train_file": str(train_file), "output_dir": str(work_dir / name), "steps": args.steps,
                    "micro_batch_size": args.micro_batch_size, "accumulation": args.accumulation,
                    "learning_rate": args.learning_rate, "lmbda": args.lmbda, "beta": args.beta,
                    "temperature": args.temperature, "topk": args.topk, "outside_topk": args.outside_topk,
                    "precompute": args.precompute, "max_new_tokens": args.max_new_tokens,
                    "max_length": args.max_length, "trl_trainer": args.trl_trainer, "seed": args.seed,
                    "threads": args.threads, "trl_optim": args.trl_optim, "lm_head": args.lm_head,
                    "packing": args.packing, "compile": args.compile, "lm_head_chunk_size": args.lm_head_chunk_size,
                }
                spec_path, result_path, log_path = (work_dir / f"{name}.{suffix}" for suffix in
                                                    ("spec.json", "result.json", "log"))
                _common.write_json(spec_path, spec)
                print(f"repeat {repeat + 1}/{args.repeats}: {framework} ...", end=" ", flush=True)
                try:
                    result = _common.run_worker(
                        [script, "--worker", framework, "--spec", str(spec_path), "--result", str(result_path)],
                        result_path, log_path, args.timeout)
                except _common.WorkerError:
                    refused = refusal(log_path) if framework == "posttrain" else None
                    if refused is None:
                        raise
                    print(f"config refused: {refused}")
                    continue
                summary = summarize_run(result, args.skip_steps, args.steps)
                print(f"{summary['median_step_seconds']:.4f} s/step (median), wall {summary['wall_seconds']:.1f}s, "
                      f"peak {summary['peak_rss_mib']:.0f} MiB, loss {_common.fmt(summary['first_loss'], 4)} -> "
                      f"{_common.fmt(summary['final_loss'], 4)}")
                raw[framework].append({**result, "repeat": repeat, "order": order.index(framework)})
                runs[framework].append(summary)

        scores = None
        if tiny and args.eval_examples > 0:
            models = {"teacher": teacher_dir, "student_start": student_dir}
            for fw in FRAMEWORKS:
                for r in raw[fw]:
                    models[f"{fw}-{r['repeat']}"] = r["final_dir"]
            spec_path, result_path = work_dir / "eval.spec.json", work_dir / "eval.result.json"
            _common.write_json(spec_path, {"models": models, "num_examples": args.eval_examples, "seed": args.seed,
                                           "threads": args.threads})
            print(f"held-out exact match of {len(models)} models ...", end=" ", flush=True)
            evaluated = _common.run_worker([script, "--worker", "eval", "--spec", str(spec_path), "--result",
                                            str(result_path)], result_path, work_dir / "eval.log", args.timeout)
            accuracy = {label: s["accuracy"] for label, s in evaluated["scores"].items()}
            print(", ".join(f"{label} {value:.3f}" for label, value in accuracy.items()))
            scores = {"num_examples": args.eval_examples,
                      "reference": {k: accuracy[k] for k in ("teacher", "student_start")},
                      "runs": [{fw: accuracy.get(f"{fw}-{repeat}") for fw in FRAMEWORKS} for repeat in range(args.repeats)],
                      "details": evaluated["scores"]}
        vocabulary = json.loads((Path(student_dir) / "config.json").read_text())["vocab_size"]
        text, summary = report(runs, raw, refused, expected, scores, args.topk >= vocabulary)
        result_report.update({"student_dir": student_dir, "teacher_dir": teacher_dir, "expected": expected,
                              "summary": summary, "runs": runs, "raw": raw})
    finally:
        if not args.keep:
            shutil.rmtree(work_dir, ignore_errors=True)
    total = time.perf_counter() - started
    result_report["benchmark_seconds"] = total

    form = "off-policy (lambda 0)" if args.lmbda == 0 else f"on-policy (lambda 1, {args.max_new_tokens} new tokens)"
    trl_name = "GKDTrainer" if args.trl_trainer == "gkd" else "DistillationTrainer"
    print()
    print(f"## posttrain distill vs TRL {versions['trl']} {trl_name}, {form} (torch {versions['torch']}, "
          f"transformers {versions['transformers']})")
    print()
    print(f"Student {student}, teacher {teacher}, {dataset} rows of <= {args.max_length} tokens in order, "
          f"{examples_per_step} per step ({args.micro_batch_size} x {args.accumulation}), JSD beta {args.beta}, "
          f"temperature {args.temperature}, posttrain top-{args.topk} ({args.outside_topk}"
          f"{', precomputed' if args.precompute else ''}) against TRL's full vocabulary, lr {args.learning_rate} "
          f"constant, fp32 on CPU, {args.steps} steps, step times over steps {args.skip_steps + 1}-{args.steps}, "
          f"medians of {args.repeats} repeat(s), order alternating, posttrain trainer.lm_head={args.lm_head}. "
          "Ratios are TRL/posttrain.")
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
