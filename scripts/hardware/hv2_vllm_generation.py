"""HV-2: the vLLM generation backend on a CUDA device — greedy parity, sampler logprobs, stop strings,
update_weights and sleep.

Run on a machine with an NVIDIA GPU, after `bash scripts/setup.sh` and `pip install 'posttrain[vllm]'`:

    .venv/bin/python scripts/hardware/hv2_vllm_generation.py [--model NAME_OR_PATH] [--workdir DIR]

The reference is the Hugging Face model in float32. vLLM runs the same checkpoint through
`posttrain.generation.vllm_backend.VLLMGenerator` (in-process engine, processed logprobs, CUDA graphs) twice,
each in a fresh subprocess: once in float32, where the two must agree to float32 precision, which checks the
backend's logic (sampling parameters, temperature, logprob extraction, weight loading) with sharp thresholds;
once in bfloat16, the dtype used in training, where bf16 rounding sets looser thresholds and the numbers show
how far generator and trainer logprobs drift (what the importance-sampling correction absorbs).

By default the model is posttrain/tiny-2m (random Llama-architecture weights, tied embeddings, byte-level
tokenizer saved as tokenizer.json), "sharpened": the decoder layers' matrices are multiplied by --layer-scale
and the final norm weight by --logit-scale. The raw random model predicts an almost uniform distribution over
the bytes, on which a broken weight load or a missing temperature would barely show; sharpened, it has
context-dependent distributions (top-1 probability ~0.4, entropy ~2.4 nats), so the comparisons can fail.
Use --layer-scale 1 --logit-scale 1 with a trained model.

Prints one JSON object (also written to $OUT/hv2.json when OUT is set); exit 0 when every check of both phases
passes, 1 when one fails, 2 when there is no CUDA device or no vllm. Checks, per phase:
  greedy:        vLLM's greedy token ids equal HF `generate`'s (do_sample=False) for at least a set fraction of the
                 prompts; every divergence is a near-tie (HF's two candidate logits within the tie margin); no
                 sequence is a strict prefix of the other (eos ends both alike);
  logprobs:      at temperature 1.0 and 0.7, vLLM's logprobs of its sampled tokens against HF's recomputed at the
                 same temperature (mean and max abs error); at 0.7 they are much closer to HF's tempered logprobs
                 than to its untempered ones (logprobs_mode="processed_logprobs" took effect);
  stop_strings:  a completion ended by a stop string ends with it (kept in the text) and holds no earlier one;
                 one that ran out of budget holds none (skipped when vLLM runs without its tokenizer);
  sleep:         sleep(level=1) frees GPU memory;
  update_weights: while asleep, push the perturbed HF model's state_dict (HF names, tied lm_head included), then
                 generate: logprobs match the perturbed model and are far from the stale weights';
  throughput (bfloat16 phase): tokens per second of a larger batch, reported only.
If vLLM cannot start with its own tokenizer, the phase rebuilds the engine with skip_tokenizer_init=True
(completions decoded with the HF tokenizer); tokenizer_loaded_by_vllm and engine_error_with_tokenizer say so.
Takes about 3-5 minutes on one H200, mostly the two engine start-ups (torch.compile and CUDA graph capture).
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from posttrain.generation.base import Completion, SamplingParams
from posttrain.models.loading import resolve_model_path

THRESHOLDS = {
    "float32": {
        "greedy_exact_match_rate_min": 0.9,
        "greedy_tie_margin": 0.01,
        "logprob_mean_abs_max": 2e-3,
        "logprob_max_abs_max": 5e-2,
        "tempered_over_untempered_error_max": 0.05,
        "updated_mean_abs_max": 2e-3,
        "updated_over_stale_error_max": 0.05,
        "sleep_freed_gib_min": 1.0,
    },
    # bf16 against an fp32 reference on the sharpened model, simulated on the CPU (HF in bf16): greedy sequences
    # of 48 tokens agree for ~15% of prompts with first divergences at logit gaps up to 0.24; logprob error mean
    # ~0.06, max ~0.65; error against untempered logprobs at 0.7 ~0.36; stale weights ~8.8.
    "bfloat16": {
        "greedy_exact_match_rate_min": 0.0,
        "greedy_tie_margin": 0.5,
        "logprob_mean_abs_max": 0.15,
        "logprob_max_abs_max": 1.5,
        "tempered_over_untempered_error_max": 0.5,
        "updated_mean_abs_max": 0.15,
        "updated_over_stale_error_max": 0.1,
        "sleep_freed_gib_min": 1.0,
    },
}
"""First estimates, to revisit with the first hardware results."""

TEXT_PROMPTS = [
    "what is 12+3", "The quick brown fox", "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return", "Once upon a time", "héllo wörld", "1 2 3 4 5", "a",
]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="posttrain/tiny-2m", help="embedded name, HF directory or hub id")
    parser.add_argument("--layer-scale", type=float, default=5.0)
    parser.add_argument("--logit-scale", type=float, default=12.0)
    parser.add_argument("--workdir", default=None, help="for the reference checkpoint and phase results (default: temp)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="engine dtypes to check, one phase each")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--num-samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / torch.compile (faster start)")
    parser.add_argument("--skip-tokenizer-init", action="store_true", help="never let vLLM load the tokenizer")
    parser.add_argument("--phase-timeout", type=int, default=240, help="seconds allowed to each phase")
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # internal: run one phase (a dtype)
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="hv2-"))
    if args.phase is not None:
        return run_phase(args, workdir)

    if not torch.cuda.is_available():
        return finish({"hv": "HV-2", "error": "no CUDA device: HV-2 needs an NVIDIA GPU"}, 2)
    if importlib.util.find_spec("vllm") is None:
        return finish({"hv": "HV-2", "error": "vllm is not installed: pip install 'posttrain[vllm]' on this machine"}, 2)

    started = time.perf_counter()
    results: dict = {"hv": "HV-2", "model": args.model, "layer_scale": args.layer_scale, "logit_scale": args.logit_scale,
                     "workdir": str(workdir), "phases": {}}
    prepare_reference_model(args.model, workdir / "reference", args.layer_scale, args.logit_scale)
    for dtype in args.dtypes.split(","):
        results["phases"][dtype] = run_phase_subprocess(dtype, workdir, args.phase_timeout)
    results["passed"] = all(phase.get("passed", False) for phase in results["phases"].values())
    results["total_seconds"] = round(time.perf_counter() - started, 1)
    return finish(results, 0 if results["passed"] else 1)


def run_phase_subprocess(dtype: str, workdir: Path, timeout: int) -> dict:
    """One phase in a fresh process (one engine per process), its output going to stderr; its result read from a file."""
    output = workdir / f"phase-{dtype}.json"
    output.unlink(missing_ok=True)
    command = [sys.executable, __file__, *sys.argv[1:], "--workdir", str(workdir), "--phase", dtype]
    try:
        process = subprocess.run(command, check=False, stdout=sys.stderr, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"passed": False, "error": f"phase {dtype} ran past {timeout} s"}
    if not output.exists():
        return {"passed": False, "error": f"phase {dtype} exited with {process.returncode} and wrote no result (log above)"}
    return json.loads(output.read_text())


def run_phase(args: argparse.Namespace, workdir: Path) -> int:
    import transformers
    import vllm

    dtype, thresholds = args.phase, THRESHOLDS[args.phase]
    device = torch.device("cuda")
    # vLLM runs in this process: keep float32 matmuls in full float32 for the engine (float32 phase) and the reference.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    results: dict = {
        "dtype": dtype, "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "vllm": vllm.__version__,
        "transformers": transformers.__version__, "thresholds": thresholds,
    }
    checks: dict[str, bool] = {}
    reference_dir = workdir / "reference"
    hf = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(reference_dir)
    prompts = build_prompts(tokenizer, args.num_prompts)

    t0 = time.perf_counter()
    generator = build_generator(str(reference_dir), dtype, args, results)
    results["engine_start_seconds"] = round(time.perf_counter() - t0, 1)
    results["float32_matmul_precision"] = torch.get_float32_matmul_precision()

    # Greedy parity.
    greedy = generator.generate(prompts, SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0))
    vllm_greedy = [row[0].token_ids for row in greedy.completions]
    hf_greedy = [hf_generate_greedy(hf, prompt, args.max_new_tokens, tokenizer) for prompt in prompts]
    results["greedy"] = compare_greedy(hf, prompts, vllm_greedy, hf_greedy, thresholds["greedy_tie_margin"])
    checks["greedy"] = (results["greedy"]["exact_match_rate"] >= thresholds["greedy_exact_match_rate_min"]
                        and results["greedy"]["non_tie_divergences"] == 0 and results["greedy"]["prefix_mismatches"] == 0)

    # Logprobs of the sampled tokens, under the sampling temperature.
    samples: dict[float, list[list[Completion]]] = {}
    for temperature in (1.0, 0.7):
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=temperature, seed=1234)
        samples[temperature] = generator.generate(prompts, params, args.num_samples).completions
        errors = logprob_errors(hf, samples[temperature], temperature)
        results[f"logprobs_t{temperature}"] = errors
        checks[f"logprobs_t{temperature}"] = (errors["mean_abs"] <= thresholds["logprob_mean_abs_max"]
                                             and errors["max_abs"] <= thresholds["logprob_max_abs_max"])
    untempered = logprob_errors(hf, samples[0.7], 1.0)
    results["logprobs_t0.7_against_untempered_hf"] = untempered
    checks["logprobs_are_tempered"] = (results["logprobs_t0.7"]["mean_abs"]
                                       <= thresholds["tempered_over_untempered_error_max"] * untempered["mean_abs"])
    results["text_matches_hf_decode_rate"] = text_match_rate(samples[1.0], tokenizer)

    # Stop strings: the characters the model emits most, so that they do trigger.
    if results["tokenizer_loaded_by_vllm"]:
        stops = most_common_ascii(samples[1.0], 3)
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, stop_strings=stops, seed=99)
        stopped = generator.generate(prompts, params, args.num_samples).completions
        results["stop_strings"] = check_stop_strings(stopped, stops, tokenizer.eos_token_id)
        checks["stop_strings"] = results["stop_strings"]["violations"] == 0 and results["stop_strings"]["stopped"] > 0
    else:
        results["stop_strings"] = "skipped: vLLM runs without its tokenizer, so it cannot match stop strings"

    # Sleep, update_weights while asleep (wakes the weights only), generate (wakes the KV cache).
    free_awake = torch.cuda.mem_get_info()[0]
    generator.sleep(level=1)
    results["sleep_freed_gib"] = round((torch.cuda.mem_get_info()[0] - free_awake) / 2**30, 2)
    checks["sleep"] = results["sleep_freed_gib"] >= thresholds["sleep_freed_gib_min"]
    hf_new = perturbed_copy(hf, noise=0.5, seed=7)
    stale = logprob_errors(hf_new, samples[1.0], 1.0)
    t0 = time.perf_counter()
    generator.update_weights(1, hf_new.state_dict().items())
    results["update_weights_seconds"] = round(time.perf_counter() - t0, 3)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=4321)
    updated_samples = generator.generate(prompts, params, args.num_samples).completions
    updated = logprob_errors(hf_new, updated_samples, 1.0)
    results["update_weights"] = {"stale_against_new_hf": stale, "updated_against_new_hf": updated,
                                 "updated_against_old_hf": logprob_errors(hf, updated_samples, 1.0)}
    checks["update_weights"] = (updated["mean_abs"] <= thresholds["updated_mean_abs_max"]
                                and updated["mean_abs"] <= thresholds["updated_over_stale_error_max"] * stale["mean_abs"])

    if dtype == "bfloat16":
        big = build_prompts(tokenizer, 256, seed=1)
        out = generator.generate(big, SamplingParams(max_new_tokens=128, temperature=1.0), num_samples=8)
        results["throughput"] = {"prompts": 256, "samples_per_prompt": 8, "tokens": out.num_generated_tokens,
                                 "seconds": round(out.seconds, 2),
                                 "tokens_per_second": round(out.num_generated_tokens / out.seconds)}

    results["checks"] = checks
    results["passed"] = all(checks.values())
    (workdir / f"phase-{dtype}.json").write_text(json.dumps(results) + "\n")
    return 0


def finish(results: dict, code: int) -> int:
    text = json.dumps(results)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "hv2.json").write_text(text + "\n")
    return code


def prepare_reference_model(source: str, directory: Path, layer_scale: float, logit_scale: float) -> None:
    """Save the model in float32, sharpened (see the module docstring), with its tokenizer, to `directory`."""
    path = resolve_model_path(source)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if (layer_scale, logit_scale) != (1, 1):
        with torch.no_grad():  # model.model.layers / model.model.norm: Llama, Qwen2 and most decoder-only HF models
            for param in model.model.layers.parameters():
                if param.ndim >= 2:
                    param.mul_(layer_scale)
            model.model.norm.weight.mul_(logit_scale)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(path).save_pretrained(directory)


def build_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    """A few text prompts, then random byte-token prompts of 1-60 tokens."""
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in TEXT_PROMPTS][:count]
    generator = torch.Generator().manual_seed(seed)
    while len(prompts) < count:
        length = int(torch.randint(1, 61, (1,), generator=generator))
        prompts.append(torch.randint(0, 256, (length,), generator=generator).tolist())
    return prompts


def build_generator(model_dir: str, dtype: str, args: argparse.Namespace, results: dict):
    from posttrain.generation.vllm_backend import VLLMGenerator

    kwargs = {"dtype": dtype, "gpu_memory_utilization": args.gpu_memory_utilization, "enable_sleep_mode": True,
              "seed": 0, "enforce_eager": args.enforce_eager}
    if not args.skip_tokenizer_init:
        try:
            generator = VLLMGenerator(model_dir, **kwargs)
            results["tokenizer_loaded_by_vllm"] = True
            return generator
        except Exception as err:  # noqa: BLE001 — recorded in the summary, then one retry without vLLM's tokenizer
            results["engine_error_with_tokenizer"] = f"{type(err).__name__}: {err}"[:2000]
            gc.collect()
            torch.cuda.empty_cache()
    results["tokenizer_loaded_by_vllm"] = False
    return VLLMGenerator(model_dir, skip_tokenizer_init=True, **kwargs)


@torch.no_grad()
def hf_generate_greedy(model: PreTrainedModel, prompt: list[int], max_new_tokens: int, tokenizer) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def hf_logits(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 logits."""
    return model(torch.tensor([ids], device=model.device)).logits[0].float()


def compare_greedy(hf: PreTrainedModel, prompts, vllm_tokens, hf_tokens, tie_margin: float) -> dict:
    exact, ties, non_ties, prefix, margins, examples = 0, 0, 0, 0, [], []
    for i, (prompt, ours, theirs) in enumerate(zip(prompts, vllm_tokens, hf_tokens)):
        if ours == theirs:
            exact += 1
            continue
        if len(examples) < 3:
            examples.append({"prompt": i, "vllm": ours, "hf": theirs})
        position = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if position is None:  # one stopped (eos) where the other went on
            prefix += 1
            continue
        logits = hf_logits(hf, prompt + theirs[:position])[-1]
        margin = float(logits[theirs[position]] - logits[ours[position]])
        margins.append(round(margin, 5))
        if margin <= tie_margin:
            ties += 1
        else:
            non_ties += 1
    return {"prompts": len(prompts), "exact_match_rate": exact / len(prompts), "tie_divergences": ties,
            "non_tie_divergences": non_ties, "prefix_mismatches": prefix, "divergence_margins": margins,
            "examples": examples}


@torch.no_grad()
def logprob_errors(model: PreTrainedModel, completions: list[list[Completion]], temperature: float) -> dict:
    """|generator logprob - HF logprob under `temperature`| over every sampled token."""
    diffs = []
    for row in completions:
        for completion in row:
            if not completion.token_ids:
                continue
            start = len(completion.prompt_ids) - 1
            logits = hf_logits(model, completion.prompt_ids + completion.token_ids)[start:start + len(completion.token_ids)]
            tokens = torch.tensor(completion.token_ids, device=logits.device)
            reference = torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens[:, None])[:, 0]
            diffs.append((torch.tensor(completion.logprobs, device=logits.device) - reference).abs())
    diff = torch.cat(diffs)
    return {"tokens": diff.numel(), "mean_abs": float(diff.mean()), "max_abs": float(diff.max()),
            "p99_abs": float(diff.quantile(0.99))}


def text_match_rate(completions: list[list[Completion]], tokenizer) -> float:
    flat = [c for row in completions for c in row]
    return sum(c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in flat) / len(flat)


def most_common_ascii(completions: list[list[Completion]], count: int) -> tuple[str, ...]:
    counts = Counter(ch for row in completions for c in row for ch in c.text if ch.isascii() and ch.isprintable())
    return tuple(ch for ch, _ in counts.most_common(count))


def check_stop_strings(completions: list[list[Completion]], stops: tuple[str, ...], eos_id: int) -> dict:
    """Counts completions ended by a stop string, and those that break the stop-string contract."""
    stopped, violations, examples = 0, 0, []
    for row in completions:
        for c in row:
            ends = [c.text.find(s) + len(s) for s in stops if s in c.text]
            first_end = min(ends) if ends else None
            if c.finish_reason == "stop" and c.token_ids and c.token_ids[-1] != eos_id:
                stopped += 1
                ok = first_end == len(c.text)
            else:
                ok = first_end is None
            if not ok:
                violations += 1
                if len(examples) < 3:
                    examples.append({"text": c.text, "finish_reason": c.finish_reason, "tokens": c.token_ids})
    return {"stops": list(stops), "stopped": stopped, "violations": violations, "examples": examples}


def perturbed_copy(model: PreTrainedModel, noise: float, seed: int) -> PreTrainedModel:
    """A copy with Gaussian noise (noise x each matrix's std) on every matrix and ±10% on every norm weight."""
    new = copy.deepcopy(model)
    generator = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for param in new.parameters():  # a tied matrix appears once
            draw = torch.randn(param.shape, generator=generator, device=param.device, dtype=param.dtype)
            if param.ndim >= 2:
                param.add_(noise * param.std() * draw)
            else:
                param.mul_(1 + 0.1 * draw)
    return new.eval()


if __name__ == "__main__":
    sys.exit(main())
