"""Helpers shared by the posttrain-vs-TRL benchmarks (sft_vs_trl.py, dpo_vs_trl.py, grpo_vs_trl.py, distill_vs_trl.py).

A benchmark script runs every measured training call in its own fresh Python process (a "worker"), so each
framework's imports, allocator state and peak memory are its own. The parent process only prepares the
inputs, starts the workers one at a time, collects their JSON results and prints medians and ratios.

Nothing here imports torch, transformers or TRL: the parent stays light, and a worker imports only what
its framework needs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.metadata
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

# Everything runs offline: nothing may be fetched from the Hugging Face hub, and no telemetry is sent.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
    "WANDB_DISABLED": "true",
    "WANDB_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONHASHSEED": "0",
}


def add_posttrain_trainer_flags(parser, compile_flag: bool = True) -> None:
    """The posttrain-side trainer knobs the comparisons with TRL share: --lm-head, --packing, --lm-head-chunk-size
    and (where the recipe allows it) --compile."""
    parser.add_argument("--lm-head", choices=["auto", "chunked", "full"], default="auto",
                        help="posttrain's trainer.lm_head (default auto)")
    parser.add_argument("--packing", action="store_true",
                        help="posttrain's trainer.packing=true: each padded micro-batch runs packed (default off)")
    parser.add_argument("--lm-head-chunk-size", type=int, default=1024,
                        help="posttrain's trainer.lm_head_chunk_size (default 1024)")
    if compile_flag:
        parser.add_argument("--compile", action="store_true",
                            help="posttrain's trainer.compile=true: torch.compile the model (default off)")


def apply_offline_env() -> None:
    """Set OFFLINE_ENV in this process (before transformers/datasets/TRL are imported)."""
    os.environ.update(OFFLINE_ENV)


# ---------------------------------------------------------------------------------------------------------
# Memory (Linux /proc)


def _proc_status_kib(key: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def rss_mib() -> float | None:
    """Current resident set size of this process (VmRSS), MiB."""
    kib = _proc_status_kib("VmRSS")
    return None if kib is None else kib / 1024


def peak_rss_mib() -> float | None:
    """Peak resident set size of this process (VmHWM) since start or the last reset_peak_rss(), MiB."""
    kib = _proc_status_kib("VmHWM")
    return None if kib is None else kib / 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to /proc/self/clear_refs). True if it worked."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
    except OSError:
        return False
    return True


# ---------------------------------------------------------------------------------------------------------
# Environment description


def package_versions(names: Iterable[str]) -> dict[str, str | None]:
    """Installed distribution versions (None when not installed), read without importing the packages."""
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def loadavg() -> list[float] | None:
    """1-, 5- and 15-minute load averages: a busy machine makes every timing here unreliable."""
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info["loadavg_at_start"] = loadavg()
    return info


# ---------------------------------------------------------------------------------------------------------
# Workers


class WorkerError(RuntimeError):
    pass


def run_worker(
    argv: Sequence[str], result_path: Path, log_path: Path, timeout_s: float, env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Run `python argv...` in a fresh process; it must write its result as JSON to result_path.

    stdout and stderr go to log_path. Raises WorkerError (with the log's tail) on a non-zero exit, a
    timeout or a missing result.
    """
    result_path.unlink(missing_ok=True)
    full_env = {**os.environ, **OFFLINE_ENV, **(env or {})}
    started = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            process = subprocess.run(
                [sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT, env=full_env, timeout=timeout_s
            )
            returncode: int | str = process.returncode
        except subprocess.TimeoutExpired:
            returncode = f"timeout after {timeout_s:.0f}s"
    elapsed = time.perf_counter() - started
    if returncode != 0 or not result_path.is_file():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
        raise WorkerError(f"worker {' '.join(argv)} failed (exit {returncode}); last lines of {log_path}:\n{tail}")
    result = json.loads(result_path.read_text())
    result["process_seconds"] = elapsed
    return result


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


# ---------------------------------------------------------------------------------------------------------
# Numbers


def steady_state_throughput(tokens_per_step: Sequence[int], step_end_times: Sequence[float], skip: int) -> dict[str, float]:
    """Tokens per second over steps skip+1..N, timed from the end of step `skip` to the end of step N.

    step_end_times[i] is a perf_counter() reading taken when step i+1 ended (same clock within one process);
    tokens_per_step[i] the tokens step i+1 processed. The first `skip` steps (warm-up) are left out.
    """
    if len(tokens_per_step) != len(step_end_times):
        raise ValueError(f"{len(tokens_per_step)} token counts but {len(step_end_times)} step times")
    if not 0 < skip < len(step_end_times) - 1:
        raise ValueError(f"cannot skip {skip} of {len(step_end_times)} steps and keep at least two")
    seconds = step_end_times[-1] - step_end_times[skip - 1]
    tokens = sum(tokens_per_step[skip:])
    durations = [b - a for a, b in zip(step_end_times[skip - 1 : -1], step_end_times[skip:])]
    return {
        "tokens_per_second": tokens / seconds,
        # Robust to a few steps stalled by other processes (equal to the above on a quiet machine, give or take
        # the spread of step lengths).
        "median_step_tokens_per_second": statistics.median(t / d for t, d in zip(tokens_per_step[skip:], durations)),
        "steady_seconds": seconds,
        "steady_tokens": tokens,
        "steady_steps": len(durations),
        "median_step_ms": 1000 * statistics.median(durations),
    }


def steady_state_step_seconds(step_end_times: Sequence[float], skip: int) -> dict[str, float]:
    """Seconds per step over steps skip+1..N, each step timed from the previous step's end to its own end.

    step_end_times[i] is a perf_counter() reading taken when step i+1 ended; the first `skip` steps (warm-up)
    are left out. For jobs whose work per step is not a fixed token count (RL: sampled completions vary).
    """
    if not 0 < skip < len(step_end_times) - 1:
        raise ValueError(f"cannot skip {skip} of {len(step_end_times)} steps and keep at least two")
    durations = [b - a for a, b in zip(step_end_times[skip - 1 : -1], step_end_times[skip:])]
    seconds = step_end_times[-1] - step_end_times[skip - 1]
    return {
        # Robust to a few steps stalled by other processes.
        "median_step_seconds": statistics.median(durations),
        "mean_step_seconds": seconds / len(durations),
        "steady_seconds": seconds,
        "steady_steps": len(durations),
    }


def median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    separator = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), separator, *(line(r) for r in rows)])


def alternating_orders(frameworks: Sequence[str], repeats: int) -> list[list[str]]:
    """Run order per repeat: as given, then reversed, and so on, so neither framework always goes first."""
    return [list(frameworks) if r % 2 == 0 else list(reversed(frameworks)) for r in range(repeats)]


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


# ---------------------------------------------------------------------------------------------------------
# Worker helpers


def load_spec(path: str) -> dict[str, Any]:
    """The JSON spec a benchmark's parent wrote for one worker run."""
    return json.loads(Path(path).read_text())


def baseline_rss_mib(load_model_and_tokenizer: Callable[[], tuple[Any, Any]]) -> float | None:
    """Load the model and tokenizer once (pulling in the lazily imported modeling code), free them, and
    return the RSS then: the worker's baseline (the caller resets the peak to it before training)."""
    model, tokenizer = load_model_and_tokenizer()
    del model, tokenizer
    gc.collect()
    return rss_mib()


@contextlib.contextmanager
def measured_run(framework: str, version: str | None, baseline: float | None) -> Iterator[dict[str, Any]]:
    """Measure the training call made inside the `with` block: yields the worker's common result fields, filled
    in on exit (peak RSS reset to the current RSS on entry when the kernel allows it; wall time; peak RSS; torch
    threads; load average). A worker returns {**fields, ...its own}."""
    import torch

    fields: dict[str, Any] = {"framework": framework, "version": version, "baseline_rss_mib": baseline,
                              "peak_reset": reset_peak_rss()}
    started = time.perf_counter()
    yield fields
    fields.update(wall_seconds=time.perf_counter() - started, peak_rss_mib=peak_rss_mib(),
                  torch_threads=torch.get_num_threads(), loadavg_at_end=loadavg())


def trl_baseline_rss_mib(model_dir: str) -> float | None:
    """`baseline_rss_mib` for a TRL worker: the model as TRL loads it here (float32, sdpa) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return baseline_rss_mib(lambda: (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa"),
        AutoTokenizer.from_pretrained(model_dir),
    ))


def trl_step_recorder(log_key: str) -> Any:
    """A TrainerCallback keeping the time of every step's begin and end (step_begins, step_ends) and every log
    record that has `log_key` (logs: {"step": global step, **record})."""
    from transformers import TrainerCallback

    class StepRecorder(TrainerCallback):
        def __init__(self):
            self.step_begins: list[float] = []
            self.step_ends: list[float] = []
            self.logs: list[dict[str, float]] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.step_begins.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.step_ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and log_key in logs:
                self.logs.append({"step": state.global_step, **logs})

    return StepRecorder()


def announce_environment() -> tuple[dict[str, str | None], dict[str, Any]]:
    """Print the package versions and the machine (warning when the CPU is busy); return both for the report."""
    versions = package_versions(["posttrain", "trl", "transformers", "torch", "accelerate", "datasets", "tokenizers"])
    machine = machine_info()
    print("Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    load = machine.get("loadavg_at_start")
    print(f"Machine: {machine.get('cpu_model', '?')}, {machine['cpu_count']} CPUs ({machine['affinity_cpus']} usable), "
          f"load average at start {load}, Python {machine['python']}")
    if load and load[0] > 0.5:
        print(f"warning: the load average is {load[0]:.2f}: other processes are using the CPU, so the timings will be "
              "noisy and may favour either framework. Re-run on a quiet machine.")
    return versions, machine


def record_posttrain_step_ends() -> dict[int, float]:
    """Time every posttrain training step from inside this (worker) process: returns a dict that fills with
    {step: perf_counter() at the step's end}. RunLogger.log (or .advance, for steps not logged) is called once
    per step, right after the optimizer step, so consecutive entries delimit one whole step. Patches the class,
    so call it before the training call."""
    import posttrain.logging

    step_ends: dict[int, float] = {}
    original_log, original_advance = posttrain.logging.RunLogger.log, posttrain.logging.RunLogger.advance

    def log(self, step, metrics):
        step_ends.setdefault(step, time.perf_counter())
        return original_log(self, step, metrics)

    def advance(self, step, metrics=None):
        step_ends.setdefault(step, time.perf_counter())
        return original_advance(self, step, metrics)

    posttrain.logging.RunLogger.log, posttrain.logging.RunLogger.advance = log, advance
    return step_ends


def trl_optimization_and_bookkeeping(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The TRL config arguments the posttrain-vs-TRL benchmarks share: spec["steps"] steps at a constant
    spec["learning_rate"] (a script replaces the schedule itself when the spec asks for another), AdamW betas
    0.9/0.999, eps 1e-8, no weight decay, clipping at 1.0, spec["trl_optim"] if set; a metrics record every step,
    no tracker, no progress bar, no evaluation, one checkpoint at the last step."""
    return {
        "max_steps": spec["steps"],
        "learning_rate": spec["learning_rate"],
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_epsilon": 1e-8,
        "max_grad_norm": 1.0,
        **({"optim": spec["trl_optim"]} if spec["trl_optim"] else {}),
        "logging_steps": 1,
        "report_to": "none",
        "disable_tqdm": True,
        "eval_strategy": "no",
        "save_strategy": "steps",
        "save_steps": spec["steps"],
        "save_total_limit": 1,
    }


def write_prompt_completion_rows(work_dir: Path, dataset: str, num_rows: int, seed: int, order_name: str,
                                 keep: Callable[[dict[str, str]], bool] | None = None) -> Path:
    """Write num_rows prompt/completion rows of `dataset` (those `keep` accepts, when given), in a seeded shuffled
    order (reshuffled each time the rows are used up; the order depends on order_name and seed), to
    work_dir/train.jsonl."""
    from posttrain.data import iter_records

    rows = [{"prompt": r["prompt"], "completion": r["completion"]} for _, r in iter_records(dataset)]
    if keep is not None:
        rows = [r for r in rows if keep(r)]
    if not rows:
        raise ValueError(f"no row of {dataset} is usable")
    ordered: list[dict[str, str]] = []
    epoch = 0
    while len(ordered) < num_rows:
        order = list(range(len(rows)))
        random.Random(f"{order_name}/{seed}/{epoch}").shuffle(order)
        ordered.extend(rows[i] for i in order[: num_rows - len(ordered)])
        epoch += 1
    path = work_dir / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ordered))
    return path


def posttrain_trainer_section(spec: Mapping[str, Any]) -> dict[str, Any]:
    """posttrain's `trainer:` keys matching trl_optimization_and_bookkeeping: spec["steps"] steps of
    spec["micro_batch_size"] x spec["accumulation"] examples at spec["learning_rate"] (schedule spec["lr_scheduler"],
    default constant, after spec["warmup_steps"], default 0), AdamW 0.9/0.999, eps 1e-8, no weight decay, clipping at
    1.0, fp32, a metrics record every step, no evaluation, one checkpoint (at the last step), spec["threads"] torch
    threads and the --lm-head/--packing/--compile/--lm-head-chunk-size flags."""
    return {
        "max_steps": spec["steps"],
        "learning_rate": spec["learning_rate"],
        "lr_scheduler": spec.get("lr_scheduler", "constant"),
        "warmup_steps": spec.get("warmup_steps", 0),
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
    }


def trl_fp32_cpu_args(config_class: Any) -> dict[str, Any]:
    """The TRL config arguments that make a run plain fp32 on CPU with the model loaded as posttrain loads it
    (float32, SDPA): TRL's defaults of bf16 and gradient checkpointing turned off."""
    fields = {f.name for f in dataclasses.fields(config_class)}
    return {
        "use_cpu": True,
        "bf16": False,
        "fp16": False,
        "gradient_checkpointing": False,  # TRL's default is True
        # transformers >= 5.x renamed it; setting both avoids the deprecation path.
        **({"activation_checkpointing": False} if "activation_checkpointing" in fields else {}),
        "model_init_kwargs": {"dtype": "float32", "attn_implementation": "sdpa"},
    }


def jsonl_dataset(path: str | Path):
    """A datasets.Dataset of the JSON rows of `path` (in a worker: imports datasets)."""
    import datasets

    with open(path) as file:
        rows = [json.loads(line) for line in file if line.strip()]
    return datasets.Dataset.from_list(rows)


def train_and_save_quietly(trainer: Any, final_dir: Path) -> None:
    """trainer.train() without per-step console output (posttrain runs with logging.progress=none), then
    save_model(final_dir)."""
    from transformers import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.train()
    trainer.save_model(str(final_dir))
