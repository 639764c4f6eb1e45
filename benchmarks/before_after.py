"""A posttrain-vs-TRL benchmark run on two versions of posttrain side by side: did a change make a step slower?

    .venv/bin/python benchmarks/before_after.py --base 96c1ecb grpo_vs_trl.py -- --steps 20 --skip-steps 3 --repeats 1
    .venv/bin/python benchmarks/before_after.py --base 96c1ecb sft_vs_trl.py -- --steps 30 --repeats 1 --settings 16x4

The base version is checked out into a temporary git worktree. The benchmark (the current tree's script, taking
`--json`) then runs `--rounds` times on each version, alternating (base, current, current, base, ...), each run a
full benchmark (posttrain and TRL on the same job), with the version's own `src/` first on PYTHONPATH. TRL is the
same in every run, so its numbers are a control for the machine's drift between runs.

Reported, for every median the benchmark reports: posttrain's value on the base and on the current version, their
ratio (current / base), and TRL's ratio over the same runs. For seconds per step, a ratio above 1 is slower; for
throughput, below 1 is slower.

posttrain alone, from a worker spec (where TRL's run would dominate the time, as at the 152k vocabulary):

    .venv/bin/python benchmarks/sft_vs_trl.py --shape vocab152k --settings 4x1 --steps 3 --skip-steps 1 --repeats 1 --keep /tmp/k
    .venv/bin/python benchmarks/before_after.py --base 96c1ecb --rounds 4 --spec /tmp/k/sft_vs_trl.*/4x1/posttrain-0.spec.json \
        --steps 10 --skip-steps 2 sft_vs_trl.py

With --spec, each round runs only the benchmark's posttrain worker on that spec (--steps overrides its step count,
and every run gets a fresh output folder), alternating the versions; reported are the medians over rounds of each
run's median step time (steps after --skip-steps, step end to step end), wall time and peak RSS, and the median of
the per-round ratios current / base (each round's two runs are neighbours in time, so the pairing absorbs the
machine's drift; there is no TRL control in this mode).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def medians_in(report: Any, path: str = "") -> dict[str, dict[str, dict[str, float]]]:
    """Every `medians` table in a benchmark's JSON report ({framework: {metric: value}}), by where it sits."""
    found = {}
    if isinstance(report, dict):
        for key, value in report.items():
            if key == "medians" and isinstance(value, dict) and "posttrain" in value:
                found[path or "."] = value
            else:
                found.update(medians_in(value, f"{path}/{key}" if path else key))
    return found


def run_once(tree: Path, benchmark: str, args: list[str], out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    command = [sys.executable, str(HERE / benchmark), *args, "--json", str(out)]
    print(f"[{tree.name}] {' '.join(command[1:])}", flush=True)
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def run_worker_once(tree: Path, benchmark: str, spec: dict, work: Path, name: str, skip: int) -> dict[str, float]:
    """One run of the benchmark's posttrain worker on `spec` with the version in `tree`: its median step time
    (after `skip` warm-up steps), wall time and peak RSS."""
    spec = {**spec, "output_dir": str(work / f"{name}.run")}
    spec_path, result_path = work / f"{name}.spec.json", work / f"{name}.result.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    command = [sys.executable, str(HERE / benchmark), "--worker", "posttrain", "--spec", str(spec_path),
               "--result", str(result_path)]
    print(f"[{tree.name}] {name}", flush=True)
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, cwd=tree)
    shutil.rmtree(work / f"{name}.run", ignore_errors=True)
    result = json.loads(result_path.read_text())
    ends = result["step_end_times"]
    if any(t is None for t in ends) or not 0 < skip < len(ends) - 1:
        raise RuntimeError(f"{name}: step end times {ends} do not allow skipping {skip} steps")
    steps = [b - a for a, b in zip(ends[skip - 1:-1], ends[skip:])]
    return {"median_step_seconds": statistics.median(steps), "wall_seconds": result["wall_seconds"],
            "peak_rss_mib": result["peak_rss_mib"]}


def compare_workers(trees: dict[str, Path], args: argparse.Namespace, work: Path) -> dict[str, dict]:
    """--spec mode: the posttrain worker alone on each version, alternating, `args.rounds` rounds."""
    spec = json.loads(args.spec.read_text())
    if args.steps:
        spec["steps"] = args.steps
    runs: dict[str, list[dict[str, float]]] = {"base": [], "current": []}
    for round_index in range(args.rounds):
        order = ["base", "current"] if round_index % 2 == 0 else ["current", "base"]
        for version in order:
            runs[version].append(run_worker_once(trees[version], args.benchmark, spec, work,
                                                 f"{version}-{round_index}", args.skip_steps))
    comparison = {}
    for metric in runs["base"][0]:
        base = [r[metric] for r in runs["base"]]
        current = [r[metric] for r in runs["current"]]
        comparison[metric] = {
            "posttrain_base": statistics.median(base), "posttrain_current": statistics.median(current),
            "posttrain_current_over_base": statistics.median(c / b for c, b in zip(current, base)),
            "runs": {"base": base, "current": current},
        }
    return comparison


def compare_benchmarks(trees: dict[str, Path], args: argparse.Namespace, bench_args: list[str],
                       work: Path) -> dict[str, dict]:
    """Whole benchmark runs (posttrain and TRL) on each version, alternating, `args.rounds` rounds."""
    results: dict[str, list[dict]] = {"base": [], "current": []}
    for round_index in range(args.rounds):
        order = ["base", "current"] if round_index % 2 == 0 else ["current", "base"]
        for version in order:
            out = work / f"{version}-{round_index}.json"
            results[version].append(medians_in(run_once(trees[version], args.benchmark, bench_args, out)))
    comparison = {}
    for where in results["current"][0]:
        for metric in results["current"][0][where]["posttrain"]:
            values = {version: {fw: [r[where][fw][metric] for r in results[version]] for fw in ("posttrain", "trl")}
                      for version in results}
            if any(v is None for version in values.values() for fw in version.values() for v in fw):
                continue
            med = {version: {fw: statistics.median(v) for fw, v in by_fw.items()} for version, by_fw in values.items()}
            comparison[f"{where}: {metric}"] = {
                "posttrain_base": med["base"]["posttrain"], "posttrain_current": med["current"]["posttrain"],
                "posttrain_current_over_base": med["current"]["posttrain"] / med["base"]["posttrain"]
                if med["base"]["posttrain"] else None,
                "trl_current_runs_over_base_runs": med["current"]["trl"] / med["base"]["trl"] if med["base"]["trl"] else None,
                "runs": values,
            }
    return comparison


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="git revision of the version to compare against")
    parser.add_argument("--rounds", type=int, default=2, help="runs per version, alternating (default 2)")
    parser.add_argument("--json", type=Path, default=None, help="write the comparison to this JSON file")
    parser.add_argument("--spec", type=Path, default=None,
                        help="run only the posttrain worker on this worker spec (written by a benchmark run with --keep)")
    parser.add_argument("--steps", type=int, default=None, help="with --spec: optimizer steps per run")
    parser.add_argument("--skip-steps", type=int, default=2, help="with --spec: warm-up steps left out (default 2)")
    parser.add_argument("benchmark", help="a benchmark script in benchmarks/, e.g. grpo_vs_trl.py")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then the benchmark's own arguments")
    args = parser.parse_args(argv)
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args

    work = Path(tempfile.mkdtemp(prefix="before-after-"))
    base_tree = work / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base_tree), args.base], check=True,
                   stdout=subprocess.DEVNULL)
    trees = {"base": base_tree, "current": ROOT}
    try:
        if args.spec:
            comparison = compare_workers(trees, args, work)
        else:
            comparison = compare_benchmarks(trees, args, bench_args, work)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_tree)], check=False)
        shutil.rmtree(work, ignore_errors=True)

    what = f"the posttrain worker on {args.spec}, {args.steps or 'its'} steps" if args.spec else " ".join(bench_args)
    print(f"\n{args.benchmark} {what}: base {args.base} vs the current tree, medians of {args.rounds} run(s) each")
    print("| metric | posttrain base | posttrain current | current/base | TRL control (current runs/base runs) |")
    print("|---|---|---|---|---|")
    for name, row in comparison.items():
        ratio = row["posttrain_current_over_base"]
        control = row.get("trl_current_runs_over_base_runs")
        print(f"| {name} | {row['posttrain_base']:.4g} | {row['posttrain_current']:.4g} | "
              f"{'n/a' if ratio is None else f'{ratio:.3f}'} | {'n/a' if control is None else f'{control:.3f}'} |")
    if args.json:
        args.json.write_text(json.dumps({"base": args.base, "benchmark": args.benchmark, "args": bench_args,
                                         "spec": str(args.spec) if args.spec else None, "steps": args.steps,
                                         "comparison": comparison}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
