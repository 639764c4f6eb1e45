"""Multiple-choice evaluation by log-likelihood, as lm-evaluation-harness scores its `multiple_choice` tasks.

For each question (`data.multiple_choice`: a prompt, its choices and the right one's index) every choice is a
continuation of the prompt: its log-likelihood is the sum of the log-probabilities of its tokens given the prompt
and the tokens of the choice before them, computed in one batched forward pass of a frozen scorer
(`ScoringWorker.logprobs`). Then

  acc        the fraction of questions whose highest-log-likelihood choice is the right one
  acc_norm   the same with each log-likelihood divided by its choice's length in characters (lm-eval's acc_norm,
             which favours long answers less than the raw sum does)
  count      the questions scored

Ties go to the first choice (numpy's argmax, as lm-eval).

Tokenization (`encode_continuation`) is lm-eval's `_encode_pair` for causal models, so that both score the same
tokens: trailing whitespace of the prompt moves to the front of the continuation; the prompt is encoded alone
(with the tokenizer's special tokens, such as a BOS, unless it comes from the chat template, which writes its own),
and the continuation's tokens are those of the whole text (prompt + continuation) after as many tokens as the
prompt alone has. Where the tokenizer merges characters across the boundary ("1" + "2" → the one token "12"), the
prompt's tokens stay as encoded alone and the continuation is what the whole text has after that many tokens:
the tokens scored are then not exactly the tokenization of the whole text, the choice lm-eval makes and that this
module follows for comparability. A choice with no tokens of its own after that split is a malformed row. The
continuation is `target_delimiter` + the choice (lm-eval's default delimiter is one space).

Departure from lm-eval: no left truncation. lm-eval keeps the last max_length + 1 tokens of a long request;
here a prompt longer than data.max_length tokens is a malformed row, named with its file and line.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.algorithms.common import check_writable_file, chunks
from posttrain.algorithms.rl import format_prompt
from posttrain.config.schema import EvalConfig, PromptSection, TrainerConfig
from posttrain.data.collate import collate_padded
from posttrain.data.dataset import DataStats, skip_or_raise
from posttrain.data.errors import DataError
from posttrain.data.formats import PromptOnlyRow
from posttrain.data.multiple_choice import MultipleChoiceRow, load_multiple_choice_rows
from posttrain.data.tokenize import render_generation_prompt
from posttrain.data.types import TokenizedExample
from posttrain.models.loading import default_device, load_tokenizer
from posttrain.workers import ScoringWorker
from posttrain.workers.local import build_scorer

ARITHMETIC_MC_SOURCE = "posttrain/arithmetic-mc:heldout"
"""The bundled task's questions (`--task arithmetic_mc`): held-out additions with four choices."""


@dataclass(frozen=True)
class EncodedQuestion:
    """A question's prompt and choices as token ids, ready to score."""

    row: MultipleChoiceRow
    prompt: str
    """The prompt text the model sees (after prompt.template and the chat template)."""
    context_ids: tuple[int, ...]
    """[C] the prompt's tokens (the same for every choice)."""
    continuation_ids: tuple[tuple[int, ...], ...]
    """[K][L_k] the tokens of each choice's continuation."""


@dataclass(frozen=True)
class QuestionRecord:
    """One scored question."""

    prompt: str
    choices: tuple[str, ...]
    answer: int
    loglikelihoods: tuple[float, ...]
    """Per choice: the summed log-probability of its continuation tokens given the prompt."""
    prediction: int
    """The choice of highest log-likelihood."""
    prediction_norm: int
    """The choice of highest log-likelihood per character."""

    def to_json(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "choices": list(self.choices), "answer": self.answer,
                "loglikelihoods": list(self.loglikelihoods), "prediction": self.prediction,
                "prediction_norm": self.prediction_norm, "correct": self.prediction == self.answer,
                "correct_norm": self.prediction_norm == self.answer}


@dataclass(frozen=True)
class MultipleChoiceReport:
    metrics: dict[str, float]
    """acc, acc_norm, count (module docstring)."""
    records: list[QuestionRecord]
    seconds: float = 0.0
    data_summary: str = ""

    def to_json(self) -> dict[str, Any]:
        return dict(self.metrics)


def encode_continuation(context: str, continuation: str, tokenizer, add_special_tokens: bool = True
                        ) -> tuple[list[int], list[int]]:
    """(context token ids, continuation token ids) split as lm-eval's `_encode_pair` splits them (module
    docstring): trailing whitespace of `context` moves into `continuation`; the continuation's ids are the whole
    text's after the first len(context ids) of them."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=add_special_tokens)["input_ids"]
    context_ids = tokenizer(context, add_special_tokens=add_special_tokens)["input_ids"]
    return list(context_ids), list(whole[len(context_ids):])


def encode_question(row: MultipleChoiceRow, prompt: PromptSection, tokenizer, target_delimiter: str,
                    max_length: int) -> EncodedQuestion:
    """The row's prompt (prompt.template with the row's columns, `choices` among them; the chat template with
    prompt.use_chat_template) and choices as token ids; DataError naming the row for an empty prompt, a choice
    without tokens of its own, or a prompt longer than max_length tokens."""
    formatted = format_prompt(PromptOnlyRow(row.prompt, {**row.extras, "choices": list(row.choices)}), prompt,
                              row.location)
    chat = not isinstance(formatted, str)
    text = render_generation_prompt(formatted, tokenizer) if chat else formatted
    if not text.strip():
        raise DataError(row.location, "the prompt is empty (or only whitespace); a choice needs a prompt to be "
                        "scored against", "prompt")
    pairs = [encode_continuation(text, target_delimiter + choice, tokenizer, add_special_tokens=not chat)
             for choice in row.choices]
    context_ids = pairs[0][0]
    if len(context_ids) > max_length:
        raise DataError(row.location, f"the prompt has {len(context_ids)} tokens, more than "
                        f"data.max_length={max_length}", "prompt")
    for index, (_, continuation_ids) in enumerate(pairs):
        if not continuation_ids:
            raise DataError(row.location, f"{row.choices[index]!r} has no tokens of its own after the prompt (the "
                            "tokenizer merged it into the prompt's last token); it cannot be scored", f"choices[{index}]")
    return EncodedQuestion(row, text, tuple(context_ids), tuple(tuple(ids) for _, ids in pairs))


def choice_loglikelihoods(questions: list[EncodedQuestion], scorer: ScoringWorker, pad_token_id: int,
                          batch_size: int) -> list[list[float]]:
    """Per question, per choice: the summed log-probability of the continuation's tokens given the prompt
    (float64 sums of the scorer's float32 log-probabilities), `batch_size` sequences (prompt + one choice) per
    forward pass, right-padded."""
    requests = [(q.context_ids, ids) for q in questions for ids in q.continuation_ids]
    sums: list[float] = []
    for group in chunks(requests, batch_size):
        examples = [TokenizedExample(context + continuation, (0,) * len(context) + (1,) * len(continuation))
                    for context, continuation in group]
        batch = collate_padded(examples, pad_token_id)
        logprobs = scorer.logprobs(batch)  # [B, T]: log p(input_ids[t] | input_ids[<t]) at the loss_mask's targets
        sums += (logprobs.double() * batch.loss_mask.double()).sum(dim=1).tolist()
    out, start = [], 0
    for question in questions:
        count = len(question.continuation_ids)
        out.append(sums[start:start + count])
        start += count
    return out


def argmax_first(values: list[float]) -> int:
    """Index of the largest value, the first on ties (numpy's argmax, which lm-eval uses)."""
    return max(range(len(values)), key=lambda index: (values[index], -index))


def score_questions(questions: list[EncodedQuestion], scorer: ScoringWorker, pad_token_id: int,
                    batch_size: int) -> MultipleChoiceReport:
    """acc, acc_norm and count over `questions`, and one QuestionRecord each (module docstring)."""
    started = time.perf_counter()
    records = []
    for question, lls in zip(questions, choice_loglikelihoods(questions, scorer, pad_token_id, batch_size)):
        per_character = [ll / len(choice) for ll, choice in zip(lls, question.row.choices)]
        records.append(QuestionRecord(question.prompt, question.row.choices, question.row.answer, tuple(lls),
                                      argmax_first(lls), argmax_first(per_character)))
    count = len(records)
    metrics = {"acc": sum(r.prediction == r.answer for r in records) / count,
               "acc_norm": sum(r.prediction_norm == r.answer for r in records) / count,
               "count": count}
    return MultipleChoiceReport(metrics, records, time.perf_counter() - started)


def encode_questions(rows: list[MultipleChoiceRow], cfg: EvalConfig, tokenizer, stats: DataStats,
                     sources: list[str]) -> list[EncodedQuestion]:
    """Every row encoded (encode_question); a malformed one raises, or with data.on_error=skip is counted in stats."""
    questions = []
    for row in rows:
        try:
            questions.append(encode_question(row, cfg.prompt, tokenizer, target_delimiter_of(cfg), cfg.data.max_length))
        except DataError as error:
            skip_or_raise(error, cfg.data.on_error, stats)
    stats.examples = len(questions)
    if not questions:
        raise DataError(", ".join(sources), f"no usable rows ({stats.counts()})")
    return questions


def target_delimiter_of(cfg: EvalConfig) -> str:
    """cfg.target_delimiter; for the bundled task ("12+34=" continued by "46") "" unless target_delimiter is set."""
    if cfg.task == "arithmetic_mc" and "target_delimiter" not in cfg.model_fields_set:
        return ""
    return cfg.target_delimiter


def evaluate_multiple_choice(cfg: EvalConfig) -> MultipleChoiceReport:
    """`posttrain eval --multiple-choice` (and `--task arithmetic_mc`): cfg.model on the questions of cfg.data.files
    (or the bundled task's), every question written to cfg.output. The rows are read and encoded before the model
    loads: a malformed one fails in seconds."""
    if cfg.output is not None:
        check_writable_file(Path(cfg.output), "output")
    sources = cfg.data.files or [f"{ARITHMETIC_MC_SOURCE}[:{cfg.task_examples}]"]
    rows, stats = load_multiple_choice_rows(sources, cfg.data.column_map, cfg.data.on_error,
                                            limit=cfg.num_examples if cfg.data.files else None)
    tokenizer = load_tokenizer(cfg.model)
    questions = encode_questions(rows, cfg, tokenizer, stats, sources)
    scorer = build_scorer(cfg.model, TrainerConfig(), default_device(), role="multiple_choice")
    report = score_questions(questions, scorer, pad_token_id_of(tokenizer), cfg.batch_size)
    if cfg.output is not None:
        write_question_records(Path(cfg.output), report.records)
    return MultipleChoiceReport(report.metrics, report.records, report.seconds, stats.summary())


def write_question_records(path: Path, records: list[QuestionRecord]) -> None:
    """One JSON object per question: prompt_index, then the record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"prompt_index": index, **record.to_json()}) for index, record in enumerate(records)]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def describe_multiple_choice(report: MultipleChoiceReport, what: str, shown: int = 3) -> str:
    """The report as lines for the console: the metrics, then the first questions."""
    lines = [f"{what}: {report.metrics['count']} questions, {report.seconds:.1f}s",
             f"  {'acc':<10} {report.metrics['acc']:.4f}", f"  {'acc_norm':<10} {report.metrics['acc_norm']:.4f}"]
    for record in report.records[:shown]:
        verdict = "correct" if record.prediction == record.answer else f"wrong (answer {record.choices[record.answer]!r})"
        lines.append(f"  {record.prompt!r} -> {record.choices[record.prediction]!r}  ({verdict})")
    return "\n".join(lines)


def pad_token_id_of(tokenizer) -> int:
    """The tokenizer's pad id, else its eos id (padding is masked out of every score)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
