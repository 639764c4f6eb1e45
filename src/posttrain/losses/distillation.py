"""Top-k knowledge distillation: the student's next-token distribution against the teacher's k likeliest tokens.

At each target position the teacher gives its top-k log-probabilities log p_i and their token ids K (taken at the
temperature τ over its full vocabulary, as `ScoringWorker.topk_logprobs` returns them); the student gives its logits
z, and q = softmax(z / τ) over its full vocabulary. `config.outside_topk` decides which two distributions P
(teacher) and Q (student) are compared, on which support:

    renormalize   P_i = p_i / Σ_K p,   Q_i = q_i / Σ_K q            on K               (NeMo-RL's default)
    tail          P = (p_K, 1 − Σ_K p),  Q = (q_K, 1 − Σ_K q)        on K ∪ {tail}      (TRL, add_tail=True)
    zero_outside  P = p_K (0 outside K),  Q = q (full vocabulary)    on the vocabulary  (NeMo-RL zero_outside_topk)

and `config.divergence` which divergence of the two:

    forward   KL(P ‖ Q) = Σ P (log P − log Q)
    reverse   KL(Q ‖ P) = Σ Q (log Q − log P)
    mixed     w·forward + (1 − w)·reverse,  w = mixed_kl_weight
    jsd       β·KL(P ‖ M) + (1 − β)·KL(Q ‖ M),  M = β·P + (1 − β)·Q,  β = jsd_beta   (GKD, Agarwal et al. 2024, eq. 1)

With zero_outside only the sum over K is computed from gathered values; the part of the sum outside K is a closed
form in the student's mass there, Q_rest = 1 − Σ_K q, and its entropy part Σ_rest q log q (from the full-vocabulary
Σ q log q):
    forward: 0 (P is 0 there);
    reverse: Σ_rest q (log q − log ε), ε = e^−100 (NeMo-RL's `log_infinitesimal`: the teacher's "zero" is ε, or the
             KL would be infinite), i.e. NeMo-RL's correction H_rest − log ε·P_rest (its H_all read as Σ_V q log q,
             the reading under which the correction is the KL of the rest); weighted (1 − w) under mixed;
    jsd:     Σ_rest (1 − β)·q·log(q / ((1 − β) q)) = −(1 − β)·log(1 − β)·Q_rest (exact with P = 0 outside K).

Each valid position's divergence (plus nll_weight × the data token's NLL at temperature 1) is summed over this
micro-batch and divided by `normalizer`, the valid-token count of the whole optimizer step, so micro-batching and
data-parallel ranks leave the update unchanged.

Where this departs from its peers:
  - TRL's GKD (`generalized_jsd_loss`) compares full-vocabulary logits; here the teacher is always its top-k (the
    full [T, V] teacher logits are never materialised). With outside_topk=tail the support is the teacher's top-k
    for every β; TRL's DistillationTrainer takes the student's top-k for β = 1 and the union of both for 0 < β < 1,
    which needs the teacher's full distribution.
  - β = 0 and β = 1 are exactly the forward and reverse KL, as TRL special-cases them; the JSD itself tends to 0 at
    both ends (M tends to Q, resp. P), so the family is discontinuous there, in TRL as here.
  - NeMo-RL has no generalized JSD; its mixed KL weights the forward term by mixed_kl_weight, as here.
  - Neither peer multiplies by τ² (Hinton et al. 2015 do, to keep gradient magnitudes across temperatures); nor
    does this function.
  - Tail masses are floored at TAIL_FLOOR (1e-20) before the log: a teacher whose top-k holds all its mass (to
    float rounding) has a tail of 0 and log 0 = −inf.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from posttrain.config.losses import DistillationLossConfig

LOG_INFINITESIMAL = -100.0
"""log ε, the log-probability the zero_outside mode gives the teacher outside its top-k in the reverse KL (NeMo-RL's
`log_infinitesimal`)."""
TAIL_FLOOR = 1e-20
"""Smallest tail mass the tail mode takes the log of."""


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    config: DistillationLossConfig,
    normalizer: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the step's distillation loss.

    student_logits: [B, T, V]; position s predicts token s + 1 (a causal LM's logits).
    teacher_topk_logprobs: [B, T, k] the teacher's log-probabilities (at config.temperature, normalized over its
        full vocabulary) of its k likeliest next tokens at position s; teacher_topk_ids: [B, T, k] their ids.
        Only the positions that predict a target are read.
    input_ids: [B, T] the data's tokens (the NLL term's targets).
    loss_mask: [B, T] 1 where input_ids[b, t] is a target (predicted from position t − 1).
    normalizer: valid target tokens of the whole optimizer step.
    Returns (loss, metrics): metrics are sums over this micro-batch's targets (0-dim, detached) — divergence_sum,
    nll_sum, teacher_topk_mass_sum (Σ_K p), student_topk_mass_sum (Σ_K q), top1_agreement_sum (the student's
    argmax is the teacher's first token) — and target_tokens.
    """
    predicts = loss_mask[:, 1:] > 0  # [B, T - 1]: position s predicts target s + 1
    loss_sum, metrics = position_sums(student_logits[:, :-1][predicts].float(),
                                      teacher_topk_logprobs[:, :-1][predicts].float(),
                                      teacher_topk_ids[:, :-1][predicts].long(), input_ids[:, 1:][predicts], config)
    return loss_sum / normalizer, metrics


def chunked_distillation_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    teacher_logp: torch.Tensor,
    teacher_ids: torch.Tensor,
    targets: torch.Tensor,
    config: DistillationLossConfig,
    normalizer: float,
    chunk_size: int,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`distillation_loss` from the last hidden states at the n positions that predict a target, with the LM head
    applied chunk_size positions at a time: the student's [n, V] logits never exist whole, in the forward pass or
    the backward pass (each chunk is recomputed there, torch.utils.checkpoint), so memory grows with chunk_size · V.

    hidden: [n, H]; weight: [V, H] and bias: [V] or None, the LM head; teacher_logp, teacher_ids: [n, k] the
    teacher's top-k at those positions; targets: [n] the data's tokens there. The same sums as distillation_loss
    to float rounding (a matrix product over fewer rows may take other kernels)."""
    def chunk_sums(h, w, b, logp, ids, tokens):
        return position_sums(F.linear(h, w, b).float(), logp.float(), ids.long(), tokens, config)

    loss_sum = (hidden.sum() * 0.0).float()  # with a graph, so a micro-batch without targets backpropagates
    totals: dict[str, torch.Tensor] = {}
    for start in range(0, hidden.shape[0], chunk_size):
        part = slice(start, start + chunk_size)
        chunk_loss, sums = checkpoint(chunk_sums, hidden[part], weight, bias, teacher_logp[part], teacher_ids[part],
                                      targets[part], use_reentrant=False)
        loss_sum = loss_sum + chunk_loss
        totals = {name: totals.get(name, 0) + value for name, value in sums.items()}
    if not totals:  # no target in this micro-batch
        totals = {name: loss_sum.detach().clone() for name in METRIC_SUMS}
    return loss_sum / normalizer, totals


METRIC_SUMS = ("divergence_sum", "nll_sum", "teacher_topk_mass_sum", "student_topk_mass_sum", "top1_agreement_sum",
               "target_tokens")
"""The metrics `distillation_loss` returns, each a sum over the micro-batch's targets."""


def position_sums(logits: torch.Tensor, teacher_logp: torch.Tensor, ids: torch.Tensor, targets: torch.Tensor,
                  config: DistillationLossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(Σ divergence + nll_weight · Σ NLL, the METRIC_SUMS) over n positions: logits [n, V] float32 the student's,
    teacher_logp [n, k] and ids [n, k] the teacher's top-k, targets [n] the data's tokens."""
    student_logq_full = torch.log_softmax(logits / config.temperature, dim=-1)  # [n, V]
    student_logq = student_logq_full.gather(-1, ids)  # [n, k]
    divergence = topk_divergence(teacher_logp, student_logq, config, student_logq_full)

    nll = F.cross_entropy(logits, targets, reduction="none") if config.nll_weight else torch.zeros_like(divergence)
    loss_sum = divergence.sum() + config.nll_weight * nll.sum()
    with torch.no_grad():
        metrics = {
            "divergence_sum": divergence.sum(),
            "nll_sum": nll.sum(),
            "teacher_topk_mass_sum": teacher_logp.exp().sum(-1).sum(),
            "student_topk_mass_sum": student_logq.exp().sum(-1).sum(),
            "top1_agreement_sum": (logits.argmax(-1) == ids[:, 0]).float().sum(),
            "target_tokens": logits.new_tensor(float(targets.shape[0])),
        }
    return loss_sum, metrics


def topk_divergence(teacher_logp: torch.Tensor, student_logq: torch.Tensor, config: DistillationLossConfig,
                    student_logq_full: torch.Tensor | None = None) -> torch.Tensor:
    """[n] the divergence at each of n positions (see the module docstring).

    teacher_logp, student_logq: [n, k] log p and log q of the teacher's top-k tokens, each normalized over its full
    vocabulary. student_logq_full: [n, V] the student's full log-distribution, needed by zero_outside only (the
    student's entropy outside the top-k)."""
    mode = config.outside_topk
    if mode == "renormalize":
        log_p = teacher_logp - torch.logsumexp(teacher_logp, -1, keepdim=True)
        log_q = student_logq - torch.logsumexp(student_logq, -1, keepdim=True)
    elif mode == "tail":
        log_p = torch.cat([teacher_logp, log_rest(teacher_logp)], dim=-1)
        log_q = torch.cat([student_logq, log_rest(student_logq)], dim=-1)
    else:  # zero_outside: the sums over K; the rest of the vocabulary is the correction below
        log_p, log_q = teacher_logp, student_logq

    divergence, beta = config.divergence, config.jsd_beta
    forward = reverse = jsd = None
    if divergence in ("forward", "mixed"):
        forward = kl_terms(log_p, log_q)
    if divergence in ("reverse", "mixed"):
        reverse = kl_terms(log_q, log_p)
    if divergence == "jsd":
        log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)]), dim=0)
        jsd = beta * kl_terms(log_p, log_m) + (1 - beta) * kl_terms(log_q, log_m)

    if mode == "zero_outside":
        if student_logq_full is None:
            raise ValueError("outside_topk='zero_outside' needs the student's full-vocabulary log-probabilities")
        q_rest = (1 - student_logq.exp().sum(-1)).clamp(min=0)
        if reverse is not None:
            # Σ_rest q log q = Σ_V q log q − Σ_K q log q
            rest_q_log_q = ((student_logq_full.exp() * student_logq_full).sum(-1)
                            - (student_logq.exp() * student_logq).sum(-1))
            reverse = reverse + rest_q_log_q - LOG_INFINITESIMAL * q_rest
        if jsd is not None:
            jsd = jsd - (1 - beta) * math.log(1 - beta) * q_rest

    if divergence == "forward":
        return forward
    if divergence == "reverse":
        return reverse
    if divergence == "mixed":
        return config.mixed_kl_weight * forward + (1 - config.mixed_kl_weight) * reverse
    return jsd


def kl_terms(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """[n] Σ a (log a − log b) over the last dimension, with 0 where a is 0 (0·log 0 = 0)."""
    a = log_a.exp()
    return torch.where(a > 0, a * (log_a - log_b), 0.0).sum(-1)


def log_rest(log_topk: torch.Tensor) -> torch.Tensor:
    """[n, 1] log(1 − Σ exp(log_topk)): the log of the mass outside the top-k, floored at TAIL_FLOOR."""
    covered = torch.logsumexp(log_topk, -1, keepdim=True)
    return torch.log((-torch.expm1(covered)).clamp(min=TAIL_FLOOR))
