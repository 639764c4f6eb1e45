"""Data: reading local files and hub datasets, validating row formats, tokenizing and masking."""

from posttrain.data.dataset import DataStats, load_rows, load_sft_examples
from posttrain.data.errors import DataError
from posttrain.data.formats import (
    FORMATS,
    ROLES,
    Message,
    Messages,
    MessagesRow,
    PreferenceRow,
    PromptCompletionRow,
    PromptOnlyRow,
    Row,
    TextRow,
    detect_format,
    parse_row,
)
from posttrain.data.loading import LOCAL_EXTENSIONS, iter_records
from posttrain.data.tokenize import tokenize_sft_row, truncate_or_drop
from posttrain.data.types import SFTBatch, TokenizedExample

__all__ = [
    "FORMATS",
    "LOCAL_EXTENSIONS",
    "ROLES",
    "DataError",
    "DataStats",
    "Message",
    "Messages",
    "MessagesRow",
    "PreferenceRow",
    "PromptCompletionRow",
    "PromptOnlyRow",
    "Row",
    "SFTBatch",
    "TextRow",
    "TokenizedExample",
    "detect_format",
    "iter_records",
    "load_rows",
    "load_sft_examples",
    "parse_row",
    "tokenize_sft_row",
    "truncate_or_drop",
]
