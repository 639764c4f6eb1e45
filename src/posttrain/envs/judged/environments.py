"""HLE- and GDPval-format tasks scored by an LLM judge (the judge environment's backends: a server with deadlines,
retries and an API key from the environment, or a local model the recipe builds).

HLE (`HleEnvironment`): the judge reads the question, the response and the reference answer, and answers in four
lines, in the spirit of HLE's own judge prompt: `extracted_final_answer:` (the response's final answer),
`reasoning:`, `correct: yes|no`, `confidence:`. Reward 1 when it says yes, 0 when no; `correct` goes into the
episode's metadata (accuracy). The response's own stated confidence ("Confidence: 85%", the format the prompt asks
for; the last such line counts) goes into metadata as `stated_confidence` in [0, 1], or None when the response
states none or states one outside 0–100%; `posttrain.algorithms.rollout.rollout_metrics` turns them into HLE's RMS
calibration error over the responses that state one, with the count of those that do not.

GDPval (`GdpvalEnvironment`): each rubric item is one question to the judge (the task, the response, the
criterion and its points), answered "Score: N" with N from 0 to the item's points (`judge.parse_score`). Reward:
the points awarded summed over the items, divided by the rubric's total, in [0, 1]; `rubric_points` (per item) and
`rubric_score` go into metadata.

Failures are the judge environment's: a verdict that cannot be read (HLE: no_verdict, several_verdicts; GDPval:
judge.parse_score's kinds) or a transport failure (timeout, http_error, connection_error, invalid_response) masks
the sample with an error saying why and is counted in `counts`, never turned into a zero. For GDPval one failed
item masks the whole sample (a partial sum would read as a low score). Verdicts are cached by the exact messages the
judge reads, as the judge environment does; transport failures are asked again.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from posttrain.config.environments import DEFAULT_SCORE_PATTERN
from posttrain.envs.base import EnvStep, Message, check_batch, prompt_of, reply_of, single_turn_step
from posttrain.envs.judge import QUOTED_REPLY_CHARS, CachedJudge, JudgeBackend, parse_score
from posttrain.envs.judged.tasks import GdpvalTask, HleTaskSet

HLE_JUDGE_TEMPLATE = """\
Decide whether a response to a question gives the same final answer as the reference answer.

Question:
{question}

Response:
{response}

Reference answer ({answer_type}): {answer}

Judge only the final answer: it is correct when it means the same as the reference (for numbers, within a small \
rounding difference; for a multiple-choice question, the same choice). An answer that differs, adds or omits a \
part, or is missing is incorrect. Do not solve the question yourself.

Reply in exactly four lines:
extracted_final_answer: <the final answer the response gives, copied as written, or None>
reasoning: <one or two sentences on how it compares with the reference>
correct: <yes or no>
confidence: <the confidence the response states, 0 to 100, or 100 when it states none>"""

GDPVAL_JUDGE_TEMPLATE = """\
Grade a deliverable against one criterion of its rubric.

Task:
{prompt}

Deliverable:
{response}

Criterion (worth {points} points):
{criterion}

Award from 0 to {points} points for how well the deliverable meets this criterion alone. End your answer with one \
line of the form "Score: N"."""

ANSWER_TYPE_WORDS = {"exactMatch": "exact match", "multipleChoice": "multiple choice"}
VERDICT_PATTERN = re.compile(r"(?im)^[\s*_#>-]*correct\s*[:=]\s*\**\s*(yes|no)\b")
EXTRACTED_PATTERN = re.compile(r"(?im)^[\s*_#>-]*extracted_final_answer\s*[:=]\s*\**\s*(.*?)\s*$")
CONFIDENCE_PATTERN = re.compile(r"(?im)^[\s*_#>-]*confidence\s*(?:score)?\s*[:=]\s*\**\s*([-+]?\d+(?:\.\d+)?)\s*%")
"""A "Confidence: NN%" line (markdown bold allowed); the percent sign is required, as HLE's format asks for it."""
_SCORE_REGEX = re.compile(DEFAULT_SCORE_PATTERN)


def stated_confidence(response: str) -> float | None:
    """The confidence the response states on its last "Confidence: NN%" line, in [0, 1]; None when there is none
    or it lies outside 0–100%."""
    matches = CONFIDENCE_PATTERN.findall(response)
    if not matches:
        return None
    percent = float(matches[-1])
    return percent / 100 if 0 <= percent <= 100 else None


def parse_hle_verdict(text: str) -> tuple[bool | None, str | None, str | None]:
    """(correct, extracted_final_answer, error) from the judge's reply: exactly one distinct `correct: yes|no`;
    error names the failure kind (no_verdict, several_verdicts) and quotes the reply."""
    quoted = repr(text[:QUOTED_REPLY_CHARS] + ("..." if len(text) > QUOTED_REPLY_CHARS else ""))
    verdicts = {match.lower() for match in VERDICT_PATTERN.findall(text)}
    extracted = EXTRACTED_PATTERN.findall(text)
    answer = extracted[-1] if extracted else None
    if not verdicts:
        return None, answer, f"no_verdict: no 'correct: yes|no' line in the judge's reply {quoted}"
    if len(verdicts) > 1:
        return None, answer, f"several_verdicts: the judge said both yes and no in {quoted}"
    return verdicts.pop() == "yes", answer, None


def _task_of(row: dict[str, Any], column: str, tasks: dict[str, Any], index: int, environment: str,
             extra: str = "") -> Any:
    if column not in row:
        raise ValueError(f"the {environment} environment needs a {column!r} column naming the task, but row {index} "
                         f"of the batch has only {sorted(row)}")
    task = tasks.get(str(row[column]))
    if task is None:
        raise ValueError(f"row {index} of the batch names {column} {row[column]!r}, which is not among the "
                         f"{len(tasks)} tasks of the {environment} environment{extra}")
    return task


class HleEnvironment:
    """Single turn. Reward: 1 when the judge finds the response's final answer equal to the reference, else 0.

    Each data row names its question by an `id` column. Metadata out: the row's plus `correct`,
    `stated_confidence` (in [0, 1], or None) and `extracted_final_answer` (the judge's reading)."""

    def __init__(self, tasks: HleTaskSet, backend: JudgeBackend):
        if not tasks.tasks:
            raise ValueError(f"no text-only questions to score ({tasks.skipped_image_rows} rows skipped for their "
                             "image, which needs a vision-language model)")
        self.tasks, self.backend = tasks, backend
        self.counts: Counter[str] = Counter()
        """Failure kinds, `judged` and `cache_hits`, over the environment's life."""
        self.verdicts = CachedJudge(backend, self.counts)

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvStep:
        check_batch(message_logs, metadata)
        extra = (f" ({self.tasks.skipped_image_rows} were skipped for their image)"
                 if self.tasks.skipped_image_rows else "")
        conversations, responses = [], []
        for index, (log, row) in enumerate(zip(message_logs, metadata)):
            task = _task_of(row, "id", self.tasks.tasks, index, "hle", extra)
            response = reply_of(log)
            responses.append(response)
            conversations.append([{"role": "user", "content": HLE_JUDGE_TEMPLATE.format(
                question=task.question, response=response, answer=task.answer,
                answer_type=ANSWER_TYPE_WORDS[task.answer_type])}])
        rewards, errors, metadata_out = [], [], []
        for reply, row, response in zip(self.verdicts.ask(conversations), metadata, responses):
            confidence = stated_confidence(response)
            if reply.text is None:
                correct, extracted, error = None, None, f"{reply.failure}: {reply.error}"
                self.counts[reply.failure] += 1
            else:
                correct, extracted, error = parse_hle_verdict(reply.text)
                if error is not None:
                    self.counts[error.split(":", 1)[0]] += 1
            rewards.append(None if correct is None else float(correct))
            errors.append(None if error is None else f"judge ({error})")
            out = {**row, "stated_confidence": confidence, "extracted_final_answer": extracted}
            if correct is not None:
                out["correct"] = correct
            metadata_out.append(out)
        return single_turn_step(rewards, errors, metadata_out)

    def close(self) -> None:
        """Release the local judge model (nothing to release for a server)."""
        self.backend.close()


class GdpvalEnvironment:
    """Single turn. Reward: the rubric points the judge awards, summed over the items, over the rubric's total.

    Each data row names its task by a `task_id` column. Metadata out: the row's plus `rubric_points` (per item,
    None where the item's verdict failed), `rubric_score` (the reward) and `rubric_max` (the rubric's total)."""

    def __init__(self, tasks: dict[str, GdpvalTask], backend: JudgeBackend):
        if not tasks:
            raise ValueError("no GDPval tasks to score")
        self.tasks, self.backend = tasks, backend
        self.counts: Counter[str] = Counter()
        """Failure kinds, `judged` and `cache_hits`, over the environment's life."""
        self.verdicts = CachedJudge(backend, self.counts)

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvStep:
        check_batch(message_logs, metadata)
        tasks: list[GdpvalTask] = []
        conversations = []
        for index, (log, row) in enumerate(zip(message_logs, metadata)):
            task = _task_of(row, "task_id", self.tasks, index, "gdpval")
            tasks.append(task)
            prompt, response = prompt_of(log), reply_of(log)
            conversations += [[{"role": "user", "content": GDPVAL_JUDGE_TEMPLATE.format(
                prompt=prompt, response=response, points=f"{item.points:g}", criterion=item.criterion)}]
                for item in task.rubric]
        replies = iter(self.verdicts.ask(conversations))
        rewards, errors, metadata_out = [], [], []
        for task, row in zip(tasks, metadata):
            points: list[float | None] = []
            failures = []
            for number, (item, reply) in enumerate(zip(task.rubric, replies)):
                if reply.text is None:
                    failure, error = reply.failure, reply.error
                    score = None
                else:
                    verdict = parse_score(reply.text, _SCORE_REGEX, 0.0, item.points)
                    score, failure, error = verdict.score, verdict.failure, verdict.error
                if failure is not None:
                    self.counts[failure] += 1
                    name = item.item_id or f"item {number}"
                    failures.append(f"rubric {name} ({failure}): {error}")
                points.append(score)
            total = sum(p for p in points if p is not None) / task.max_points
            rewards.append(None if failures else total)
            errors.append(None if not failures else "judge: " + "; ".join(failures))
            metadata_out.append({**row, "rubric_points": points, "rubric_max": task.max_points,
                                 "rubric_score": None if failures else total})
        return single_turn_step(rewards, errors, metadata_out)

    def close(self) -> None:
        """Release the local judge model (nothing to release for a server)."""
        self.backend.close()
