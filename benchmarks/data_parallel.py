"""Data-parallel FSDP2 on CPU: 2 ranks x 1 thread against 1 process x 2 threads on the same SFT (or GRPO) job.

Run (CPU, offline; each measured run is a fresh `posttrain sft` process, or two under torchrun):

    .venv/bin/python benchmarks/data_parallel.py                      # tiny (~1M) and ~21M models, 30 steps
    .venv/bin/python benchmarks/data_parallel.py --models tiny --steps 10 --json /tmp/dp.json   # quick check
    .venv/bin/python benchmarks/data_parallel.py --recipe grpo --steps 30  # GRPO: rollouts replicated or divided

What is compared, per model
    the same config file (the same data in the same order, micro_batch_size 8 x gradient_accumulation_steps 4 =
    32 rows of 2 to 90 tokens per optimizer step, AdamW, fp32) run as
    - `1 process`: `posttrain sft ... trainer.num_threads=2`, the local worker;
    - `2 ranks`:   `posttrain sft ... --nproc-per-node 2 trainer.num_threads=1`, FSDP2 over gloo, each rank
                   taking 2 of the step's 4 micro-batches.
    Both use the machine's two cores; the losses of both runs are compared step by step (they are the same
    update, to float rounding).

What is measured
    - throughput: non-padding tokens of the whole step (every rank's) per second, median over the steps after
      --skip-steps, from metrics.jsonl (rank 0 logs it after the step's collectives, so it covers the slowest
      rank);
    - peak memory per process: the largest VmHWM (peak resident set) of any training process, read from /proc
      while it runs;
    - training state per process: bytes of parameters + gradients + AdamW moments each process holds after one
      optimizer step, counted on the tensors themselves (the local shards under FSDP2), in a separate small
      run of the same model. Under FSDP2 each rank should hold about half of a full replica.
    The machine's load average is printed first: other work on the CPU makes timings noisy.

--recipe grpo
    the quickstart's GRPO stage from the embedded tiny model (16 prompts x 8 samples of 8 tokens per step, one
    update of 128 episodes), in one process of 2 threads and on 2 ranks of 1 thread, each with sampling seeded per
    round (every rank samples every group) and per group (`rollout.seed_per_group`: each rank samples and scores
    half of the groups): median seconds per step and of its generation, peak RSS per process, and the largest
    difference of the logged mean reward from the one-process run of the same seeding.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "tiny": None,  # posttrain/tiny, ~1.1M parameters
    "21m": {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8},
}
STATE_PROBE = r"""
import json, sys, torch
from posttrain.config.schema import LoraSection, ModelConfig, TrainerConfig
from posttrain.data.collate import collate_padded
from posttrain.data.types import TokenizedExample
from posttrain.distributed.builders import build_policy
from posttrain.process_group import init_from_env, rank
from posttrain.losses.nll import nll_loss
from posttrain.models.loading import load_tokenizer
init_from_env()
cfg = ModelConfig(name_or_path=sys.argv[1])
tokenizer = load_tokenizer(cfg)
policy = build_policy(cfg, LoraSection(), TrainerConfig(gradient_accumulation_steps=2), tokenizer, torch.device("cpu"))
batch = collate_padded([TokenizedExample(tuple(range(3, 40)), (0,) + (1,) * 36)] * 2, tokenizer.pad_token_id)
policy.forward_backward(batch, lambda logits, b, n: (nll_loss(logits, b.input_ids, b.loss_mask, n)[0], {}), 72.0)
local = lambda t: getattr(t, "_local_tensor", t)
nbytes = lambda ts: sum(local(t).numel() * local(t).element_size() for t in ts)
params = [p for p in policy.model.parameters()]
grads = [p.grad for p in params if p.grad is not None]
policy.optim_step()
moments = [v for state in policy.optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
print(json.dumps({"rank": rank(), "parameters": nbytes(params), "gradients": nbytes(grads), "optimizer": nbytes(moments)}))
"""


def build_model(name: str, spec: dict | None, directory: Path) -> str:
    """The embedded tiny model, or a Llama of `spec`'s shape with the embedded tokenizer, saved to `directory`."""
    if spec is None:
        return "posttrain/tiny"
    code = ("import sys; from transformers import LlamaConfig, LlamaForCausalLM; import torch;"
            "from posttrain.models.tiny import build_tokenizer; t = build_tokenizer(); torch.manual_seed(0);"
            f"m = LlamaForCausalLM(LlamaConfig(vocab_size=len(t), max_position_embeddings=512, **{spec!r}));"
            "m.save_pretrained(sys.argv[1]); t.save_pretrained(sys.argv[1])")
    subprocess.run([sys.executable, "-c", code, str(directory)], check=True, env=_env(1))
    return str(directory)


def write_rows(path: Path, count: int) -> Path:
    rng = random.Random(0)
    lines = []
    for i in range(count):
        numbers = " ".join(str(rng.randint(0, 99)) for _ in range(rng.choice([1, 3, 8, 15, 28])))
        lines.append(json.dumps({"prompt": f"echo {i}: ", "completion": numbers}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _env(threads: int) -> dict[str, str]:
    return {**os.environ, **_common.OFFLINE_ENV, "OMP_NUM_THREADS": str(threads)}


def _descendants(pid: int) -> list[int]:
    out = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                out += [int(child), *_descendants(int(child))]
    except OSError:
        pass
    return out


def _vm_hwm_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def sft_args(model: str, rows: Path, steps: int) -> list[str]:
    return [f"model.name_or_path={model}", f"data.train_files=[{rows}]", f"trainer.max_steps={steps}",
            "trainer.micro_batch_size=8", "trainer.gradient_accumulation_steps=4", "trainer.learning_rate=1e-3",
            "trainer.save_every=0"]


def grpo_args(steps: int, seed_per_group: bool) -> list[str]:
    """The quickstart's GRPO stage (16 prompts x 8 samples of up to 8 tokens, one update of 128 episodes) from the
    embedded tiny model, without validation or checkpoints."""
    return ["--config", str(ROOT / "configs" / "grpo_arithmetic.yaml"), "model.name_or_path=posttrain/tiny",
            f"trainer.max_steps={steps}", "trainer.eval_every=0", "trainer.save_every=0",
            f"rollout.seed_per_group={str(seed_per_group).lower()}"]


def run_training(recipe: str, recipe_args: list[str], output_dir: Path, nproc: int) -> dict:
    """One `posttrain RECIPE` run on the machine's two cores (one process of 2 threads, or `nproc` ranks sharing
    them); its metrics and the largest peak RSS of any of its training processes."""
    threads = 2 // nproc
    args = [*recipe_args, "logging.progress=none", "logging.plot=false", f"trainer.num_threads={threads}",
            f"output_dir={output_dir}"]
    command = [sys.executable, "-m", "posttrain", recipe, *args] + (["--nproc-per-node", str(nproc)] if nproc > 1 else [])
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(threads))
    peaks: dict[int, float] = {}

    def watch() -> None:
        while process.poll() is None:
            for pid in [process.pid, *_descendants(process.pid)]:
                value = _vm_hwm_mib(pid)
                if value is not None:
                    peaks[pid] = max(peaks.get(pid, 0.0), value)
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    _, stderr = process.communicate()
    watcher.join()
    if process.returncode != 0:
        raise RuntimeError(f"posttrain {recipe} failed:\n{stderr[-3000:]}")
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    # The launcher processes (posttrain re-executing itself, torchrun) are small; the ranks are the big ones.
    return {"records": records, "peak_rss_mib": max(peaks.values()) if peaks else None}


def state_bytes(model: str, nproc: int) -> list[dict]:
    probe = [sys.executable, "-c", STATE_PROBE, model]
    if nproc > 1:
        probe = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                 "--no-python", sys.executable, "-c", STATE_PROBE, model]
    out = subprocess.run(probe, capture_output=True, text=True, env=_env(1))
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,21m", help="comma-separated: tiny, 21m")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip-steps", type=int, default=5, help="steps left out of the throughput median")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--recipe", choices=["sft", "grpo"], default="sft",
                        help="grpo: the rollout-division comparison instead (see grpo_comparison)")
    args = parser.parse_args()
    _common.announce_environment()
    if args.recipe == "grpo":
        return grpo_comparison(args)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rows = write_rows(tmp / "rows.jsonl", 32 * args.steps)
        for name in args.models.split(","):
            model = build_model(name, MODELS[name], tmp / f"model-{name}")
            runs = {nproc: run_training("sft", sft_args(model, rows, args.steps), tmp / f"{name}-{nproc}", nproc)
                    for nproc in (1, 2)}
            states = {nproc: state_bytes(model, nproc) for nproc in (1, 2)}
            entry = {}
            for nproc, run in runs.items():
                steady = [r["tokens_per_second"] for r in run["records"][args.skip_steps:]]
                per_process = max(s["parameters"] + s["gradients"] + s["optimizer"] for s in states[nproc])
                entry[nproc] = {"tokens_per_second": _common.median(steady), "peak_rss_mib": run["peak_rss_mib"],
                                "state_mib": per_process / 2**20, "state": states[nproc]}
            losses = [[r["loss"] for r in runs[n]["records"]] for n in (1, 2)]
            entry["max_loss_difference"] = max(abs(a - b) for a, b in zip(*losses))
            results[name] = entry
    table = []
    for name, entry in results.items():
        one, two = entry[1], entry[2]
        table.append([name, _common.fmt(one["tokens_per_second"], 0), _common.fmt(two["tokens_per_second"], 0),
                      _common.fmt(_common.ratio(two["tokens_per_second"], one["tokens_per_second"])),
                      _common.fmt(one["peak_rss_mib"], 0), _common.fmt(two["peak_rss_mib"], 0),
                      _common.fmt(one["state_mib"], 1), _common.fmt(two["state_mib"], 1),
                      _common.fmt(_common.ratio(two["state_mib"], one["state_mib"])),
                      f"{entry['max_loss_difference']:.1e}"])
    print(_common.markdown_table(
        ["model", "tokens/s 1x2t", "tokens/s 2x1t", "ratio", "peak RSS MiB 1 proc", "peak RSS MiB per rank",
         "state MiB 1 proc", "state MiB per rank", "state ratio", "max |loss diff|"], table))
    if args.json:
        _common.write_json(args.json, results)
    return 0


GRPO_SETUPS = [("1 process x 2 threads", 1, False), ("2 ranks x 1 thread, every rank samples all", 2, False),
               ("1 process x 2 threads, seed_per_group", 1, True), ("2 ranks x 1 thread, seed_per_group", 2, True)]


def grpo_comparison(args) -> int:
    """GRPO's step on 2 ranks with sampling replicated (the default) and divided (rollout.seed_per_group), each
    against one process of 2 threads with the same seeding: median step and generation seconds after
    --skip-steps, and the largest reward difference from the one-process run of the same seeding (the same
    episodes: 0 up to float rounding)."""
    results, table = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for label, nproc, per_group in GRPO_SETUPS:
            run = run_training("grpo", grpo_args(args.steps, per_group), Path(tmp) / f"{nproc}-{per_group}", nproc)
            steady = run["records"][args.skip_steps:]
            results[label] = {
                "step_seconds": _common.median([r["time/step"] for r in steady]),
                "generate_seconds": _common.median([r["time/generate"] for r in steady]),
                "rewards": [r["reward/mean"] for r in run["records"]], "peak_rss_mib": run["peak_rss_mib"]}
    for label, nproc, per_group in GRPO_SETUPS:
        entry, one = results[label], results[GRPO_SETUPS[2 if per_group else 0][0]]
        entry["max_reward_difference"] = max(abs(a - b) for a, b in zip(entry["rewards"], one["rewards"]))
        table.append([label, _common.fmt(entry["step_seconds"], 3), _common.fmt(entry["generate_seconds"], 3),
                      _common.fmt(_common.ratio(one["step_seconds"], entry["step_seconds"])),
                      _common.fmt(entry["peak_rss_mib"], 0), f"{entry['max_reward_difference']:.1e}"])
    print(_common.markdown_table(["setup", "step s (median)", "generate s (median)", "speed vs 1 process",
                                  "peak RSS MiB per process", "max |reward diff| vs 1 process"], table))
    if args.json:
        _common.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
