"""posttrain DPO vs TRL's DPOTrainer: seconds per step, wall time, peak memory and loss on the same job.

Run (CPU, offline; needs the bench extra: pip install 'trl>=1.0', which brings accelerate):

    .venv/bin/python benchmarks/dpo_vs_trl.py     # 150 steps x 3 repeats: expected 2-3 minutes on 2 idle cores
    .venv/bin/python benchmarks/dpo_vs_trl.py --steps 5 --skip-steps 2 --repeats 1   # quick check
    .venv/bin/python benchmarks/dpo_vs_trl.py --shape vocab152k --steps 6 --skip-steps 2 --repeats 2 \
        --pairs-per-step 4 --accumulation 2 --threads 2     # a 151,936-token vocabulary, pairs of 16-1,024 tokens

What is compared
    posttrain.algorithms.dpo.train_dpo against trl.DPOTrainer(...).train(), on the same job:
    - the same model directory: the embedded tiny Llama after SFT on arithmetic (posttrain/tiny-arithmetic-sft,
      the starting point of posttrain's dpo_arithmetic preset), resolved once here with
      posttrain.models.loading.resolve_model_path, so its one-time build on first use (~2 minutes) happens
      before any worker starts and is not measured; loaded in float32 with SDPA attention by both, once as
      the policy and once more as the frozen reference; --model picks another directory or name;
    - the same pairs, in the same order: the prompt/chosen/rejected rows of posttrain/arithmetic-preference:train
      (a split stored in a seeded random order), the first steps x pairs-per-step of them, written once to a
      JSONL file. posttrain reads it with data.shuffle=false (its EpochSampler walks it in order); TRL gets
      it as a datasets.Dataset with train_sampling_strategy="sequential" (a SequentialSampler; the sampler
      TRL built is recorded). The file holds exactly one epoch of the run, so neither wraps around;
    - the same tokens: both encode the prompt as the tokenizer does (with its special tokens; the tiny
      byte-level tokenizer adds none) and each completion without special tokens, followed by EOS. TRL
      appends the EOS string to the completion text and encodes prompt + completion in one call, then
      splits at the common prefix with the prompt's ids; with a byte-level vocabulary and the EOS string
      parsed as its special token, that gives the same ids. This is checked, not assumed: each worker
      records every batch it trains on (token ids, completion mask, attention mask: chosen rows first,
      then the rejected rows of the same pairs, right-padded to the longest row, pad id <|pad|>), and the
      parent compares them, step by step, with its own encoding of the file (prompt ids + completion ids
      + EOS). data.max_length / max_length is 32 in both; the pairs are at most 10 tokens, so neither
      framework's truncation (posttrain cuts the completions and keeps the prompt, TRL keeps the start)
      can trigger; the parent checks that too;
    - the same loss: plain sigmoid DPO, -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), beta 0.1,
      with completion log-probabilities summed over the completion tokens (EOS included), averaged over
      the pairs of the optimizer step (posttrain loss.type=dpo, loss.sft_weight=0, average_logprobs=false,
      label_smoothing 0; TRL loss_type=["sigmoid"], no loss weights, label_smoothing 0,
      f_divergence_type="reverse_kl", use_weighting=False, ld_alpha=None). With accumulation > 1, posttrain
      divides each micro-batch's summed loss by the step's pair count and TRL divides each micro-batch mean
      by the accumulation count: the same for equal micro-batches;
    - the same reference: a second copy of the starting model, loaded from the same directory, scoring every
      batch in eval mode under torch.no_grad (posttrain reference=frozen_copy, which also sets
      requires_grad=False on it; TRL ref_model=None, which loads the copy, precompute_ref_log_probs=False,
      sync_ref_model=False; its copy keeps requires_grad=True but never enters a backward pass). Neither
      precomputes anything before step 1. At step 1 policy and reference are the same weights, so both
      losses must be log 2 = 0.693147 (checked to 1e-5), and the two frameworks' losses must agree over the
      first 5 steps (checked to 1e-4): the report starts with a warning otherwise;
    - the same optimization: torch's fused AdamW in both (posttrain's build_optimizer; TRL's default
      optim="adamw_torch_fused"), lr 2e-4 (the dpo_arithmetic preset's peak) constant, no warm-up, betas
      0.9/0.999, eps 1e-8, no weight decay, gradient clipping at 1.0, 32 pairs per optimizer step in one
      micro-batch (posttrain trainer.micro_batch_size=32, gradient_accumulation_steps=1; TRL
      per_device_train_batch_size=32, gradient_accumulation_steps=1), seed 0, fp32 on CPU, torch's default
      thread count in both (or --threads N in both). TRL defaults that would differ are turned off:
      gradient_checkpointing=False, bf16=False, padding_free=False, activation_offloading=False,
      use_liger_kernel=False, pad_to_multiple_of=None;
    - the same bookkeeping: one metrics record per step (posttrain metrics.jsonl, TRL logging_steps=1), no
      progress bar, no evaluation (posttrain data.eval_files=[], TRL eval_strategy="no"), no tracker (TRL
      report_to="none"); a resumable checkpoint at the last step (posttrain always writes one, also with
      trainer.save_every=0; TRL save_steps=steps, plus a model card beside it) and a final model directory
      (posttrain OUTPUT/final, TRL save_model()). posttrain's end-of-run plot (logging.plot) is turned off.

What is measured (each framework in its own fresh subprocess, one at a time; the order alternates
between repeats; medians over --repeats are reported; ratios are TRL / posttrain, so > 1 means posttrain is
faster or lighter)
    - seconds per step: the median, and the mean, of the intervals between consecutive step ends over the
      steady state (steps --skip-steps + 1 to the last). A step's time includes everything the framework
      does per step: collation, the reference forward, the policy forward/backward, clipping, the optimizer
      step, the scheduler and the per-step logging. Step ends are taken in TRL from a TrainerCallback's
      on_step_end, in posttrain by wrapping RunLogger.log/advance (called once per step, right after the
      optimizer step), in this benchmark process only. The work per step is fixed (the same padded
      batches in both), so the pairs per second follow from it;
    - wall time of the whole training call: posttrain train_dpo(cfg); TRL DPOTrainer(...) construction
      (policy and reference model loads, dataset tokenization) + train() + save_model(). Both include
      reading and tokenizing the pairs, loading both models, training, and writing the checkpoint and the
      final model;
    - memory: peak resident set size of the worker process (VmHWM) at the end; and separately the baseline
      RSS after the framework's imports and one model + tokenizer load (then freed), and the peak's increase
      over that baseline (VmHWM is reset to the current RSS just before the training call when the kernel
      allows it);
    - loss agreement (a correctness check, not a comparison): the loss of step 1 (log 2 in both), of the
      last step and the mean over the last 10 steps; per repeat, the largest per-step loss difference
      between the two frameworks over the first 5 steps and over the whole run, and the first step where
      they differ by more than 1e-3; also the largest difference of the mean reward margin and the
      relative difference of the pre-clip gradient norm at step 1 (the same gradient, computed twice).
      Measured in the quick check (5 steps, TRL 1.16, transformers 5.24, torch 2.13): both step-1 losses
      are log 2 to 2e-9 and equal to each other, the step-1 gradient norms agree to 4e-7 (relative), and
      the losses of steps 1-5 to 7e-6 (the largest difference at a step whose gradient norm, ~19 before
      clipping, amplifies float rounding differences). Agreement over a full run is in the report.

Known remaining differences (not removed)
    - The forward pass: TRL computes the per-token log-probabilities through its fused LM head (in chunks,
      never the full logits; given the labels, for the policy and the reference, at every position) and,
      every step, also the per-token entropy, the mean logits and top-1 accuracy of the chosen tokens for
      its logged metrics. posttrain with trainer.lm_head=auto computes the full logits and their log-softmax
      where they are small (the tiny shape), and at the vocab152k shape runs the LM head in chunks on the
      completion tokens only (prompt positions never reach it); it passes explicit position ids. Per-step
      losses therefore agree closely but not bit for bit, and the difference may grow over training.
    - Logged metrics differ: TRL logs log-probabilities, logits, entropy, token accuracy and token counts;
      posttrain logs rewards, margin, reward accuracy, gradient norm and throughput. Both log the loss, the
      implicit rewards' mean margin and accuracy, the pre-clip gradient norm and the learning rate the step
      used (compared step by step in the report).
    - Learning-rate schedule: for anything but constant without warm-up (the default, where TRL's own
      schedule is identical), TRL is given posttrain's schedule (posttrain.optim.lr_multiplier, through
      DPOTrainer.create_scheduler), because transformers' warm-up gives the first update lr 0 and its
      decays end a step short of 0; nothing else of TRL's is replaced.
    - Tokenization path: TRL tokenizes the dataset with datasets.map at construction (prompt + completion
      in one call, then the split at the common prefix); posttrain encodes prompt and completions
      separately. Same ids here (checked), not in general: with a BPE vocabulary, tokens can merge across
      the prompt/completion boundary in TRL's encoding.
    - posttrain turns on torch.use_deterministic_algorithms(True, warn_only=True); TRL leaves it off.
    - The baseline memory differs because the imports differ (TRL brings in datasets and accelerate);
      compare the increase over the baseline for the training itself.
    - The default job is tiny (a ~1M-parameter model, 64 sequences of at most 10 tokens per step, scored
      by two models), so per-step framework overhead weighs heavily; the numbers say little about large
      models, where the kernels dominate.

Timing hygiene: run on an otherwise idle machine. With other processes busy on the same cores, torch's
OpenMP threads (2 on a 2-core machine) stall for seconds at a time, in either framework at random, making
single steps many times slower; the benchmark prints a warning when the load average is high at the start
and records it after every run. The median step time is robust to a few such stalls; --threads 1 avoids
them almost entirely (both frameworks get the same setting).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

FRAMEWORKS = ("posttrain", "trl")
DATASET = "posttrain/arithmetic-preference:train"
MODEL = "posttrain/tiny-arithmetic-sft"
SHAPES = {
    # name: (model, pairs, max_length)
    "tiny": (MODEL, DATASET, 32),
    # A real vocabulary and real lengths: the 151,936-token LM head of Qwen2.5 on a 4-layer, 89M-parameter random
    # model; prompts, chosen and rejected replies of 16-1,024 tokens each (log-normal, median ~128), so a row of
    # prompt + reply is at most 2,049 tokens with its EOS.
    "vocab152k": ("posttrain/bench-vocab152k", "posttrain/bench-lengths-preference:train", 2049),
}
LAST_N_LOSSES = 10
FIRST_N_LOSSES = 5
LOSS_TOLERANCE = 1e-3
STEP1_TOLERANCE = 1e-5  # |loss at step 1 - log 2|: policy and reference are the same weights
FIRST_STEPS_TOLERANCE = 1e-4  # |loss(posttrain) - loss(TRL)| over the first FIRST_N_LOSSES steps
LOG2 = math.log(2.0)


def batch_rows(input_ids: list[list[int]], completion_mask: list[list[int]], attention_mask: list[list[int]]
               ) -> list[list[list[int]]]:
    """The rows of a padded batch without their padding: [[token ids], [completion mask]] per row, in order."""
    rows = []
    for ids, completion, attention in zip(input_ids, completion_mask, attention_mask, strict=True):
        n = sum(attention)
        if any(attention[n:]) or not all(attention[:n]):
            raise ValueError("expected right padding (attention mask ones, then zeros)")
        rows.append([list(ids[:n]), [int(c) for c in completion[:n]]])
    return rows


def shared_prompt_rows(input_ids: list[list[int]], segments: list[list[int]]) -> list[list[list[int]]]:
    """A shared-prompt batch (one row per pair: prompt, chosen, rejected) as the rows of the two-row layout:
    [[prompt + chosen ids], [completion mask]] for every pair, then the same for prompt + rejected."""
    from posttrain.data.types import CHOSEN, PROMPT, REJECTED

    halves: dict[int, list[list[list[int]]]] = {CHOSEN: [], REJECTED: []}
    for ids, labels in zip(input_ids, segments, strict=True):
        prompt = [t for t, s in zip(ids, labels) if s == PROMPT]
        for which, rows in halves.items():
            completion = [t for t, s in zip(ids, labels) if s == which]
            rows.append([prompt + completion, [0] * len(prompt) + [1] * len(completion)])
    return halves[CHOSEN] + halves[REJECTED]


def per_step(per_micro_batch: Sequence[int], accumulation: int, steps: int, reduce=sum) -> list[int | None]:
    """`reduce` over each optimizer step's micro-batch values (sum or max); None for a step not seen whole."""
    return [reduce(per_micro_batch[i * accumulation : (i + 1) * accumulation])
            if len(per_micro_batch) >= (i + 1) * accumulation else None for i in range(steps)]


def step_fingerprints(micro_batches: list[list[list[list[int]]]], accumulation: int, steps: int) -> list[str | None]:
    """A digest of the unpadded rows of each optimizer step's micro-batches (None for steps not seen)."""
    digests: list[str | None] = []
    for step in range(steps):
        group = micro_batches[step * accumulation : (step + 1) * accumulation]
        if len(group) < accumulation:
            digests.append(None)
            continue
        digests.append(hashlib.sha256(json.dumps(group, separators=(",", ":")).encode()).hexdigest())
    return digests


# =========================================================================================================
# Workers: each runs in a fresh process, `dpo_vs_trl.py --worker FRAMEWORK --spec SPEC.json`


def worker_posttrain(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    import posttrain
    import posttrain.data.preference
    from posttrain.algorithms.dpo import train_dpo
    from posttrain.config import load_config
    from posttrain.config.schema import DPOConfig, ModelConfig
    from posttrain.data.types import SharedPromptBatch
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
            "train_files": [spec["pairs_file"]],
            "eval_files": [],
            "format": "preference",
            "max_length": spec["max_length"],
            "overlong": "truncate",
            "packing": False,
            "shuffle": False,
        },
        "loss": {
            "type": "dpo",
            "beta": spec["beta"],
            "label_smoothing": 0.0,
            "sft_weight": 0.0,
            "average_logprobs": False,
        },
        "reference": "frozen_copy",
        "share_prompt": spec["share_prompt"],
        "trainer": {
            "max_steps": spec["steps"],
            "learning_rate": spec["learning_rate"],
            "lr_scheduler": spec["lr_scheduler"],
            "warmup_steps": spec["warmup_steps"],
            "min_lr_ratio": 0.0,
            "weight_decay": 0.0,
            "adam_beta1": 0.9,
            "adam_beta2": 0.999,
            "adam_epsilon": 1e-8,
            "max_grad_norm": 1.0,
            "micro_batch_size": spec["micro_batch_size"],
            "gradient_accumulation_steps": spec["accumulation"],
            "precision": "fp32",
            "log_every": 1,
            "eval_every": 0,
            "save_every": 0,  # still saves at the last step
            "keep_last": 1,
            "num_threads": spec["threads"],
            "lm_head": spec.get("lm_head", "auto"),
            "packing": spec.get("packing", False),
            "compile": spec.get("compile", False),
            "lm_head_chunk_size": spec.get("lm_head_chunk_size", 1024),
        },
        "logging": {"progress": "none", "plot": False},
    }
    cfg = load_config(DPOConfig, None, None, base=tree)

    step_ends = _common.record_posttrain_step_ends()

    # The batches trained on, as built by posttrain's collate_shared_prompt (one row per pair, the default) or
    # collate_preference (chosen rows then rejected rows, --no-share-prompt); kept as tensors, unpacked after
    # training. The names are replaced in every loaded posttrain module that imported them, wherever the
    # recipe's loop lives; with no evaluation and no precomputed reference, only training batches are collated.
    collated = []
    for collate_name in ("collate_preference", "collate_shared_prompt"):
        original = getattr(posttrain.data.preference, collate_name)

        def recording(pairs, pad_token_id, original=original):
            batch = original(pairs, pad_token_id)
            collated.append(batch)
            return batch

        for name, module in list(sys.modules.items()):
            if name.startswith("posttrain") and getattr(module, collate_name, None) is original:
                setattr(module, collate_name, recording)

    with _common.measured_run("posttrain", getattr(posttrain, "__version__", None), baseline) as measured:
        train_dpo(cfg)

    micro_batches = [
        shared_prompt_rows(b.input_ids.tolist(), b.segments.tolist()) if isinstance(b, SharedPromptBatch)
        else batch_rows(b.input_ids.tolist(), b.loss_mask.long().tolist(), b.attention_mask.tolist()) for b in collated
    ]
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    by_step = {r["step"]: r for r in records if "loss" in r}
    steps = range(1, spec["steps"] + 1)
    steps_shape = (spec["accumulation"], spec["steps"])
    return {
        **measured,
        "step_end_times": [step_ends.get(s) for s in steps],
        "collate_calls": len(collated),
        "step_fingerprints": step_fingerprints(micro_batches, spec["accumulation"], spec["steps"]),
        "tokens_per_step": per_step([sum(len(row[0]) for row in mb) for mb in micro_batches], *steps_shape),
        # Of the two-row layout (the longest prompt + completion); with a shared prompt the rows are longer, fewer.
        "padded_width_per_step": per_step([max(len(row[0]) for row in mb) for mb in micro_batches], *steps_shape, max),
        "model_positions_per_step": per_step([b.input_ids.numel() for b in collated], *steps_shape),
        "share_prompt": cfg.shares_prompt,
        "losses": [by_step.get(s, {}).get("loss") for s in steps],
        "margins": [by_step.get(s, {}).get("margin") for s in steps],
        "reward_accuracies": [by_step.get(s, {}).get("reward_accuracy") for s in steps],
        "grad_norms": [by_step.get(s, {}).get("grad_norm") for s in steps],
        "learning_rates": [by_step.get(s, {}).get("learning_rate") for s in steps],
        # posttrain's own in-loop timer (collate + reference + forward/backward + optimizer; no logging): reference.
        "in_loop_step_seconds": [by_step.get(s, {}).get("step_seconds") for s in steps],
    }


def worker_trl(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    import trl
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    model_dir = spec["model_dir"]
    baseline = _common.trl_baseline_rss_mib(model_dir)

    class RecordingCollator:
        """Wraps TRL's own collator and keeps each batch it builds (unpacked after training)."""

        def __init__(self, inner):
            self.inner = inner
            self.batches: list[dict[str, Any]] = []

        def __call__(self, examples):
            batch = self.inner(examples)
            self.batches.append(batch)
            return batch

    trainer_class = DPOTrainer
    if spec["lr_scheduler"] != "constant" or spec["warmup_steps"]:
        # posttrain's schedule, from posttrain's own formula (imported only in this case).
        from posttrain.config.schema import TrainerConfig
        from posttrain.optim import lr_multiplier

        schedule = TrainerConfig(max_steps=spec["steps"], learning_rate=spec["learning_rate"],
                                 lr_scheduler=spec["lr_scheduler"], warmup_steps=spec["warmup_steps"], min_lr_ratio=0.0)

        class DPOTrainerWithPosttrainSchedule(DPOTrainer):
            def create_scheduler(self, num_training_steps, optimizer=None):
                if self.lr_scheduler is None:
                    self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                        optimizer or self.optimizer, lambda step: lr_multiplier(step, schedule)
                    )
                return self.lr_scheduler

        trainer_class = DPOTrainerWithPosttrainSchedule

    output_dir = Path(spec["output_dir"])
    if output_dir.exists():
        raise FileExistsError(f"{output_dir} exists; every run needs a fresh directory")
    config_fields = {f.name for f in dataclasses.fields(DPOConfig)}
    args = DPOConfig(
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
        truncation_mode="keep_start",
        padding_free=False,
        pad_to_multiple_of=None,
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        dataloader_drop_last=False,
        # reference: a frozen copy of the starting model, scoring every batch
        precompute_ref_log_probs=False,
        sync_ref_model=False,
        disable_dropout=True,
        # loss: plain sigmoid DPO on summed log-probabilities
        loss_type=["sigmoid"],
        loss_weights=None,
        beta=spec["beta"],
        label_smoothing=0.0,
        f_divergence_type="reverse_kl",
        use_weighting=False,
        ld_alpha=None,
        activation_offloading=False,
        use_liger_kernel=False,
        # optimization (and bookkeeping: one record per step, no tracker, no eval, one checkpoint at the end)
        **_common.trl_optimization_and_bookkeeping(spec),
        per_device_train_batch_size=spec["micro_batch_size"],
        gradient_accumulation_steps=spec["accumulation"],
    )
    recorder = _common.trl_step_recorder("loss")

    with _common.measured_run("trl", trl.__version__, baseline) as measured:
        dataset = _common.jsonl_dataset(spec["pairs_file"])
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        trainer = trainer_class(
            model=model_dir, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[recorder]
        )
        collator = RecordingCollator(trainer.data_collator)
        trainer.data_collator = collator
        _common.train_and_save_quietly(trainer, output_dir / "final")

    steps, accumulation = spec["steps"], spec["accumulation"]
    batches = collator.batches[: steps * accumulation]
    micro_batches = [
        batch_rows(b["input_ids"].tolist(), b["completion_mask"].tolist(), b["attention_mask"].tolist()) for b in batches
    ]
    logs = {entry["step"]: entry for entry in recorder.logs}
    step_range = range(1, steps + 1)
    reference = trainer.ref_model
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
        "train_sampler": type(trainer._get_train_sampler()).__name__,
        "train_dataset_rows": len(trainer.train_dataset),
        "reference_model": None if reference is None else {
            "class": type(reference).__name__,
            "training": bool(reference.training),
            "requires_grad": any(p.requires_grad for p in reference.parameters()),
            "distinct_from_policy": reference is not trainer.model,
        },
        "collate_calls": len(collator.batches),
        "step_end_times": recorder.step_ends,
        "step_fingerprints": step_fingerprints(micro_batches, accumulation, steps),
        "tokens_per_step": per_step([sum(len(row[0]) for row in mb) for mb in micro_batches], accumulation, steps),
        "padded_width_per_step": per_step([b["input_ids"].shape[1] for b in batches], accumulation, steps, max),
        "model_positions_per_step": per_step([b["input_ids"].numel() for b in batches], accumulation, steps),
        "losses": [logs.get(s, {}).get("loss") for s in step_range],
        "margins": [logs.get(s, {}).get("rewards/margins") for s in step_range],
        "reward_accuracies": [logs.get(s, {}).get("rewards/accuracies") for s in step_range],
        "grad_norms": [logs.get(s, {}).get("grad_norm") for s in step_range],
        "learning_rates": [logs.get(s, {}).get("learning_rate") for s in step_range],
        # on_step_begin -> on_step_end (forward/backward + optimizer; excludes collation and logging): reference.
        "in_loop_step_seconds": [b - a for a, b in zip(recorder.step_begins, recorder.step_ends)],
    }


WORKERS = {"posttrain": worker_posttrain, "trl": worker_trl}


def run_as_worker(framework: str, spec_path: str, result_path: str) -> None:
    _common.apply_offline_env()
    result = WORKERS[framework](_common.load_spec(spec_path))
    _common.write_json(Path(result_path), result)


# =========================================================================================================
# Parent: prepare the pairs, run the workers, summarize


def prepare_pairs(work_dir: Path, num_rows: int, dataset: str = DATASET) -> Path:
    """Write the prompt/chosen/rejected columns of the first num_rows rows of a preference training split
    (stored in a seeded random order; started over if it runs out) to work_dir/pairs.jsonl."""
    from posttrain.data import iter_records

    rows = [{"prompt": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]} for _, r in iter_records(dataset)]
    ordered = [rows[i % len(rows)] for i in range(num_rows)]
    path = work_dir / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ordered))
    return path


def expected_batches(pairs_file: Path, model_dir: str, micro_batch_size: int, accumulation: int, steps: int,
                     max_length: int) -> dict[str, Any]:
    """Each step's batches as both frameworks should build them, encoded here independently: per pair, the
    prompt as the tokenizer encodes it, each completion without special tokens followed by EOS; chosen rows
    first, then the rejected rows of the same pairs. Also the longest sequence (to check that no truncation
    can apply) and what the tokenizer adds to a prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer of {model_dir} has no EOS token")
    pairs = [json.loads(line) for line in pairs_file.read_text().splitlines() if line.strip()]
    encoded = []
    for pair in pairs:
        prompt = list(tokenizer(pair["prompt"])["input_ids"])
        completions = [list(tokenizer(pair[key], add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
                       for key in ("chosen", "rejected")]
        encoded.append((prompt, completions))
    longest = max(len(prompt) + len(c) for prompt, completions in encoded for c in completions)
    if longest > max_length:
        raise ValueError(f"a pair has {longest} tokens, more than --max-length {max_length}: the frameworks truncate "
                         "differently, so the comparison needs pairs that fit")
    micro_batches = []
    for start in range(0, steps * micro_batch_size * accumulation, micro_batch_size):
        group = encoded[start : start + micro_batch_size]
        micro_batches.append(
            [[prompt + completions[0], [0] * len(prompt) + [1] * len(completions[0])] for prompt, completions in group]
            + [[prompt + completions[1], [0] * len(prompt) + [1] * len(completions[1])] for prompt, completions in group]
        )
    bare = tokenizer("x")["input_ids"]
    return {
        "fingerprints": step_fingerprints(micro_batches, accumulation, steps),
        "tokens_per_step": [sum(len(row[0]) for mb in micro_batches[i * accumulation : (i + 1) * accumulation] for row in mb)
                            for i in range(steps)],
        "longest_sequence": longest,
        "special_tokens_added_to_prompt": len(bare) - len(tokenizer("x", add_special_tokens=False)["input_ids"]),
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
    }


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def summarize_run(result: dict[str, Any], skip: int, steps: int, pairs_per_step: int) -> dict[str, Any]:
    """Derived numbers of one worker run."""
    times = result["step_end_times"]
    if len(times) != steps or any(t is None for t in times):
        raise RuntimeError(f"{result['framework']}: {len(times)} step end times for {steps} steps (the step-end "
                           "instrumentation no longer matches the framework's code)")
    steady = _common.steady_state_step_seconds(times, skip)
    losses = [v for v in result["losses"] if v is not None]
    peak, base = result["peak_rss_mib"], result["baseline_rss_mib"]
    return {
        **steady,
        "pairs_per_second": pairs_per_step * steady["steady_steps"] / steady["steady_seconds"],
        "wall_seconds": result["wall_seconds"],
        "peak_rss_mib": peak,
        "baseline_rss_mib": base,
        "peak_increase_mib": peak - base if peak is not None and base is not None else None,
        "first_loss": result["losses"][0],
        "final_loss": result["losses"][-1],
        "mean_last_losses": statistics.fmean(losses[-LAST_N_LOSSES:]) if losses else None,
        "final_margin": result["margins"][-1],
        "mean_tokens_per_step": _mean(result["tokens_per_step"]),
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
    ("Loss at step 1 (log 2 = 0.6931)", "first_loss", 4, "should be 1.000"),
    ("Loss at the last step", "final_loss", 4, "~1"),
    (f"Mean loss, last {LAST_N_LOSSES} steps", "mean_last_losses", 4, "~1"),
    ("Mean reward margin at the last step", "final_margin", 4, "~1"),
]


def _max_abs_diff(a: list[float | None], b: list[float | None]) -> float | None:
    diffs = [abs(x - y) for x, y in zip(a, b) if x is not None and y is not None]
    return max(diffs) if diffs else None


def report(runs: dict[str, list[dict[str, Any]]], raw: dict[str, list[dict[str, Any]]],
           expected: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    medians = {fw: {key: _common.median(r[key] for r in runs[fw]) for _, key, _, _ in ROWS} for fw in FRAMEWORKS}
    table_rows = []
    for label, key, digits, meaning in ROWS:
        a, b = medians["posttrain"][key], medians["trl"][key]
        table_rows.append([label, _common.fmt(a, digits), _common.fmt(b, digits), _common.fmt(_common.ratio(b, a), 3),
                           meaning])
    table = _common.markdown_table(["Metric (median)", "posttrain", "TRL", "TRL/posttrain", ""], table_rows)

    # Per-step agreement, repeat by repeat (each repeat ran both frameworks on identical batches).
    agreement = []
    for pt, tr in zip(raw["posttrain"], raw["trl"]):
        diffs = [abs(a - b) if a is not None and b is not None else None for a, b in zip(pt["losses"], tr["losses"])]
        g_pt, g_tr = pt["grad_norms"][0], tr["grad_norms"][0]
        agreement.append({
            "step1_loss_minus_log2": {"posttrain": pt["losses"][0] - LOG2 if pt["losses"][0] is not None else None,
                                      "trl": tr["losses"][0] - LOG2 if tr["losses"][0] is not None else None},
            "max_loss_diff_first_steps": _max_abs_diff(pt["losses"][:FIRST_N_LOSSES], tr["losses"][:FIRST_N_LOSSES]),
            "max_loss_diff": _max_abs_diff(pt["losses"], tr["losses"]),
            "first_step_loss_diff_over_tolerance": next(
                (i + 1 for i, d in enumerate(diffs) if d is not None and d > LOSS_TOLERANCE), None),
            "max_margin_diff": _max_abs_diff(pt["margins"], tr["margins"]),
            "step1_grad_norm_relative_diff": (abs(g_pt - g_tr) / abs(g_pt)
                                              if g_pt not in (None, 0) and g_tr is not None else None),
            "per_step_loss_diffs": diffs,
        })
    recorded = {fw: all(r["collate_calls"] > 0 for r in raw[fw]) for fw in FRAMEWORKS}
    same_batches = {fw: all(r["step_fingerprints"] == expected["fingerprints"] for r in raw[fw]) for fw in FRAMEWORKS}
    same_tokens = {fw: all(r["tokens_per_step"] == expected["tokens_per_step"] for r in raw[fw]) for fw in FRAMEWORKS}
    same_lr = all(
        len(a["learning_rates"]) == len(b["learning_rates"])
        and all(x is not None and y is not None and math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-15)
                for x, y in zip(a["learning_rates"], b["learning_rates"]))
        for a, b in zip(raw["posttrain"], raw["trl"])
    )
    same_width = all(a["padded_width_per_step"] == b["padded_width_per_step"] for a, b in zip(raw["posttrain"], raw["trl"]))
    threads = {fw: sorted({r["torch_threads"] for r in runs[fw]}) for fw in FRAMEWORKS}
    trl = raw["trl"][0]
    positions = {fw: statistics.mean(n for r in raw[fw] for n in r["model_positions_per_step"]) for fw in FRAMEWORKS}
    layout = ("one row per pair, the prompt once (share_prompt)" if raw["posttrain"][0]["share_prompt"]
              else "a chosen row and a rejected row per pair (share_prompt=false)")

    def yes(ok: bool) -> str:
        return "yes" if ok else "NO"

    def checked(fw: str) -> str:
        return yes(same_batches[fw]) if recorded[fw] else "not recorded (the collate hook saw no calls)"

    def fmt_e(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1e}"

    notes = [
        "loss at step 1 minus log 2, per repeat: "
        + "; ".join(f"{fw} {', '.join(fmt_e(a['step1_loss_minus_log2'][fw]) for a in agreement)}" for fw in FRAMEWORKS),
        (f"max |loss(posttrain) - loss(TRL)| per repeat: over steps 1-{FIRST_N_LOSSES} "
         f"{', '.join(fmt_e(a['max_loss_diff_first_steps']) for a in agreement)}; over all steps "
         f"{', '.join(fmt_e(a['max_loss_diff']) for a in agreement)}; first step differing by more than "
         f"{LOSS_TOLERANCE:g}: {', '.join(str(a['first_step_loss_diff_over_tolerance'] or 'none') for a in agreement)}"),
        (f"max |mean margin difference| per repeat: {', '.join(fmt_e(a['max_margin_diff']) for a in agreement)}; "
         "relative difference of the step-1 gradient norm: "
         f"{', '.join(fmt_e(a['step1_grad_norm_relative_diff']) for a in agreement)}"),
        ("batches (token ids and completion masks, chosen rows then rejected) identical to the parent's encoding, "
         f"step by step: posttrain {checked('posttrain')}, TRL {checked('trl')}; non-padding tokens per step as "
         f"expected: posttrain {yes(same_tokens['posttrain'])}, TRL {yes(same_tokens['trl'])}; same padded width "
         f"every step: {yes(same_width)} (longest pair sequence {expected['longest_sequence']} tokens; the "
         f"tokenizer adds {expected['special_tokens_added_to_prompt']} special token(s) to a prompt)"),
        (f"posttrain layout: {layout}; positions (tokens and padding) through each model per step, mean: "
         f"posttrain {positions['posttrain']:.0f}, TRL {positions['trl']:.0f}"),
        (f"learning rate of every step the same in both: {yes(same_lr)}; "
         f"torch threads during training: posttrain {threads['posttrain']}, TRL {threads['trl']}; "
         f"TRL optimizer: {trl.get('optimizer')} (optim={trl.get('optim')}), gradient checkpointing "
         f"{trl.get('gradient_checkpointing')}, weights {trl.get('param_dtype')}, sampler {trl.get('train_sampler')}, "
         f"{trl.get('train_dataset_rows')} tokenized pairs, reference model {trl.get('reference_model')}"),
        "1-minute load average at the end of each run: "
        + "; ".join(f"{fw} {', '.join(_common.fmt((r.get('loadavg_at_end') or [None])[0]) for r in raw[fw])}"
                    for fw in FRAMEWORKS),
    ]
    problems = [f"{fw}: the batches differ from the parent's encoding" for fw in FRAMEWORKS if not same_batches[fw]]
    if not same_lr:
        problems.append("the learning rates differ")
    for a in agreement:
        problems += [f"{fw}: the step-1 loss is not log 2" for fw, d in a["step1_loss_minus_log2"].items()
                     if d is None or abs(d) > STEP1_TOLERANCE]
        if a["max_loss_diff_first_steps"] is None or a["max_loss_diff_first_steps"] > FIRST_STEPS_TOLERANCE:
            problems.append(f"the losses of steps 1-{FIRST_N_LOSSES} differ by more than {FIRST_STEPS_TOLERANCE:g}")
    if problems:
        notes.insert(0, "WARNING, the two runs are not the same computation: " + "; ".join(dict.fromkeys(problems)))
    text = f"{table}\n\n" + "\n".join(f"- {n}" for n in notes)
    summary = {
        "same_computation": not problems,
        "problems": list(dict.fromkeys(problems)),
        "medians": medians,
        "ratios_trl_over_posttrain": {key: _common.ratio(medians["trl"][key], medians["posttrain"][key])
                                      for _, key, _, _ in ROWS},
        "loss_agreement": agreement,
        "same_batches_as_expected": same_batches,
        "same_tokens_as_expected": same_tokens,
        "same_padded_width": same_width,
        "same_learning_rates": same_lr,
        "torch_threads": threads,
        "model_positions_per_step": positions,
    }
    return text, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps per run (default 150)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per framework; medians are reported (default 3)")
    parser.add_argument("--skip-steps", type=int, default=5, help="warm-up steps left out of the step times (default 5)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny",
                        help="tiny: posttrain/tiny-arithmetic-sft on arithmetic pairs (<= 10 tokens); vocab152k: "
                             "posttrain/bench-vocab152k on posttrain/bench-lengths-preference (16-1,024 tokens each "
                             "of prompt, chosen, rejected)")
    parser.add_argument("--model", default=None, help="model directory or embedded name (default: the shape's)")
    _common.add_posttrain_trainer_flags(parser, compile_flag=True)
    parser.add_argument("--pairs-per-step", type=int, default=32, help="preference pairs per optimizer step (default 32)")
    parser.add_argument("--accumulation", type=int, default=1,
                        help="micro-batches per optimizer step; must divide --pairs-per-step (default 1)")
    parser.add_argument("--beta", type=float, default=0.1, help="DPO beta (default 0.1)")
    parser.add_argument("--learning-rate", type=float, default=2e-4, help="peak learning rate (default 2e-4)")
    parser.add_argument("--lr-scheduler", choices=["constant", "cosine", "linear"], default="constant",
                        help="schedule after warm-up (default constant: identical in both frameworks)")
    parser.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up steps (default 0)")
    parser.add_argument("--max-length", type=int, default=None,
                        help="max tokens per sequence (default: the shape's, 32 for tiny as the dpo_arithmetic preset, "
                             "2049 for vocab152k: no pair is cut)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads in both workers (default: torch's default, the same in both)")
    parser.add_argument("--trl-optim", default=None,
                        help="TRL optim name (default: TRL's default, adamw_torch_fused, as posttrain's)")
    parser.add_argument("--no-share-prompt", dest="share_prompt", action="store_false",
                        help="posttrain scores each pair as a chosen row and a rejected row (share_prompt=false), "
                             "as TRL does, instead of one row holding the prompt once")
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
    if args.accumulation < 1 or args.pairs_per_step % args.accumulation:
        parser.error("--accumulation must be at least 1 and divide --pairs-per-step")
    missing = [name for name, v in _common.package_versions(["trl", "accelerate"]).items() if v is None]
    if missing:
        parser.error(f"missing {', '.join(missing)}: pip install 'trl>=1.0' (or the project's bench extra)")
    micro_batch_size = args.pairs_per_step // args.accumulation
    default_model, dataset, default_length = SHAPES[args.shape]
    args.model = args.model or default_model
    args.max_length = args.max_length or default_length

    _common.apply_offline_env()
    from posttrain.models.loading import resolve_model_path

    versions, machine = _common.announce_environment()

    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="dpo_vs_trl.", dir=args.keep))
    script = str(Path(__file__).resolve())
    benchmark_started = time.perf_counter()
    result_report: dict[str, Any] = {
        "benchmark": "dpo_vs_trl",
        "argv": sys.argv,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("worker", "spec", "result")},
        "versions": versions,
        "machine": machine,
    }
    try:
        model_dir = resolve_model_path(args.model)  # builds an embedded model once, before any worker starts
        pairs_file = prepare_pairs(work_dir, args.steps * args.pairs_per_step, dataset)
        expected = expected_batches(pairs_file, model_dir, micro_batch_size, args.accumulation, args.steps,
                                    args.max_length)
        raw: dict[str, list[dict[str, Any]]] = {fw: [] for fw in FRAMEWORKS}
        runs: dict[str, list[dict[str, Any]]] = {fw: [] for fw in FRAMEWORKS}
        for repeat, order in enumerate(_common.alternating_orders(FRAMEWORKS, args.repeats)):
            for framework in order:
                spec = {
                    "framework": framework,
                    "model_dir": str(model_dir),
                    "pairs_file": str(pairs_file),
                    "output_dir": str(work_dir / f"{framework}-{repeat}"),
                    "steps": args.steps,
                    "micro_batch_size": micro_batch_size,
                    "accumulation": args.accumulation,
                    "beta": args.beta,
                    "learning_rate": args.learning_rate,
                    "lr_scheduler": args.lr_scheduler,
                    "warmup_steps": args.warmup_steps,
                    "max_length": args.max_length,
                    "seed": args.seed,
                    "threads": args.threads,
                    "trl_optim": args.trl_optim,
                    "share_prompt": args.share_prompt,
                    "lm_head": args.lm_head,
                    "packing": args.packing,
                    "compile": args.compile,
                    "lm_head_chunk_size": args.lm_head_chunk_size,
                }
                spec_path = work_dir / f"{framework}-{repeat}.spec.json"
                result_path = work_dir / f"{framework}-{repeat}.result.json"
                _common.write_json(spec_path, spec)
                print(f"repeat {repeat + 1}/{args.repeats}: {framework} ...", end=" ", flush=True)
                result = _common.run_worker(
                    [script, "--worker", framework, "--spec", str(spec_path), "--result", str(result_path)],
                    result_path, work_dir / f"{framework}-{repeat}.log", args.timeout,
                )
                summary = summarize_run(result, args.skip_steps, args.steps, args.pairs_per_step)
                print(f"{summary['median_step_seconds']:.4f} s/step (median), wall {summary['wall_seconds']:.1f}s, "
                      f"peak {summary['peak_rss_mib']:.0f} MiB, loss {_common.fmt(summary['first_loss'], 4)} -> "
                      f"{_common.fmt(summary['final_loss'], 4)}")
                raw[framework].append({**result, "repeat": repeat, "order": order.index(framework)})
                runs[framework].append(summary)
                if not args.keep:
                    shutil.rmtree(work_dir / f"{framework}-{repeat}", ignore_errors=True)
        text, summary = report(runs, raw, expected)
        result_report.update({"model_dir": str(model_dir), "expected": expected, "summary": summary, "runs": runs,
                              "raw": raw})
    finally:
        if not args.keep:
            shutil.rmtree(work_dir, ignore_errors=True)
    total = time.perf_counter() - benchmark_started
    result_report["benchmark_seconds"] = total

    print()
    print(f"## posttrain DPO vs TRL {versions['trl']} DPOTrainer (torch {versions['torch']}, "
          f"transformers {versions['transformers']}, accelerate {versions['accelerate']})")
    print()
    print(f"{args.model}, {dataset} pairs in order, {args.pairs_per_step} pairs per step ({micro_batch_size} x "
          f"{args.accumulation}), sigmoid DPO beta {args.beta} against a frozen reference copy, no SFT term, lr "
          f"{args.learning_rate} {args.lr_scheduler} (warm-up {args.warmup_steps}), fp32 on CPU, {args.steps} steps, "
          f"step times over steps {args.skip_steps + 1}-{args.steps}, medians of {args.repeats} repeat(s), order "
          f"alternating, posttrain trainer.lm_head={args.lm_head} trainer.packing={str(args.packing).lower()} "
          f"trainer.compile={str(args.compile).lower()} "
          f"trainer.lm_head_chunk_size={args.lm_head_chunk_size}. "
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
