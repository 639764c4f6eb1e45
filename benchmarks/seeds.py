"""Run a preset over several seeds and both CPU code paths; print min / median / max of what it claims.

    python benchmarks/seeds.py sft_arithmetic                    # seeds 0-4 x {default, avx2}, 2 runs at a time
    python benchmarks/seeds.py quickstart --seeds 0-9
    python benchmarks/seeds.py dpo_arithmetic rm_arithmetic      # several presets, one after the other
    python benchmarks/seeds.py grpo_arithmetic --paths avx2 --jobs 1 --threads 2
    python benchmarks/seeds.py sft_arithmetic trainer.learning_rate=1e-3   # KEY=VALUE goes to every run

A documented outcome is the worst case over seeds and CPU code paths, never one trajectory: the same seed
rounds floats differently on CPUs with other instruction sets (oneDNN and MKL pick kernels by ISA), and a
recipe near its stability edge turns that into a different result. This script is how a claim in README.md,
BENCHMARKS.md or a config's header is checked:

- code paths: `default` (whatever this CPU offers) and `avx2`, which stands in for another CPU:
  ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 (oneDNN's and MKL's kernels) and ATEN_CPU_CAPABILITY=avx2
  (PyTorch's own vectorized kernels: softmax, norms, reductions, elementwise ops). The last one matters: on
  an AMD CPU MKL already runs its AVX2 kernels, and the first two variables alone change no bit of a run;
- each run is a fresh process (`posttrain RECIPE --config configs/PRESET.yaml seed=N`), with
  `trainer.num_threads` = --threads; --jobs runs go side by side (default 2 x 1 thread on 2 cores);
- presets that start from an SFT'd model (dpo, rm, ppo and the GRPO family) start, with the default
  `--start seeded`, from their start preset run with the same seed on the same code path (reused from that
  preset's own sweep when it has been run), so the starting model's variance is part of the spread;
  `--start embedded` uses the embedded model a user gets (built once per code path, seed 0);
- every run's result is kept in OUTPUT/PRESET/PATH-seedN/result.json and reused on a re-run (--fresh
  recomputes), so an interrupted sweep continues where it stopped;
- the table (and OUTPUT/PRESET/summary.json) gives min / median / max of each metric and whether each claim
  holds on the worst run. The exit status is 1 when a claim fails.

Every training run also reports `steps_per_second` (steps after the first two, from `time/step`) and
`train_reward_last50` (the mean sampled reward of its last 50 steps). Asynchronous GRPO against synchronous, with a
reward that takes about as long as a training step (BENCHMARKS.md, "Asynchronous against synchronous GRPO"):

    export POSTTRAIN_BENCH_REWARD_SECONDS=0.12
    R="cluster.backend=ray trainer.max_steps=800 trainer.eval_every=0 trainer.save_every=0 environment.kind=python"
    F="environment.options={functions: ['$PWD/benchmarks/slow_reward.py:slow_correct'], num_workers: 0, samples_per_call: 128}"
    python benchmarks/seeds.py grpo_arithmetic --start embedded --seeds 0-2 --jobs 1 $R "$F" --label ray-sync
    python benchmarks/seeds.py grpo_arithmetic --start embedded --seeds 0-2 --jobs 1 $R "$F" --label ray-async \
        rollout.asynchronous=true loss.importance_correction=tis

Held-out exact match is greedy, on 800 held-out 2-digit additions (`posttrain eval ... num_examples=800`); the
quickstart's own table scores the same 800 problems, so its GRPO stage is also a `grpo_arithmetic` run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import OFFLINE_ENV, announce_environment, markdown_table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CODE_PATHS: dict[str, dict[str, str]] = {
    "default": {},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}
HELD_OUT_PROBLEMS = 800
LOWER_IS_BETTER = {"seconds", "reward_minus_accuracy"}
"""Metrics whose worst run is the one with the largest value (so are those whose name ends in `loss`)."""
CLI = "import sys; from posttrain.cli import main; sys.exit(main(sys.argv[1:]))"


@dataclass(frozen=True)
class Claim:
    """What a preset's documentation promises of one metric, checked on the worst run."""

    metric: str
    text: str
    holds: Callable[[float], bool]


@dataclass(frozen=True)
class Preset:
    recipe: str
    """sft, dpo, rm, grpo, ppo, distill or quickstart."""
    start: str | None = None
    """The SFT preset whose model this one starts from (its `model.name_or_path` is an embedded trained model)."""
    claims: tuple[Claim, ...] = field(default_factory=tuple)
    model_reward: bool = False
    """Trained on a model's reward (a reward model or a judge) with the verifier beside it at weight 0: report how
    the model reward moved (`reward_gain`: last minus first greedy val/reward_mean) and how far it ends above the
    verifier's accuracy (`reward_minus_accuracy`, meaningful for 0/1 rewards)."""
    reward_model: str | None = None
    """The rm preset whose run of the same seed and code path scores this preset's reward_model components."""
    teacher: str | None = None
    """A distillation preset's teacher (an embedded model): its held-out exact match is measured on each code path
    and `gap_closed` = (exact_match - start) / (teacher_exact_match - start) reported, `start` being the starting
    student's exact match (the start preset's model, or `untrained` for a preset without one)."""
    untrained: str = "posttrain/tiny"
    """The untrained student of a distillation preset without a start preset, scored on the same code path."""
    eval_args: tuple[str, ...] = ()
    """How `posttrain eval` scores this preset's models instead of greedy exact match on the built-in 2-digit
    additions (e.g. the tool-use word problems, with the tools environment); the eval's tool-call metrics are
    reported beside exact_match."""
    held_out: tuple[str, ...] = ()
    """More held-out sets of the arithmetic environment (embedded dataset names, e.g. posttrain/subtraction:heldout),
    each reported as exact_match/<task>: the greedy exact match of the run's model on its prompts."""


def at_least(metric: str, bound: float, text: str) -> Claim:
    return Claim(metric, text, lambda value: value >= bound)


GRPO_CLAIMS = (Claim("exact_match_gain", "raises held-out exact match over its starting model", lambda v: v > 0),)
PRESETS: dict[str, Preset] = {
    "sft_arithmetic": Preset("sft", claims=(at_least("exact_match", 0.90, ">= 90% held-out exact match"),)),
    "sft_arithmetic_small": Preset("sft"),
    "sft_arithmetic_large": Preset("sft", claims=(at_least("exact_match", 0.99, ">= 99% held-out exact match"),)),
    "distill_kd_arithmetic": Preset("distill", claims=(
        at_least("gap_closed", 0.5, "closes at least half the held-out exact-match gap between the untrained student "
                 "and its larger teacher, posttrain/tiny-2m-arithmetic-sft"),),
        teacher="posttrain/tiny-2m-arithmetic-sft"),
    "distill_mopd_arithmetic": Preset("distill", claims=(
        at_least("exact_match", 0.5, ">= 50% held-out exact match on addition: half the gap from the untrained "
                 "student (0%) to its addition teacher posttrain/tiny-arithmetic-sft (100%)"),
        at_least("exact_match/subtraction", 0.5, ">= 50% held-out exact match on subtraction: half the gap from "
                 "the untrained student (0%) to its subtraction teacher posttrain/tiny-subtraction-sft (100%)"),
    ), held_out=("posttrain/subtraction:heldout",)),
    "distill_gkd_arithmetic": Preset("distill", "sft_arithmetic_small", (
        at_least("gap_closed", 0.5, "closes >= half the held-out exact-match gap from its starting student "
                 "(sft_arithmetic_small) to its teacher posttrain/tiny-arithmetic-sft"),),
        teacher="posttrain/tiny-arithmetic-sft"),
    "opd_arithmetic": Preset("grpo", "sft_arithmetic_small", (
        at_least("gap_closed", 0.5, "closes >= half the held-out exact-match gap from its starting student "
                 "(sft_arithmetic_small) to its teacher posttrain/tiny-arithmetic-sft"),),
        teacher="posttrain/tiny-arithmetic-sft"),
    "sft_bpe_arithmetic": Preset("sft", claims=(at_least("exact_match", 0.90, ">= 90% held-out exact match"),)),
    "distill_xtoken_arithmetic": Preset("distill", claims=(
        at_least("gap_closed", 0.5, "closes at least half the held-out exact-match gap between the untrained student "
                 "and its teacher with another tokenizer, posttrain/tiny-bpe-arithmetic-sft"),),
        teacher="posttrain/tiny-bpe-arithmetic-sft"),
    "distill_xtoken_onpolicy_arithmetic": Preset("distill", "sft_arithmetic_small", (
        at_least("gap_closed", 0.5, "closes at least half the held-out exact-match gap from its starting student "
                 "(sft_arithmetic_small) to its teacher with another tokenizer, posttrain/tiny-bpe-arithmetic-sft"),),
        teacher="posttrain/tiny-bpe-arithmetic-sft"),
    "dpo_arithmetic": Preset("dpo", "sft_arithmetic", (
        at_least("eval_reward_accuracy", 0.90, ">= 0.90 held-out reward accuracy"),
        Claim("exact_match_gain", "does not lower held-out exact match", lambda v: v >= 0),
    )),
    "rm_arithmetic": Preset("rm", "sft_arithmetic", (at_least("eval_accuracy", 0.95, ">= 0.95 held-out accuracy"),)),
    **{f"{name}_arithmetic": Preset("grpo", "sft_arithmetic_small", GRPO_CLAIMS)
       for name in ("grpo", "dapo", "gspo", "cispo", "rloo", "dr_grpo", "gdpo")},
    "ppo_arithmetic": Preset("ppo", "sft_arithmetic_small", GRPO_CLAIMS),
    "ppo_rlhf_arithmetic": Preset("ppo", "sft_arithmetic_small", (
        *GRPO_CLAIMS, Claim("reward_gain", "raises the reward model's score", lambda v: v > 0),
    ), model_reward=True, reward_model="rm_arithmetic"),
    "grpo_judge_arithmetic": Preset("grpo", "sft_arithmetic_small", GRPO_CLAIMS, model_reward=True),
    "quickstart": Preset("quickstart", claims=(
        at_least("grpo_minus_sft", 0.20, "GRPO at least 20 points above its own SFT stage"),
        Claim("grpo_minus_control", "GRPO above the equal-step SFT control", lambda v: v > 0),
    )),
}
TOOLS_EVAL = ("--data", "posttrain/arithmetic-tools:heldout[:400]", "environment.kind=tools",
              "environment.options={tools: [calculator], task: {kind: arithmetic}, tool_call_format: hermes}",
              "max_turns=2", "max_new_tokens=96")
"""Held-out accuracy of the tool-use presets: 400 word problems, greedy, the calculator offered, two turns."""
PRESETS["sft_tools_arithmetic"] = Preset("sft", eval_args=TOOLS_EVAL)
PRESETS["grpo_tools_arithmetic"] = Preset("grpo", "sft_tools_arithmetic", GRPO_CLAIMS, eval_args=TOOLS_EVAL)
START_MODELS = {"sft_tools_arithmetic": "posttrain/tiny-tools-sft",
                "sft_arithmetic": "posttrain/tiny-arithmetic-sft",
                "sft_arithmetic_small": "posttrain/tiny-arithmetic-sft-small"}


@dataclass
class Sweep:
    output: Path
    threads: int
    start: str
    fresh: bool

    def env(self, code_path: str) -> dict[str, str]:
        return {**os.environ, **OFFLINE_ENV, **CODE_PATHS[code_path], "OMP_NUM_THREADS": str(self.threads),
                "POSTTRAIN_CACHE_DIR": str(self.output / f"cache-{code_path}")}

    def posttrain(self, code_path: str, args: list[str], log: Path) -> str:
        """Run the posttrain CLI in a fresh process; return its stdout (the log keeps stdout and stderr)."""
        process = subprocess.run([sys.executable, "-c", CLI, *args], capture_output=True, text=True,
                                 env=self.env(code_path), cwd=ROOT)
        with log.open("a") as file:
            file.write(f"$ posttrain {' '.join(args)}\n{process.stdout}{process.stderr}\n")
        if process.returncode != 0:
            tail = "\n".join((process.stdout + process.stderr).splitlines()[-30:])
            raise RuntimeError(f"posttrain {args[0]} failed (exit {process.returncode}); see {log}:\n{tail}")
        return process.stdout

    def exact_match(self, code_path: str, model: str, log: Path, data: str | None = None,
                    eval_args: tuple[str, ...] = (), metrics: dict[str, Any] | None = None) -> float:
        """Greedy exact match of `model` on the built-in task's held-out problems, on the prompts of `data`
        scored by the arithmetic environment, or as `eval_args` say (a preset's own evaluation). `metrics`, when
        given, receives the evaluation's tool-call metrics (tools/...) and turns/mean."""
        where = ["--data", data, "--environment", "arithmetic"] if data else [f"num_examples={HELD_OUT_PROBLEMS}"]
        out = self.posttrain(code_path, ["eval", "--model", model, "--json", *(eval_args or where)], log)
        report = json.loads(out.strip().splitlines()[-1])
        if metrics is not None:
            metrics.update({k: v for k, v in report.items() if k.startswith("tools/") or k == "turns/mean"})
        return report["accuracy"]

    def run(self, name: str, code_path: str, seed: int, overrides: list[str], label: str = "") -> dict[str, Any]:
        """One seeded run of preset `name` on `code_path` (cached in its result.json, reused while the overrides
        and the starting-model choice are the same). A start preset runs without the overrides or the label."""
        preset = PRESETS[name]
        run_dir = self.output / folder(name, label) / f"{code_path}-seed{seed}"
        result_file = run_dir / "result.json"
        settings = {"overrides": overrides, "start": self.start if preset.start else None}
        if result_file.is_file() and not self.fresh:
            cached = json.loads(result_file.read_text())
            if cached.get("settings") == settings:
                return cached
        if (run_dir / "run").exists():
            shutil.rmtree(run_dir / "run")  # other settings, or unfinished: start over rather than resume
        run_dir.mkdir(parents=True, exist_ok=True)
        log = run_dir / "log.txt"
        log.write_text("")
        started = time.perf_counter()
        result: dict[str, Any] = {"preset": name, "code_path": code_path, "seed": seed, "settings": settings}
        if preset.recipe == "quickstart":
            threads = [f"{stage}.trainer.num_threads={self.threads}" for stage in ("sft", "grpo")]
            self.posttrain(code_path, ["quickstart", f"output_dir={run_dir / 'run'}", f"sft.seed={seed}",
                                       f"grpo.seed={seed}", "sft.logging.progress=plain", "grpo.logging.progress=plain",
                                       *threads, *overrides], log)
            summary = json.loads((run_dir / "run" / "summary.json").read_text())
            result.update({stage: summary[stage]["accuracy"] for stage in ("sft", "control", "grpo")})
            result["grpo_minus_sft"] = result["grpo"] - result["sft"]
            result["grpo_minus_control"] = result["grpo"] - result["control"]
        else:
            args = [preset.recipe, "--config", f"configs/{name}.yaml", f"seed={seed}", f"output_dir={run_dir / 'run'}",
                    f"trainer.num_threads={self.threads}", "logging.progress=plain", "logging.plot=false"]
            start_accuracy = None
            if preset.start:
                if self.start == "seeded":
                    start = self.run(preset.start, code_path, seed, [])
                    start_model, start_accuracy = start["model"], start["exact_match"]
                else:
                    start_model = START_MODELS[preset.start]
                args.append(f"model.name_or_path={start_model}")
                result["start_model"] = start_model
            if preset.reward_model:
                reward_model = self.run(preset.reward_model, code_path, seed, [])["model"]
                result["reward_model"] = reward_model
                args.append(f"environment.options={json.dumps(with_reward_model(name, reward_model))}")
            self.posttrain(code_path, [*args, *overrides], log)
            result["model"] = str(run_dir / "run" / "final")
            records = [json.loads(line) for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()]
            result.update(step_rate(records))
            evaluated = [r for r in records if any(k.startswith("eval_") for k in r)]
            if evaluated:
                result.update({k: v for k, v in evaluated[-1].items() if k.startswith("eval_")})
            if preset.model_reward:
                validated = [r for r in records if "val/reward_mean" in r]
                result["reward_gain"] = validated[-1]["val/reward_mean"] - validated[0]["val/reward_mean"]
                result["reward_minus_accuracy"] = validated[-1]["val/reward_mean"] - validated[-1]["val/accuracy"]
            if preset.recipe in ("sft", "dpo", "grpo", "ppo", "distill"):
                result["exact_match"] = self.exact_match(code_path, result["model"], log,
                                                         eval_args=preset.eval_args, metrics=result)
            for data in preset.held_out:
                task = data.removeprefix("posttrain/").split(":")[0]
                result[f"exact_match/{task}"] = self.exact_match(code_path, result["model"], log, data)
            if preset.teacher and not preset.start:
                teacher, untrained = (self.exact_match(code_path, model, log)
                                      for model in (preset.teacher, preset.untrained))
                result.update(teacher_exact_match=teacher, untrained_exact_match=untrained,
                              gap_closed=gap_closed(result["exact_match"], untrained, teacher))
            if preset.start and preset.recipe != "rm":
                if start_accuracy is None:
                    start_accuracy = self.exact_match(code_path, result["start_model"], log,
                                                      eval_args=preset.eval_args)
                result["start_exact_match"] = start_accuracy
                result["exact_match_gain"] = result["exact_match"] - start_accuracy
                if preset.teacher:
                    teacher_accuracy = self.exact_match(code_path, preset.teacher, log)
                    result["teacher_exact_match"] = teacher_accuracy
                    result["gap_closed"] = gap_closed(result["exact_match"], start_accuracy, teacher_accuracy)
        result["seconds"] = round(time.perf_counter() - started, 1)
        write_json(result_file, result)
        return result


def step_rate(records: list[dict[str, Any]]) -> dict[str, float]:
    """Training steps per second over the steps after the first two (`time/step`: sampling, scoring and the
    update, not evaluation or checkpoints), and the mean sampled reward of the last 50 steps."""
    stepped = [r for r in records if "time/step" in r]
    rate: dict[str, float] = {}
    if len(stepped) > 2:
        rate["steps_per_second"] = (len(stepped) - 2) / sum(r["time/step"] for r in stepped[2:])
    rewards = [r["reward/mean"] for r in stepped[-50:] if "reward/mean" in r]
    if rewards:
        rate["train_reward_last50"] = statistics.fmean(rewards)
    return rate


def gap_closed(exact_match: float, start: float, teacher: float) -> float:
    """The fraction of the gap from the starting student's exact match to the teacher's that a run closed (1: it
    matches the teacher; 0: no gain; negative: it lost ground). A teacher no better than its student is no gap to
    close: 0."""
    if teacher <= start:
        return 0.0
    return (exact_match - start) / (teacher - start)


def with_reward_model(name: str, path: str) -> dict[str, Any]:
    """The environment options of preset `name` with every reward_model component scoring with `path`."""
    from posttrain.config.loader import read_yaml_with_defaults

    options = read_yaml_with_defaults(ROOT / "configs" / f"{name}.yaml")["environment"]["options"]
    for component in options["components"]:
        if component["kind"] == "reward_model":
            component["options"] = {**component.get("options", {}), "path": path}
    return options


def folder(name: str, label: str) -> str:
    return f"{name}@{label}" if label else name


def summarize(name: str, results: list[dict[str, Any]]) -> tuple[str, dict[str, Any], bool]:
    """Markdown table of min / median / max per metric (and which run is the worst), plus the claims' verdicts."""
    metrics = [k for k, v in results[0].items() if isinstance(v, float) and k != "seconds"]
    rows, summary = [], {"preset": name, "runs": len(results), "metrics": {}, "claims": []}
    for metric in metrics + ["seconds"]:
        values = sorted((r[metric], f"{r['code_path']}-seed{r['seed']}") for r in results)
        worst = values[-1] if metric in LOWER_IS_BETTER or metric.endswith("loss") else values[0]
        stats = {"min": values[0][0], "median": statistics.median(v for v, _ in values), "max": values[-1][0],
                 "worst_run": worst[1]}
        summary["metrics"][metric] = stats
        rows.append([metric, f"{stats['min']:.4g}", f"{stats['median']:.4g}", f"{stats['max']:.4g}", stats["worst_run"]])
    table = markdown_table(["metric", "min", "median", "max", "worst run"], rows)
    all_hold = True
    for claim in PRESETS[name].claims:
        worst = summary["metrics"][claim.metric]["min"]
        holds = claim.holds(worst)
        all_hold &= holds
        summary["claims"].append({"claim": claim.text, "metric": claim.metric, "worst": worst, "holds": holds})
        table += f"\n{'holds' if holds else 'FAILS'}: {claim.text} (worst {claim.metric} {worst:.4g})"
    return table, summary, all_hold


def parse_seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        seeds += list(range(int(low), int(high or low) + 1))
    return seeds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("items", nargs="+", metavar="PRESET|KEY=VALUE",
                        help=f"presets ({', '.join(PRESETS)}), then overrides given to every run")
    parser.add_argument("--seeds", default="0-4", help="seeds, as 0-4 or 0,3,7 (default 0-4)")
    parser.add_argument("--paths", default="default,avx2", help="CPU code paths (default: default,avx2)")
    parser.add_argument("--jobs", type=int, default=2, help="runs side by side (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    parser.add_argument("--start", choices=("seeded", "embedded"), default="seeded",
                        help="starting model of dpo/rm/grpo presets (default: seeded; see the module docstring)")
    parser.add_argument("--output", type=Path, default=ROOT / "runs" / "seeds", help="default runs/seeds")
    parser.add_argument("--fresh", action="store_true", help="recompute runs that already have a result.json")
    parser.add_argument("--label", default="", help="keep these runs apart from the preset's own, in "
                        "OUTPUT/PRESET@LABEL (for a preset under a test's overrides); start runs stay shared")
    args = parser.parse_intermixed_args(argv)
    names = [item for item in args.items if "=" not in item]
    overrides = [item for item in args.items if "=" in item]
    unknown = [name for name in names if name not in PRESETS]
    if unknown or not names:
        parser.error(f"unknown preset {unknown or '(none given)'}; choose from {', '.join(PRESETS)}")
    paths = args.paths.split(",")
    if set(paths) - set(CODE_PATHS):
        parser.error(f"unknown code path in {args.paths!r}; choose from {', '.join(CODE_PATHS)}")
    seeds = parse_seeds(args.seeds)
    announce_environment()
    sweep = Sweep(args.output.resolve(), args.threads, args.start, args.fresh)
    all_hold = True
    for name in names:
        print(f"\n## {folder(name, args.label)}: seeds {args.seeds} x code paths {', '.join(paths)}"
              + (f", overrides {' '.join(overrides)}" if overrides else ""), flush=True)
        jobs = [(code_path, seed) for seed in seeds for code_path in paths]
        with ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(lambda job: report(sweep, name, *job, overrides, args.label), jobs))
        table, summary, holds = summarize(name, results)
        all_hold &= holds
        write_json(sweep.output / folder(name, args.label) / "summary.json", {**summary, "overrides": overrides, "seeds": seeds,
                                                          "paths": paths, "start": args.start})
        print(table, flush=True)
    return 0 if all_hold else 1


def report(sweep: Sweep, name: str, code_path: str, seed: int, overrides: list[str], label: str) -> dict[str, Any]:
    result = sweep.run(name, code_path, seed, overrides, label)
    shown = ", ".join(f"{k} {v:.4g}" for k, v in result.items() if isinstance(v, float))
    print(f"  {name} {code_path} seed {seed}: {shown}", flush=True)
    return result


if __name__ == "__main__":
    sys.exit(main())
