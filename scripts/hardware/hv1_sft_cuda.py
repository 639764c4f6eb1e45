"""HV-1: SFT on a CUDA device — bf16 autocast, packed rows with the block-causal mask, resume.

Run on a machine with an NVIDIA GPU after `bash scripts/setup.sh`:

    .venv/bin/python scripts/hardware/hv1_sft_cuda.py [--out DIR]

Checks, printing one JSON object (and exiting non-zero if any fails):
  1. training runs on cuda with trainer.precision=bf16 and data.packing=true, and the loss falls;
  2. packed and padded batches give the same per-token logprobs on the GPU (bf16 tolerance);
  3. a run stopped after its checkpoint and re-run logs the same losses as an uninterrupted run
     (to 1e-3 relative: CUDA kernels need not be bitwise deterministic).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from posttrain.algorithms.sft import train_sft
from posttrain.config import SFTConfig, load_config
from posttrain.data.collate import collate_packed, collate_padded
from posttrain.data.types import TokenizedExample
from posttrain.logging import read_metrics
from posttrain.losses.nll import token_logprobs
from posttrain.models.loading import load_causal_lm
from posttrain.workers.forward import batch_to, forward_logits

ARGS = ["data.train_files=[posttrain/arithmetic:train]", "data.packing=true", "data.max_length=128",
        "trainer.precision=bf16", "trainer.max_steps=200", "trainer.learning_rate=3e-3", "trainer.warmup_steps=10",
        "trainer.micro_batch_size=64", "trainer.save_every=100", "logging.progress=none", "logging.plot=false"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--allow-cpu", action="store_true", help="dry-run the script's logic on the CPU")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="hv1-"))
    if not torch.cuda.is_available() and not args.allow_cpu:
        print(json.dumps({"hv": "HV-1", "error": "no CUDA device"}))
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (dry run)"
    results: dict = {"hv": "HV-1", "device": name, "torch": torch.__version__}

    full = load_config(SFTConfig, None, ARGS + [f"output_dir={out / 'full'}"])
    train_sft(full)
    losses = [r["loss"] for r in read_metrics(out / "full" / "metrics.jsonl")]
    results["loss_first"], results["loss_last"] = losses[0], losses[-1]
    results["loss_falls"] = losses[-1] < 0.5 * losses[0]

    model = load_causal_lm(full.model.model_copy(update={"name_or_path": str(out / "full" / "final")}),
                           device=device).eval()
    g = torch.Generator().manual_seed(0)
    examples = [TokenizedExample(tuple(torch.randint(0, 256, (n,), generator=g).tolist()), tuple([0] + [1] * (n - 1)))
                for n in (5, 60, 17, 33, 9, 41)]
    padded, packed = collate_padded(examples, 257), collate_packed(examples, 257, 128)
    padded, packed = batch_to(padded, device), batch_to(packed, device)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        lp_pad = token_logprobs(forward_logits(model, padded), padded.input_ids)
        lp_pack = token_logprobs(forward_logits(model, packed), packed.input_ids)
    pad_targets = torch.cat([lp_pad[i][padded.loss_mask[i] > 0] for i in range(len(examples))]).sort().values
    pack_targets = lp_pack[packed.loss_mask > 0].sort().values
    results["packing_max_abs_diff"] = float((pad_targets - pack_targets).abs().max())
    results["packing_matches"] = results["packing_max_abs_diff"] < 5e-2

    # Resume: a copy of the finished run, rolled back to its step-100 checkpoint, then re-run.
    resumed_dir = out / "resumed"
    shutil.copytree(out / "full", resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "step_200")
    shutil.rmtree(resumed_dir / "final")
    train_sft(load_config(SFTConfig, None, ARGS + [f"output_dir={resumed_dir}"]))
    resumed = [r["loss"] for r in read_metrics(resumed_dir / "metrics.jsonl")]
    reference = [r["loss"] for r in read_metrics(out / "full" / "metrics.jsonl")]
    results["resume_max_rel_diff"] = max(abs(a - b) / abs(a) for a, b in zip(reference[100:], resumed[100:]))
    results["resume_matches"] = len(resumed) == len(reference) and results["resume_max_rel_diff"] < 1e-3
    ok = results["loss_falls"] and results["packing_matches"] and results["resume_matches"]
    results["passed"] = bool(ok)
    print(json.dumps(results))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
