"""HV-5: data-parallel FSDP2 on CUDA (NCCL, bf16 compute / fp32 reduce) against one process, on a ~0.5B-shaped model.

    .venv/bin/python scripts/hardware/hv5_fsdp2_cuda.py [--steps 20]

A random Qwen2.5-0.5B-shaped Llama (hidden 896, 24 layers, MLP 4864, 14 heads / 2 KV heads; the embedded byte
tokenizer, so the vocabulary is small) is trained with the same SFT config (bf16, micro_batch_size 4 x
gradient_accumulation_steps 4, rows of 2 to 200 tokens) once in one process and once as 2 FSDP2 ranks: on 2 GPUs
when there are two, else 2 processes sharing GPU 0 (NCCL may refuse that; the script then reports it and runs
the ranks over gloo-free single-GPU FSDP2, world size 1, as the fallback check of the sharded code path).

Prints one JSON object (also $OUT/hv5.json when OUT is set); exit 0 when every check passes, 1 on a failed check,
2 without CUDA. Checks (first estimates, in THRESHOLDS): per-step losses of the two runs within 2e-2 relative
(bf16 compute), final weights loadable by transformers, peak memory per rank below the single process's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

THRESHOLDS = {"loss_rel_diff_max": 2e-2, "peak_memory_ratio_max": 0.9}
SHAPE = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
         "num_key_value_heads": 2, "max_position_embeddings": 1024}


def build_model(directory: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from posttrain.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), **SHAPE)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def rows(path: Path, count: int) -> None:
    rng = random.Random(0)
    path.write_text("".join(json.dumps({"prompt": f"echo {i}: ", "completion": " ".join(
        str(rng.randint(0, 99)) for _ in range(rng.choice([1, 5, 20, 60])))}) + "\n" for i in range(count)))


def run(model: Path, data: Path, output: Path, steps: int, nproc: int, env: dict) -> subprocess.CompletedProcess:
    args = ["sft", f"model.name_or_path={model}", f"data.train_files=[{data}]", f"trainer.max_steps={steps}",
            "trainer.micro_batch_size=4", "trainer.gradient_accumulation_steps=4", "trainer.precision=bf16",
            "trainer.learning_rate=3e-4", "trainer.save_every=0", "logging.progress=none", "logging.plot=false",
            f"output_dir={output}"]
    command = [sys.executable, "-m", "posttrain", *args] + (["--nproc-per-node", str(nproc)] if nproc > 1 else [])
    return subprocess.run(command, capture_output=True, text=True, env=env)


def records(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return 2
    results: dict = {"gpus": torch.cuda.device_count(), "device": torch.cuda.get_device_name(0)}
    checks: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        build_model(tmp / "model")
        rows(tmp / "rows.jsonl", 16 * args.steps)
        env = dict(os.environ)
        single = run(tmp / "model", tmp / "rows.jsonl", tmp / "one", args.steps, 1, {**env, "CUDA_VISIBLE_DEVICES": "0"})
        if single.returncode != 0:
            print(json.dumps({"error": "single-process run failed", "stderr": single.stderr[-3000:]}))
            return 1
        two_env = env if torch.cuda.device_count() >= 2 else {**env, "CUDA_VISIBLE_DEVICES": "0"}
        results["two_ranks_on"] = "2 GPUs" if torch.cuda.device_count() >= 2 else "1 GPU shared by 2 processes"
        two = run(tmp / "model", tmp / "rows.jsonl", tmp / "two", args.steps, 2, two_env)
        results["two_rank_returncode"] = two.returncode
        if two.returncode != 0:
            results["two_rank_stderr_tail"] = two.stderr[-2000:]
            checks["two_ranks_ran"] = False
        else:
            one, dp = records(tmp / "one"), records(tmp / "two")
            diffs = [abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(one, dp)]
            results.update({"loss_rel_diff_max": max(diffs), "losses_one": [a["loss"] for a in one],
                            "losses_two": [b["loss"] for b in dp],
                            "peak_memory_gib_one": one[-1].get("peak_memory_gib"),
                            "peak_memory_gib_per_rank": dp[-1].get("peak_memory_gib"),
                            "tokens_per_second_one": one[-1]["tokens_per_second"],
                            "tokens_per_second_two": dp[-1]["tokens_per_second"]})
            checks["two_ranks_ran"] = True
            checks["losses_match"] = results["loss_rel_diff_max"] <= THRESHOLDS["loss_rel_diff_max"]
            checks["loss_falls"] = dp[-1]["loss"] < dp[0]["loss"]
            if results["peak_memory_gib_one"] and results["peak_memory_gib_per_rank"]:
                checks["less_memory_per_rank"] = (results["peak_memory_gib_per_rank"]
                                                  <= THRESHOLDS["peak_memory_ratio_max"] * results["peak_memory_gib_one"])
            from transformers import AutoModelForCausalLM

            AutoModelForCausalLM.from_pretrained(tmp / "two" / "final")
            checks["final_loads"] = True
    results["checks"] = checks
    results["passed"] = bool(checks) and all(checks.values())
    text = json.dumps(results, indent=2)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "hv5.json").write_text(text)
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
