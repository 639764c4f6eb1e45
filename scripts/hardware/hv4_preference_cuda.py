"""HV-4: preference optimization and reward models on a CUDA device — LoRA DPO in bf16 with gradient
checkpointing, its two reference modes, adapter export, memory against full fine-tuning, reward model, resume.

Run on a machine with an NVIDIA GPU after `bash scripts/setup.sh` (no network needed: the model and data are
embedded; posttrain/tiny-arithmetic-sft is trained on first use, a minute or two):

    .venv/bin/python scripts/hardware/hv4_preference_cuda.py [--out DIR] [--steps 200] [--rm-steps 300]

Every DPO run starts from configs/dpo_arithmetic.yaml with lora.enabled=true, trainer.precision=bf16,
model.gradient_checkpointing=true and loss.sft_weight=0 (plain DPO, so that the first step's loss is exactly
log 2). Checks, printing one JSON object on stdout (the runs' console lines go to stderr; the object is also
written to $OUT/hv4.json when OUT is set):
  dpo_lora:   reference=frozen_copy (the base with the adapters off, scored every batch): the step-1 loss is log 2
              (the fresh adapter's B = 0 leaves the policy equal to its reference), the loss falls and the
              training reward accuracy rises (means of the first and last quarter of steps);
  reference:  reference=precomputed (the same base scored once up front) logs the same per-step losses;
  export:     OUTPUT/final (the adapter merged into the base) gives the logits of OUTPUT/adapter loaded with
              peft onto the base, in float32; and differs from the base (the adapter did train);
  memory:     peak CUDA memory of the LoRA run and of a full fine-tuning run with reference=frozen_copy (which
              keeps a second copy of the model, gradients and AdamW state for every weight): LoRA ≤ full;
  rm:         configs/rm_arithmetic.yaml in bf16: held-out eval_accuracy rises above its first evaluation;
              RewardModel.from_pretrained(OUTPUT/final) on the same device scores the same held-out pairs with
              the accuracy of the run's last evaluation: under bf16 autocast (as the run evaluated), and in
              float32, where pairs whose verdict bf16 rounding flips may move it further if every one of them is
              a near-tie (float32 |margin| small against the spread of the rewards);
  shared:     DPO's shared-prompt rows (one row per pair, tree attention mask, share_prompt) give the
              completion log-probabilities of separate chosen and rejected rows on the device's sdpa kernels, in
              float32 and under bf16 autocast;
  resume:     a copy of the LoRA run rolled back to its checkpoint at half the steps and re-run logs the losses
              of the uninterrupted run (to 1e-3 relative: CUDA kernels need not be bitwise deterministic).
Exit 0 when every check passes, 1 when one fails (or a stage raised: its error is in the JSON), 2 without CUDA.
Run directories go under --out (emptied run by run; default: a new temporary directory). --allow-cpu dry-runs
the same logic on the CPU with fewer steps and one thread (about a minute on two cores; bf16 autocast on the
CPU); the memory comparison is then skipped (peaks reported as null).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from posttrain.algorithms.dpo import completion_logps, train_dpo
from posttrain.algorithms.rm import train_rm
from posttrain.config import DPOConfig, RMConfig, load_config
from posttrain.config.presets import preset_path
from posttrain.data.embedded import iter_embedded
from posttrain.data.preference import (
    collate_preference,
    collate_shared_prompt,
    load_preference_examples,
)
from posttrain.logging import read_metrics
from posttrain.workers import RewardModel
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.workers.forward import batch_to, forward_logits
from posttrain.workers.local import LocalScoringWorker

THRESHOLDS = {
    "step1_loss_abs_diff_max": 1e-2,        # |DPO loss at step 1 − log 2| (bf16 autocast)
    "loss_drop_min": 0.05,                  # mean loss, first quarter of steps − last quarter
    "reward_accuracy_gain_min": 0.1,        # mean training reward accuracy, last quarter − first quarter
    "reference_loss_abs_diff_max": 2e-2,    # per step, reference=frozen_copy against reference=precomputed
    "merged_logit_abs_diff_max": 1e-3,      # OUTPUT/final against OUTPUT/adapter on the base, float32
    "adapter_logit_change_min": 1e-2,       # OUTPUT/final against the untouched base: the adapter trained
    "rm_eval_accuracy_gain_min": 0.0,       # last held-out eval_accuracy − the first one (strictly above)
    "rm_rescored_accuracy_abs_diff_max": 1e-2,  # RewardModel's accuracy against the run's last (bf16) evaluation
    "rm_near_tie_rel_margin_max": 0.05,     # float32 |margin| / reward std of any pair bf16 scoring flips
    "resume_rel_diff_max": 1e-3,            # per step, resumed run against the uninterrupted one
    "shared_prompt_fp32_abs_diff_max": 1e-4,  # completion log-probabilities, shared-prompt rows against two rows
    "shared_prompt_bf16_abs_diff_max": 1e-1,  # the same under bf16 autocast (different matmul shapes round apart)
}
"""First estimates, to revisit with the first hardware results."""

DPO_ARGS = [
    "lora.enabled=true", "lora.r=16", "lora.alpha=32", "model.gradient_checkpointing=true", "trainer.precision=bf16",
    "loss.sft_weight=0", "trainer.learning_rate=2e-3", "trainer.warmup_steps=5", "logging.progress=none",
    "logging.plot=false",
]
RM_ARGS = ["trainer.precision=bf16", "trainer.save_every=0", "logging.progress=none", "logging.plot=false"]
CPU_STEPS, CPU_RM_STEPS = 60, 100
CPU_ARGS = ["trainer.num_threads=1"]  # the dry run: one thread is faster on a small, shared CPU


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="run directories (default: a temporary directory)")
    parser.add_argument("--steps", type=int, default=None, help=f"DPO steps, even (default 200; {CPU_STEPS} on CPU)")
    parser.add_argument("--rm-steps", type=int, default=None,
                        help=f"reward-model steps (default: the preset's 300; {CPU_RM_STEPS} on CPU)")
    parser.add_argument("--allow-cpu", action="store_true", help="dry-run the script's logic on the CPU")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.allow_cpu:
        return finish({"hv": "HV-4", "error": "no CUDA device"}, 2)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    steps = args.steps or (200 if cuda else CPU_STEPS)
    rm_steps = args.rm_steps or (300 if cuda else CPU_RM_STEPS)
    if steps < 8 or steps % 2:
        parser.error("--steps must be even and at least 8")
    out = Path(args.out or tempfile.mkdtemp(prefix="hv4-"))
    extra = [] if cuda else CPU_ARGS
    started = time.perf_counter()
    results: dict = {
        "hv": "HV-4", "device": torch.cuda.get_device_name(0) if cuda else "cpu (dry run)", "torch": torch.__version__,
        "out": str(out), "dpo_steps": steps, "rm_steps": rm_steps, "thresholds": THRESHOLDS,
    }
    checks: dict[str, bool] = {}
    errors: dict[str, str] = {}

    def stage(name: str, function, *stage_args) -> None:
        stage_started = time.perf_counter()
        try:
            with contextlib.redirect_stdout(sys.stderr):  # the runs' console lines; stdout carries only the JSON
                function(*stage_args, results, checks, device)
        except Exception:  # noqa: BLE001 — recorded in the JSON: one broken stage should not hide the others
            errors[name] = traceback.format_exc(limit=-4)
            checks[f"{name}_ran"] = False
        results.setdefault("seconds", {})[name] = round(time.perf_counter() - stage_started, 1)

    def dpo_config(output_dir: Path, *overrides: str) -> DPOConfig:
        return load_config(DPOConfig, preset_path("dpo_arithmetic.yaml"), [
            *DPO_ARGS, f"output_dir={output_dir}", f"trainer.max_steps={steps}", f"trainer.save_every={steps // 2}",
            f"trainer.eval_every={steps // 2}", *extra, *overrides,
        ])

    live, table, full = out / "dpo_lora_frozen_copy", out / "dpo_lora_precomputed", out / "dpo_full_frozen_copy"
    # The precomputed run goes first: it also warms up CUDA (cuBLAS workspaces and the like stay allocated), so
    # that the two runs whose peak memory is compared start from the same state.
    stage("dpo_precomputed", run_dpo, dpo_config(table, "reference=precomputed"), "precomputed", False)
    stage("dpo_lora", run_dpo, dpo_config(live, "reference=frozen_copy"), "lora", True)
    stage("dpo_full", run_dpo, dpo_config(full, "reference=frozen_copy", "lora.enabled=false",
                                          "trainer.learning_rate=2e-4", f"trainer.max_steps={min(steps, 20)}",
                                          "trainer.save_every=0", "trainer.eval_every=0"), "full", True)
    stage("dpo_checks", check_dpo, live, table)
    stage("export", check_export, dpo_config(live))
    stage("resume", check_resume, dpo_config, live, out / "dpo_lora_resumed", steps)
    stage("shared_prompt", check_shared_prompt)
    stage("rm", check_rm, out / "rm", rm_steps, extra)

    if cuda and "lora_peak_mib" in results and "full_peak_mib" in results:
        checks["lora_memory_not_above_full"] = results["lora_peak_mib"] <= results["full_peak_mib"]
    results["checks"] = checks
    if errors:
        results["errors"] = errors
    results["passed"] = bool(checks) and all(checks.values()) and not errors
    results["total_seconds"] = round(time.perf_counter() - started, 1)
    return finish(results, 0 if results["passed"] else 1)


def finish(results: dict, code: int) -> int:
    text = json.dumps(results, indent=2)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "hv4.json").write_text(text + "\n")
    return code


def losses(output_dir: Path) -> list[float]:
    return [record["loss"] for record in read_metrics(output_dir / "metrics.jsonl")]


def quarter_means(values: list[float]) -> tuple[float, float]:
    window = max(1, len(values) // 4)
    return sum(values[:window]) / window, sum(values[-window:]) / window


def run_dpo(cfg: DPOConfig, label: str, measure: bool, results: dict, checks: dict, device: torch.device) -> None:
    """One DPO run; if `measure`, its peak allocated CUDA memory above what was allocated before it (None on CPU)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    shutil.rmtree(cfg.output_dir, ignore_errors=True)  # a leftover run there would be resumed, not repeated
    before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    result = train_dpo(cfg)
    if measure:
        measured = device.type == "cuda"
        results[f"{label}_peak_mib"] = round((torch.cuda.max_memory_allocated() - before) / 2**20, 2) if measured else None
    records = read_metrics(Path(cfg.output_dir) / "metrics.jsonl")
    results[f"{label}_loss_first_last"] = [records[0]["loss"], records[-1]["loss"]]
    results[f"{label}_eval_reward_accuracy"] = result.eval_reward_accuracy
    results[f"{label}_seconds_per_step"] = round(sum(r["step_seconds"] for r in records) / len(records), 4)


def check_dpo(live: Path, table: Path, results: dict, checks: dict, device: torch.device) -> None:
    records = read_metrics(live / "metrics.jsonl")
    loss = [r["loss"] for r in records]
    accuracy = [r["reward_accuracy"] for r in records]
    results["dpo_step1_loss"] = loss[0]
    results["dpo_loss_first_last_quarter"] = quarter_means(loss)
    results["dpo_reward_accuracy_first_last_quarter"] = quarter_means(accuracy)
    results["dpo_eval_reward_accuracy"] = [r["eval_reward_accuracy"] for r in records if "eval_reward_accuracy" in r]
    checks["dpo_step1_loss_is_log2"] = abs(loss[0] - math.log(2)) <= THRESHOLDS["step1_loss_abs_diff_max"]
    first, last = results["dpo_loss_first_last_quarter"]
    checks["dpo_loss_falls"] = first - last >= THRESHOLDS["loss_drop_min"]
    first, last = results["dpo_reward_accuracy_first_last_quarter"]
    checks["dpo_reward_accuracy_rises"] = last - first >= THRESHOLDS["reward_accuracy_gain_min"]

    precomputed = losses(table)
    differences = [abs(a - b) for a, b in zip(loss, precomputed)]
    results["reference_loss_max_abs_diff"] = max(differences)
    results["reference_loss_mean_abs_diff"] = sum(differences) / len(differences)
    checks["references_agree"] = (len(precomputed) == len(loss)
                                  and results["reference_loss_max_abs_diff"] <= THRESHOLDS["reference_loss_abs_diff_max"])


@torch.no_grad()
def check_shared_prompt(results: dict, checks: dict, device: torch.device) -> None:
    """completion_logps of held-out pairs from shared-prompt rows against separate rows, float32 and bf16."""
    cfg = load_config(DPOConfig, preset_path("dpo_arithmetic.yaml"), ["logging.progress=none"])
    tokenizer = load_tokenizer(cfg.model)
    model = load_causal_lm(cfg.model, device=device).eval()
    examples, _ = load_preference_examples(["posttrain/arithmetic-preference:heldout[:128]"], tokenizer, cfg.data)
    for precision in ("fp32", "bf16"):
        trainer = cfg.trainer.model_copy(update={"precision": precision})
        scorer = LocalScoringWorker(model, trainer)
        batches = [collate(examples, tokenizer.pad_token_id) for collate in (collate_preference, collate_shared_prompt)]
        scores = [completion_logps(scorer.logprobs(batch), batch, False) for batch in batches]
        difference = max(float((getattr(scores[0], side) - getattr(scores[1], side)).abs().max())
                         for side in ("chosen", "rejected"))
        results[f"shared_prompt_{precision}_max_abs_logp_diff"] = difference
        checks[f"shared_prompt_{precision}"] = difference <= THRESHOLDS[f"shared_prompt_{precision}_abs_diff_max"]


@torch.no_grad()
def check_export(cfg: DPOConfig, results: dict, checks: dict, device: torch.device) -> None:
    """OUTPUT/final against OUTPUT/adapter on the base model, in float32 (no autocast), on held-out pairs."""
    from peft import PeftModel

    output_dir = Path(cfg.output_dir)
    plain = cfg.model.model_copy(update={"gradient_checkpointing": False})
    tokenizer = load_tokenizer(plain)
    examples, _ = load_preference_examples(["posttrain/arithmetic-preference:heldout[:32]"], tokenizer, cfg.data)
    batch = batch_to(collate_preference(examples, tokenizer.pad_token_id), device)
    real = batch.attention_mask.bool()

    def logits(model: torch.nn.Module) -> torch.Tensor:
        return forward_logits(model.eval(), batch).float()[real]

    merged = logits(load_causal_lm(plain, output_dir / "final", device=device))
    base_logits = logits(load_causal_lm(plain, device=device))
    adapted = logits(PeftModel.from_pretrained(load_causal_lm(plain, device=device), str(output_dir / "adapter")))
    results["merged_vs_adapter_max_abs_logit_diff"] = float((merged - adapted).abs().max())
    results["merged_vs_base_max_abs_logit_diff"] = float((merged - base_logits).abs().max())
    checks["merged_equals_adapter"] = (results["merged_vs_adapter_max_abs_logit_diff"]
                                       <= THRESHOLDS["merged_logit_abs_diff_max"])
    checks["adapter_changed_the_model"] = (results["merged_vs_base_max_abs_logit_diff"]
                                           >= THRESHOLDS["adapter_logit_change_min"])


def check_resume(dpo_config, live: Path, resumed_dir: Path, steps: int, results: dict, checks: dict,
                 device: torch.device) -> None:
    """A copy of the finished LoRA run, rolled back to its checkpoint at steps/2, then re-run to the end."""
    shutil.rmtree(resumed_dir, ignore_errors=True)
    shutil.copytree(live, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / f"step_{steps}")
    shutil.rmtree(resumed_dir / "final")
    shutil.rmtree(resumed_dir / "adapter")
    train_dpo(dpo_config(resumed_dir, "reference=frozen_copy"))
    reference, resumed = losses(live), losses(resumed_dir)
    half = steps // 2
    results["resume_max_rel_diff"] = max(abs(a - b) / abs(a) for a, b in zip(reference[half:], resumed[half:]))
    checks["resume_matches"] = (len(resumed) == len(reference)
                                and results["resume_max_rel_diff"] <= THRESHOLDS["resume_rel_diff_max"])


def check_rm(output_dir: Path, rm_steps: int, extra: list[str], results: dict, checks: dict,
             device: torch.device) -> None:
    cfg = load_config(RMConfig, preset_path("rm_arithmetic.yaml"), [
        *RM_ARGS, f"output_dir={output_dir}", f"trainer.max_steps={rm_steps}",
        f"trainer.eval_every={max(1, rm_steps // 20)}", f"trainer.warmup_steps={min(20, rm_steps // 10)}", *extra,
    ])
    shutil.rmtree(output_dir, ignore_errors=True)
    result = train_rm(cfg)
    records = read_metrics(output_dir / "metrics.jsonl")
    evaluations = [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
    results["rm_eval_accuracy"] = evaluations
    results["rm_loss_first_last"] = [records[0]["loss"], records[-1]["loss"]]
    results["rm_last_eval_margin_bf16"] = records[-1]["eval_margin"]
    checks["rm_eval_accuracy_rises"] = evaluations[-1][1] - evaluations[0][1] > THRESHOLDS["rm_eval_accuracy_gain_min"]

    # The same held-out pairs the run evaluated on (the first data.max_eval_examples), scored by the exported
    # model: in float32, and under bf16 autocast as the run's evaluation was.
    (source,) = cfg.data.eval_files
    rows = [row for _, row in iter_embedded(source)][: cfg.data.max_eval_examples]
    scorer = RewardModel.from_pretrained(result.final_dir, device=device, dtype="float32",
                                         batch_size=cfg.trainer.eval_batch_size)
    prompts = [row["prompt"] for row in rows]

    def margins() -> tuple[torch.Tensor, list[float]]:
        chosen = scorer.score(prompts, [row["chosen"] for row in rows])
        rejected = scorer.score(prompts, [row["rejected"] for row in rows])
        return torch.tensor(chosen, dtype=torch.float64) - torch.tensor(rejected, dtype=torch.float64), chosen + rejected

    fp32, rewards = margins()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        bf16, _ = margins()
    last = result.eval_accuracy
    results["rm_rescored_pairs"] = len(rows)
    results["rm_rescored_accuracy_fp32"] = float((fp32 > 0).double().mean())
    results["rm_rescored_margin_fp32"] = float(fp32.mean())
    results["rm_rescored_accuracy_bf16"] = float((bf16 > 0).double().mean())
    # Pairs whose verdict float32 and bf16 scoring disagree on, and how close to a tie they are in float32
    # (|margin| over the spread of the rewards): bf16 rounding flips only near-ties.
    flipped = (fp32 > 0) != (bf16 > 0)
    scale = float(torch.tensor(rewards).std())
    results["rm_fp32_bf16_flipped_pairs"] = int(flipped.sum())
    results["rm_flipped_max_rel_margin"] = float(fp32[flipped].abs().max()) / scale if flipped.any() else 0.0
    tolerance = THRESHOLDS["rm_rescored_accuracy_abs_diff_max"]
    checks["rm_rescoring_bf16_matches_last_eval"] = abs(results["rm_rescored_accuracy_bf16"] - last) <= tolerance
    checks["rm_rescoring_fp32_matches_last_eval"] = (
        abs(results["rm_rescored_accuracy_fp32"] - last) <= tolerance
        or results["rm_flipped_max_rel_margin"] <= THRESHOLDS["rm_near_tie_rel_margin_max"])


if __name__ == "__main__":
    sys.exit(main())
