"""Computer use: what a desktop episode costs, part by part, and how many actions per second an episode takes.

    .venv/bin/python benchmarks/cua.py --output cua.json

(a) Episode start-up: `CuaEnvironment.open_episode` on the contact-name task (Xvfb started with -displayfd, the Tk
    app launched, its first accessibility tree answered), median and p90 over --episodes starts; then close.
(b) Parts of one step, each median and p90 over --repeats, on one open episode: an xdotool action (a CLICK on the
    Name entry, TYPING 12 characters, PRESS end), the app's tree over its socket, the screenshot (the XWD framebuffer
    read into an array; that array encoded as PNG), and the task's evaluator.
(c) Actions per second of whole environment steps (parse, perform, tree, screenshot saved, evaluate) in one episode:
    --repeats steps alternating CLICK on the Name entry and TYPING, with screenshots saved and without.

Needs Xvfb and xdotool. The machine's load matters: say what else was running when quoting the numbers.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from PIL import Image

from posttrain.envs.cua.actions import parse_action, perform
from posttrain.envs.cua.desktop import missing_programs
from posttrain.envs.cua.environment import CuaEnvironment, initial_tree
from posttrain.envs.cua.scripted import resolve
from posttrain.envs.cua.tasks import evaluate, load_tasks

TASK = "contact-name"
TYPING = '{"action_type": "TYPING", "parameters": {"text": "Ada Lovelace"}}'
PRESS = '{"action_type": "PRESS", "parameters": {"key": "end"}}'


def summary_ms(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    position = 0.9 * (len(ordered) - 1)
    low = int(position)
    p90 = ordered[low] + (ordered[min(low + 1, len(ordered) - 1)] - ordered[low]) * (position - low)
    return {"median_ms": statistics.median(ordered) * 1000, "p90_ms": p90 * 1000, "n": len(ordered)}


def timed(function, repeats: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        seconds.append(time.perf_counter() - started)
    return seconds


def startups(environment: CuaEnvironment, count: int) -> list[float]:
    seconds = []
    for _ in range(count):
        started = time.perf_counter()
        key, _ = environment.open_episode(TASK)
        seconds.append(time.perf_counter() - started)
        environment._close_episode(key)
    return seconds


def click_on_name(environment: CuaEnvironment) -> str:
    """A CLICK on the Name entry, wherever the machine's fonts put it."""
    return resolve({"action_type": "CLICK", "target": {"role": "entry", "name": "Name"}},
                   initial_tree(environment.tasks[TASK], screen=environment.screen))


def parts(environment: CuaEnvironment, repeats: int) -> dict[str, dict[str, float]]:
    click = click_on_name(environment)
    key, episode = environment.open_episode(TASK)
    try:
        actions = {name: parse_action(reply, environment.screen)
                   for name, reply in (("CLICK", click), ("TYPING 12 characters", TYPING), ("PRESS", PRESS))}
        results = {f"xdotool {name}": summary_ms(timed(lambda a=action: perform(a, episode.desktop), repeats))
                   for name, action in actions.items()}
        results["accessibility tree"] = summary_ms(timed(episode.tree, repeats))
        results["screenshot: framebuffer to array"] = summary_ms(timed(episode.desktop.screenshot, repeats))
        pixels = episode.desktop.screenshot()
        results["screenshot: array to PNG"] = summary_ms(timed(
            lambda: Image.fromarray(pixels).save(io.BytesIO(), format="PNG", compress_level=1), repeats))
        results["evaluator"] = summary_ms(timed(lambda: evaluate(episode.task, episode.workdir, "DONE"), repeats))
    finally:
        environment._close_episode(key)
    return results


def actions_per_second(environment: CuaEnvironment, steps: int) -> dict[str, Any]:
    click = click_on_name(environment)
    messages = [{"role": "user", "content": "benchmark"}]
    row: dict[str, Any] = {"task_id": TASK}
    started = time.perf_counter()
    for index in range(steps):
        messages.append({"role": "assistant", "content": click if index % 2 == 0 else TYPING})
        result = environment.step([messages], [row])
        if result.errors[0] is not None or result.metadata[0]["cua_errors"]:
            raise RuntimeError(f"step {index} failed: {result.errors[0] or result.metadata[0]['cua_error_kinds']}")
        row = result.metadata[0]
        messages.append(result.observations[0])
    seconds = time.perf_counter() - started
    environment._close_episode(row["cua_episode"])
    return {"steps": steps, "seconds": seconds, "actions_per_second": steps / seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=10, help="episode start-ups timed in (a) (default 10)")
    parser.add_argument("--repeats", type=int, default=30, help="repeats per part in (b), steps in (c) (default 30)")
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if missing_programs():
        parser.error(f"needs {' and '.join(missing_programs())} (apt-get install -y xvfb xdotool)")
    if args.episodes < 1 or args.repeats < 2:
        parser.error("--episodes is at least 1 and --repeats at least 2")
    started = time.perf_counter()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg(),
        "args": {key: str(value) for key, value in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="cua-bench-") as folder:
        tasks = load_tasks()
        environment = CuaEnvironment(tasks, episodes_dir=Path(folder) / "shots", max_steps=args.repeats + 1)
        bare = CuaEnvironment(tasks, episodes_dir=Path(folder) / "bare", max_steps=args.repeats + 1,
                              save_screenshots=False)
        try:
            results["startup"] = summary_ms(startups(environment, args.episodes))
            results["parts"] = parts(environment, args.repeats)
            results["steps_with_screenshots"] = actions_per_second(environment, args.repeats)
            results["steps_without_screenshots"] = actions_per_second(bare, args.repeats)
        finally:
            environment.close()
            bare.close()
    results["load_average_at_end"] = os.getloadavg()
    results["seconds"] = time.perf_counter() - started
    print(markdown(results))
    print(f"\n{results['seconds']:.0f} s; load average {results['load_average_at_start'][0]:.2f} at the start, "
          f"{results['load_average_at_end'][0]:.2f} at the end")
    if args.output:
        args.output.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


def markdown(results: dict[str, Any]) -> str:
    lines = ["| part | median | p90 | n |", "|---|---|---|---|"]
    rows = {"episode start-up (Xvfb, app, first tree)": results["startup"], **results["parts"]}
    for name, row in rows.items():
        lines.append(f"| {name} | {row['median_ms']:.3g} ms | {row['p90_ms']:.3g} ms | {row['n']} |")
    lines += ["", "| environment steps | actions per second |", "|---|---|"]
    for key, title in (("steps_with_screenshots", "screenshot saved each step"),
                       ("steps_without_screenshots", "no screenshot")):
        lines.append(f"| {title} | {results[key]['actions_per_second']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
