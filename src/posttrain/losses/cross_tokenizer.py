"""Cross-tokenizer distillation: the student against a teacher with another tokenizer, chunk by aligned chunk.

The row's text is tokenized by both models and cut into chunks, the shortest spans both cover with whole tokens
(posttrain.data.alignment). At the start of a chunk both models predict the text that follows the same prefix, so
they can be compared there; inside a chunk they cannot (one model is mid-token). With the chunk's student targets
y_1..y_n and teacher tokens x_1..x_m (all at the temperature τ):

    student chunk log-likelihood  ℓ_S = Σ_i log q(y_i | prefix, y_<i)
    teacher chunk log-likelihood  ℓ_T = Σ_j log p(x_j | prefix, x_<j)

Each chunk contributes one term:

  - exact (one student token, one teacher token, the teacher's token mapped onto the student's by the exact
    projection, i.e. the same bytes): the top-k divergence of `losses.distillation.topk_divergence` with the
    teacher's top-k carried onto the student's vocabulary through the projection. Teacher tokens without a student
    match leave the support: their log-probability (both sides) is MASKED_LOGPROB, so they weigh nothing. With a
    teacher sharing the student's tokenizer every chunk is exact and the projection the identity, so the loss is
    `distillation_loss`'s, to float rounding (tested at 1e-6).
  - any other chunk: the divergence (config.divergence) between the two-outcome distributions "the chunk's text
    comes next" / "something else", P = (e^ℓ_T, 1 − e^ℓ_T) and Q = (e^ℓ_S, 1 − e^ℓ_S), i.e. topk_divergence's tail
    form with k = 1, times cross_tokenizer.chunk_weight. With the forward KL and a confident teacher (e^ℓ_T → 1)
    this tends to −ℓ_S, the chunk's NLL; it compares the chunk's summed log-probabilities without needing the two
    vocabularies to match. The chain rule makes a chunk's joint log-likelihood the sum of its tokens', so a chunk
    counts once however many tokens it spans.
  - cross_tokenizer.unmatched = uld adds, at the first position of every non-exact chunk, uld_weight × ULD:
    Σ_i |p_(i) − q_(i)|, the L1 distance between the two next-token distributions sorted in decreasing order,
    which needs no vocabulary mapping (Boizard et al. 2024, "Towards Cross-Tokenizer Distillation: the Universal
    Logit Distillation Loss"). Here over the k largest probabilities of each side (the teacher's top-k at τ and the
    student's own top-k), not the full padded vocabularies.

Each chunk's terms are multiplied by its weight (several teachers scoring the same text: 1 each for
kd_loss_mode=sum, 1/n for average; 1 otherwise). Plus nll_weight × the data's NLL (τ = 1) at every student target,
as the plain loss. The sum over the micro-batch
is divided by `normalizer`, the student's target count of the whole optimizer step, so micro-batching and ranks
leave the update unchanged. Student targets in chunks that are not counted (straddling the prompt, text the two
tokenizations do not share) carry no divergence but stay in the normalizer.

Where this departs from the peers: TRL's GOLD sums log-probabilities inside groups of tokens whose offsets meet and
applies ULD or a vocabulary-mapped KL; NeMo-RL projects the teacher's distribution through a learned/offline
matrix at every token. Here only exactly matched one-token chunks compare full (top-k) distributions; the other
chunks compare the likelihood of the text itself, and ULD, when chosen, at their first position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from posttrain.config.losses import DistillationLossConfig
from posttrain.losses.distillation import topk_divergence

MASKED_LOGPROB = -1.0e4
"""The log-probability given to teacher top-k tokens with no student match, on both sides (exp of it is 0 in
float32; finite, so no 0·∞ in the gradient)."""


def cross_tokenizer_loss(
    student_logits: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    chunk_row: torch.Tensor,
    chunk_start: torch.Tensor,
    chunk_end: torch.Tensor,
    chunk_teacher_logprobs: torch.Tensor,
    chunk_exact: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    config: DistillationLossConfig,
    normalizer: float,
    chunk_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the step's cross-tokenizer distillation loss (see the module docstring).

    student_logits: [B, T, V]; position s predicts token s + 1. input_ids, loss_mask: [B, T] the student's rows.
    chunk_row, chunk_start, chunk_end: [C] long, chunk c covers the student tokens chunk_start..chunk_end − 1 of
        row chunk_row (all targets, chunk_start ≥ 1).
    chunk_teacher_logprobs: [C] ℓ_T, the teacher's summed log-probabilities of the chunk's tokens at τ.
    chunk_exact: [C] bool, one student token exactly matched by one teacher token.
    teacher_topk_logprobs: [C, k] the teacher's top-k log-probabilities (τ) at the chunk's first position.
    teacher_topk_ids: [C, k] for exact chunks the student ids they project onto (−1: no match); else ignored.
    chunk_weight: [C] the weight of each chunk's terms (several teachers: 1 each with kd_loss_mode=sum, 1/n with
        average); None: 1 for every chunk. The NLL term is not weighted.
    Returns (loss, metrics): sums over the micro-batch (0-dim, detached, unweighted) — divergence_sum (exact
    chunks), chunk_divergence_sum (other chunks), uld_sum, logprob_gap_sum (|ℓ_S − ℓ_T| over other chunks),
    nll_sum, exact_chunks, other_chunks, target_tokens — and each chunk's own terms ([C], detached, 0 where a term
    does not apply): chunk_divergence (the exact chunks' top-k divergence or the others' two-outcome one),
    chunk_uld, chunk_logprob_gap.
    """
    tau = config.temperature
    # Student log-probabilities at τ of every position's next token; position s predicts token s + 1.
    logq_full = torch.log_softmax(student_logits[:, :-1].float() / tau, dim=-1)  # [B, T - 1, V]
    token_logq = logq_full.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [B, T - 1]: log q of token s + 1
    before = chunk_start - 1  # the position predicting the chunk's first token
    exact = chunk_exact.bool()
    zero = student_logits.new_zeros((), dtype=torch.float32)
    weight = (torch.ones(len(chunk_start), device=student_logits.device) if chunk_weight is None
              else chunk_weight.float())
    # Each chunk's terms, [C]; a term that does not apply to a chunk stays 0.
    per_divergence = weight.new_zeros(len(chunk_start))
    per_uld, per_gap = per_divergence.clone(), per_divergence.clone()

    divergence = zero
    if exact.any():
        ids = teacher_topk_ids[exact].long()
        matched = ids >= 0
        student_logq = logq_full[chunk_row[exact], before[exact]].gather(-1, ids.clamp(min=0))
        student_logq = torch.where(matched, student_logq, MASKED_LOGPROB)
        teacher_logp = torch.where(matched, teacher_topk_logprobs[exact].float(), MASKED_LOGPROB)
        values = topk_divergence(teacher_logp, student_logq, config, logq_full[chunk_row[exact], before[exact]])
        per_divergence = per_divergence.masked_scatter(exact, values.detach())
        divergence = (weight[exact] * values).sum()

    other = ~exact
    chunk_divergence = uld = zero
    if other.any():
        rows = chunk_row[other]
        student_ll = chunk_sums(token_logq, rows, chunk_start[other], chunk_end[other])
        teacher_ll = chunk_teacher_logprobs[other].float()
        two_outcome = config.model_copy(update={"outside_topk": "tail"})
        per_chunk = topk_divergence(teacher_ll[:, None], student_ll[:, None], two_outcome)
        per_divergence = per_divergence.masked_scatter(other, per_chunk.detach())
        per_gap = per_gap.masked_scatter(other, (student_ll - teacher_ll).abs().detach())
        chunk_divergence = (weight[other] * per_chunk).sum()
        if config.cross_tokenizer.unmatched == "uld":
            teacher_p = teacher_topk_logprobs[other].float().exp().sort(-1, descending=True).values
            student_q = logq_full[rows, before[other]].exp().topk(teacher_p.shape[-1], -1).values
            chunk_uld = (teacher_p - student_q).abs().sum(-1)
            per_uld = per_uld.masked_scatter(other, chunk_uld.detach())
            uld = (weight[other] * chunk_uld).sum()

    nll = zero
    if config.nll_weight:
        predicts = loss_mask[:, 1:] > 0
        nll = F.cross_entropy(student_logits[:, :-1][predicts].float(), input_ids[:, 1:][predicts], reduction="sum")
    loss = (divergence + config.cross_tokenizer.chunk_weight * chunk_divergence
            + config.cross_tokenizer.uld_weight * uld + config.nll_weight * nll) / normalizer
    metrics = {
        "divergence_sum": per_divergence[exact].sum(),
        "chunk_divergence_sum": per_divergence[other].sum(),
        "uld_sum": per_uld.sum(),
        "logprob_gap_sum": per_gap.sum(),
        "nll_sum": nll.detach(),
        "exact_chunks": exact.sum().float(),
        "other_chunks": other.sum().float(),
        "target_tokens": (loss_mask[:, 1:] > 0).sum().float(),
        "chunk_divergence": per_divergence,
        "chunk_uld": per_uld,
        "chunk_logprob_gap": per_gap,
    }
    return loss, metrics


def chunk_sums(token_logq: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """[C] Σ_{t = starts[c]}^{ends[c] − 1} token_logq[rows[c], t − 1]: each chunk's summed log-probability
    (token_logq [B, T − 1]: position s holds the log-probability of token s + 1). Gathered position by position and
    added per chunk, so no cumulative sum over a long row loses precision."""
    lengths = ends - starts
    chunk_of = torch.repeat_interleave(torch.arange(len(starts), device=starts.device), lengths)
    first = torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    positions = starts[chunk_of] - 1 + torch.arange(len(chunk_of), device=starts.device) - first
    values = token_logq[rows[chunk_of], positions]
    return values.new_zeros(len(starts)).index_add(0, chunk_of, values)
