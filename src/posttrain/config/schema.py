"""Validated configuration trees for every recipe.

Each field's docstring is its documentation: `posttrain RECIPE --help` prints it. Unknown keys
are rejected (``extra="forbid"``) so a typo never silently falls back to a default.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    """Base of every config node: unknown keys are errors, field docstrings are the help text."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class ModelConfig(Section):
    name_or_path: str = "posttrain/tiny"
    """Hugging Face hub id, local model directory, or an embedded model name (posttrain/tiny)."""

    tokenizer_name_or_path: str | None = None
    """Tokenizer to load when it differs from the model's (defaults to model.name_or_path)."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype the weights are loaded and kept in. Keep float32 for CPU training; see trainer.precision."""

    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernel passed to transformers."""

    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""

    trust_remote_code: bool = False
    """Allow model code from the checkpoint's repository (only for models you trust)."""


class DataConfig(Section):
    train_files: list[str] = Field(default_factory=list)
    """Training data: local .jsonl/.json/.parquet/.csv files, or `datasets` hub names (name or name:split)."""

    eval_files: list[str] = Field(default_factory=list)
    """Held-out data in the same formats; enables eval_loss every trainer.eval_every steps."""

    format: Literal["auto", "text", "prompt_completion", "messages", "preference", "prompt_only"] = "auto"
    """Row format. auto detects it from the columns: messages, prompt+chosen+rejected, prompt+completion, text, prompt."""

    on_error: Literal["raise", "skip"] = "raise"
    """What a malformed row does: raise (stop, naming file, line and field) or skip (drop it and count it)."""

    max_length: int = Field(1024, gt=0)
    """Maximum tokens per example (and per packed row)."""

    overlong: Literal["truncate", "drop"] = "truncate"
    """What an example longer than max_length does: truncate (keep its first max_length tokens) or drop; both are counted."""

    completion_only_loss: bool = True
    """Train only on completion / assistant tokens. False trains on every token except the first of each example."""

    packing: bool = False
    """Pack each micro-batch's examples into as few rows of max_length as fit, with no attention across examples."""

    shuffle: bool = True
    """Reshuffle the training examples every epoch (deterministically from seed)."""

    max_eval_examples: int | None = Field(None, gt=0)
    """Use at most this many eval examples (the first ones) for eval_loss."""


class TrainerConfig(Section):
    max_steps: int = Field(100, gt=0)
    """Number of optimizer steps."""

    learning_rate: float = Field(2e-5, gt=0)
    """Peak learning rate of AdamW."""

    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warm-up: cosine or linear to min_lr_ratio * learning_rate, or constant."""

    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warm-up from 0 to learning_rate."""

    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Final learning rate as a fraction of learning_rate (cosine and linear schedules)."""

    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay (not applied to biases and norm weights)."""

    adam_beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW beta1."""

    adam_beta2: float = Field(0.999, ge=0, lt=1)
    """AdamW beta2."""

    adam_epsilon: float = Field(1e-8, gt=0)
    """AdamW epsilon."""

    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this value; null disables clipping."""

    micro_batch_size: int = Field(8, gt=0)
    """Examples per forward/backward pass."""

    gradient_accumulation_steps: int = Field(1, gt=0)
    """Micro-batches per optimizer step. Examples per step = micro_batch_size * gradient_accumulation_steps."""

    precision: Literal["fp32", "bf16"] = "fp32"
    """fp32, or bf16 autocast for the forward pass with float32 weights and optimizer state."""

    log_every: int = Field(1, gt=0)
    """Write a metrics.jsonl line every this many steps."""

    eval_every: int = Field(0, ge=0)
    """Compute eval_loss on data.eval_files every this many steps (0: only at the end)."""

    save_every: int = Field(0, ge=0)
    """Write a resumable checkpoint every this many steps (0: none until the end)."""

    keep_last: int = Field(2, gt=0)
    """Keep only this many most recent checkpoints."""

    eval_batch_size: int = Field(32, gt=0)
    """Examples per forward pass when computing eval_loss."""

    num_threads: int | None = Field(None, gt=0)
    """torch intra-op CPU threads (default: torch's choice)."""


class LoggingConfig(Section):
    progress: Literal["auto", "rich", "plain", "none"] = "auto"
    """Console progress: auto (a rich bar on a terminal, plain lines otherwise), rich, plain or none."""

    tensorboard: bool = False
    """Write TensorBoard event files to OUTPUT/tensorboard (needs the tensorboard package)."""

    wandb: bool = False
    """Log to Weights & Biases (needs wandb)."""

    wandb_project: str = "posttrain"
    """W&B project name."""

    wandb_mode: Literal["online", "offline"] = "offline"
    """W&B mode; offline writes to OUTPUT/wandb and needs no network (sync later with `wandb sync`)."""

    mlflow: bool = False
    """Log to MLflow (needs mlflow or mlflow-skinny)."""

    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI; default is a file store in OUTPUT/mlruns."""

    run_name: str | None = None
    """Run name for W&B and MLflow (default: the output directory's name)."""

    plot: bool = True
    """Write OUTPUT/training_curves.png at the end of the run."""


class RecipeConfig(Section):
    """Keys every training recipe has."""

    output_dir: str = "runs/default"
    """Run directory: config.yaml, metrics.jsonl, checkpoints/, final/. Re-running with the same directory resumes."""

    seed: int = 0
    """Seed for model init (where applicable), data order and sampling."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """The model to train."""

    data: DataConfig = Field(default_factory=DataConfig)
    """Training and evaluation data."""

    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Optimization, schedule, checkpointing and evaluation cadence."""

    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Console progress and experiment loggers."""


class SFTConfig(RecipeConfig):
    """Supervised fine-tuning: next-token loss on completions (or whole texts)."""

    output_dir: str = "runs/sft"
    """Run directory: config.yaml, metrics.jsonl, checkpoints/, final/. Re-running with the same directory resumes."""

    @model_validator(mode="after")
    def _check(self) -> "SFTConfig":
        if not self.data.train_files:
            raise ValueError("data.train_files is empty: give at least one training file or dataset name")
        if self.data.format in ("preference", "prompt_only"):
            raise ValueError(f"data.format={self.data.format!r} has no SFT target; use text, prompt_completion or messages")
        return self


class EvalConfig(Section):
    """Greedy exact-match evaluation of a model on a built-in task."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """The model to evaluate (model.name_or_path; `--model` is a shortcut)."""

    task: Literal["arithmetic"] = "arithmetic"
    """Built-in task whose held-out split is scored."""

    num_examples: int = Field(200, gt=0)
    """Held-out examples to score."""

    batch_size: int = Field(200, gt=0)
    """Prompts generated together."""

    max_new_tokens: int = Field(8, gt=0)
    """Generation budget per answer."""

    seed: int = 0
    """Seed of the task's held-out split."""


class QuickstartConfig(Section):
    """Build the tiny model, measure it, fine-tune it with SFT on arithmetic, measure again."""

    output_dir: str = "runs/quickstart"
    """Where each stage writes its run directory and where summary.json goes."""

    sft: SFTConfig
    """The SFT stage (defaults: configs/sft_arithmetic.yaml; override as sft.trainer.max_steps=...)."""

    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out evaluation before and after each stage."""


class PreferenceLossSection(Section):
    """The preference loss and its coefficients (posttrain.losses.preference.PreferenceLossConfig)."""

    type: Literal["dpo", "ipo", "cdpo", "dpop", "rdpo", "simpo", "orpo"] = "dpo"
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

    @model_validator(mode="after")
    def _check(self) -> "PreferenceLossSection":
        if self.average_logprobs and self.type in ("simpo", "orpo"):
            raise ValueError(
                f"loss.average_logprobs=true does not apply to loss.type={self.type!r}: it normalizes by length "
                "itself and needs summed log-probabilities; set loss.average_logprobs=false"
            )
        return self

    @property
    def reference_free(self) -> bool:
        return self.type in ("simpo", "orpo")


class DPOConfig(RecipeConfig):
    """Offline preference optimization (DPO and its family) on prompt/chosen/rejected pairs."""

    output_dir: str = "runs/dpo"
    """Run directory: config.yaml, metrics.jsonl, checkpoints/, final/. Re-running with the same directory resumes."""

    loss: PreferenceLossSection = Field(default_factory=PreferenceLossSection)
    """The preference loss."""

    reference: Literal["frozen_copy", "precomputed"] = "frozen_copy"
    """Reference log-probabilities: frozen_copy (a frozen copy of the starting model scores every batch) or
    precomputed (scored once for every pair before training and kept in memory; no reference model stays
    loaded). simpo and orpo are reference-free and load no reference either way."""

    @model_validator(mode="after")
    def _check(self) -> "DPOConfig":
        if not self.data.train_files:
            raise ValueError("data.train_files is empty: give at least one preference file or dataset name")
        if self.data.format not in ("auto", "preference"):
            raise ValueError(f"data.format={self.data.format!r}: DPO trains on preference rows; use auto or preference")
        if self.data.packing:
            raise ValueError("data.packing=true is not supported by DPO (pairs are padded); set data.packing=false")
        return self
