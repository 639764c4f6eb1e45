"""Loading whole datasets: read every source, detect and validate the format, tokenize for SFT, count.

`load_rows` returns validated rows (preference pairs, RL prompts) for recipes that tokenize later;
`load_sft_examples` continues through tokenization and length limits. Both share one reading and
validation path, so a malformed row is reported (or skipped and counted) the same way everywhere.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING


from posttrain.config.schema import DataConfig
from posttrain.data.errors import DataError
from posttrain.data.formats import PreferenceRow, PromptOnlyRow, Row, detect_format, parse_row
from posttrain.data.loading import iter_records
from posttrain.data.tokenize import tokenize_sft_row, truncate_or_drop
from posttrain.data.types import TokenizedExample

if TYPE_CHECKING:  # annotations only: importing transformers takes seconds
    from transformers import PreTrainedTokenizerBase

MAX_SKIP_REASONS = 10
SHOWN_SKIP_REASONS = 5
"""How many of the kept skip reasons the run's data summary prints (each with its file:line and field)."""


@dataclass
class DataStats:
    """What loading did. Every record read ends up in exactly one of examples, rows_skipped, dropped_overlong.

    rows_read: records seen, including malformed ones (blank JSONL lines are not records).
    rows_skipped: malformed records dropped because data.on_error is "skip" (or examples with no targets).
    skip_reasons: the first MAX_SKIP_REASONS skip messages, each naming its location.
    truncated: examples cut to max_length and kept.
    dropped_overlong: examples longer than max_length dropped because data.overlong is "drop".
    examples: rows or examples returned.
    target_tokens: total loss-mask ones over the returned examples (0 for load_rows).
    """

    rows_read: int = 0
    rows_skipped: int = 0
    skip_reasons: list[str] = field(default_factory=list)
    truncated: int = 0
    dropped_overlong: int = 0
    examples: int = 0
    target_tokens: int = 0

    def record_skip(self, error: DataError) -> None:
        self.rows_skipped += 1
        if len(self.skip_reasons) < MAX_SKIP_REASONS:
            self.skip_reasons.append(str(error))

    def counts(self) -> str:
        """One line: rows read, examples, skipped, truncated and dropped."""
        # Prompt rows (RL, eval) have no target tokens: a count of 0 would read as a fault.
        targets = f" ({self.target_tokens} target tokens)" if self.target_tokens else ""
        return (
            f"{self.rows_read} rows read: {self.examples} examples{targets}, "
            f"{self.rows_skipped} skipped as malformed, {self.truncated} truncated, "
            f"{self.dropped_overlong} dropped as overlong"
        )

    def summary(self) -> str:
        """The counts, then (when rows were skipped) the first skip reasons, one per line with its location, so
        that a user who asked for skipping sees what was dropped and where without rerunning in raise mode."""
        shown = self.skip_reasons[:SHOWN_SKIP_REASONS]
        if not shown:
            return self.counts()
        unshown = self.rows_skipped - len(shown)
        lines = [f"{self.counts()}; first skipped:", *(f"  {reason}" for reason in shown)]
        if unshown:
            lines.append(f"  ... and {unshown} more")
        return "\n".join(lines)


def load_rows(sources: Sequence[str], cfg: DataConfig) -> tuple[list[Row], DataStats]:
    """Read and validate every record of sources (format cfg.format, or detected per source).

    Malformed records raise their DataError (cfg.on_error == "raise") or are skipped and counted ("skip").
    Raises DataError when sources are given but no row survives.
    """
    stats = DataStats()
    rows = [row for _, row in iter_rows(sources, cfg, stats)]
    stats.examples = len(rows)
    check_not_empty(sources, stats)
    return rows, stats


def load_sft_examples(
    sources: Sequence[str], tokenizer: PreTrainedTokenizerBase, cfg: DataConfig
) -> tuple[list[TokenizedExample], DataStats]:
    """Read, validate and tokenize every record of sources into SFT examples of at most cfg.max_length tokens.

    Overlong examples are truncated or dropped (cfg.overlong), and counted. An example left with no
    target tokens is a malformed row: raised or skipped per cfg.on_error. A source whose rows have no SFT
    target (preference pairs, prompts alone) raises DataError whatever cfg.on_error says: every row of it would
    be skipped, since a source's format is decided once.
    """
    stats = DataStats()
    examples: list[TokenizedExample] = []
    for location, row in iter_rows(sources, cfg, stats):
        check_sft_target(row, location)
        try:
            example = _sft_example(row, tokenizer, cfg, location, stats)
        except DataError as error:
            skip_or_raise(error, cfg.on_error, stats)
            continue
        if example is not None:
            examples.append(example)
            stats.examples += 1
            stats.target_tokens += example.num_targets
    check_not_empty(sources, stats)
    return examples, stats


def iter_rows(sources: Sequence[str], cfg: DataConfig, stats: DataStats) -> Iterator[tuple[str, Row]]:
    """(location, validated row) for every usable record; counts reads and skips into stats."""

    def unreadable(error: DataError) -> None:
        stats.rows_read += 1
        skip_or_raise(error, cfg.on_error, stats)

    for source in sources:
        fmt = None if cfg.format == "auto" else cfg.format
        for location, record in iter_records(source, on_bad_record=unreadable):
            stats.rows_read += 1
            if cfg.column_map:
                record = {cfg.column_map.get(key, key): value for key, value in record.items()}
            try:
                # Each source may have its own layout; its first well-formed record decides it.
                fmt = fmt or detect_format(record, location)
                row = parse_row(fmt, record, location)
            except DataError as error:
                skip_or_raise(error, cfg.on_error, stats)
                continue
            yield location, row


def check_sft_target(row: Row, location: str) -> None:
    """DataError (at location) when the row has nothing for SFT to learn: a preference pair or a prompt alone."""
    if isinstance(row, PreferenceRow):
        raise DataError(
            location,
            "is a preference pair (chosen and rejected columns), which has no SFT target; SFT takes text, "
            "prompt+completion or messages rows. Train on pairs with `posttrain dpo` or `posttrain rm`, or give "
            "SFT data",
        )
    if isinstance(row, PromptOnlyRow):
        columns = ", ".join(["prompt", *sorted(row.extras)])
        raise DataError(
            location,
            f"has a prompt but no completion (columns: {columns}), so there is no SFT target; SFT takes text, "
            "prompt+completion or messages rows. Name the target column `completion` (data.column_map can rename "
            "it), or train on prompts with `posttrain grpo`",
        )


def _sft_example(
    row: Row, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, location: str, stats: DataStats
) -> TokenizedExample | None:
    example = tokenize_sft_row(row, tokenizer, cfg.completion_only_loss, location)
    kept = truncate_or_drop(example, cfg.max_length, cfg.overlong)
    if kept is None:
        stats.dropped_overlong += 1
        return None
    if kept.num_targets == 0:
        if len(kept) < len(example):
            reason = (
                f"no target tokens left after truncation to data.max_length={cfg.max_length} "
                f"(the example has {len(example)} tokens, its first target is beyond the limit)"
            )
        else:
            reason = "no target tokens: nothing to train on"
        raise DataError(location, reason)
    if len(kept) < len(example):
        stats.truncated += 1
    return kept


def skip_or_raise(error: DataError, on_error: str, stats: DataStats) -> None:
    if on_error == "raise":
        raise error
    stats.record_skip(error)


def check_not_empty(sources: Sequence[str], stats: DataStats) -> None:
    if sources and stats.examples == 0:
        reasons = "; ".join(stats.skip_reasons[:3])
        raise DataError(
            ", ".join(sources),
            f"no usable rows ({stats.counts()})" + (f"; first problems: {reasons}" if reasons else ""),
        )
