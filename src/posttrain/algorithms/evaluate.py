"""Evaluation of a model on prompts scored by an environment, and the built-in task's greedy exact match.

`evaluate_prompts` is the one evaluation: it samples `num_samples` episodes per prompt through a `Generator` and
scores them with an `Environment` (`rollout.run_episodes`, the path GRPO's rollouts take), then reports

  reward/mean, reward/std, reward/<component>   over the samples whose reward did not fail
  accuracy             the fraction of scored samples that are correct (the environment's `correct`, or
                       reward ≥ correct_threshold for environments that judge no correctness)
  pass@k               for each k asked: the unbiased estimator of Chen et al. 2021 (posttrain.metrics), averaged
                       over the prompts with at least k scored samples
  response_length/mean, response_length/max, truncation_rate, turns/mean
  reward/errors        samples whose reward failed (raised, timed out, NaN): masked, counted, never a zero

and one `SampleRecord` per sample. `posttrain eval --data FILES --environment KIND` runs it on a model loaded for
the purpose (`run_eval`); the training recipes run it on their evaluation sets with the current policy
(`TrainingEvaluation`). `evaluate_arithmetic` is the fixed greedy measurement the quickstart and
`posttrain eval --task arithmetic` report, kept as it was measured. `posttrain eval` also scores multiple-choice
questions by log-likelihood (algorithms/multiple_choice.py) and runs lm-evaluation-harness tasks
(algorithms/lm_harness.py); `run_eval` picks among them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from posttrain.algorithms.common import check_writable_file, chunks, evaluation_sampling
from posttrain.algorithms.lm_harness import HarnessReport, describe_harness, run_harness
from posttrain.algorithms.multiple_choice import (MultipleChoiceReport, describe_multiple_choice,
                                                  evaluate_multiple_choice)
from posttrain.algorithms.rl import build_generator, load_prompts, offer_tools
from posttrain.algorithms.rollout import Episode, PromptRow, rollout_metrics, run_episodes, scalar_reward
from posttrain.config.schema import EvalConfig, EvaluationSet, ModelConfig
from posttrain.envs import arithmetic
from posttrain.envs.base import Environment
from posttrain.algorithms.environments import build_recipe_environment
from posttrain.errors import RunError
from posttrain.generation.base import Generator, SamplingParams
from posttrain.generation.transformers_backend import check_fits_context
from posttrain.metrics import mean_pass_at_k
from posttrain.models.loading import default_device, load_causal_lm, load_tokenizer
from posttrain.workers import PolicyWorker


# ---- the built-in task: greedy exact match on held-out arithmetic ---------------------------------------------


@dataclass(frozen=True)
class EvalResult:
    task: str
    accuracy: float
    num_examples: int
    mean_response_tokens: float
    samples: list[dict[str, str]] = field(default_factory=list)
    """The first few (prompt, answer, completion) triples, for a look at what the model does."""

    def to_json(self) -> dict:
        return {"task": self.task, "accuracy": self.accuracy, "num_examples": self.num_examples,
                "mean_response_tokens": self.mean_response_tokens, "samples": self.samples}


@torch.no_grad()
def generate_greedy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str],
                    max_new_tokens: int, batch_size: int) -> tuple[list[str], list[int]]:
    """Greedy completions (decoded, special tokens removed) and their lengths in tokens."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    tokenizer.padding_side = "left"
    texts, lengths = [], []
    for group in chunks(prompts, batch_size):
        encoded = tokenizer(group, return_tensors="pt", padding=True).to(device)
        output = model.generate(**encoded, max_new_tokens=max_new_tokens, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        new_tokens = output[:, encoded["input_ids"].shape[1]:]
        texts += tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
        # Length up to and including the first eos (or the whole budget when none was produced).
        is_eos = new_tokens == tokenizer.eos_token_id
        has_eos = is_eos.any(dim=1)
        first_eos = is_eos.int().argmax(dim=1)
        lengths += torch.where(has_eos, first_eos + 1, torch.full_like(first_eos, new_tokens.shape[1])).tolist()
    tokenizer.padding_side = "right"
    model.train(was_training)
    return texts, lengths


def evaluate_arithmetic(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, num_examples: int = 200,
                        seed: int = 0, batch_size: int = 200, max_new_tokens: int = 8) -> EvalResult:
    problems = arithmetic.sample_problems("heldout", num_examples, seed=seed)
    completions, lengths = generate_greedy(model, tokenizer, [p.prompt for p in problems], max_new_tokens, batch_size)
    scores = [arithmetic.exact_match(c, p.answer) for c, p in zip(completions, problems)]
    samples = [{"prompt": p.prompt, "answer": p.answer, "completion": c} for p, c in zip(problems[:5], completions)]
    return EvalResult("arithmetic", sum(scores) / len(scores), len(scores), sum(lengths) / len(lengths), samples)


# ---- any model on any environment -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleRecord:
    """One evaluated sample."""

    prompt_index: int
    """Index of its prompt among the evaluated prompts (samples of one prompt are consecutive)."""
    prompt: str
    """The prompt as the model saw it (decoded prompt tokens: a chat template's rendering included)."""
    completion: str
    """The reply (special tokens removed); for multi-turn episodes every turn and observation after the prompt."""
    reward: float | None
    """The scalar reward (weighted sum of the components); None when scoring failed."""
    components: dict[str, float] | None
    """The named reward components, for environments that give them."""
    correct: bool | None
    """Whether the sample is correct; None when scoring failed or nothing judges correctness."""
    error: str | None
    """Why scoring failed."""
    reference: str | None = None
    """What the reply is checked against, from the prompt's row (`reference_text`); None when the row has none."""

    def to_json(self) -> dict[str, Any]:
        """The sample as a samples.jsonl record (without step and split)."""
        return {"prompt": self.prompt, "reference": self.reference, "completion": self.completion,
                "reward": self.reward, "components": self.components, "correct": self.correct, "error": self.error}


@dataclass(frozen=True)
class EvalReport:
    metrics: dict[str, float]
    """reward/mean, accuracy, pass@k, response_length/mean, truncation_rate, reward/errors, ... (module docstring)."""
    samples: list[SampleRecord]
    """Every sample, prompt by prompt."""
    num_prompts: int
    num_samples: int
    """Samples per prompt."""
    seconds: float = 0.0
    data_summary: str = ""
    """What loading the prompts read and skipped (set by `run_eval`)."""

    @property
    def errors(self) -> list[str]:
        """The distinct reasons of failed rewards, in the order first seen."""
        return list(dict.fromkeys(s.error for s in self.samples if s.error is not None))

    def to_json(self) -> dict[str, Any]:
        return {"num_prompts": self.num_prompts, "num_samples": self.num_samples, **self.metrics,
                "reward_errors": self.errors[:5]}


def evaluate_prompts(prompts: list[PromptRow], generator: Generator, environment: Environment, tokenizer,
                     params: SamplingParams, num_samples: int = 1, pass_k: list[int] | tuple[int, ...] = (),
                     max_turns: int = 1, weights: dict[str, float] | None = None,
                     correct_threshold: float | None = None) -> EvalReport:
    """Sample `num_samples` episodes of every prompt with `params` (seeded when params.seed is set), score them
    with `environment` and report the metrics and every sample (see the module docstring).

    weights: how named reward components sum to the scalar reward (the environment's reward_weights; a
    component without one weighs 1). correct_threshold: for environments that report no `correct`, a sample is
    correct when its reward is at least this (None: such samples have no correctness, hence no accuracy and no
    pass@k)."""
    weights = weights or {}
    started = time.perf_counter()
    episodes, _ = run_episodes(prompts, 0, num_samples, generator, environment, tokenizer, params, max_turns)
    samples = [sample_record(e, tokenizer, weights, correct_threshold) for e in episodes]

    metrics = rollout_metrics(episodes, weights)
    metrics.pop("accuracy", None)  # recomputed below, with correct_threshold for environments that judge nothing
    judged = [s.correct for s in samples if s.correct is not None]
    if judged:
        metrics["accuracy"] = sum(judged) / len(judged)
    counts = [(0, 0) for _ in prompts]
    for s in samples:
        if s.correct is not None:
            n, c = counts[s.prompt_index]
            counts[s.prompt_index] = (n + 1, c + s.correct)
    for k in pass_k:
        metrics[f"pass@{k}"] = mean_pass_at_k(counts, k)[0]
    metrics["reward/errors"] = sum(s.reward is None for s in samples)
    return EvalReport(metrics, samples, len(prompts), num_samples, time.perf_counter() - started)


REFERENCE_COLUMNS = ("answer", "reference", "solution", "tests", "assert_code")
"""The data columns a sample's reference answer is read from, the first one its row has: the gold answer of the
arithmetic and math environments, the tests of the code environment, or a column of a usual name (python reward
functions and judges read whichever columns they like)."""


def reference_text(metadata: dict[str, Any]) -> str | None:
    """The reference answer in a prompt row's columns (REFERENCE_COLUMNS), as text; None when there is none."""
    for column in REFERENCE_COLUMNS:
        value = metadata.get(column)
        if value is not None:
            return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return None


def sample_record(episode: Episode, tokenizer, weights: dict[str, float],
                  correct_threshold: float | None = None) -> SampleRecord:
    """An episode as a SampleRecord (its group id is its prompt's index)."""
    prompt = tokenizer.decode(episode.token_ids[: episode.prompt_length])
    if episode.num_turns == 1:
        completion = episode.reply
    else:
        completion = tokenizer.decode(episode.token_ids[episode.prompt_length:])
    reward = scalar_reward(episode.reward, weights)
    correct = None
    if reward is not None:
        if "correct" in episode.metadata:
            correct = bool(episode.metadata["correct"])
        elif correct_threshold is not None:
            correct = reward >= correct_threshold
    error = None if reward is not None else episode.error or "the environment gave no reward and no reason"
    components = dict(episode.reward) if isinstance(episode.reward, dict) else None
    return SampleRecord(episode.group_id, prompt, completion, reward, components, correct, error,
                        reference_text(episode.metadata))


def train_sample(episode: Episode, tokenizer, weights: dict[str, float]) -> dict[str, Any]:
    """A training episode as a samples.jsonl record: `sample_record`'s fields, plus its group id (the run's group
    counter: which prompt draw it answers) and the policy version that sampled it, from which a run's records show
    which prompts each step trained on and how stale they were; with in-flight weight updates also its version
    spans ([index of the first sampled token, version] where the weights that sampled it changed; else [])."""
    return {**sample_record(episode, tokenizer, weights).to_json(), "group_id": episode.group_id,
            "policy_version": episode.policy_version,
            "version_spans": [list(span) for span in episode.version_spans]}


def reward_weights(environment: Environment) -> dict[str, float]:
    """How the environment's named reward components sum to one reward (python, math with components)."""
    return dict(getattr(environment, "reward_weights", {}))


def run_eval(cfg: EvalConfig) -> EvalResult | EvalReport | MultipleChoiceReport | HarnessReport:
    """`posttrain eval`: lm-eval's tasks (lm_eval_tasks), multiple-choice questions (scoring=multiple_choice or
    the arithmetic_mc task), the built-in task when no data.files are given, otherwise `evaluate_files`."""
    if cfg.lm_eval_tasks:
        return run_harness(cfg)
    if cfg.scoring == "multiple_choice" or cfg.task == "arithmetic_mc":
        return evaluate_multiple_choice(cfg)
    if not cfg.data.files:
        tokenizer = load_tokenizer(cfg.model)
        model = load_causal_lm(cfg.model, device=default_device())
        check_fits_context(model.config, cfg.max_new_tokens or 8)
        return evaluate_arithmetic(model, tokenizer, cfg.task_examples, cfg.seed, cfg.batch_size,
                                   cfg.max_new_tokens or 8)
    return evaluate_files(cfg)


def evaluate_files(cfg: EvalConfig) -> EvalReport:
    """cfg.model on the prompts of cfg.data.files, scored by cfg.environment; the samples written to cfg.output.

    The data is read and the environment built before the model loads: a malformed row or a broken reward
    setup fails in seconds."""
    if cfg.output is not None:
        check_writable_file(Path(cfg.output), "output")
    tokenizer = load_tokenizer(cfg.model)
    prompts, summary = load_prompts(cfg.data.files, cfg.data.data_config(), cfg.prompt, cfg.environment.kind,
                                    tokenizer, limit=cfg.num_examples)
    environment = build_recipe_environment(cfg.environment, tokenizer)
    try:
        prompts = offer_tools(prompts, tokenizer, environment, cfg.data.data_config().max_length)
        generator = build_generator(cfg.model, cfg.backend, tokenizer, batch_size=cfg.batch_size, seed=cfg.seed,
                                    vllm_gpu_memory_utilization=cfg.vllm_gpu_memory_utilization)
        report = evaluate_prompts(prompts, generator, environment, tokenizer,
                                  evaluation_sampling(cfg, cfg.max_new_tokens or 256), cfg.num_samples, cfg.pass_k,
                                  cfg.max_turns, reward_weights(environment), cfg.correct_threshold)
    finally:
        environment.close()
    if cfg.output is not None:
        write_sample_records(Path(cfg.output), report.samples)
    return replace(report, data_summary=summary)


def describe_report(report: EvalReport, what: str, shown_samples: int = 3) -> str:
    """The report as lines for the console: the metrics (accuracy and pass@k first), the reward errors, and the
    first samples."""
    first = [key for key in ("accuracy", *sorted((k for k in report.metrics if k.startswith("pass@")),
                                                 key=lambda k: int(k[5:])), "reward/mean") if key in report.metrics]
    keys = first + [key for key in report.metrics if key not in first and key != "reward/errors"]
    lines = [f"{what}: {report.num_prompts} prompts x {report.num_samples} sample(s), {report.seconds:.1f}s"]
    lines += [f"  {key:<22} {report.metrics[key]:.4f}" for key in keys]
    failed, total = int(report.metrics["reward/errors"]), len(report.samples)
    lines.append(f"  {'reward/errors':<22} {failed} of {total} samples masked (left out of every metric above)")
    lines += [f"    {reason}" for reason in report.errors[:3]]
    for sample in report.samples[:shown_samples]:
        verdict = "failed" if sample.reward is None else f"reward {sample.reward:g}" + (
            "" if sample.correct is None else ", correct" if sample.correct else ", wrong")
        lines.append(f"  {sample.prompt!r} -> {sample.completion!r}  ({verdict})")
    return "\n".join(lines)


def write_sample_records(path: Path, samples: list[SampleRecord]) -> None:
    """One JSON object per sample: prompt_index, sample (its number among its prompt's), then the record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines, seen = [], {}
    for s in samples:
        seen[s.prompt_index] = seen.get(s.prompt_index, -1) + 1
        lines.append(json.dumps({"prompt_index": s.prompt_index, "sample": seen[s.prompt_index], **s.to_json()}))
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


# ---- evaluation sets of a training run ------------------------------------------------------------------------


class TrainingEvaluation:
    """A training recipe's evaluation sets (its `evaluation:` section).

    Built before the model loads, so that a malformed row or a reward function that cannot be imported stops the
    run before minutes go into loading: each set's prompts are read and tokenized and its environment started.
    `run` evaluates the sets due at a step (every `every` steps, and at the last) with a generator of the current
    policy, returns their metrics as eval/<name>/<metric> and writes each set's first `samples_logged` samples to
    samples.jsonl. Each set samples with its own seed, so neither the training's random streams nor its numbers
    change; with no sets nothing is loaded, built or drawn. Under data parallelism every rank evaluates the same
    prompts identically (their environments are their own) and rank 0 logs.
    """

    def __init__(self, sets: list[EvaluationSet], tokenizer, max_steps: int, generation_batch_size: int = 256):
        self.sets = sets
        self.tokenizer = tokenizer
        self.max_steps = max_steps
        self.generation_batch_size = generation_batch_size
        self.prompts = {s.name: load_prompts(s.data.files, s.data.data_config(), s.prompt, s.environment.kind,
                                             tokenizer, limit=s.num_examples)[0] for s in sets}
        self.environments: dict[str, Environment] = {}
        for s in sets:
            self.environments[s.name] = build_recipe_environment(s.environment, tokenizer)
            self.prompts[s.name] = offer_tools(self.prompts[s.name], tokenizer, self.environments[s.name],
                                               s.data.data_config().max_length)
        self._policy_generator: Generator | None = None

    def is_due(self, step: int) -> bool:
        return any(self._due(s, step) for s in self.sets)

    def _due(self, s: EvaluationSet, step: int) -> bool:
        return bool(s.every and step % s.every == 0) or step == self.max_steps

    def run(self, step: int, generator: Generator, run_log) -> dict[str, float]:
        """Evaluate the sets due at `step` with `generator`; their metrics, keyed eval/<name>/<metric>."""
        metrics: dict[str, float] = {}
        for s in self.sets:
            if not self._due(s, step):
                continue
            environment = self.environments[s.name]
            report = evaluate_prompts(self.prompts[s.name], generator, environment, self.tokenizer,
                                      evaluation_sampling(s), s.num_samples, s.pass_k, s.max_turns,
                                      reward_weights(environment), s.correct_threshold)
            metrics.update({f"eval/{s.name}/{key}": value for key, value in report.metrics.items()})
            run_log.log_samples(step, f"eval/{s.name}", [r.to_json() for r in report.samples[: s.samples_logged]])
        return metrics

    def run_for_policy(self, step: int, policy: PolicyWorker, model: ModelConfig, run_log) -> dict[str, float]:
        """`run` for recipes without a generator of their own (sft, dpo): the transformers backend sampling from
        the policy, built at the first evaluation and given the policy's current weights at each."""
        if self._policy_generator is None:
            self._policy_generator = build_generator(model, "transformers", self.tokenizer, policy,
                                                     batch_size=self.generation_batch_size, seed=0)
        else:
            policy.push_weights(self._policy_generator)
        return self.run(step, self._policy_generator, run_log)

    def close(self) -> None:
        """Stop the environments' worker processes."""
        for environment in self.environments.values():
            environment.close()
