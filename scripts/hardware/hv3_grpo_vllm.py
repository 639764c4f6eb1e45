"""HV-3: the GRPO loop on a CUDA device, sampling with vLLM and pushing weights into it every step.

Run on a machine with an NVIDIA GPU after `bash scripts/setup.sh vllm`:

    .venv/bin/python scripts/hardware/hv3_grpo_vllm.py [--out DIR] [--steps 60]

Checks, printing one JSON object (and exiting non-zero if any fails):
  1. `posttrain grpo` runs with rollout.backend=vllm on the embedded SFT'd tiny model (arithmetic);
  2. the generator and the trainer agree on the sampled tokens' logprobs after every weight push
     (generator_logprob_error small at the last step: the weights really arrived in the engine);
  3. truncated importance sampling keeps nearly all tokens (is_weight_mean near 1);
  4. the training reward rises and held-out accuracy does not fall, as on CPU with the transformers backend.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

from posttrain.algorithms.grpo import train_grpo
from posttrain.config import load_config
from posttrain.config.presets import preset_path
from posttrain.config.schema import GRPOConfig
from posttrain.logging import read_metrics

THRESHOLDS = {"generator_logprob_error_max": 0.05, "is_weight_mean_min": 0.9, "reward_gain_min": 0.03}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"hv": "HV-3", "error": "no CUDA device"}))
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="hv3-"))
    cfg = load_config(GRPOConfig, preset_path("grpo_arithmetic.yaml"), [
        f"output_dir={out / 'run'}", "rollout.backend=vllm", "rollout.vllm_gpu_memory_utilization=0.2",
        "loss.importance_correction=tis", f"trainer.max_steps={args.steps}", "trainer.eval_every=30",
        "trainer.save_every=0", "logging.progress=none", "logging.plot=false",
    ])
    train_grpo(cfg)
    records = read_metrics(out / "run" / "metrics.jsonl")
    window = max(1, len(records) // 4)
    first = sum(r["reward/mean"] for r in records[:window]) / window
    last = sum(r["reward/mean"] for r in records[-window:]) / window
    validation = [r["val/accuracy"] for r in records if "val/accuracy" in r]
    results = {
        "hv": "HV-3", "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "steps": len(records),
        "reward_first_quarter": first, "reward_last_quarter": last, "val_accuracy": validation,
        "generator_logprob_error_last": records[-1]["generator_logprob_error"],
        "is_weight_mean_last": records[-1]["is_weight_mean"],
        "seconds_per_step": sum(r["time/step"] for r in records) / len(records),
        "thresholds": THRESHOLDS,
    }
    results["checks"] = {
        "logprobs_agree": results["generator_logprob_error_last"] < THRESHOLDS["generator_logprob_error_max"],
        "is_weights_near_one": results["is_weight_mean_last"] > THRESHOLDS["is_weight_mean_min"],
        "reward_rises": last - first > THRESHOLDS["reward_gain_min"],
        "accuracy_holds": validation[-1] >= validation[0] - 0.02 if len(validation) > 1 else True,
    }
    results["passed"] = all(results["checks"].values())
    text = json.dumps(results, indent=2)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "hv3.json").write_text(text + "\n")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
