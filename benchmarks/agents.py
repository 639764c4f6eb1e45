"""Tool calls and multi-turn episodes: how long a built-in tool call takes, and how many tool-using episodes per
second the rollout runs with 1, 4 and 16 episodes in flight.

    .venv/bin/python benchmarks/agents.py --output agents.json

(a) Tool-call latency, per built-in tool (calculator, python in the sandbox, write_file, read_file, search), median
    and p90 over --calls calls, two ways: the tool's own function (`Tool.run`), and one `ToolEnvironment.step`
    answering one reply that calls it (parsing the call, checking its arguments against the schema, the call's own
    thread and deadline, the observation message).
(b) Episodes per second through the real multi-turn rollout (`run_episodes` with the tools environment built from
    its config options, the arithmetic task scoring the answer), with 1, 4 and 16 episodes started together. The
    generator is scripted: turn 1 is a fixed tool call, turn 2 the answer. It returns canned token ids at once, so
    what is measured is the rollout, the environment and the tool, not a model's sampling speed. Each setting runs
    rounds of that many episodes started together until --episodes episodes have run (at least one round);
    episodes per second is all its episodes over all its rounds' wall time. The tool-call latency
    column is the environment step answering the call, measured inside those episodes (so under that concurrency).
(c) With --model (an embedded model already in the cache, e.g. posttrain/tiny): the same, but turn 2 is sampled by
    the model (transformers backend, --model-new-tokens tokens); turn 1 is still the scripted call, since the
    embedded models have never been trained to call tools. This adds the model's sampling to (b).

Every episode is checked (two turns, no tool error, reward 1.0 for the scripted answer), so a broken tool or parser
fails the run instead of being timed. The machine's load matters: say what else was running when quoting the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from posttrain.algorithms.rollout import PromptRow, run_episodes  # noqa: E402
from posttrain.config.environments import ToolsOptions  # noqa: E402
from posttrain.data.tokenize import tokenize_prompt  # noqa: E402
from posttrain.envs.registry import build_environment  # noqa: E402
from posttrain.envs.tools import ToolCall, ToolContext, parser_of  # noqa: E402
from posttrain.generation.base import Completion, GenerationOutput, SamplingParams  # noqa: E402
from posttrain.models.tiny import build_tokenizer  # noqa: E402

HERMES = parser_of("hermes")
A, B = 123456, 654321
QUESTION = [{"role": "user", "content": f"What is {A} + {B}?"}]
ANSWER = str(A + B)
EPISODE_CALLS = {"calculator": ToolCall("calculator", {"expression": f"{A} + {B}"}),
                 "python": ToolCall("python", {"code": f"print({A} + {B})"})}
"""The scripted first turn of an episode, per tool."""
LATENCY_CALLS = [
    ToolCall("calculator", {"expression": f"({A} + {B}) * 3 - 7"}),
    ToolCall("python", {"code": f"print(sum(range({A})))"}),
    ToolCall("write_file", {"path": "notes/sum.txt", "content": f"{A} + {B} = {ANSWER}\n" * 20}),
    ToolCall("read_file", {"path": "notes/sum.txt"}),
    ToolCall("search", {"query": "how does the calculator tool evaluate an expression"}),
]
"""The calls timed in (a), in order: read_file reads what write_file wrote in the same work directory."""


def quantile(values: list[float], q: float) -> float:
    """The q-quantile of `values` (linear interpolation between order statistics, like numpy's default)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary_ms(seconds: list[float]) -> dict[str, float]:
    return {"median_ms": 1000 * statistics.median(seconds), "p90_ms": 1000 * quantile(seconds, 0.9),
            "n": len(seconds)}


def tools_environment(tools: list[str]):
    """The tools environment as a recipe builds it from `environment.options` (arithmetic task, hermes calls)."""
    return build_environment(ToolsOptions(tools=tools, task={"kind": "arithmetic"}, tool_call_format="hermes"))


# ---- (a) one call at a time ------------------------------------------------------------------------------------


def tool_latencies(num_calls: int) -> dict[str, dict[str, Any]]:
    environment = tools_environment(["calculator", "python", "files", "search"])
    results = {}
    try:
        # Tool.run: the function alone, in this thread, in a work directory of its own.
        context = ToolContext(workdir=Path(tempfile.mkdtemp(prefix="posttrain-bench-tools-")))
        direct = {call.name: [] for call in LATENCY_CALLS}
        for _ in range(num_calls):
            for call in LATENCY_CALLS:
                tool = environment.tools[call.name]
                started = time.perf_counter()
                tool.run(dict(call.arguments), context)
                direct[call.name].append(time.perf_counter() - started)
        # ToolEnvironment.step: one reply calling the tool, answered as in an episode.
        stepped = {call.name: [] for call in LATENCY_CALLS}
        metadata: dict[str, Any] = {"answer": ANSWER}
        for _ in range(num_calls):
            for call in LATENCY_CALLS:
                log = [*QUESTION, {"role": "assistant", "content": HERMES.render([call])}]
                started = time.perf_counter()
                result = environment.step([log], [metadata])
                stepped[call.name].append(time.perf_counter() - started)
                metadata = result.metadata[0]
                if metadata["tool_errors"]:
                    raise RuntimeError(f"{call.name} answered with an error: {result.observations[0]}")
        for call in LATENCY_CALLS:
            results[call.name] = {"tool_run": summary_ms(direct[call.name]),
                                  "environment_step": summary_ms(stepped[call.name])}
    finally:
        environment.close()
        shutil.rmtree(context.workdir, ignore_errors=True)
    return results


# ---- (b) and (c) concurrent episodes ---------------------------------------------------------------------------


class ScriptedGenerator:
    """Turn 1: the fixed tool call; turn 2: the answer. Canned token ids, returned at once; the turn is read from the
    prompt's count of <|im_start|> (2 before the first turn, 4 after the tool's answer). With `model_generator`,
    turn 2 is that generator's own sampling instead."""

    weights_version = 0

    def __init__(self, tokenizer, call: ToolCall, model_generator=None):
        self.im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.turns = {1: tokenizer(HERMES.render([call]), add_special_tokens=False)["input_ids"] + [im_end],
                      2: tokenizer(ANSWER, add_special_tokens=False)["input_ids"] + [im_end]}
        self.texts = {turn: tokenizer.decode(ids, skip_special_tokens=True) for turn, ids in self.turns.items()}
        self.model_generator = model_generator

    def generate(self, prompts, params, num_samples=1):
        turns = [2 if prompt.count(self.im_start) > 2 else 1 for prompt in prompts]
        if self.model_generator is not None and all(turn == 2 for turn in turns):
            return self.model_generator.generate(prompts, params, num_samples)
        completions = []
        for prompt, turn in zip(prompts, turns):
            ids = self.turns[turn][: params.max_new_tokens]
            completions.append([Completion(prompt, ids, [-0.5] * len(ids), self.texts[turn], "stop")] * num_samples)
        return GenerationOutput(completions, num_generated_tokens=sum(len(c[0].token_ids) for c in completions))

    def update_weights(self, version, weights):
        return 0


class TimedSteps:
    """The environment, with the wall time of each step that answered tool calls recorded (thread-safe)."""

    def __init__(self, environment):
        self.environment = environment
        self.tool_use = environment.tool_use
        self.tool_call_seconds: list[float] = []
        self._lock = threading.Lock()

    def step(self, message_logs, metadata):
        started = time.perf_counter()
        result = self.environment.step(message_logs, metadata)
        elapsed = time.perf_counter() - started
        if any(not done for done in result.done):  # a tool call answered; the episode goes on
            with self._lock:
                self.tool_call_seconds.append(elapsed)
        return result

    def close(self):
        self.environment.close()


def episodes_per_second(tokenizer, tool: str, concurrency: int, num_episodes: int, model_generator=None,
                        max_new_tokens: int = 64) -> dict[str, Any]:
    """Rounds of `concurrency` episodes started together, until `num_episodes` have run (at least one round)."""
    rounds = -(-num_episodes // concurrency)
    environment = TimedSteps(tools_environment([tool]))
    generator = ScriptedGenerator(tokenizer, EPISODE_CALLS[tool], model_generator)
    with warnings.catch_warnings():  # the embedded ChatML template does not render tool schemas; it says so
        warnings.simplefilter("ignore")
        prompt_ids = tokenize_prompt(QUESTION, tokenizer, environment.tool_use.tools)
    rows = [PromptRow(QUESTION, prompt_ids, {"answer": ANSWER}) for _ in range(concurrency)]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=0)
    round_seconds, rewards, turns, errors = [], [], [], 0
    try:
        for round_index in range(rounds):
            started = time.perf_counter()
            episodes, _ = run_episodes(rows, round_index * concurrency, 1, generator, environment, tokenizer,
                                       params, max_turns=2)
            round_seconds.append(time.perf_counter() - started)
            rewards += [e.reward for e in episodes]
            turns += [e.num_turns for e in episodes]
            errors += sum(e.metadata["tool_errors"] for e in episodes)
    finally:
        environment.close()
    where = f"{tool}, {concurrency} in flight"
    if turns.count(2) != len(turns) or errors:
        raise RuntimeError(f"{where}: {len(turns) - turns.count(2)} episodes did not call the tool, {errors} tool "
                           "errors")
    if model_generator is None and any(reward != 1.0 for reward in rewards):
        raise RuntimeError(f"{where}: rewards {sorted(set(map(str, rewards)))}, expected 1.0")
    return {"tool": tool, "concurrency": concurrency, "rounds": rounds, "episodes": len(rewards),
            "episodes_per_second": len(rewards) / sum(round_seconds),
            "round_seconds_median": statistics.median(round_seconds),
            "tool_call": summary_ms(environment.tool_call_seconds),
            "mean_reward": sum(r for r in rewards if r is not None) / len(rewards)}


def model_generator_of(name: str, threads: int):
    """A transformers-backend generator for embedded model `name`, which must already be in the cache (building a
    model here would be timed as part of nothing and can take long)."""
    import torch  # here, not at the top: only --model loads a model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.generation.transformers_backend import TransformersGenerator
    from posttrain.models.tiny import EMBEDDED_MODELS, cache_dir
    from posttrain.models.trained import TRAINED_MODELS

    torch.set_num_threads(threads)
    specs = {**EMBEDDED_MODELS, **TRAINED_MODELS}
    if name not in specs:
        raise SystemExit(f"--model {name!r} is not an embedded model; they are: {', '.join(sorted(specs))}")
    path = cache_dir() / "models" / f"{name.replace('/', '--')}-v{specs[name].version}"  # as build_into_cache names it
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {name}: {path} is not built; this benchmark does not build models (building a "
                         "trained one takes long): run anything that uses the model once, then this")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    return TransformersGenerator(model, tokenizer, seed=0), tokenizer


# ---- report ----------------------------------------------------------------------------------------------------


def markdown(results: dict[str, Any]) -> str:
    lines = ["| tool | `Tool.run` median | p90 | `ToolEnvironment.step` median | p90 |", "|---|---|---|---|---|"]
    for name, row in results["tool_latency"].items():
        run, step = row["tool_run"], row["environment_step"]
        lines.append(f"| {name} | {run['median_ms']:.3g} ms | {run['p90_ms']:.3g} ms | {step['median_ms']:.3g} ms "
                     f"| {step['p90_ms']:.3g} ms |")
    for key, title in (("episodes", "scripted generator"), ("model_episodes", f"turn 2 by {results['model']}")):
        if not results.get(key):
            continue
        lines += ["", f"| episodes ({title}) | in flight | episodes/s | tool call median | p90 | episodes |",
                  "|---|---|---|---|---|---|"]
        for row in results[key]:
            lines.append(f"| {row['tool']} | {row['concurrency']} | {row['episodes_per_second']:.1f} | "
                         f"{row['tool_call']['median_ms']:.3g} ms | {row['tool_call']['p90_ms']:.3g} ms | "
                         f"{row['episodes']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20, help="calls per tool in (a) (default 20)")
    parser.add_argument("--concurrency", default="1,4,16", help="episodes in flight, comma-separated (default 1,4,16)")
    parser.add_argument("--episodes", type=int, default=64,
                        help="episodes per setting in (b) and (c), in rounds of as many as are in flight (default 64)")
    parser.add_argument("--episode-tools", default="calculator,python",
                        help="the tools episodes call in (b), comma-separated (default calculator,python)")
    parser.add_argument("--model", default=None,
                        help="(c): an embedded model already in the cache (e.g. posttrain/tiny) samples turn 2")
    parser.add_argument("--model-new-tokens", type=int, default=16, help="tokens turn 2 samples in (c) (default 16)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the model in (c) (default 1)")
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    tools = args.episode_tools.split(",")
    unknown = set(tools) - set(EPISODE_CALLS)
    if unknown or args.calls < 1 or args.episodes < 1 or min(concurrency) < 1:
        parser.error(f"--episode-tools takes {', '.join(EPISODE_CALLS)}; --calls, --episodes and --concurrency are "
                     f"at least 1 (unknown tools: {sorted(unknown)})")

    model = model_generator_of(args.model, args.threads) if args.model else None  # refused before anything runs
    started = time.perf_counter()
    tokenizer = build_tokenizer()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg(), "args": {k: str(v) for k, v in
                                                                                   vars(args).items()},
        "tool_latency": tool_latencies(args.calls),
        "episodes": [episodes_per_second(tokenizer, tool, c, args.episodes) for tool in tools for c in concurrency],
        "model": args.model, "model_episodes": [],
    }
    if model is not None:
        generator, model_tokenizer = model
        results["model_episodes"] = [
            episodes_per_second(model_tokenizer, "calculator", c, args.episodes, generator, args.model_new_tokens)
            for c in concurrency]
    results["load_average_at_end"] = os.getloadavg()
    results["seconds"] = time.perf_counter() - started
    print(markdown(results))
    print(f"\n{results['seconds']:.0f} s; load average {results['load_average_at_start'][0]:.2f} at the start, "
          f"{results['load_average_at_end'][0]:.2f} at the end")
    if args.output:
        args.output.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
