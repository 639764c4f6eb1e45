"""What the critic costs: PPO's step time and peak memory against GRPO's on the same job, and held-out accuracy
against optimizer steps for both.

    python benchmarks/ppo_cost.py                        # 200 RL steps each, the arithmetic presets
    python benchmarks/ppo_cost.py --steps 600 --eval-every 100 --repeats 2

Both recipes run their shipped arithmetic preset (configs/grpo_arithmetic.yaml, configs/ppo_arithmetic.yaml)
from the same start (posttrain/tiny-arithmetic-sft-small) with the same number of sampled completions per step
(128), each in a fresh process, order alternating over repeats. Step time is the median `time/step` after the
first 5 steps; peak memory is the process's peak resident set (VmHWM) over the whole run, model loading
included. PPO makes update.ppo_epochs × update.num_minibatches optimizer steps per RL step where GRPO makes
one, and each of them also updates the critic: the accuracy table counts optimizer steps of the policy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    alternating_orders,
    announce_environment,
    fmt,
    markdown_table,
    peak_rss_mib,
    ratio,
    run_worker,
    write_json,
)

RECIPES = ("grpo", "ppo")


def worker(recipe: str, steps: int, eval_every: int, output_dir: Path, result_path: Path) -> None:
    import torch

    torch.set_num_threads(1)
    from posttrain.config import load_config
    from posttrain.config.presets import preset_path
    from posttrain.config.schema import GRPOConfig, PPOConfig
    from posttrain.logging import read_metrics

    overrides = [f"output_dir={output_dir}", f"trainer.max_steps={steps}", f"trainer.eval_every={eval_every}",
                 "trainer.save_every=0", "trainer.num_threads=1", "logging.progress=none", "logging.plot=false"]
    if recipe == "grpo":
        from posttrain.algorithms.grpo import train_grpo

        cfg = load_config(GRPOConfig, preset_path("grpo_arithmetic.yaml"), overrides)
        train_grpo(cfg)
    else:
        from posttrain.algorithms.ppo import train_ppo

        cfg = load_config(PPOConfig, preset_path("ppo_arithmetic.yaml"), overrides)
        train_ppo(cfg)
    records = read_metrics(output_dir / "metrics.jsonl")
    updates = cfg.update.ppo_epochs * cfg.update.num_minibatches
    warmup = cfg.critic.warmup_steps if recipe == "ppo" else 0
    write_json(result_path, {
        "recipe": recipe,
        "step_seconds": statistics.median(r["time/step"] for r in records[5:]),
        "peak_rss_mib": peak_rss_mib(),
        "updates_per_step": updates,
        "accuracy": [(max(0, r["step"] - warmup) * updates, r["step"], r["val/accuracy"])
                     for r in records if "val/accuracy" in r],
    })


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--output", type=Path, default=Path("runs/benchmarks/ppo_cost.json"))
    parser.add_argument("--worker", choices=RECIPES, help=argparse.SUPPRESS)
    parser.add_argument("--worker-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker-result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps, args.eval_every, args.worker_dir, args.worker_result)
        return 0

    announce_environment()
    results: dict[str, list[dict]] = {recipe: [] for recipe in RECIPES}
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        for repeat, order in enumerate(alternating_orders(RECIPES, args.repeats)):
            for recipe in order:
                run_dir = scratch / f"{recipe}-{repeat}"
                result = run_worker([__file__, "--worker", recipe, "--steps", str(args.steps), "--eval-every",
                                     str(args.eval_every), "--worker-dir", str(run_dir), "--worker-result",
                                     str(scratch / "result.json")], scratch / "result.json",
                                    scratch / f"{recipe}-{repeat}.log", timeout_s=4 * 3600)
                print(f"  {recipe} repeat {repeat}: {result['step_seconds']:.2f} s/step, peak "
                      f"{result['peak_rss_mib']:.0f} MiB", flush=True)
                results[recipe].append(result)

    step = {r: statistics.median(x["step_seconds"] for x in results[r]) for r in RECIPES}
    peak = {r: statistics.median(x["peak_rss_mib"] for x in results[r]) for r in RECIPES}
    print(markdown_table(["recipe", "s/step", "peak RSS MiB", "optimizer steps per RL step"],
                         [[r, fmt(step[r]), fmt(peak[r], 0), str(results[r][0]["updates_per_step"])]
                          for r in RECIPES]))
    print(f"PPO / GRPO: step time {fmt(ratio(step['ppo'], step['grpo']))}, peak memory "
          f"{fmt(ratio(peak['ppo'], peak['grpo']))}")
    rows = []
    for r in RECIPES:
        for updates, rl_step, accuracy in results[r][0]["accuracy"]:
            rows.append([r, str(rl_step), str(updates), f"{accuracy:.1%}"])
    print(markdown_table(["recipe", "RL step", "policy optimizer steps", "held-out accuracy (200)"], rows))
    write_json(args.output, {"steps": args.steps, "results": results, "step_ratio": ratio(step["ppo"], step["grpo"]),
                             "peak_ratio": ratio(peak["ppo"], peak["grpo"])})
    print(f"results: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
