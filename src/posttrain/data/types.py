"""Typed containers that cross module boundaries: the data pipeline's examples and the batches every worker reads
(SFTBatch, SharedPromptBatch, RolloutBatch, PairBatch, DistillBatch, CrossTokenizerBatch)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenizedExample:
    """One training example after tokenization.

    input_ids: [T] token ids of the whole example (prompt + completion, or the whole text).
    loss_mask: [T] 1 where input_ids[t] is a training target (predicted from positions < t), else 0.
        Position 0 is always 0: nothing precedes it.
    source: where the example came from ("file.jsonl:12"), for error messages.
    """

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    source: str = ""

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_targets(self) -> int:
        return sum(self.loss_mask)


@dataclass(frozen=True)
class SFTBatch:
    """A micro-batch for next-token training, padded or packed.

    input_ids: [B, T] long token ids; padding positions hold the pad id.
    loss_mask: [B, T] float, 1.0 where input_ids[b, t] is a target predicted from earlier tokens of the same example.
    position_ids: [B, T] long, restarting at 0 at the start of every example (packed rows hold several).
    attention_mask: [B, T] long, 1 for real tokens, for padded batches; None for packed batches, whose
        block-diagonal causal mask is built from position_ids at the forward pass (models.packing).
    num_examples: how many examples the batch holds (rows can hold several when packed).
    num_tokens: real (non-padding) tokens in the batch.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    num_examples: int
    num_tokens: int

    @property
    def num_target_tokens(self) -> int:
        return int(self.loss_mask.sum().item())


PROMPT, CHOSEN, REJECTED, PADDING = 0, 1, 2, 3
"""Segment labels of the tokens of a `SharedPromptBatch` row."""


@dataclass(frozen=True)
class SharedPromptBatch:
    """B preference pairs in B rows: each row holds the prompt once, then the chosen and then the rejected completion.

    One forward pass scores both completions while computing the prompt once; the attention mask, built from
    `segments` at the forward pass (models.packing.shared_prompt_mask), keeps the completions from seeing each
    other, and the position ids put the rejected tokens where they stand in their own sequence, so every
    log-probability equals the one from a row of prompt + that completion alone.

    input_ids: [B, T] long; padding positions hold the pad id.
    position_ids: [B, T] long: 0..P+C-1 over the prompt and the chosen tokens, P..P+R-1 again over the rejected ones.
    segments: [B, T] long, PROMPT, CHOSEN, REJECTED or PADDING for each token.
    chosen_mask, rejected_mask: [B, T] float, 1.0 on the chosen / rejected completion's tokens.
    prompt_ends: [B] long, each row's last prompt position (its logits predict the first token of both completions).
    rejected_starts: [B] long, each row's first rejected position.
    num_examples: B (pairs); num_tokens: real (non-padding) tokens.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segments: torch.Tensor
    chosen_mask: torch.Tensor
    rejected_mask: torch.Tensor
    prompt_ends: torch.Tensor
    rejected_starts: torch.Tensor
    num_examples: int
    num_tokens: int


@dataclass(frozen=True)
class PreferenceExample:
    """One (chosen, rejected) pair after tokenization; the prompt is shared.

    prompt_ids: [P] token ids of the prompt (with the chat template's generation prompt for conversations).
    chosen_ids: [C] token ids of the preferred completion, ending with EOS (or the template's end of turn).
    rejected_ids: [R] token ids of the dispreferred completion, ending likewise.
    source: where the pair came from ("file.jsonl:12"), for error messages.
    margin: the row's optional `margin` column (how strongly chosen is preferred), else None.
    """

    prompt_ids: tuple[int, ...]
    chosen_ids: tuple[int, ...]
    rejected_ids: tuple[int, ...]
    source: str = ""
    margin: float | None = None

    def sequence(self, which: str) -> TokenizedExample:
        """The prompt followed by the chosen or rejected completion, completion tokens as targets."""
        completion = {"chosen": self.chosen_ids, "rejected": self.rejected_ids}[which]
        return TokenizedExample(
            input_ids=self.prompt_ids + completion,
            loss_mask=(0,) * len(self.prompt_ids) + (1,) * len(completion),
            source=self.source,
        )


@dataclass(frozen=True)
class RolloutBatch:
    """N episodes as right-padded tensors; token t of a row is predicted from tokens < t."""

    input_ids: torch.Tensor
    """[N, T] prompt and episode tokens, right-padded."""
    attention_mask: torch.Tensor
    """[N, T] 1 on real tokens."""
    loss_mask: torch.Tensor
    """[N, T] float, 1 on sampled tokens that get loss (0 for prompts, observations, padding and masked episodes)."""
    generator_logprobs: torch.Tensor
    """[N, T] the sampler's logprob of each sampled token (0 elsewhere)."""
    rewards: torch.Tensor
    """[N] scalar reward (components combined, overlong penalty included); 0 where invalid."""
    reward_components: dict[str, torch.Tensor]
    """name -> [N] per-component rewards, when the environment returns named components (else empty)."""
    valid: torch.Tensor
    """[N] bool, False where scoring failed (the episode is masked and counted)."""
    group_ids: torch.Tensor
    """[N] long, the group of each episode."""
    truncated: torch.Tensor
    """[N] bool, the last turn ran out of tokens."""
    response_lengths: torch.Tensor
    """[N] sampled tokens per episode."""
    policy_versions: torch.Tensor | None = None
    """[N] long, the policy version (optimizer steps taken) whose weights sampled each episode; None when unknown."""
    advantages: torch.Tensor | None = None
    """[N] one advantage per episode (GRPO family) or [N, T] one per token (PPO's GAE, OPD); set by the loop."""
    old_logprobs: torch.Tensor | None = None
    """[N, T] π_old's log-probabilities of the tokens under the sampling temperature; None when the update is
    on-policy (π_old is then the training pass itself, detached)."""
    reference_logprobs: torch.Tensor | None = None
    """[N, T] π_ref's log-probabilities of the tokens (the KL anchor); None when no KL term reads them."""
    old_values: torch.Tensor | None = None
    """[N, T] the critic's V(s_t) before the update (PPO's clipped value loss); None without a critic."""
    returns: torch.Tensor | None = None
    """[N, T] the critic's return targets (PPO); None without a critic."""
    teacher_topk_logprobs: torch.Tensor | None = None
    """[N, T, k] a teacher's log-probabilities of its k most likely next tokens at each position (distillation)."""
    teacher_topk_ids: torch.Tensor | None = None
    """[N, T, k] the token ids of those k tokens."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: torch.Tensor) -> RolloutBatch:
        """The rows `index` (a long tensor of row numbers), every per-row field alike."""
        def rows(value):
            if value is None:
                return None
            if isinstance(value, dict):
                return {k: v[index] for k, v in value.items()}
            return value[index]

        return RolloutBatch(**{f.name: rows(getattr(self, f.name)) for f in dataclasses.fields(self)})


@dataclass(frozen=True)
class PairBatch:
    """B preference pairs collated for one forward pass, with what a pair loss reads per pair.

    rows: the pairs as the model reads them: a `collate_preference` SFTBatch (2B rows, chosen then rejected) or a
        `collate_shared_prompt` SharedPromptBatch (one row per pair).
    reference_chosen_logps, reference_rejected_logps: [B] the reference model's completion log-probabilities
        (summed, or averaged per token with loss.average_logprobs), or None for reference-free losses and reward
        models.
    margins: [B] float32 per-pair margins (a reward model's loss.use_margin), or None.
    """

    rows: SFTBatch | SharedPromptBatch
    reference_chosen_logps: torch.Tensor | None = None
    reference_rejected_logps: torch.Tensor | None = None
    margins: torch.Tensor | None = None

    @property
    def num_pairs(self) -> int:
        return self.rows.input_ids.shape[0] // 2 if isinstance(self.rows, SFTBatch) else self.rows.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.rows.num_tokens


@dataclass(frozen=True)
class DistillBatch:
    """A micro-batch of data rows with a teacher's top-k next-token distribution at each position (off-policy
    distillation).

    rows: the SFTBatch the student reads (padded; loss_mask marks the targets).
    teacher_topk_logprobs: [B, T, k] float32, the teacher's log-probabilities (at the distillation temperature,
        normalized over its full vocabulary) of its k likeliest next tokens at position s of each row, i.e. of
        token s + 1; meaningful at the positions that predict a target (loss_mask[:, s + 1] = 1), 0 elsewhere.
    teacher_topk_ids: [B, T, k] long, the ids of those tokens (0 where the log-probabilities are 0).
    """

    rows: SFTBatch
    teacher_topk_logprobs: torch.Tensor
    teacher_topk_ids: torch.Tensor

    @property
    def num_target_tokens(self) -> int:
        return self.rows.num_target_tokens

    @property
    def num_tokens(self) -> int:
        return self.rows.num_tokens


@dataclass(frozen=True)
class CrossTokenizerBatch:
    """A micro-batch of data rows with a teacher of another tokenizer, as aligned chunks (posttrain.data.alignment):
    C chunks over the batch's rows, each a span of the student's tokens that the teacher covers with whole tokens
    of its own, with what the teacher says about it.

    rows: the SFTBatch the student reads (padded; loss_mask marks the targets; the normalizer counts them).
    chunk_row: [C] long, the row of chunk c; chunk_start, chunk_end: [C] long, its student tokens
        chunk_start..chunk_end − 1 (all targets, chunk_start ≥ 1).
    chunk_teacher_logprobs: [C] float32, the teacher's summed log-probabilities (at the distillation temperature) of
        its tokens of the chunk.
    chunk_exact: [C] bool, one student token and one teacher token, the same token through the exact projection.
    teacher_topk_logprobs: [C, k] float32, the teacher's top-k log-probabilities at the chunk's first position.
    teacher_topk_ids: [C, k] long, for exact chunks the student ids of those tokens through the projection (−1: the
        teacher token has no student match); −1 for the other chunks.
    chunk_teacher: [C] long, which teacher scored chunk c (an index into the run's teachers; several teachers may
        score the same student tokens); None: all one teacher's.
    chunk_weight: [C] float32, the weight of chunk c's terms in the loss (kd_loss_mode=average: 1/n for n teachers);
        None: 1 each.
    """

    rows: SFTBatch
    chunk_row: torch.Tensor
    chunk_start: torch.Tensor
    chunk_end: torch.Tensor
    chunk_teacher_logprobs: torch.Tensor
    chunk_exact: torch.Tensor
    teacher_topk_logprobs: torch.Tensor
    teacher_topk_ids: torch.Tensor
    chunk_teacher: torch.Tensor | None = None
    chunk_weight: torch.Tensor | None = None

    @property
    def num_target_tokens(self) -> int:
        return self.rows.num_target_tokens

    @property
    def num_tokens(self) -> int:
        return self.rows.num_tokens
