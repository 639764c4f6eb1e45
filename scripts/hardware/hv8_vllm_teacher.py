"""HV-8: a distillation teacher served by vLLM (teachers[i].backend=vllm) on a CUDA device.

Run on a machine with an NVIDIA GPU, after `bash scripts/setup.sh` and `pip install 'posttrain[vllm]'`:

    .venv/bin/python scripts/hardware/hv8_vllm_teacher.py [--model NAME_OR_PATH] [--workdir DIR]

--model is the teacher: a local Hugging Face directory or a hub id (default Qwen/Qwen2.5-0.5B-Instruct; give a local
path on a machine without network).

Phases, each in a fresh subprocess (one vLLM engine per process, and a clean GPU for each):
  compare-<dtype> (float32, bfloat16 by default): the same padded batch of rows of different lengths (the model's
      tokenizer on a few texts) scored by `posttrain.generation.vllm_scorer.VLLMScoringWorker` (an engine of that
      dtype) and by the transformers scorer (`LocalScoringWorker`, trainer.lm_head=full) in float32 (the reference,
      TF32 off) and, for bfloat16, also in bfloat16 (what backend=transformers with dtype bfloat16 gives, for
      scale). Reported against the reference at every real position: the token log-probabilities' max and mean
      absolute difference, the top-k values' max absolute difference (both sorted largest first), top-1
      agreement, the mean overlap of the two top-k id sets, and the seconds each scorer took (engine start-up
      apart).
  distill-transformers, distill-vllm: `python -m posttrain distill` for --steps steps, the teacher in bfloat16 with
      backend transformers, then vllm; the student a small random Qwen2 (2 layers, hidden 128) with the teacher's
      tokenizer, on the embedded arithmetic data (no network). Reported: per-step losses, teacher_seconds.

Checks (first estimates, in THRESHOLDS): per compare phase, the vLLM scorer's errors against the float32 reference
within that dtype's bounds; distill: both runs finish every step with finite losses, the two runs' losses agree
step by step within loss_rel_diff_max (the student starts identical; the teachers differ by kernels only), and the
vLLM run's loss falls (mean of its last quarter of steps below its first quarter's).

Prints one JSON object (also $OUT/hv8.json when OUT is set); exit 0 when every check passes, 1 when one fails, 2
without CUDA or vllm. Expect a few minutes on one H200, mostly engine start-ups (--enforce-eager shortens the
compare phases' ones).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from posttrain.logging import read_metrics

THRESHOLDS = {
    # float32 engine against the float32 transformers model: the scorer's logic (positions, order, the last
    # position from the sampled token) with sharp bounds; only kernels differ.
    "float32": {"token_mean_abs_max": 1e-3, "token_max_abs_max": 5e-2, "topk_values_max_abs_max": 5e-2,
                "top1_agreement_min": 0.98, "topk_overlap_min": 0.95},
    # bfloat16 engine against float32: rounding of the weights and activations (HV-2's bfloat16 bounds).
    "bfloat16": {"token_mean_abs_max": 0.15, "token_max_abs_max": 1.5, "topk_values_max_abs_max": 1.5,
                 "top1_agreement_min": 0.9, "topk_overlap_min": 0.8},
    "distill": {"loss_rel_diff_max": 5e-2},
}
TEXTS = [
    "The capital of France is Paris.",
    "Write a function that adds two numbers and returns the sum. def add(a, b):\n    return a + b",
    "1 + 1 = 2",
    "Distillation trains a small student model to match the next-token distributions of a larger teacher model, "
    "token by token, on prompts and completions drawn from a dataset or sampled by the student itself.",
    "Hi",
]
K = 16


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct", help="the teacher: HF directory or hub id")
    parser.add_argument("--workdir", default=None, help="student, runs and phase results (default: a temp folder)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="engine dtypes to compare, one phase each")
    parser.add_argument("--steps", type=int, default=30, help="steps of each distill run")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--enforce-eager", action="store_true", help="compare phases: no CUDA graphs (faster start)")
    parser.add_argument("--phase-timeout", type=int, default=400, help="seconds allowed to each phase")
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # internal: run one phase
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="hv8-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.phase is not None:
        result = compare(args, args.phase.removeprefix("compare-"))
        (workdir / f"{args.phase}.json").write_text(json.dumps(result))
        return 0

    if not torch.cuda.is_available():
        return finish({"hv": "HV-8", "error": "no CUDA device: HV-8 needs an NVIDIA GPU"}, 2)
    if importlib.util.find_spec("vllm") is None:
        return finish({"hv": "HV-8", "error": "vllm is not installed: pip install 'posttrain[vllm]' on this machine"},
                      2)
    started = time.perf_counter()
    results: dict = {"hv": "HV-8", "model": args.model, "workdir": str(workdir), "thresholds": THRESHOLDS,
                     "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "phases": {}}
    for dtype in args.dtypes.split(","):
        results["phases"][f"compare-{dtype}"] = run_compare_phase(f"compare-{dtype}", workdir, args.phase_timeout)
    results["phases"]["distill"] = run_distill(args, workdir)
    results["passed"] = all(phase.get("passed", False) for phase in results["phases"].values())
    results["total_seconds"] = round(time.perf_counter() - started, 1)
    return finish(results, 0 if results["passed"] else 1)


def finish(results: dict, code: int) -> int:
    text = json.dumps(results, indent=1)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "hv8.json").write_text(text + "\n")
    return code


def run_compare_phase(phase: str, workdir: Path, timeout: int) -> dict:
    """One compare phase in a fresh process, its log going to stderr; its result read from a file."""
    output = workdir / f"{phase}.json"
    output.unlink(missing_ok=True)
    command = [sys.executable, __file__, *sys.argv[1:], "--workdir", str(workdir), "--phase", phase]
    started = time.perf_counter()
    try:
        process = subprocess.run(command, check=False, stdout=sys.stderr, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"passed": False, "error": f"{phase} ran past {timeout} s"}
    if not output.exists():
        return {"passed": False, "error": f"{phase} exited with {process.returncode} and wrote no result (log above)"}
    result = json.loads(output.read_text())
    result["phase_seconds"] = round(time.perf_counter() - started, 1)
    return result


# ---- compare: the two scorers on the same rows -----------------------------------------------------------------


def compare(args: argparse.Namespace, dtype: str) -> dict:
    from transformers import AutoTokenizer

    from posttrain.config.schema import ModelConfig, TrainerConfig
    from posttrain.data.collate import collate
    from posttrain.data.types import TokenizedExample
    import vllm

    from posttrain.generation.vllm_scorer import VLLMScoringWorker
    from posttrain.models.loading import load_causal_lm, resolve_model_path
    from posttrain.workers.local import LocalScoringWorker

    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference in full float32
    torch.backends.cudnn.allow_tf32 = False
    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    examples = []
    for text in TEXTS:
        ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
        examples.append(TokenizedExample(ids, (0,) + (1,) * (len(ids) - 1)))
    batch = collate(examples, pad, packing=False, max_length=max(len(e) for e in examples))
    real = batch.attention_mask.bool()
    predicted = real.clone()
    predicted[:, 0] = False  # log p(token t | < t) exists for t ≥ 1

    result: dict = {"dtype": dtype, "vllm": vllm.__version__, "rows": [len(e) for e in examples], "k": K}
    started = time.perf_counter()
    served = VLLMScoringWorker(path, dtype=dtype, gpu_memory_utilization=args.gpu_memory_utilization,
                               max_model_len=batch.input_ids.shape[1] + 1, max_logprobs=K,
                               **({"enforce_eager": True} if args.enforce_eager else {}))
    result["vllm_engine_start_seconds"] = round(time.perf_counter() - started, 1)
    scores = {"vllm": timed(served, batch)}
    device = torch.device("cuda")
    trainer = TrainerConfig(lm_head="full")  # every position, as the vLLM scorer gives
    reference = LocalScoringWorker(load_causal_lm(ModelConfig(name_or_path=path, dtype="float32"), device=device),
                                   trainer)
    scores["transformers_float32"] = timed(reference, batch)
    if dtype != "float32":
        same_dtype = LocalScoringWorker(load_causal_lm(ModelConfig(name_or_path=path, dtype=dtype), device=device),
                                        trainer)
        scores[f"transformers_{dtype}"] = timed(same_dtype, batch)
    truth = scores["transformers_float32"]
    result["scorers"] = {name: {"seconds": round(score["seconds"], 3), **against(score, truth, real, predicted)}
                         for name, score in scores.items() if name != "transformers_float32"}
    result["scorers"]["transformers_float32"] = {"seconds": round(truth["seconds"], 3)}
    bounds, vllm_errors = THRESHOLDS[dtype], result["scorers"]["vllm"]
    result["checks"] = {
        "token_mean_abs": vllm_errors["token_mean_abs"] <= bounds["token_mean_abs_max"],
        "token_max_abs": vllm_errors["token_max_abs"] <= bounds["token_max_abs_max"],
        "topk_values_max_abs": vllm_errors["topk_values_max_abs"] <= bounds["topk_values_max_abs_max"],
        "top1_agreement": vllm_errors["top1_agreement"] >= bounds["top1_agreement_min"],
        "topk_overlap": vllm_errors["topk_overlap"] >= bounds["topk_overlap_min"],
        "padding_is_zero": bool((scores["vllm"]["topk_values"][~real] == 0).all()
                                and (scores["vllm"]["logprobs"][~predicted] == 0).all()),
    }
    result["passed"] = all(result["checks"].values())
    return result


def timed(scorer, batch) -> dict:
    """The scorer's log-probabilities and top-K of `batch`, and the seconds both calls took."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    logprobs = scorer.logprobs(batch)
    values, ids = scorer.topk_logprobs(batch, K)
    torch.cuda.synchronize()
    return {"logprobs": logprobs, "topk_values": values, "topk_ids": ids, "seconds": time.perf_counter() - started}


def against(score: dict, truth: dict, real: torch.Tensor, predicted: torch.Tensor) -> dict:
    """Errors of `score` against `truth` at the real positions (token log-probabilities: positions t ≥ 1)."""
    token = (score["logprobs"][predicted] - truth["logprobs"][predicted]).abs()
    values = (score["topk_values"][real] - truth["topk_values"][real]).abs()
    ids, true_ids = score["topk_ids"][real], truth["topk_ids"][real]
    overlap = [len(set(a.tolist()) & set(b.tolist())) / K for a, b in zip(ids, true_ids)]
    return {"token_max_abs": float(token.max()), "token_mean_abs": float(token.mean()),
            "topk_values_max_abs": float(values.max()),
            "top1_agreement": float((ids[:, 0] == true_ids[:, 0]).float().mean()),
            "topk_overlap": sum(overlap) / len(overlap)}


# ---- distill: posttrain distill with each backend --------------------------------------------------------------


def build_student(teacher: str, directory: Path) -> None:
    """A small random Qwen2 with the teacher's tokenizer (so the plain top-k loss applies, not the aligner)."""
    from transformers import AutoConfig, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from posttrain.models.loading import resolve_model_path

    path = resolve_model_path(teacher)
    tokenizer = AutoTokenizer.from_pretrained(path)
    source = AutoConfig.from_pretrained(path)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=source.vocab_size, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=source.bos_token_id, eos_token_id=source.eos_token_id)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def run_distill(args: argparse.Namespace, workdir: Path) -> dict:
    student = workdir / "student"
    if not (student / "config.json").exists():
        build_student(args.model, student)
    runs = {}
    for backend in ("transformers", "vllm"):
        output = workdir / f"distill-{backend}"
        teacher = f"name_or_path: '{args.model}', dtype: bfloat16, backend: {backend}"
        if backend == "vllm":
            teacher += f", vllm_gpu_memory_utilization: {args.gpu_memory_utilization}"
        command = [sys.executable, "-m", "posttrain", "distill", f"model.name_or_path={student}",
                   f"teachers=[{{{teacher}}}]", "data.train_files=['posttrain/arithmetic:train[:2048]']",
                   "data.max_length=64", "loss.topk=16", f"trainer.max_steps={args.steps}",
                   "trainer.micro_batch_size=32", "trainer.learning_rate=1e-3", "trainer.lr_scheduler=constant",
                   "trainer.save_every=0", "seed=0", "logging.progress=none", "logging.plot=false",
                   "logging.report=false", f"output_dir={output}"]
        started = time.perf_counter()
        try:
            process = subprocess.run(command, check=False, stdout=sys.stderr, stderr=sys.stderr,
                                     timeout=args.phase_timeout)
            code = process.returncode
        except subprocess.TimeoutExpired:
            code = None
        records = [r for r in read_metrics(output / "metrics.jsonl") if "loss" in r] if (
            output / "metrics.jsonl").exists() else []
        runs[backend] = {"exit_code": code, "seconds": round(time.perf_counter() - started, 1),
                         "losses": [r["loss"] for r in records],
                         "teacher_seconds_mean": (sum(r["teacher_seconds"] for r in records) / len(records)
                                                  if records else None)}
    local, served = runs["transformers"]["losses"], runs["vllm"]["losses"]
    complete = all(run["exit_code"] == 0 and len(run["losses"]) == args.steps
                   and all(math.isfinite(x) for x in run["losses"]) for run in runs.values())
    result: dict = {"runs": runs}
    result["loss_rel_diff_max"] = (max(abs(a - b) / max(abs(a), 1e-8) for a, b in zip(local, served))
                                   if complete else None)
    quarter = max(1, args.steps // 4)
    result["checks"] = {
        "both_runs_complete_and_finite": complete,
        "losses_agree": complete and result["loss_rel_diff_max"] <= THRESHOLDS["distill"]["loss_rel_diff_max"],
        "vllm_run_loss_falls": complete and sum(served[-quarter:]) < sum(served[:quarter]),
    }
    result["passed"] = all(result["checks"].values())
    return result



if __name__ == "__main__":
    raise SystemExit(main())
