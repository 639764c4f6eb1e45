"""The loss configs: each is at once the recipe's `loss:` section and the value the pure loss function reads.

One definition per knob (STYLE.md 13): `PolicyLossConfig` is GRPO's and PPO's `loss` section and the config of
`posttrain.losses.policy_gradient.policy_gradient_loss`; `PreferenceLossConfig` is DPO's `loss` section and the
config of `posttrain.losses.preference.preference_loss`; `DistillationLossConfig` is the distill recipe's `loss`
section and the config of `posttrain.losses.distillation.distillation_loss`. Built from YAML or from Python, they are validated the same
way (a boolean is no number, incompatible knobs are refused naming them), and they are frozen and picklable, so a
loss description can cross a process boundary as it is.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from posttrain.config.sections import NumericSection

RatioLevel = Literal["token", "sequence", "none"]
ClipMode = Literal["ppo", "cispo"]
KLEstimator = Literal["k1", "k2", "k3"]
ImportanceCorrection = Literal["none", "tis", "icepop", "seq-mask-tis", "seq-tis"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
PreferenceLossType = Literal["dpo", "ipo", "cdpo", "dpop", "rdpo", "simpo", "orpo"]
KLType = Literal["forward", "reverse", "mixed"]
OutsideTopk = Literal["renormalize", "zero_outside", "tail"]

REFERENCE_FREE_LOSSES = ("simpo", "orpo")
"""The preference losses that need no reference model (and length-normalize themselves)."""


class LossConfig(NumericSection):
    """A loss config: a frozen value (hashable, picklable), validated at construction like every section."""

    model_config = ConfigDict(frozen=True)


class PolicyLossConfig(LossConfig):
    """The clipped policy-gradient loss (posttrain.losses.policy_gradient); each knob changes one term of
    `policy_gradient_loss`; see docs/rl.md."""

    ratio_level: RatioLevel = "token"
    """token: PPO/GRPO per-token ratio exp(logπ − logπ_old); sequence: GSPO's length-normalized sequence ratio
    exp(mean_t(logπ − logπ_old)), broadcast to its tokens; none: REINFORCE/RLOO, loss −A·logπ, no ratio, no clip."""

    clip_mode: ClipMode = "ppo"
    """ppo: clipped surrogate −min(r·A, clip(r, 1 − low, 1 + high)·A), with the optional dual clip; cispo: detached
    clipped ratio times A·logπ (every token keeps a gradient)."""

    ratio_clip_low: float = Field(0.2, ge=0)
    """ε_low: the ratio is clipped below at 1 − ε_low."""

    ratio_clip_high: float = Field(0.2, ge=0)
    """ε_high: clipped above at 1 + ε_high (DAPO clip-higher: 0.28)."""

    ratio_clip_c: float | None = None
    """Dual clip c > 1 (Ye et al. 2020) bounding the loss of negative-advantage tokens with huge ratios; null: off."""

    reference_kl_penalty: float = Field(0.0, ge=0)
    """β of the per-token KL(π‖π_ref) penalty; > 0 loads a frozen reference model."""

    kl_estimator: KLEstimator = "k3"
    """KL estimator, with d = logπ_ref − logπ: k1 = −d, k2 = d²/2, k3 = exp(d) − 1 − d (unbiased value; see
    docs/rl.md for their gradients)."""

    kl_clamp: float | None = Field(10.0, gt=0)
    """Clamp the log-ratio to ±kl_clamp before the estimator; null: no clamp."""

    kl_output_clamp: float | None = Field(None, gt=0)
    """Clamp the KL estimate itself to ±kl_output_clamp per token (no KL gradient where it binds); null: no clamp."""

    importance_correction: ImportanceCorrection = "none"
    """Correct the generator/trainer logprob mismatch w = exp(logπ_old − logπ_gen): tis (truncated weight), icepop
    (mask tokens outside the band), seq-mask-tis (mask whole sequences outside the band, truncate the rest), seq-tis
    (one truncated weight per sequence, the product of its token weights); none."""

    is_threshold_low: float = Field(0.5, ge=0)
    """Lower bound of the accepted mismatch weight (icepop, seq-mask-tis)."""

    is_threshold_high: float = Field(2.0, gt=0)
    """Upper bound of the mismatch weight and truncation value (tis, seq-tis, seq-mask-tis)."""

    logprob_mismatch_threshold: float = Field(0.1, gt=0)
    """|logπ_trainer − logπ_gen| of a sampled token above which it counts in the generator_logprob_error_fraction
    metric (logged with the mean and max of that difference whenever the generator reports log-probabilities)."""

    tis_lower_bound: float | None = None
    """tis and seq-tis: also truncate the weight from below at this value, max(w, bound); null: no lower bound."""

    aggregation: Aggregation = "token-mean"
    """token-mean (over the step's valid tokens), seq-mean-token-mean, seq-mean-token-sum, or seq-mean-token-sum-norm
    (Dr. GRPO: token sums divided by a constant, aggregation_constant or rollout.max_new_tokens)."""

    aggregation_constant: float | None = Field(None, gt=0)
    """Constant divisor of seq-mean-token-sum-norm (default: rollout.max_new_tokens × rollout.max_turns, filled in
    by `resolved`)."""

    @model_validator(mode="after")
    def _compatible_knobs(self) -> PolicyLossConfig:
        if self.ratio_clip_c is not None and self.ratio_clip_c <= 1:
            raise ValueError(f"ratio_clip_c (dual clip) must be > 1, got {self.ratio_clip_c}")
        if self.clip_mode == "cispo" and self.ratio_clip_c is not None:
            raise ValueError("clip_mode='cispo' does not combine with ratio_clip_c (dual clip): set ratio_clip_c=None")
        if self.ratio_level == "none" and self.clip_mode == "cispo":
            raise ValueError("clip_mode='cispo' needs a ratio: ratio_level='none' has none")
        if self.ratio_level == "sequence" and self.clip_mode == "cispo":
            raise ValueError(
                "clip_mode='cispo' with ratio_level='sequence' is not defined: CISPO clips each token's own IS "
                "weight and keeps that token's gradient; with GSPO's sequence ratio every token of a sequence would "
                "get the same detached clipped weight, a combination neither paper defines. Use ratio_level='token' "
                "for CISPO, or clip_mode='ppo' for GSPO"
            )
        if self.ratio_level == "none" and self.ratio_clip_c is not None:
            raise ValueError("ratio_clip_c (dual clip) needs a ratio: ratio_level='none' has none")
        if self.ratio_level == "sequence" and self.aggregation == "token-mean":
            raise ValueError(
                "ratio_level='sequence' (GSPO) needs a sequence-level aggregation: aggregation='token-mean' would "
                "weight each sequence by its length; use aggregation='seq-mean-token-mean'"
            )
        if self.is_threshold_low >= self.is_threshold_high:
            raise ValueError(
                f"is_threshold_low ({self.is_threshold_low}) must be below is_threshold_high ({self.is_threshold_high})"
            )
        if self.tis_lower_bound is not None:
            if self.importance_correction not in ("tis", "seq-tis"):
                raise ValueError(f"tis_lower_bound applies to importance_correction 'tis' or 'seq-tis', not "
                                 f"{self.importance_correction!r}: set tis_lower_bound=None")
            if not 0 <= self.tis_lower_bound < self.is_threshold_high:
                raise ValueError(f"tis_lower_bound ({self.tis_lower_bound}) must be non-negative and below "
                                 f"is_threshold_high ({self.is_threshold_high})")
        return self

    def resolved(self, max_completion_tokens: int) -> PolicyLossConfig:
        """This config with what the rollout decides filled in: Dr. GRPO's aggregation_constant, when
        seq-mean-token-sum-norm leaves it null, becomes `max_completion_tokens` (the most tokens an episode's
        completion can have: rollout.max_new_tokens × rollout.max_turns). A copy; unchanged otherwise."""
        if self.aggregation != "seq-mean-token-sum-norm" or self.aggregation_constant is not None:
            return self
        if max_completion_tokens <= 0:
            raise ValueError(f"max_completion_tokens must be positive, got {max_completion_tokens}")
        return self.model_copy(update={"aggregation_constant": float(max_completion_tokens)})


class PreferenceLossConfig(LossConfig):
    """The preference loss and its coefficients (posttrain.losses.preference); each knob is read only by the
    variants named."""

    type: PreferenceLossType = "dpo"
    """The loss: dpo, ipo, cdpo, dpop, rdpo (against a reference model) or simpo, orpo (reference-free)."""

    beta: float = Field(0.1, gt=0)
    """β: scale of the implicit reward β·log(π/π_ref) (SimPO: β·π/|y|); IPO's τ, target margin 1/(2β)."""

    label_smoothing: float = Field(0.0, ge=0, le=0.5)
    """cdpo: the assumed probability ε that a preference label is flipped."""

    dpop_lambda: float = Field(50.0, ge=0)
    """dpop: weight λ of max(0, ref_c − π_c), the penalty for lowering the chosen log-probability."""

    rdpo_alpha: float = 0.0
    """rdpo: per-token weight α of the length difference |y_w| − |y_l| inside the sigmoid; rdpo needs it nonzero
    (α = 0 is plain dpo)."""

    simpo_gamma: float = 0.5
    """simpo: the target reward margin γ itself (not γ/β)."""

    orpo_lambda: float = Field(0.1, ge=0)
    """orpo: weight λ of the odds-ratio term added to the NLL of the chosen completion."""

    sft_weight: float = Field(0.0, ge=0)
    """Weight of an extra NLL-on-chosen term (mean per token) added to any loss; 0 turns it off."""

    average_logprobs: bool = False
    """Score each completion by its per-token MEAN log-probability instead of the sum (e.g. for IPO).
    simpo and orpo length-normalize themselves and need it false."""

    truncate_rejected: bool = False
    """Train on each rejected completion only up to and including its first token that differs from the chosen
    one (the first wrong step, as in Step-DPO). The tokens after it continue a prefix that is already wrong:
    pushing them down also teaches the model to avoid them after a right prefix, which is where they may be
    correct (an answer's units digit after a wrong tens digit). The training pairs only; evaluation pairs are
    scored whole, so eval_reward_accuracy stays the standard measure."""

    @model_validator(mode="after")
    def _compatible_knobs(self) -> PreferenceLossConfig:
        if self.type == "rdpo" and self.rdpo_alpha == 0:
            raise ValueError("loss.type='rdpo' with loss.rdpo_alpha=0 is plain DPO (α weighs the length difference "
                             "of the pair): set loss.rdpo_alpha, for example 0.01, or loss.type=dpo")
        if self.average_logprobs and self.reference_free:
            raise ValueError(
                f"loss.average_logprobs=true does not apply to loss.type={self.type!r}: it normalizes by length "
                "itself and needs summed log-probabilities; set loss.average_logprobs=false"
            )
        return self

    @property
    def reference_free(self) -> bool:
        """simpo and orpo: no reference model."""
        return self.type in REFERENCE_FREE_LOSSES


class CrossTokenizerConfig(LossConfig):
    """Distillation from a teacher whose tokenizer differs from the student's (posttrain.losses.cross_tokenizer;
    the aligner is posttrain.data.alignment): the loss is taken per aligned chunk of text. Formulas and peers in
    docs/distillation.md, "Cross-tokenizer distillation"."""

    align: Literal["auto", "always"] = "auto"
    """auto: the aligner runs for a teacher whose tokenizer differs from the student's (vocabulary, ids or special
    tokens), the plain top-k loss otherwise; always: every teacher goes through the aligner (a teacher sharing the
    student's tokenizer then gives the plain loss, to float rounding)."""

    projection: Literal["exact"] = "exact"
    """How teacher tokens are carried onto the student's vocabulary. exact: a teacher token maps to the student token
    with the same bytes (special tokens by role: end of sequence, beginning, padding), built from the two
    tokenizers and stored with the run (OUTPUT/teacher_projection/); chunks of one student and one teacher token so
    matched compare top-k distributions, through the projection."""

    chunk_weight: float = Field(1.0, ge=0)
    """Weight of each other chunk's term: the divergence between the two-outcome distributions (e^ℓ_T, 1 − e^ℓ_T)
    and (e^ℓ_S, 1 − e^ℓ_S), ℓ the chunk's summed log-probability under teacher and student."""

    unmatched: Literal["ignore", "uld"] = "ignore"
    """What else compares the models at chunks without an exact one-token match. ignore: only the chunk term; uld:
    also uld_weight × Σ_i |p_(i) − q_(i)|, the L1 distance of the two next-token distributions sorted by probability
    (top-k of each side), at the chunk's first position (Boizard et al. 2024's ULD, TRL GOLD's uld_loss)."""

    uld_weight: float = Field(1.0, ge=0)
    """unmatched=uld: the weight of the ULD term."""

    @model_validator(mode="after")
    def _compatible_knobs(self) -> CrossTokenizerConfig:
        if "uld_weight" in self.model_fields_set and self.unmatched != "uld":
            raise ValueError("loss.cross_tokenizer.uld_weight applies only to unmatched='uld'; remove it or set "
                             "loss.cross_tokenizer.unmatched=uld")
        return self


class DistillationLossConfig(LossConfig):
    """Top-k knowledge distillation (posttrain.losses.distillation): the student's next-token distribution pulled
    toward the teacher's top-k at every target position; the formulas, and which peer each knob matches, are in
    docs/distillation.md."""

    kl_type: KLType = "forward"
    """forward: KL(teacher ‖ student), mass-covering (NeMo-RL kl_type=forward, TRL GKD beta=0); reverse:
    KL(student ‖ teacher), mode-seeking (GKD beta=1); mixed: mixed_kl_weight·forward + (1 − mixed_kl_weight)·reverse
    (NeMo-RL's mixed). Ignored when jsd_beta is set."""

    mixed_kl_weight: float = Field(0.5, ge=0, le=1)
    """kl_type=mixed: the weight of the forward KL (the reverse KL gets 1 − it), as NeMo-RL's mixed_kl_weight."""

    jsd_beta: float | None = Field(None, ge=0, le=1)
    """Generalized Jensen-Shannon divergence with GKD's β (TRL's GKDConfig.beta): β·KL(teacher ‖ M) +
    (1 − β)·KL(student ‖ M), M = β·teacher + (1 − β)·student; β = 0 is exactly the forward KL and β = 1 the reverse
    KL, as TRL special-cases them. null: the divergence is kl_type's."""

    temperature: float = Field(1.0, gt=0)
    """τ: both distributions are softmax(logits / τ) (the teacher's top-k is taken at τ too). The loss is not
    multiplied by τ² (as in TRL's GKD, unlike Hinton et al.'s KD)."""

    topk: int = Field(64, gt=0)
    """k: how many of the teacher's likeliest tokens are kept at each position (NeMo-RL's topk_logits_k)."""

    outside_topk: OutsideTopk = "renormalize"
    """What happens to the probability mass outside the teacher's top-k. renormalize: both distributions are
    renormalized on the top-k set (NeMo-RL's default); zero_outside: the student keeps its full vocabulary and
    the teacher is zero outside its top-k, the reverse KL then gaining NeMo-RL's correction term for the student's
    mass there (NeMo-RL zero_outside_topk=true); tail: one extra bucket holds the rest of each side's mass (TRL's
    server distillation, add_tail)."""

    nll_weight: float = Field(0.0, ge=0)
    """Weight of the data's next-token NLL (at temperature 1) added to the divergence per target token; 0: off."""

    cross_tokenizer: CrossTokenizerConfig = Field(default_factory=CrossTokenizerConfig)
    """A teacher with another tokenizer than the student's: how its tokens are aligned and compared."""

    @model_validator(mode="after")
    def _compatible_knobs(self) -> DistillationLossConfig:
        if self.jsd_beta is not None and "kl_type" in self.model_fields_set:
            raise ValueError(f"loss.jsd_beta={self.jsd_beta} and loss.kl_type={self.kl_type!r} both choose the "
                             "divergence (jsd_beta 0 is the forward KL, 1 the reverse); give one of them")
        if "mixed_kl_weight" in self.model_fields_set and (self.kl_type != "mixed" or self.jsd_beta is not None):
            raise ValueError("loss.mixed_kl_weight applies only to loss.kl_type='mixed' (without jsd_beta); "
                             "remove it or set kl_type to mixed")
        return self

    @property
    def divergence(self) -> str:
        """What the loss computes: forward, reverse, mixed or jsd (jsd_beta strictly between 0 and 1)."""
        if self.jsd_beta is None:
            return self.kl_type
        return {0.0: "forward", 1.0: "reverse"}.get(self.jsd_beta, "jsd")
