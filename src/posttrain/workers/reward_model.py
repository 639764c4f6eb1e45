"""Scoring text with a trained reward model (the OUTPUT/final/ of `posttrain rm`, or any Hugging Face sequence
classifier with one label).

    from posttrain.workers import RewardModel
    rm = RewardModel.from_pretrained("runs/rm_arithmetic/final")
    rm.score(["12+34="], ["46"])          # -> [reward]

Text is tokenized exactly as in training (posttrain.data.preference.tokenize_completions): a string prompt with the
tokenizer's special tokens, the completion without them and followed by EOS; a conversation (a list of messages
for the prompt, one or more assistant messages for the completion) through the chat template. Rows are
right-padded and the head reads each row's last non-pad token, as in training; the scoring itself is a
`LocalScoringWorker`'s `sequence_scores`, the same pass that reward-model training evaluates with.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoTokenizer

from posttrain.data.collate import collate_padded
from posttrain.data.formats import Messages
from posttrain.data.preference import completion_room, tokenize_completions
from posttrain.config.schema import TrainerConfig
from posttrain.data.types import TokenizedExample
from posttrain.models.loading import DTYPES, default_device, resolve_model_path
from posttrain.models.value_head import scalar_head_model_class
from posttrain.workers.base import ScoringWorker
from posttrain.workers.local import LocalScoringWorker

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class RewardModel:
    """A scalar reward model and its tokenizer; `score` maps (prompt, completion) pairs to floats."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, batch_size: int = 32,
                 max_length: int | None = None):
        if getattr(model.config, "num_labels", None) != 1:
            raise ValueError(f"a reward model has one output (num_labels=1); this model has "
                             f"{getattr(model.config, 'num_labels', None)}")
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        scorer = LocalScoringWorker(model, TrainerConfig(micro_batch_size=batch_size), role="reward")
        self._attach(model.eval(), scorer, tokenizer, batch_size, max_length)

    def _attach(self, model: PreTrainedModel | None, scorer: ScoringWorker, tokenizer: PreTrainedTokenizerBase,
                batch_size: int, max_length: int | None) -> None:
        self.model, self.scorer, self.tokenizer = model, scorer, tokenizer
        self.batch_size, self.max_length = batch_size, max_length
        self._tokenizing = threading.Lock()
        """Held while tokenizing: asynchronous rounds score groups from several threads (a reward group's model)."""

    @classmethod
    def scored_by(cls, scorer: ScoringWorker, tokenizer: PreTrainedTokenizerBase, batch_size: int = 32,
                  max_length: int | None = None) -> RewardModel:
        """A reward model whose weights live elsewhere (a Ray scoring group, cluster.reward_workers): the text is
        tokenized and padded here, as `score` does in one process, and `scorer.sequence_scores` scores each batch."""
        reward_model = cls.__new__(cls)
        reward_model._attach(None, scorer, tokenizer, batch_size, max_length)
        return reward_model

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device | None = None, dtype: str = "float32",
                        batch_size: int = 32, max_length: int | None = None) -> RewardModel:
        """Load a reward-model directory (or hub id, or embedded name) with AutoModelForSequenceClassification, or,
        for an architecture transformers has no sequence classifier for, with posttrain's scalar head on its base
        model (posttrain.models.value_head), which is how `posttrain rm` saved it."""
        source = resolve_model_path(str(path))
        model = scalar_head_model_class(source).from_pretrained(source, dtype=DTYPES[dtype])
        tokenizer = load_reward_tokenizer(source)
        model.to(device if device is not None else default_device())
        return cls(model, tokenizer, batch_size, max_length)

    @property
    def device(self) -> torch.device:
        """The device of the model's weights (this process's reward models only)."""
        return self.model.device

    @torch.no_grad()
    def score(self, prompts: Sequence[str | Messages], completions: Sequence[str | Messages]) -> list[float]:
        """The reward of each (prompt, completion) pair, in batches of `batch_size`.

        With max_length set, a longer sequence keeps its prompt whole and loses the end of its completion (as
        data.overlong=truncate does in training); DataError (a ValueError) when a prompt alone does not fit."""
        if len(prompts) != len(completions):
            raise ValueError(f"got {len(prompts)} prompts but {len(completions)} completions; pass one per prompt")
        with self._tokenizing:  # a fast tokenizer refuses calls from two threads at once ("Already borrowed")
            rows = [self._tokenize(prompt, completion, index)
                    for index, (prompt, completion) in enumerate(zip(prompts, completions))]
        batches = [collate_padded(rows[start:start + self.batch_size], self.tokenizer.pad_token_id)
                   for start in range(0, len(rows), self.batch_size)]
        score_each = getattr(self.scorer, "sequence_scores_each", None)  # a Ray reward group: the batches at once
        scores = score_each(batches) if score_each is not None else map(self.scorer.sequence_scores, batches)
        return [reward for batch_scores in scores for reward in batch_scores.tolist()]

    def _tokenize(self, prompt: str | Messages, completion: str | Messages, index: int) -> TokenizedExample:
        prompt_ids, (completion_ids,) = tokenize_completions(prompt, [completion], self.tokenizer, f"pair {index}")
        if self.max_length is not None:
            completion_ids = completion_ids[:completion_room(len(prompt_ids), self.max_length, f"pair {index}",
                                                             "max_length")]
        ids = tuple(prompt_ids + completion_ids)
        return TokenizedExample(ids, (0,) * len(prompt_ids) + (1,) * len(completion_ids), f"pair {index}")


def load_reward_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """A reward model's tokenizer (a directory, hub id or embedded name), with its EOS as the pad token when it
    has none (as the model was trained)."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(str(path)))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
