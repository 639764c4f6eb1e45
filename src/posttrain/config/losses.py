"""The loss configs: each is at once the recipe's `loss:` section and the value the pure loss function reads.

One definition per knob (STYLE.md 13): `PolicyLossConfig` is GRPO's and PPO's `loss` section and the config of
`posttrain.losses.policy_gradient.policy_gradient_loss`; `PreferenceLossConfig` is DPO's `loss` section and the
config of `posttrain.losses.preference.preference_loss`. Built from YAML or from Python, they are validated the same
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
    """rdpo: per-token weight α of the length difference |y_w| − |y_l| inside the sigmoid."""

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
