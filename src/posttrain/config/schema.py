"""Validated configuration trees for every recipe.

Each field's docstring is its documentation: `posttrain RECIPE --help` prints it. Unknown keys
are rejected (``extra="forbid"``) so a typo never silently falls back to a default.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from posttrain.config.environments import ArithmeticEnvironment, EnvironmentSection
from posttrain.config.losses import DistillationLossConfig, PolicyLossConfig, PreferenceLossConfig
from posttrain.config.sections import NumericSection, Section


def _run_folder(value: str) -> str:
    if value.strip() in ("", "."):
        raise ValueError(f"{value!r} would write the run into the current directory; give it a folder of its own")
    return value


class ModelConfig(Section):
    name_or_path: str = "posttrain/tiny"
    """Hugging Face hub id, local model directory, or an embedded model name (posttrain/tiny)."""

    tokenizer_name_or_path: str | None = None
    """Tokenizer to load when it differs from the model's (defaults to model.name_or_path)."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype the weights are loaded and kept in. Keep float32 for CPU training; see trainer.precision."""

    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    """Attention kernel passed to transformers. auto: sdpa where the architecture supports it, eager otherwise
    (Bloom, for one, has no sdpa path); sdpa, eager or flash_attention_2 ask for that one, and an architecture
    without it is an error."""

    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""

    trust_remote_code: bool = False
    """Allow model code from the checkpoint's repository (only for models you trust)."""


class TeacherSection(Section):
    """A frozen teacher model (distillation; GRPO's on-policy distillation)."""

    name_or_path: str
    """Hugging Face hub id, local model directory, or an embedded model name (posttrain/tiny-arithmetic-sft). In
    posttrain distill a teacher with another tokenizer than the student's goes through the cross-tokenizer aligner
    (loss.cross_tokenizer); GRPO's on-policy distillation needs the student's tokenizer."""

    name: str | None = None
    """distill with several teachers: the teacher's name, in its metrics distill/<name>/... (letters, digits, '_'
    and '-'); optional with one teacher."""

    route: list[str] = Field(default_factory=list)
    """distill with several teachers (MOPD): the values of the routing column (teacher_column) whose rows this
    teacher scores; each value belongs to one teacher."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype the teacher's weights are loaded in."""

    precompute: bool = False
    """distill only: score every training example's top-k once before training, into OUTPUT/teacher_topk/ (with
    a checksum; a resumed run reuses it), and free the teacher, so it is not resident while the student trains.
    Several teachers: all or none; each scores only the rows routed to it, into OUTPUT/teacher_topk/<name>/, one
    teacher loaded at a time."""

    offload: bool = False
    """Keep the teacher's weights in CPU memory and move them to the training device only while the teacher scores
    (then back), so that the device holds the teacher only for its forward passes; costs two copies of its
    weights over the host link per scoring call. On a CPU-only machine nothing moves. One process only (refused
    under torchrun)."""

    backend: Literal["transformers", "vllm"] = "transformers"
    """How the teacher scores: transformers (the model loaded in this process, CPU or GPU) or vllm (a vLLM engine in
    this process on the GPU, vllm extra: the prompt log-probabilities of the rows' tokens, read into the same
    top-k and log-probabilities). vllm scores at temperature 1 only (vLLM's prompt log-probabilities ignore the
    temperature), one vLLM engine per run, in one process; refused with offload, precompute, a temperature other
    than 1, a vLLM rollout generator or a second vllm teacher, and under torchrun."""

    vllm_gpu_memory_utilization: float = Field(0.3, gt=0, lt=1)
    """backend=vllm: fraction of the GPU's memory the teacher's engine may take (weights, activations, KV cache);
    the rest is left to the student."""

    @model_validator(mode="after")
    def _one_way_out_of_memory(self) -> TeacherSection:
        if self.precompute and self.offload:
            raise ValueError("teacher precompute and offload: precompute frees the teacher after scoring the data "
                             "once, so there is nothing to offload; set one of them")
        if self.backend == "vllm" and self.offload:
            raise ValueError("backend=vllm with offload=true: a vLLM engine keeps its weights and KV cache on the "
                             "GPU (vllm_gpu_memory_utilization bounds them); set offload=false or "
                             "backend=transformers")
        if self.backend == "vllm" and self.precompute:
            raise ValueError("backend=vllm with precompute=true is not built yet (the precomputed file does not "
                             "record the backend, and freeing the engine's GPU memory before the student loads is "
                             "not built); set precompute=false, and the vLLM teacher scores each micro-batch")
        if self.backend != "vllm" and "vllm_gpu_memory_utilization" in self.model_fields_set:
            raise ValueError("vllm_gpu_memory_utilization applies to backend=vllm; set backend=vllm or remove it")
        return self

    def as_model(self) -> ModelConfig:
        """The teacher as a ModelConfig (what the model loaders read)."""
        return ModelConfig(name_or_path=self.name_or_path, dtype=self.dtype)


class DataConfig(Section):
    train_files: list[str] = Field(default_factory=list)
    """Training data: local .jsonl/.json/.parquet/.csv files, or `datasets` hub names (name or name:split)."""

    eval_files: list[str] = Field(default_factory=list)
    """Held-out data in the same formats; enables eval_loss every trainer.eval_every steps."""

    format: Literal["auto", "text", "prompt_completion", "messages", "preference", "prompt_only", "sharegpt",
                    "alpaca"] = "auto"
    """Row format. auto detects it from the columns: messages, prompt+chosen+rejected, prompt+completion, text, prompt,
    conversations (ShareGPT, read as messages), instruction+output (Alpaca, read as prompt+completion)."""

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
    """Use at most this many eval examples (the first ones) for eval_loss (GRPO: for validation)."""

    column_map: dict[str, str] = Field(default_factory=dict)
    """Rename columns as they are read, e.g. {question: prompt, solution: answer}, before the format is detected."""

    max_overlap_fraction: float = Field(0.0, ge=0, le=1)
    """The largest fraction of an evaluation source's rows (eval_files, each `evaluation:` set) whose prompt may also
    be a training row's prompt (compared after normalising case, Unicode and whitespace); more stops the run
    before training, naming both sources and a shared row. 0: held-out data shares no prompt with the training
    data."""


class TrainerConfig(NumericSection):
    max_steps: int = Field(100, gt=0)
    """Number of optimizer steps."""

    num_epochs: int | None = Field(None, gt=0)
    """sft, dpo, rm and distill: train for this many passes over the training set instead of max_steps (not both):
    max_steps becomes ceil(num_epochs × training examples / (micro_batch_size × gradient_accumulation_steps)) once
    the data is read, and is printed. config.yaml then records num_epochs, not the derived max_steps."""

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

    lm_head: Literal["auto", "chunked", "full"] = "auto"
    """How the losses of SFT, DPO (and its variants) and the RL policy read the LM head, and how references score.
    chunked: only at the positions that predict a target token (completion tokens, sampled tokens), lm_head_chunk_size
    positions at a time in forward and backward, so the [B, T, V] logits never exist (posttrain.losses.chunked);
    full: the model's own logits at every position. auto: chunked where a micro-batch's full float32 logits would
    take 256 MiB or more (large vocabularies, long rows) and the architecture's head is a plain linear layer in
    one process; full otherwise (so the small embedded recipes run exactly as before)."""

    packing: bool = False
    """Run the decoder on each padded micro-batch's rows packed end to end (DPO and reward-model pairs, RL
    episodes, padded SFT batches), with a block mask keeping them apart, and read every output back at its padded
    position: the same results to float rounding, without computing the padding. Rows are packed first-fit
    decreasing into rows no wider than the micro-batch's widest, so nothing needs tuning and no packed row costs
    more attention than a padded one. Architectures whose custom masks are not verified exact are refused (docs/
    data.md, "Batching and packing"). SFT's data.packing packs examples into data.max_length rows at collation."""

    compile: bool = False
    """torch.compile the model's forward (dynamic shapes) for the training and scoring passes of SFT, DPO and
    reward-model training. Off by default: on CPU it needs a C++ compiler and costs minutes of compilation before
    the first step; measured speed-ups are in BENCHMARKS.md. Not available to the RL recipes, whose generator
    calls the same module with ever-changing cache shapes."""

    lm_head_chunk_size: int = Field(1024, gt=0)
    """Positions per chunk of the chunked LM head (1,024 × a 152k vocabulary is 0.6 GB of float32 logits)."""

    log_every: int = Field(1, gt=0)
    """Write a metrics.jsonl line every this many steps."""

    eval_every: int = Field(0, ge=0)
    """Compute eval_loss on data.eval_files every this many steps (0: only at the end)."""

    save_every: int = Field(0, ge=0)
    """Write a resumable checkpoint every this many steps (0: none until the end)."""

    save_every_minutes: float = Field(20.0, ge=0)
    """Also write a checkpoint at the first step end this many minutes after the previous one (or the start), so
    a run killed without warning loses at most about this much work (0: only save_every and the end). SIGTERM and
    SIGUSR1 save at the current step's end whatever this says (docs/failure-modes.md). These checkpoints count
    toward keep_last like the others."""

    keep_last: int = Field(2, gt=0)
    """Keep only this many most recent checkpoints."""

    eval_batch_size: int = Field(32, gt=0)
    """Examples per forward pass when computing eval_loss; sft and dpo: also the sequences sampled together by
    the evaluation sets."""

    num_threads: int | None = Field(None, gt=0)
    """torch intra-op CPU threads (default: torch's choice)."""

    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A step whose loss or gradient norm is NaN or infinite: "stop" the run (the update is not applied, the
    newest checkpoint is kept, final/ is not written) or "skip" it (not applied, counted as
    nonfinite_skipped_steps) and go on."""

    max_nonfinite_skips: int = Field(5, ge=0)
    """With on_nonfinite=skip: stop after more than this many non-finite steps in a row."""

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainerConfig:
        if self.num_epochs is not None and "max_steps" in self.model_fields_set:
            raise ValueError(f"trainer.num_epochs={self.num_epochs} and trainer.max_steps={self.max_steps} both say "
                             "how long to train; give one of them")
        return self

    def with_epochs_as_steps(self, num_examples: int) -> TrainerConfig:
        """This section with max_steps derived from num_epochs over `num_examples` training examples (at least 1
        step); itself when num_epochs is not set."""
        if self.num_epochs is None:
            return self
        per_step = self.micro_batch_size * self.gradient_accumulation_steps
        return self.model_copy(update={"max_steps": max(1, math.ceil(self.num_epochs * num_examples / per_step))})


class LoggingConfig(Section):
    progress: Literal["auto", "rich", "tqdm", "plain", "none"] = "auto"
    """Console progress: auto (a tqdm widget in a Jupyter notebook, a rich bar on a terminal, plain lines
    otherwise), rich, tqdm (tqdm.auto: a widget in a notebook, a text bar elsewhere), plain or none."""

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

    report: bool = True
    """Write OUTPUT/report.html at the end of the run (also when it fails): curves, config, data summary, timings,
    samples, in one self-contained page; `posttrain report OUTPUT` rewrites it (see docs/report.md)."""

    samples_per_step: int = Field(4, ge=0)
    """grpo: the first this-many episodes of each step (prompt, completion, reward, error) are appended to
    OUTPUT/samples.jsonl with split "train"; 0 writes none. Evaluation sets write theirs there too."""


class LoraSection(Section):
    """Low-rank adapters (LoRA, Hu et al. 2021) through peft: only the adapters (and, for reward models, the
    score head) train; the base weights stay frozen. Supported by sft, dpo and rm."""

    enabled: bool = False
    """Train LoRA adapters instead of the full model."""

    r: int = Field(16, gt=0)
    """Rank of each adapter."""

    alpha: float = Field(32.0, gt=0)
    """Scaling numerator: the adapter's update is multiplied by alpha / r."""

    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input."""

    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Module names (or name suffixes) to adapt, e.g. [q_proj, v_proj]; all-linear: every linear layer but the
    output head."""


class HubSection(Section):
    """Upload the run's export to the Hugging Face Hub when it ends (`posttrain push RUN_DIR --repo-id ID` does
    the same for a finished run). The token is huggingface_hub's (HF_TOKEN or `hf auth login`), checked before
    training starts; it is written to no file of the run."""

    push_at_end: bool = False
    """After writing OUTPUT/final/ (and its README.md model card), create repo_id if needed and upload the folder
    in one commit. A failed upload stops with an error naming the `posttrain push` command that retries it."""

    repo_id: str | None = Field(None, pattern=r"^(?:[\w.-]+/)?[\w.-]+$")
    """The repository, NAMESPACE/NAME (or NAME in the token owner's namespace)."""

    private: bool = False
    """Create the repository private (an existing repository keeps its visibility)."""

    folder: Literal["final", "adapter"] = "final"
    """final: the whole model (with LoRA, merged into its base); adapter: the LoRA adapter alone (OUTPUT/adapter/,
    needs lora.enabled)."""

    @model_validator(mode="after")
    def _check(self) -> HubSection:
        if self.push_at_end and self.repo_id is None:
            raise ValueError("hub.push_at_end=true needs hub.repo_id (NAMESPACE/NAME)")
        return self


class RecipeConfig(Section):
    """Keys every training recipe has."""

    output_dir: str = "runs/default"
    """Run directory: config.yaml, metrics.jsonl, checkpoints/, final/. Re-running with the same directory resumes;
    one run at a time holds it (OUTPUT/.lock)."""

    seed: int = 0
    """Seed for model init (where applicable), data order and sampling."""

    overwrite_output_dir: bool = False
    """Write into an output_dir that already holds files posttrain did not put there (no OUTPUT/.posttrain-run
    marker); without it such a folder is refused before anything is written, naming the files."""

    @field_validator("output_dir")
    @classmethod
    def _a_folder(cls, value: str) -> str:
        return _run_folder(value)

    model: ModelConfig = Field(default_factory=ModelConfig)
    """The model to train."""

    data: DataConfig = Field(default_factory=DataConfig)
    """Training and evaluation data."""

    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Optimization, schedule, checkpointing and evaluation cadence."""

    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Console progress and experiment loggers."""

    lora: LoraSection = Field(default_factory=LoraSection)
    """LoRA adapters instead of full fine-tuning."""

    hub: HubSection = Field(default_factory=HubSection)
    """Upload OUTPUT/final/ (or adapter/) to the Hugging Face Hub at the end of the run."""

    @model_validator(mode="after")
    def _check_hub(self) -> RecipeConfig:
        if self.hub.folder == "adapter" and not self.lora.enabled:
            raise ValueError("hub.folder=adapter uploads OUTPUT/adapter/, which only a LoRA run writes; set "
                             "lora.enabled=true or hub.folder=final")
        return self


class SFTConfig(RecipeConfig):
    """Supervised fine-tuning: next-token loss on completions (or whole texts)."""

    output_dir: str = "runs/sft"
    """Run directory: config.yaml, metrics.jsonl, checkpoints/, final/. Re-running with the same directory resumes."""

    evaluation: list[EvaluationSet] = Field(default_factory=list)
    """Evaluation sets sampled from the policy during training (see docs/evaluation.md), each logged as
    eval/<name>/<metric>; none by default."""

    @model_validator(mode="after")
    def _check(self) -> SFTConfig:
        check_evaluation_sets(self.evaluation, self.trainer)
        if not self.data.train_files:
            raise ValueError("data.train_files is empty: give at least one training file or dataset name")
        if self.data.format in ("preference", "prompt_only"):
            raise ValueError(f"data.format={self.data.format!r} has no SFT target; use text, prompt_completion or messages")
        return self


class DPOConfig(RecipeConfig):
    """Offline preference optimization (DPO and its family) on prompt/chosen/rejected pairs."""

    output_dir: str = "runs/dpo"
    """Run directory: config.yaml, metrics.jsonl, checkpoints/, final/. Re-running with the same directory resumes."""

    loss: PreferenceLossConfig = Field(default_factory=PreferenceLossConfig)
    """The preference loss."""

    reference: Literal["frozen_copy", "precomputed"] = "frozen_copy"
    """Reference log-probabilities: frozen_copy (a frozen copy of the starting model scores every batch) or
    precomputed (scored once for every pair before training and kept in memory; no reference model stays
    loaded). With lora.enabled no copy is ever loaded: the reference is the policy with its adapters switched
    off (the frozen base model), scored every batch or once up front. simpo and orpo are reference-free and
    use no reference either way."""

    share_prompt: bool | None = None
    """Score each pair in ONE row: the prompt once, then the chosen and the rejected completion, kept from seeing
    each other by a tree-shaped attention mask. The log-probabilities are those of two separate rows (to float
    rounding) while the prompt's tokens go through the model once instead of twice, in the policy and in the
    reference. Needs sdpa or eager attention. null (default): on unless model.attn_implementation is
    flash_attention_2 (which takes no such mask) or the architecture's custom masks are not verified exact (see
    docs/data.md, "Batching and packing"); false: two rows per pair, chosen and rejected."""

    evaluation: list[EvaluationSet] = Field(default_factory=list)
    """Evaluation sets sampled from the policy during training (see docs/evaluation.md), each logged as
    eval/<name>/<metric>; none by default."""

    final_interpolation: float = Field(1.0, gt=0)
    """After the last optimizer step the weights become start + final_interpolation·(trained − start), the
    starting model's weights pulled toward (below 1) or pushed past (above 1) the trained ones, before the last
    evaluation, checkpoint and OUTPUT/final/. 1 (default): the trained weights. Below 1 is WiSE-FT's weight
    interpolation (Wortsman et al. 2022): it keeps more of what the starting model could do on inputs the pairs
    never cover; above 1 is ExPO's extrapolation (Zheng et al. 2024). With LoRA the adapters' updates are
    scaled; otherwise the starting model is loaded once more, on the CPU, for the interpolation."""

    @model_validator(mode="after")
    def _check(self) -> DPOConfig:
        check_evaluation_sets(self.evaluation, self.trainer)
        check_pair_data(self.data, "DPO")
        if self.share_prompt and self.model.attn_implementation == "flash_attention_2":
            raise ValueError("share_prompt=true needs an attention mask that flash_attention_2 cannot take; set "
                             "model.attn_implementation to sdpa or eager, or share_prompt to false")
        return self

    @property
    def shares_prompt(self) -> bool:
        """Whether pairs are scored as one shared-prompt row (share_prompt resolved)."""
        if self.share_prompt is None:
            return self.model.attn_implementation != "flash_attention_2"
        return self.share_prompt


class SamplingSection(NumericSection):
    """How a recipe samples completions from the model it trains: the knobs the online RL recipes' `rollout:` and
    on-policy distillation's `rollout:` share."""

    max_new_tokens: int = Field(256, gt=0)
    """Completion budget in tokens (per turn of a multi-turn episode); a completion that reaches it is truncated."""

    temperature: float = Field(1.0, gt=0)
    """Sampling temperature. The RL recipes' trainer scores tokens under the same temperature."""

    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling (1: off). Anything but 1 makes the sampler's distribution differ from the trainer's."""

    top_k: int = Field(0, ge=0)
    """Top-k sampling (0: off)."""

    stop_strings: list[str] = Field(default_factory=list)
    """Stop a completion once its text contains one of these (the completion keeps the stop string)."""

    backend: Literal["transformers", "vllm"] = "transformers"
    """Generator: transformers (samples from the trained model itself; CPU or GPU) or vllm (GPU extra)."""

    generation_batch_size: int = Field(256, gt=0)
    """Sequences sampled together by the transformers backend."""

    vllm_gpu_memory_utilization: float = Field(0.3, gt=0, lt=1)
    """Fraction of GPU memory vLLM may take (vllm backend)."""


class DistillConfig(RecipeConfig):
    """Knowledge distillation: the student (model:) learns the teacher's next-token distribution (its top-k at
    every completion position) on a dataset, with the loss of `loss:` (see docs/distillation.md)."""

    output_dir: str = "runs/distill"
    """Run directory: config.yaml, metrics.jsonl, checkpoints/, teacher_topk/, final/. Re-running with the same
    directory resumes."""

    mode: Literal["off_policy", "on_policy"] = "off_policy"
    """off_policy: every step distills the dataset's completions (prompt/completion or messages rows). on_policy
    (GKD, Agarwal et al. 2024): a step is on-policy with probability `lmbda`; its completions are then sampled by
    the student (rollout:) from the same rows' prompts, and the teacher scores its top-k at the sampled tokens."""

    lmbda: float | None = Field(None, ge=0, le=1)
    """mode=on_policy: the probability that a step's completions are the student's own samples (TRL GKDConfig's
    lmbda), drawn per step from a stream seeded by the run's seed and the step (a resumed run draws what an
    uninterrupted one does); the other steps distill the dataset's completions. Default 1.0 (every step on-policy);
    0 is exactly off_policy. Refused with mode=off_policy, which is lmbda 0."""

    rollout: SamplingSection = Field(default_factory=SamplingSection)
    """mode=on_policy: how the student samples an on-policy step's completions (max_new_tokens, temperature, top_p,
    top_k, stop_strings, backend); one completion per prompt, the prompt being the row's tokens before its first
    target. Refused with mode=off_policy."""

    teachers: list[TeacherSection] = Field(default_factory=list)
    """The teacher models, each {name_or_path, dtype (float32 or bfloat16), precompute (bool: score the training
    set's top-k once into OUTPUT/teacher_topk/ and free the teacher), offload (bool: weights on the CPU, moved to
    the training device only while scoring), backend (transformers, or vllm: scored by a vLLM engine on the GPU),
    name, route}. Several teachers (MOPD) each score the rows whose teacher_column value their `route` lists."""

    teacher_column: str | None = None
    """Several teachers: the training data's column whose value sends each row to the one teacher whose `route`
    lists it (a row without the column, or with a value no teacher serves, is refused naming it)."""

    kd_loss_mode: Literal["select", "sum", "average"] = "select"
    """How several teachers combine. select: each row is distilled from the one teacher its teacher_column value
    routes it to (MOPD). sum / average: every teacher scores every row and the teachers' losses are added (or added
    and divided by the number of teachers); these go through the cross-tokenizer aligner for every teacher (each
    with its own projection onto the student's vocabulary; a teacher sharing the student's tokenizer gives the plain
    top-k loss there), take no teacher_column, and need a name per teacher (its metrics: distill/<name>/...)."""

    loss: DistillationLossConfig = Field(default_factory=DistillationLossConfig)
    """The distillation loss."""

    evaluation: list[EvaluationSet] = Field(default_factory=list)
    """Evaluation sets sampled from the student during training (see docs/evaluation.md), each logged as
    eval/<name>/<metric>; none by default."""

    cluster: ClusterSection = Field(default_factory=lambda: ClusterSection())
    """Where the teachers score: in this process (backend local, the default), or with backend=ray and
    teacher_workers > 0 each teacher in a group of that many Ray actors of its own (docs/ray.md). The student
    trains, and on-policy steps sample, in this process."""

    @field_validator("lmbda", mode="before")
    @classmethod
    def _a_number(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError(f"expected a number in [0, 1], got the boolean {value}")
        return value

    @model_validator(mode="after")
    def _check(self) -> DistillConfig:
        check_evaluation_sets(self.evaluation, self.trainer)
        self._check_teachers()
        if not self.data.train_files:
            raise ValueError("data.train_files is empty: give at least one training file or dataset name")
        if self.data.format in ("preference", "prompt_only", "text"):
            raise ValueError(f"data.format={self.data.format!r}: distill reads prompt/completion or messages rows; "
                             "use auto, prompt_completion or messages")
        if self.data.packing:
            raise ValueError("data.packing=true is not built for distill yet (the teacher's top-k travels per "
                             "padded row); set data.packing=false")
        self._check_on_policy()
        self._check_vllm_teacher()
        self._check_cluster()
        return self

    def _check_cluster(self) -> None:
        """cluster: for distill only the teacher groups (backend, address, num_cpus, timeout_s, teacher_workers,
        the scoring workers' CPUs and GPUs, max_restarts); every other cluster key belongs to the RL recipes."""
        c = self.cluster
        for key in sorted(c.model_fields_set):
            if key not in DISTILL_CLUSTER_KEYS and getattr(c, key) != ClusterSection.model_fields[key].default:
                raise ValueError(f"cluster.{key} does not apply to distill: its Ray cluster holds the teachers' "
                                 f"scoring groups only (the student trains, and samples, in the driver process); "
                                 f"the keys it reads are cluster.{', cluster.'.join(DISTILL_CLUSTER_KEYS)}")
        if c.backend == "local":
            for key in ("teacher_workers", "cpus_per_scoring_worker", "gpus_per_scoring_worker"):
                if key in c.model_fields_set:
                    raise ValueError(f"cluster.{key} needs cluster.backend=ray (the teachers' Ray scoring groups)")
            return
        if not c.teacher_workers:
            raise ValueError("cluster.backend=ray for distill puts the teachers on Ray actors: set "
                             "cluster.teacher_workers to the actors of each teacher's group (1 or more), or "
                             "cluster.backend=local")
        if served := [i for i, teacher in enumerate(self.teachers) if teacher.backend != "transformers"]:
            raise ValueError(f"cluster.teacher_workers={c.teacher_workers} with teachers[{served[0]}].backend="
                             f"{self.teachers[served[0]].backend}: teacher actors run the transformers backend for "
                             "now; set the teacher's backend=transformers or cluster.backend=local")
        if self.kd_loss_mode != "select" or self.loss.cross_tokenizer.align == "always":
            raise ValueError(f"cluster.backend=ray with "
                             + (f"kd_loss_mode={self.kd_loss_mode}" if self.kd_loss_mode != "select"
                                else "loss.cross_tokenizer.align=always")
                             + ": these teachers score through the cross-tokenizer aligner, which runs in the "
                             "driver process and has no Ray scoring group yet; set cluster.backend=local")
        if c.address is None:
            # Precomputed teachers are loaded one after the other; teachers scoring each step are all resident.
            groups = 1 if self.teacher.precompute else len(self.teachers)
            wanted = groups * c.teacher_workers * c.cpus_per_scoring_worker
            if wanted > c.num_cpus:
                raise ValueError(f"the teacher actors ask for more CPUs than the local Ray instance offers: {groups} "
                                 f"teacher group(s) x cluster.teacher_workers={c.teacher_workers} x "
                                 f"cpus_per_scoring_worker={c.cpus_per_scoring_worker:g} = {wanted:g} > "
                                 f"cluster.num_cpus={c.num_cpus}; raise cluster.num_cpus (Ray counts slots, not "
                                 "cores) or lower cluster.teacher_workers")

    def _check_vllm_teacher(self) -> None:
        """backend=vllm: one vLLM engine per process, scoring at temperature 1."""
        served = [i for i, teacher in enumerate(self.teachers) if teacher.backend == "vllm"]
        if not served:
            return
        i = served[0]
        if len(served) > 1:
            raise ValueError(f"teachers[{served[1]}].backend=vllm: teachers[{i}] is served by vLLM already, and one "
                             "vLLM engine per process is built; set backend=transformers on all teachers but one")
        if self.loss.temperature != 1.0:
            raise ValueError(f"teachers[{i}].backend=vllm with loss.temperature={self.loss.temperature:g}: vLLM "
                             "computes prompt log-probabilities from the raw logits whatever the request's "
                             "temperature, and a temperature cannot be applied to a top-k afterwards (its "
                             f"normalizer needs every logit); set loss.temperature=1 or teachers[{i}].backend="
                             "transformers")
        if self.on_policy_fraction > 0 and self.rollout.backend == "vllm":
            raise ValueError(f"teachers[{i}].backend=vllm with rollout.backend=vllm: the student's sampler and the "
                             "teacher would be two vLLM engines in one process, which is not built; set one of "
                             "them to transformers")

    def _check_teachers(self) -> None:
        """One teacher, or several each with a name and the teacher_column values it serves (each value one
        teacher's)."""
        if not self.teachers:
            raise ValueError("teachers: give at least one teacher ({name_or_path: ...})")
        if self.kd_loss_mode != "select":
            self._check_combined_teachers()
            return
        if self.teacher_column is None:
            if len(self.teachers) > 1:
                raise ValueError(f"teachers: {len(self.teachers)} teachers need teacher_column, the data column "
                                 "whose value routes each row to one teacher (each teacher's route lists its values), "
                                 "or kd_loss_mode=sum or average (every teacher scores every row)")
            if self.teachers[0].route:
                raise ValueError("teachers[0].route applies with teacher_column (the column it routes by); set "
                                 "teacher_column or remove route")
            return
        names: dict[str, int] = {}
        served: dict[str, int] = {}
        for i, teacher in enumerate(self.teachers):
            if teacher.name is None or not re.fullmatch(r"[A-Za-z0-9_-]+", teacher.name):
                raise ValueError(f"teachers[{i}].name: with teacher_column every teacher needs a name of letters, "
                                 f"digits, '_' and '-' (its metrics are distill/<name>/...); got {teacher.name!r}")
            if teacher.name in names:
                raise ValueError(f"teachers[{i}].name={teacher.name!r} is also teachers[{names[teacher.name]}]'s")
            names[teacher.name] = i
            if not teacher.route:
                raise ValueError(f"teachers[{i}].route is empty: list the {self.teacher_column!r} values whose rows "
                                 f"teacher {teacher.name!r} scores")
            if teacher.precompute != self.teachers[0].precompute:
                raise ValueError(f"teachers[{i}].precompute={str(teacher.precompute).lower()} but teachers[0]."
                                 f"precompute={str(self.teachers[0].precompute).lower()}: with several teachers "
                                 "either every teacher's top-k is precomputed or none is; set them alike")
            for value in teacher.route:
                if value in served:
                    raise ValueError(f"teachers[{i}].route: the {self.teacher_column!r} value {value!r} is also "
                                     f"served by teachers[{served[value]}]; each value belongs to one teacher")
                served[value] = i

    def _check_combined_teachers(self) -> None:
        """kd_loss_mode=sum or average: several named teachers, each scoring every row (no routing)."""
        mode = self.kd_loss_mode
        if len(self.teachers) < 2:
            raise ValueError(f"kd_loss_mode={mode} combines several teachers' losses, and teachers has one; remove "
                             "kd_loss_mode (select) or add teachers")
        if self.teacher_column is not None:
            raise ValueError(f"teacher_column={self.teacher_column!r} with kd_loss_mode={mode}: every teacher scores "
                             "every row, so nothing is routed; remove teacher_column, or set kd_loss_mode=select")
        names: dict[str, int] = {}
        for i, teacher in enumerate(self.teachers):
            if teacher.name is None or not re.fullmatch(r"[A-Za-z0-9_-]+", teacher.name):
                raise ValueError(f"teachers[{i}].name: with kd_loss_mode={mode} every teacher needs a name of "
                                 f"letters, digits, '_' and '-' (its metrics are distill/<name>/...); got "
                                 f"{teacher.name!r}")
            if teacher.name in names:
                raise ValueError(f"teachers[{i}].name={teacher.name!r} is also teachers[{names[teacher.name]}]'s")
            names[teacher.name] = i
            if teacher.route:
                raise ValueError(f"teachers[{i}].route applies with kd_loss_mode=select and teacher_column; with "
                                 f"kd_loss_mode={mode} every teacher scores every row; remove route")

    def _check_on_policy(self) -> None:
        """The keys of mode=on_policy: lmbda and rollout only with it; no precompute, no NLL term, no whole-text
        loss when some steps sample."""
        if self.mode == "off_policy":
            if self.lmbda is not None:
                raise ValueError("lmbda applies to mode=on_policy (off_policy is lmbda 0: every step distills the "
                                 "dataset's completions); set mode=on_policy or remove lmbda")
            if self.rollout.model_fields_set:
                keys = ", ".join(f"rollout.{key}" for key in sorted(self.rollout.model_fields_set))
                raise ValueError(f"{keys}: the rollout section applies to mode=on_policy (the student's samples); "
                                 "set mode=on_policy or remove it")
            return
        if self.on_policy_fraction == 0:
            return
        precomputed = [i for i, teacher in enumerate(self.teachers) if teacher.precompute]
        if precomputed:
            first = precomputed[0]
            others = " (and every other teacher's)" if len(precomputed) > 1 else ""
            raise ValueError(f"teachers[{first}].precompute=true cannot serve mode=on_policy with lmbda="
                             f"{self.on_policy_fraction:g}: on-policy steps score the student's new samples each "
                             f"step; set teachers[{first}].precompute=false{others} (or lmbda=0)")
        if self.loss.nll_weight > 0:
            raise ValueError("loss.nll_weight > 0 with mode=on_policy and lmbda > 0: on an on-policy step the NLL "
                             "term would train the student on its own samples; set loss.nll_weight=0")
        if not self.data.completion_only_loss:
            raise ValueError("data.completion_only_loss=false with mode=on_policy: the student samples from each "
                             "row's prompt (its tokens before the first target), which needs completion-only "
                             "targets; set data.completion_only_loss=true")

    @property
    def on_policy_fraction(self) -> float:
        """lmbda as the loop uses it: 0 with mode=off_policy, lmbda (default 1) with mode=on_policy."""
        if self.mode == "off_policy":
            return 0.0
        return 1.0 if self.lmbda is None else self.lmbda

    @property
    def teacher(self) -> TeacherSection:
        return self.teachers[0]


DISTILL_CLUSTER_KEYS = ("backend", "address", "num_cpus", "timeout_s", "teacher_workers", "cpus_per_scoring_worker",
                        "gpus_per_scoring_worker", "max_restarts")
"""The cluster keys `posttrain distill` reads (its Ray cluster holds the teachers' scoring groups only)."""


class RewardLossSection(Section):
    """The Bradley-Terry reward-model loss (posttrain.losses.reward_model.bradley_terry_loss)."""

    use_margin: bool = False
    """Subtract each pair's `margin` column from the reward difference inside the sigmoid (Llama 2's graded
    preferences); every training and evaluation row must then have one."""

    center_rewards_coefficient: float = Field(0.0, ge=0)
    """Weight of (r_chosen + r_rejected)², which keeps rewards centred on zero; 0 turns it off."""


class RMConfig(RecipeConfig):
    """Reward model training: a scalar head on a language-model backbone, Bradley-Terry loss on
    prompt/chosen/rejected pairs. OUTPUT/final/ loads with AutoModelForSequenceClassification (for architectures
    transformers has a sequence classifier for; posttrain.models.value_head otherwise) and scores text through
    posttrain.workers.RewardModel."""

    output_dir: str = "runs/rm"
    """Run directory: config.yaml, metrics.jsonl, checkpoints/, final/. Re-running with the same directory resumes."""

    loss: RewardLossSection = Field(default_factory=RewardLossSection)
    """The reward-model loss."""

    @model_validator(mode="after")
    def _check(self) -> RMConfig:
        check_pair_data(self.data, "reward-model training")
        return self


def check_pair_data(data: DataConfig, recipe: str) -> None:
    """The data keys DPO and reward-model training share: preference rows, padded pairs."""
    if not data.train_files:
        raise ValueError("data.train_files is empty: give at least one preference file or dataset name")
    if data.format not in ("auto", "preference"):
        raise ValueError(f"data.format={data.format!r}: {recipe} uses preference rows; use auto or preference")
    if data.packing:
        raise ValueError(f"data.packing=true is not supported by {recipe}: pairs are collated as pairs; set "
                         "data.packing=false and trainer.packing=true to pack each micro-batch's rows")


class RolloutSection(SamplingSection):
    """How completions are sampled each step."""

    prompts_per_step: int = Field(16, gt=0)
    """Prompts drawn per RL step (groups in the rollout batch)."""

    num_generations_per_prompt: int = Field(8, gt=0, le=4096)
    """Completions sampled per prompt: the group that group-relative advantages compare (at most 4096: every
    sample of a step is held in memory, so a larger group is a mistyped number, not a recipe)."""

    max_turns: int = Field(1, gt=0)
    """Assistant turns per episode; multi-turn environments return an observation after each until done."""

    seed_per_group: bool = False
    """Seed every group's samples from the run's seed and its group id (each sample a stream of its own)
    instead of seeding each sampling round as a whole. A group then samples the same episodes whichever groups
    share its generation call, so a data-parallel run divides each round's groups among its ranks (each samples
    and scores its share, then the episodes are gathered) and still samples what one process does. Off by default:
    it draws other samples from the same seed than the per-round default, under which every documented outcome
    was measured; with it off, every rank samples every group. The environment must score a completion from its
    messages and metadata alone (no random generator or call counter of its own)."""

    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal (no learning signal) and sample more
    prompts until prompts_per_step groups are kept or max_sampling_rounds is reached."""

    max_sampling_rounds: int = Field(4, gt=0)
    """Upper bound on generation rounds per step with dynamic_sampling (the step trains on what it has)."""

    asynchronous: bool = False
    """Asynchronous RL (cluster.backend=ray, docs/ray.md): the generation actors sample the next steps' prompts while
    the policy trains, up to max_staleness policy versions behind it; needs loss.importance_correction to correct
    for the older sampling policy. Multi-turn episodes sample their later turns with the weights the actors hold then;
    an episode's age counts from the oldest version that sampled any of its tokens."""

    max_staleness: int = Field(1, ge=1)
    """asynchronous: how many policy versions (optimizer steps) the weights that sampled an episode may lag the
    policy that trains on it; max_staleness + 1 sampling rounds are in flight."""

    group_timeout_s: float | None = Field(None, gt=0)
    """asynchronous: seconds a group may take to be generated and scored once the first of its round's completions
    have arrived (each generation actor's share is waited for on its own, and each group scored by a call of its
    own as soon as its completions arrive); a group not scored by then is dropped, never trained on, and counted
    (rollout/timed_out_groups; rollout/generation_timed_out_groups for those whose completions had not arrived). Its
    prompt is not sampled again. With max_turns > 1 a group is dropped when any of its episodes has not ended within
    that many seconds of the round's first turns arriving (a tool call or a later turn's generation still running);
    with in_flight_updates each chunk call's per-actor shares are waited for until the same deadline.
    null: every group is waited for (up to cluster.timeout_s)."""

    in_flight_updates: bool = False
    """asynchronous: a round's completions are sampled in chunks of in_flight_chunk_tokens tokens, each chunk a
    generation call of its own, so that a weight push made while a round is sampling reaches its next chunk; every
    episode records the versions of its token spans, and its age counts from the oldest. Later turns of multi-turn
    episodes are sampled in chunks too; stop_strings are looked for across chunk boundaries (where an unchunked call
    would stop)."""

    in_flight_chunk_tokens: int = Field(16, gt=0)
    """in_flight_updates: tokens sampled per chunk (the points where newer weights may take over)."""

    overlong_filtering: bool = False
    """DAPO overlong filtering: truncated completions (max_new_tokens reached) get no loss."""

    overlong_buffer_length: int = Field(0, ge=0)
    """DAPO soft overlong punishment: the last this-many tokens before max_new_tokens are a buffer where the
    reward falls linearly by up to overlong_penalty_factor; a truncated completion gets the full penalty. 0: off."""

    overlong_penalty_factor: float = Field(1.0, ge=0)
    """Largest soft overlong penalty subtracted from the reward."""


EPISODE_HOLDING_KINDS = ("tools", "swe", "cua")
"""Environment kinds whose multi-turn episodes live in the process that started them (a work directory, a
checkout, a desktop): on Ray each episode stays on one environment actor, which answers many episodes at once."""


class ClusterSection(NumericSection):
    """Where the online RL workers run (docs/ray.md). local: everything in this process (the default). ray: the
    generation and environment workers are Ray actors, and with policy_workers > 0 the policy (and PPO's critic)
    too, started on a local Ray instance sized for this machine or on the cluster at `address`; the same recipe
    loop drives them. `posttrain distill` reads only its teachers' keys (teacher_workers and the scoring workers'
    resources)."""

    backend: Literal["local", "ray"] = "local"
    """local: generator and environment in this process; ray: each a group of Ray actors (needs the `ray` extra:
    pip install 'posttrain[ray]')."""

    address: str | None = None
    """ray: the address of a running Ray cluster to join ("auto", "ray://host:10001", "host:6379"); null starts a
    local Ray instance for this run (its temporary files under OUTPUT/ray/, shut down when the run ends or
    fails)."""

    num_cpus: int = Field(2, gt=0)
    """ray without an address: CPUs the local Ray instance offers its actors (2 fits a 2-core laptop: the driver
    waits while the actors work)."""

    timeout_s: float = Field(900.0, gt=0)
    """Deadline in seconds of every remote call (generation, scoring, each weight-sync bucket, actor start-up):
    past it the run stops with an error naming the worker, the call and what it waited for. A generation call
    samples a whole step's prompts: give it the time the slowest step may take."""

    generation_workers: int = Field(1, gt=0)
    """ray: generation actors; a step's prompts are divided among them (more than one needs
    rollout.seed_per_group=true, so that each sample's stream does not depend on which actor draws it)."""

    cpus_per_generation_worker: float = Field(1.0, gt=0)
    """ray: CPUs Ray reserves for each generation actor (its torch threads follow the driver's trainer.num_threads
    setting, so that its numbers equal the driver's)."""

    gpus_per_generation_worker: float = Field(0.0, ge=0)
    """ray: GPUs the generation group's placement group reserves for each generation actor, which loads its copy of
    the model and samples on the first GPU Ray granted it (0: on CPUs; rollout.backend=vllm needs more than 0). A
    cluster without that many GPUs stops the run at start-up, before any actor starts, naming this key."""

    environment_workers: int = Field(1, gt=0)
    """ray: environment actors; a step's episodes are divided among them for scoring."""

    cpus_per_environment_worker: float = Field(1.0, gt=0)
    """ray: CPUs Ray reserves for each environment actor."""

    environment_concurrency: int = Field(1, gt=0)
    """ray: environment calls each environment actor runs at once, in threads of its process (Ray's max_concurrency),
    each on a copy of the environment of its own (N copies per actor: a reward model or judge loads N times): with
    rollout.group_timeout_s every group is a call of its own, and one that straggles (a slow judge) then holds one
    thread, not the groups queued behind it. Above 1 the calls run outside the actor's main thread: math with
    num_workers=0 refuses that (math-verify times itself with signal.alarm); give it num_workers >= 1."""

    gpus_per_environment_worker: float = Field(0.0, ge=0)
    """ray: GPUs reserved for each environment actor (a reward model or judge the environment loads); refused at
    start-up as gpus_per_generation_worker is."""

    policy_workers: int = Field(0, ge=0)
    """ray: 0 trains the policy in the driver process; N > 0 trains it (and PPO's critic) in N Ray actors, one per
    FSDP2 rank, forming one torch.distributed group (gloo on CPU, NCCL on GPU). A rank that dies stops the run
    (re-running resumes from the newest checkpoint); it is not replaced."""

    cpus_per_policy_worker: float = Field(1.0, gt=0)
    """ray: CPUs the placement group reserves for each policy worker."""

    gpus_per_policy_worker: float = Field(0.0, ge=0)
    """ray: GPUs the placement group reserves for each policy worker (0: train on CPUs). A cluster without that
    many GPUs stops the run at start-up, naming this key."""

    reference_workers: int = Field(0, ge=0)
    """ray: 0 scores the KL reference where it is today (the policy group's ranks with policy_workers > 0, else the
    driver process); N > 0 loads it in a group of N Ray actors of its own, each scoring a contiguous share of a
    batch's micro-batches (trainer.micro_batch_size rows each). Needs a KL term (loss.reference_kl_penalty, PPO's
    gae.kl_coef) and a full fine-tune (a LoRA policy's reference is its own weights with the adapters off)."""

    teacher_workers: int = Field(0, ge=0)
    """ray: as reference_workers, for a distillation teacher: GRPO's on-policy distillation (advantage.estimator=opd
    and a transformers teacher), and the teachers of `posttrain distill` (each teacher a group of this many actors
    of its own; a step's micro-batches go to its actors in turn)."""

    reward_workers: int = Field(0, ge=0)
    """ray: 0 loads a reward_model environment's model where the environment runs (the environment actors); N > 0
    loads it in a group of N Ray actors of its own, scoring through `sequence_scores` (each call of
    environment.options.batch_size rows goes to the next actor in turn), and builds the environment in the driver
    process, as verl scores a reward-model worker group from its driver (cluster.environment_* then do not apply).
    Needs environment.kind=reward_model, or a mixture with one reward_model component. With asynchronous rollouts
    the groups of a round are scored from several driver threads at once, their calls spread over the actors."""

    cpus_per_scoring_worker: float = Field(1.0, gt=0)
    """ray: CPUs the placement group of a reference, teacher or reward group reserves for each of its actors."""

    gpus_per_scoring_worker: float = Field(0.0, ge=0)
    """ray: GPUs reserved for each reference, teacher or reward actor (0: score on CPUs); refused at start-up as
    gpus_per_policy_worker is."""

    colocated: bool = False
    """ray: generation shares the trainer's processes and devices instead of actors of its own. With
    policy_workers=0 the driver's transformers generator samples from the trained module itself (no weight copy,
    weight_sync/bytes 0); with a policy group each rank samples its share of a round from a copy it refills in its
    own process from the gathered weights after every optimizer step (no byte leaves the process; needs
    rollout.seed_per_group with more than one rank). Environments stay Ray actors. Synchronous rollouts,
    rollout.backend=transformers."""

    max_restarts: int = Field(3, ge=0)
    """ray: generation, environment, reference or teacher actors each group may replace over the run when one dies;
    the call it was answering is re-sent to the replacement (a generation actor first loads the current weights, which for this
    stay in Ray's object store between pushes: one copy of the model). 0: a dead actor stops the run."""

    on_actor_failure: Literal["retry", "mask"] = "retry"
    """ray: what becomes of the samples a generation or environment actor was answering when it died (it is replaced
    either way, within max_restarts). retry: the call is re-sent to the replacement (the same seeds: the same samples).
    mask: they are masked, counted (faults/<group>_masked_samples) and not sampled again; their errors count toward
    environment.max_error_fraction. Single-turn episodes only."""

    def scoring_workers(self, role: str) -> int:
        """The actors of scorer `role`'s own group (reference_workers, teacher_workers, reward_workers); 0 for any
        other role."""
        return {"reference": self.reference_workers, "teacher": self.teacher_workers,
                "reward": self.reward_workers}.get(role, 0)


class WeightSyncSection(NumericSection):
    """How the policy's weights reach generators that keep their own copy (Ray generation actors)."""

    method: Literal["object_store", "broadcast"] = "object_store"
    """object_store: the weights pass through the driver and Ray's object store, one bucket at a time, each actor
    loading it from there. broadcast: the weights' holder (the policy group's rank 0, or the driver without a group)
    and every generation actor form a process group of their own (gloo on CPU, NCCL when every member has a GPU)
    and the holder broadcasts each bucket of a fixed sorted plan straight into the actors (docs/ray.md)."""

    bucket_mb: float = Field(256.0, gt=0)
    """Weights travel in buckets of about this many MiB (a tensor larger than that is a bucket of its own): one
    bucket in flight at a time, never a second full copy of the model in the object store."""

    lora: Literal["merged", "adapters"] = "merged"
    """With lora.enabled: what a push carries. merged: the full weights with the adapters folded in (every
    generator takes them). adapters: the adapter tensors alone (a few MB), which vLLM generation actors
    (cluster.backend=ray, rollout.backend=vllm) write as a peft adapter and sample with as a LoRA request over the
    base model they loaded; through the object store only (weight_sync.method=object_store)."""


class AdvantageSection(NumericSection):
    """How rewards become advantages (posttrain.advantages)."""

    estimator: Literal["grpo", "rloo", "gdpo", "reinforce++", "raw", "opd"] = "grpo"
    """grpo (group mean baseline), rloo (leave-one-out), gdpo (per-component group normalization, weighted sum,
    batch whitening), reinforce++ (global whitening), raw (the reward itself), opd (on-policy distillation: the
    per-token advantage sg[log π_teacher − log π_student] of each sampled token, plus opd_reward_weight × the
    grpo advantage; needs `teacher:`)."""

    opd_reward_weight: float = Field(0.0, ge=0)
    """opd: weight of the environment reward's grpo advantage added to every token's log-ratio; 0: the teacher
    alone."""

    normalize_std: bool = True
    """grpo/gdpo: divide by the group's reward std (skipped where it is 0). Dr. GRPO turns it off."""

    leave_one_out: bool = False
    """grpo: baseline each sample by the mean of the others in its group instead of the group mean."""

    component_weights: dict[str, float] = Field(default_factory=dict)
    """gdpo: weight of each named reward component (missing components weigh 1)."""


class PolicyUpdateSection(Section):
    """How one rollout batch is turned into optimizer steps."""

    ppo_epochs: int = Field(1, gt=0)
    """Passes over each rollout batch."""

    num_minibatches: int = Field(1, gt=0)
    """Optimizer steps per pass: the rollout batch is split into this many minibatches. With ppo_epochs=1 and
    num_minibatches=1 the update is on-policy and the separate old-logprob pass is skipped."""


class PromptSection(Section):
    """How a row's prompt becomes the text the policy continues."""

    template: str = "{prompt}"
    """Python format string applied to string prompts; {prompt} is the row's prompt and every other column is
    available by name, e.g. "{prompt}\nPut your final answer within \\boxed{{}}."."""

    use_chat_template: bool = False
    """Send string prompts as one user message through the tokenizer's chat template (instruct models)."""

    system_prompt: str | None = None
    """A system message put before the user message (with use_chat_template, or for conversational prompts)."""


class EvalDataSection(Section):
    """The prompts an evaluation scores: rows with a `prompt` column (a string or a list of messages); every other
    column (answer, tests, ...) goes to the environment, as in GRPO."""

    files: list[str] = Field(default_factory=list)
    """Local .jsonl/.json/.parquet/.csv files or `datasets` hub names (name or name:split), as data.train_files."""

    column_map: dict[str, str] = Field(default_factory=dict)
    """Rename columns as they are read, e.g. {question: prompt, solution: answer}."""

    on_error: Literal["raise", "skip"] = "raise"
    """What a malformed row does: raise (stop, naming file, line and field) or skip (drop it and count it)."""

    max_length: int = Field(1024, gt=0)
    """Longest prompt in tokens; a longer one is a malformed row."""

    def data_config(self) -> DataConfig:
        """The DataConfig the shared row reader takes (prompt rows, this section's column map and error mode)."""
        return DataConfig(format="prompt_only", column_map=self.column_map, on_error=self.on_error,
                          max_length=self.max_length)


class EvaluationSettings(Section):
    """What an evaluation runs: the prompts, their formatting, the environment that scores the completions, and
    how many completions are sampled how. Shared by `posttrain eval` and the training recipes' evaluation sets."""

    data: EvalDataSection = Field(default_factory=EvalDataSection)
    """The prompts."""

    prompt: PromptSection = Field(default_factory=PromptSection)
    """Prompt formatting (template, chat template, system prompt), as GRPO's prompt section."""

    environment: EnvironmentSection = Field(default_factory=ArithmeticEnvironment)
    """What scores the completions (kind and options), as GRPO's environment section. A failed reward is masked
    and counted in reward/errors; max_error_fraction does not stop an evaluation."""

    temperature: float = Field(0.0, ge=0)
    """Sampling temperature; 0 is greedy."""

    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling (1: off)."""

    top_k: int = Field(0, ge=0)
    """Top-k sampling (0: off)."""

    max_new_tokens: int = Field(256, gt=0)
    """Completion budget in tokens per turn; a completion that reaches it counts in truncation_rate."""

    stop_strings: list[str] = Field(default_factory=list)
    """Stop a completion once its text contains one of these (the completion keeps the stop string)."""

    num_samples: int = Field(1, gt=0, le=4096)
    """Completions sampled per prompt (n of pass@k)."""

    pass_k: list[int] = Field(default_factory=list)
    """Report pass@k for each of these k (each at most num_samples), with the unbiased estimator of Chen et al.
    2021 averaged over prompts."""

    num_examples: int | None = Field(None, gt=0)
    """Score only the first this-many prompts (null: all)."""

    max_turns: int = Field(1, gt=0)
    """Assistant turns per episode (multi-turn environments)."""

    correct_threshold: float | None = None
    """For environments that report no correctness of their own (python, reward_model, judge): a sample counts as
    correct when its reward is at least this, for accuracy and pass@k. null: such samples have none."""

    seed: int = 0
    """Seed of the sampling (with temperature > 0 a re-run gives the same samples)."""

    @field_validator("pass_k")
    @classmethod
    def _positive_k(cls, values: list[int]) -> list[int]:
        if any(k < 1 for k in values):
            raise ValueError(f"every k of pass_k must be at least 1, got {values}")
        return sorted(set(values))

    def check_sampling(self) -> None:
        """ValueError (naming the keys) for pass_k above num_samples, several greedy samples, or pass_k without a
        notion of correct."""
        check_tool_turns(self.environment, self.max_turns, "max_turns")
        too_large = [k for k in self.pass_k if k > self.num_samples]
        if too_large:
            raise ValueError(f"pass_k={self.pass_k}: k={too_large[0]} is more than num_samples={self.num_samples}; "
                             "pass@k needs at least k samples per prompt (raise num_samples or drop that k)")
        if self.num_samples > 1 and self.temperature == 0:
            raise ValueError(f"num_samples={self.num_samples} with temperature=0 (greedy) samples the same "
                             "completion each time; set temperature > 0 or num_samples=1")
        kind = self.environment.kind
        if self.pass_k and self.environment.reward_only and self.correct_threshold is None:
            raise ValueError(f"pass_k needs to know which samples are correct, and the {kind} environment does not "
                             "say (a mixture says only through a verifier component: arithmetic, math or code); set "
                             "correct_threshold (a sample is correct when its reward is at least that) or drop pass_k")


class EvaluationSet(EvaluationSettings):
    """One evaluation set of a training run: sampled from the current policy every `every` steps and at the end,
    its metrics logged as eval/<name>/<metric> and its first samples written to OUTPUT/samples.jsonl."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    """The set's name in metric keys (eval/<name>/accuracy): letters, digits, _ . and -."""

    every: int = Field(0, ge=0)
    """Evaluate every this many steps (0: only at the end); always at the last step."""

    samples_logged: int = Field(16, ge=0)
    """Per evaluation, the first this-many samples are written to OUTPUT/samples.jsonl (split eval/<name>)."""

    @model_validator(mode="after")
    def _check(self) -> EvaluationSet:
        if not self.data.files:
            raise ValueError(f"evaluation set {self.name!r}: data.files is empty; give the files of its prompts")
        self.check_sampling()
        return self


def check_tool_turns(environment: Any, max_turns: int, key: str) -> None:
    """ValueError for a tools environment with one turn: the model's tool calls would never get their results; and
    for a cua environment whose episodes the rollout would cut off before its max_steps (their desktops would stay
    up until the run ends)."""
    environment_kind = environment.kind
    if environment_kind == "cua" and max_turns < max(2, environment.options.max_steps):
        raise ValueError(f"environment.kind=cua with {key}={max_turns}: an episode takes up to "
                         f"environment.options.max_steps={environment.options.max_steps} actions, one per turn; set "
                         f"{key} to at least that, or lower max_steps")
    if environment_kind in ("tools", "swe") and max_turns < 2:
        raise ValueError(f"environment.kind={environment_kind} with {key}={max_turns}: tool results come back in "
                         f"the next turn, so a tool-using episode needs {key} of at least 2 (one per tool round, plus "
                         "the answer)")


def check_evaluation_sets(sets: list[EvaluationSet], trainer: TrainerConfig) -> None:
    """Distinct set names; no trainer.compile, since the sets are sampled from the trained module itself, whose
    generation cache changes shape every token."""
    check_evaluation_names(sets)
    if sets and trainer.compile:
        raise ValueError("trainer.compile=true cannot be combined with evaluation sets: they are sampled from the "
                         "compiled module, with a cache of a new shape every token; remove evaluation or set "
                         "trainer.compile=false")


def check_evaluation_names(sets: list[EvaluationSet]) -> None:
    names = [s.name for s in sets]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"evaluation: the set name {repeated[0]!r} is used twice; every set needs its own name "
                         "(it keys the set's metrics)")


class ArithmeticEvalSection(Section):
    """Greedy exact match on the arithmetic task's held-out split (the quickstart's measurement)."""

    num_examples: int = Field(200, gt=0)
    """Held-out examples to score."""

    batch_size: int = Field(200, gt=0)
    """Prompts generated together."""

    max_new_tokens: int = Field(8, gt=0)
    """Generation budget per answer."""

    seed: int = 0
    """Seed of the task's held-out split."""


class EvalConfig(EvaluationSettings):
    """Evaluate a model: on prompt files scored by an environment (`--data FILES --environment KIND`: mean
    reward, accuracy, pass@k, lengths, truncation, reward errors), on multiple-choice questions by log-likelihood
    (`--data FILES --multiple-choice`, or the bundled `--task arithmetic_mc`: acc, acc_norm), on
    lm-evaluation-harness tasks (`--lm-eval-tasks TASKS`, the lm-eval extra), or on a built-in task's held-out split
    (`--task arithmetic`, greedy exact match; the default when no data.files are given). A prompt reaches the
    model as its text, as in `posttrain generate`; `--chat-template` (prompt.use_chat_template=true) sends it
    through the tokenizer's chat template as a user message (instruct models)."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """The model to evaluate (model.name_or_path; `--model` is a shortcut)."""

    task: Literal["arithmetic", "arithmetic_mc"] | None = None
    """Built-in task, used when data.files is empty (then arithmetic when not given); not combined with data.files.
    arithmetic: held-out additions scored by greedy exact match. arithmetic_mc: held-out additions as four-choice
    questions (posttrain/arithmetic-mc) scored by log-likelihood, as scoring=multiple_choice scores files."""

    scoring: Literal["generation", "multiple_choice"] = "generation"
    """How data.files are scored. generation: completions sampled and scored by the environment. multiple_choice
    (`--multiple-choice`): rows with a question (prompt or question), choices and the right one (answer: index,
    letter, label or text); each choice's log-likelihood as a continuation of the prompt, the highest is the
    model's answer: acc, acc_norm (per character, as lm-eval) and count."""

    target_delimiter: str = " "
    """multiple_choice: text put between the prompt and each choice (lm-eval's target_delimiter, one space by
    default); "" for prompts that end where the answer starts ("12+34=", as the arithmetic_mc task, whose default
    is "")."""

    lm_eval_tasks: list[str] = Field(default_factory=list)
    """Run these lm-evaluation-harness tasks on the model instead (`--lm-eval-tasks gsm8k,mmlu`; the lm-eval
    extra: pip install 'posttrain[lm-eval]'); its results are the report, its samples go to output."""

    lm_eval_include_path: str | None = None
    """A folder of lm-eval task YAML files to find lm_eval_tasks in, besides lm-eval's own tasks
    (`--lm-eval-include-path DIR`)."""

    lm_eval_num_fewshot: int | None = Field(None, ge=0)
    """Few-shot examples per lm-eval question (null: each task's own setting). With lm_eval_tasks, `seed` (when
    set) seeds lm-eval's few-shot draws; unset, lm-eval's own seeds apply, as in a plain `lm_eval` run."""

    num_examples: int | None = Field(None, gt=0)
    """Score only the first this-many prompts of data.files (null: all), or this many held-out problems of the
    task (null: 200); with lm_eval_tasks, lm-eval's limit (documents per task; null: all)."""

    max_new_tokens: int | None = Field(None, gt=0)
    """Completion budget in tokens per turn (null: 256 with data.files, 8 for the task)."""

    batch_size: int = Field(200, gt=0)
    """Sequences generated together (transformers backend); with multiple_choice, sequences (prompt + one choice)
    scored per forward pass; with lm_eval_tasks, lm-eval's batch size."""

    seed: int = 0
    """Seed of the sampling with data.files (temperature > 0 repeats exactly); of the held-out split for the task."""

    output: str | None = None
    """With data.files: write one JSON line per sample (prompt, completion, reward, components, correct, error)
    to this .jsonl file; with multiple_choice one per question (choices, loglikelihoods, prediction, correct);
    with lm_eval_tasks lm-eval's record of each document."""

    backend: Literal["transformers", "vllm"] = "transformers"
    """Generator: transformers (CPU or GPU) or vllm (GPU extra)."""

    vllm_gpu_memory_utilization: float = Field(0.9, gt=0, lt=1)
    """Fraction of GPU memory vLLM may take (vllm backend)."""

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if self.lm_eval_tasks or self.model_fields_set & {"lm_eval_include_path", "lm_eval_num_fewshot"}:
            return self._check_lm_eval()
        if self.scoring == "multiple_choice" or self.task == "arithmetic_mc":
            return self._check_multiple_choice()
        if "target_delimiter" in self.model_fields_set:
            raise ValueError("target_delimiter is for multiple-choice scoring; set scoring=multiple_choice "
                             "(--multiple-choice) or drop it")
        if not self.data.files:
            task_keys = {"model", "task", "num_examples", "max_new_tokens", "batch_size", "seed"}
            extra = sorted(self.model_fields_set - task_keys)
            if extra:
                raise ValueError(f"{', '.join(extra)}: set for an evaluation on data.files, but data.files is empty "
                                 "(the built-in task takes only num_examples, batch_size, max_new_tokens and seed); "
                                 "give --data FILES or drop them")
            return self
        if self.task is not None:
            raise ValueError(f"task={self.task!r} and data.files are two different evaluations; give one")
        self.check_sampling()
        return self

    def _check_multiple_choice(self) -> EvalConfig:
        if self.task == "arithmetic_mc" and self.data.files:
            raise ValueError("task='arithmetic_mc' and data.files are two different evaluations; give one (for your "
                             "own questions: --data FILE --multiple-choice)")
        if self.scoring == "multiple_choice" and not self.data.files and self.task != "arithmetic_mc":
            raise ValueError("scoring=multiple_choice scores the questions of data.files: give --data FILE (or "
                             "--task arithmetic_mc for the bundled questions)")
        generation_only = {"environment", "temperature", "top_p", "top_k", "max_new_tokens", "stop_strings",
                           "num_samples", "pass_k", "max_turns", "correct_threshold", "backend",
                           "vllm_gpu_memory_utilization"}
        extra = sorted(self.model_fields_set & generation_only)
        if extra:
            raise ValueError(f"{', '.join(extra)}: sampling and environment keys, but multiple-choice scoring samples "
                             "nothing (it compares the choices' log-likelihoods); drop them")
        return self

    def _check_lm_eval(self) -> EvalConfig:
        if not self.lm_eval_tasks:
            raise ValueError("lm_eval_include_path / lm_eval_num_fewshot without lm_eval_tasks: name the tasks to run "
                             "(--lm-eval-tasks TASKS)")
        allowed = {"model", "lm_eval_tasks", "lm_eval_include_path", "lm_eval_num_fewshot", "num_examples",
                   "batch_size", "seed", "output", "prompt"}
        extra = sorted(self.model_fields_set - allowed)
        if extra:
            raise ValueError(f"{', '.join(extra)}: not used by an lm-eval run (lm_eval_tasks), which takes the model, "
                             "num_examples (lm-eval's limit), batch_size, seed, output, lm_eval_include_path, "
                             "lm_eval_num_fewshot and prompt.use_chat_template / prompt.system_prompt; run the other "
                             "evaluation separately")
        if "template" in self.prompt.model_fields_set:
            raise ValueError("prompt.template: lm-eval tasks format their own prompts (doc_to_text); drop it")
        return self

    @property
    def task_examples(self) -> int:
        return self.num_examples or 200


class GenerateConfig(Section):
    """Sample completions from a model for a quick look at a checkpoint: prompts from the command line
    (`--prompt TEXT`, repeatable) or the `prompt` column of files (`--data FILE`). A prompt reaches the model as
    its text, as in `posttrain eval` and the training recipes; `--chat-template` sends it through the tokenizer's
    chat template as a user message (instruct models)."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """The model (model.name_or_path; `--model` is a shortcut)."""

    prompts: list[str] = Field(default_factory=list)
    """Prompts to complete (`--prompt TEXT`, repeatable)."""

    data: EvalDataSection = Field(default_factory=EvalDataSection)
    """Or: files whose rows' `prompt` column is completed (`--data FILE`)."""

    num_examples: int | None = Field(None, gt=0)
    """Complete only the first this-many prompts of data.files (null: all)."""

    chat_template: bool = False
    """Send each string prompt as a user message through the tokenizer's chat template, when the tokenizer has one
    (`--chat-template`). Off by default, as `posttrain eval`'s prompt.use_chat_template: the prompt text as it is."""

    system_prompt: str | None = None
    """A system message put before each prompt (with the chat template)."""

    temperature: float = Field(0.0, ge=0)
    """Sampling temperature; 0 is greedy."""

    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling (1: off)."""

    top_k: int = Field(0, ge=0)
    """Top-k sampling (0: off)."""

    max_new_tokens: int = Field(128, gt=0)
    """Completion budget in tokens."""

    num_samples: int = Field(1, gt=0, le=4096)
    """Completions per prompt."""

    seed: int = 0
    """Seed of the sampling (with temperature > 0 a re-run prints the same completions)."""

    batch_size: int = Field(64, gt=0)
    """Sequences generated together."""

    @model_validator(mode="after")
    def _check(self) -> GenerateConfig:
        if bool(self.prompts) == bool(self.data.files):
            raise ValueError("give prompts (--prompt TEXT) or data.files (--data FILE), one of the two")
        if self.num_samples > 1 and self.temperature == 0:
            raise ValueError(f"num_samples={self.num_samples} with temperature=0 (greedy) samples the same "
                             "completion each time; set temperature > 0 or num_samples=1")
        return self


class OnlineRLConfig(RecipeConfig):
    """Keys both online RL recipes (grpo, ppo) have: the prompts, how completions are sampled and scored, the policy
    loss and the update. A base of shared sections, not a recipe: GRPO adds its advantage estimator, PPO its critic
    and GAE."""

    prompt: PromptSection = Field(default_factory=PromptSection)
    """Prompt formatting."""

    rollout: RolloutSection = Field(default_factory=RolloutSection)
    """Sampling."""

    environment: EnvironmentSection = Field(default_factory=ArithmeticEnvironment)
    """Rewards: kind picks the environment, options are that environment's."""

    loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    """Policy-gradient loss."""

    update: PolicyUpdateSection = Field(default_factory=PolicyUpdateSection)
    """Optimizer steps per rollout batch."""

    evaluation: list[EvaluationSet] = Field(default_factory=list)
    """Evaluation sets sampled with the rollout generator during training (see docs/evaluation.md), each logged
    as eval/<name>/<metric>; none by default."""

    cluster: ClusterSection = Field(default_factory=ClusterSection)
    """Where the generation and environment workers run: this process (local) or Ray actors (docs/ray.md)."""

    weight_sync: WeightSyncSection = Field(default_factory=WeightSyncSection)
    """How weights reach generators with their own copy."""

    def check_online_rl(self, recipe: str) -> None:
        """ValueError (naming the keys) for what no online RL recipe takes: compiled modules, no prompts, gradient
        accumulation, minibatches that do not divide the rollout batch, an overlong buffer past the budget, epochs."""
        check_evaluation_names(self.evaluation)
        check_tool_turns(self.environment, self.rollout.max_turns, "rollout.max_turns")
        if self.trainer.num_epochs is not None:
            raise ValueError(f"trainer.num_epochs does not apply to {recipe}: a step samples rollout.prompts_per_step "
                             "prompts, however many the data holds; set trainer.max_steps")
        if self.trainer.compile:
            raise ValueError("trainer.compile=true is not available to the RL recipes: the rollout generator runs "
                             "the same module, whose cache shapes change every token; set trainer.compile=false")
        if not self.data.train_files:
            raise ValueError("data.train_files is empty: give at least one file or dataset of prompts")
        if self.data.format not in ("auto", "prompt_only"):
            raise ValueError(f"data.format={self.data.format!r}: {recipe} reads prompts; use auto or prompt_only "
                             "(every column other than prompt is passed to the environment)")
        if self.trainer.gradient_accumulation_steps != 1:
            raise ValueError(f"trainer.gradient_accumulation_steps does not apply to {recipe}: each minibatch "
                             "(rollout batch / update.num_minibatches) is split into micro-batches of "
                             "trainer.micro_batch_size; leave it at 1")
        rollout_size = self.rollout.prompts_per_step * self.rollout.num_generations_per_prompt
        if rollout_size % self.update.num_minibatches:
            raise ValueError(f"update.num_minibatches={self.update.num_minibatches} must divide the rollout batch "
                             f"(rollout.prompts_per_step × num_generations_per_prompt = {rollout_size})")
        if self.rollout.overlong_buffer_length >= self.rollout.max_new_tokens:
            raise ValueError("rollout.overlong_buffer_length must be smaller than rollout.max_new_tokens")
        if self.rollout.asynchronous:
            problems = {"cluster.backend=ray": self.cluster.backend == "ray",
                        "loss.importance_correction other than none": self.loss.importance_correction != "none"}
            if missing := [need for need, met in problems.items() if not met]:
                raise ValueError(f"rollout.asynchronous=true needs {', '.join(missing)} (episodes sampled by an older "
                                 "policy need the importance correction between generator and trainer; generation "
                                 "runs ahead in Ray actors)")
            updates = self.update.ppo_epochs * self.update.num_minibatches
            if updates > 1:
                raise ValueError(f"rollout.asynchronous=true with update.ppo_epochs × update.num_minibatches = {updates} "
                                 "optimizer steps per rollout batch: rollout.max_staleness counts policy versions, one "
                                 "per optimizer step, while rounds run ahead by training steps, so rounds would outrun the bound "
                                 "and be dropped; set both to 1 for asynchronous runs")
            if "in_flight_chunk_tokens" in self.rollout.model_fields_set and not self.rollout.in_flight_updates:
                raise ValueError("rollout.in_flight_chunk_tokens applies only with rollout.in_flight_updates=true")
        else:
            for key in ("max_staleness", "group_timeout_s", "in_flight_updates", "in_flight_chunk_tokens"):
                if key in self.rollout.model_fields_set:
                    raise ValueError(f"rollout.{key} applies only with rollout.asynchronous=true")
        if self.weight_sync.lora == "adapters":
            if not self.lora.enabled:
                raise ValueError("weight_sync.lora=adapters needs lora.enabled=true: without LoRA there are no "
                                 "adapters to send")
            if self.cluster.backend != "ray" or self.rollout.backend != "vllm":
                raise ValueError(f"weight_sync.lora=adapters with cluster.backend={self.cluster.backend} and "
                                 f"rollout.backend={self.rollout.backend}: only vLLM generation actors "
                                 "(cluster.backend=ray, rollout.backend=vllm) take adapters, as a LoRA request; the "
                                 "transformers generators and an in-process engine take the merged weights: set "
                                 "weight_sync.lora=merged")
            if self.weight_sync.method != "object_store":
                raise ValueError("weight_sync.lora=adapters with weight_sync.method=broadcast is not built: adapters "
                                 "go through the object store (a few MB); set weight_sync.method=object_store")
        if self.cluster.backend == "ray":
            if self.environment.kind in EPISODE_HOLDING_KINDS and self.cluster.environment_concurrency > 1:
                raise ValueError(f"cluster.environment_concurrency={self.cluster.environment_concurrency} with "
                                 f"environment.kind={self.environment.kind}: the actors of an environment whose "
                                 "episodes live in it (work directories, checkouts, desktops) already answer many "
                                 "calls at once on one copy, which holds its episodes' state; leave "
                                 "cluster.environment_concurrency at 1")
            if self.rollout.backend == "vllm":
                if self.cluster.colocated:
                    raise ValueError("cluster.colocated=true with rollout.backend=vllm: colocated generation samples "
                                     "with the transformers backend (from the trained module, or from a copy on each "
                                     "policy rank); set "
                                     "rollout.backend=transformers, or cluster.colocated=false for vLLM generation "
                                     "actors")
                if self.cluster.gpus_per_generation_worker == 0:
                    raise ValueError("cluster.backend=ray with rollout.backend=vllm needs "
                                     "cluster.gpus_per_generation_worker > 0: each vLLM generation worker runs its "
                                     "engine on a GPU of its bundle (1 for a GPU each)")
                if self.rollout.in_flight_updates:
                    raise ValueError("rollout.in_flight_updates=true with rollout.backend=vllm on Ray generation "
                                     "workers is not built yet (the chunked rounds are checked with the transformers "
                                     "backend only); set rollout.in_flight_updates=false or "
                                     "rollout.backend=transformers")
            if self.cluster.on_actor_failure == "mask" and self.rollout.max_turns > 1:
                raise ValueError("cluster.on_actor_failure=mask needs rollout.max_turns=1: masking part of a "
                                 "multi-turn episode is not built; use cluster.on_actor_failure=retry")
            if self.cluster.generation_workers > 1 and not self.rollout.seed_per_group:
                raise ValueError(f"cluster.generation_workers={self.cluster.generation_workers} needs "
                                 "rollout.seed_per_group=true: a round seeded as a whole draws from one stream, "
                                 "which several actors cannot share; per-group seeds sample the same episodes "
                                 "whichever actor draws them")
            if self.cluster.colocated:
                c = self.cluster
                if c.policy_workers > 1 and not self.rollout.seed_per_group:
                    raise ValueError(f"cluster.colocated=true with cluster.policy_workers={c.policy_workers} needs "
                                     "rollout.seed_per_group=true: each rank samples its share of a round, and a "
                                     "round seeded as a whole draws from one stream, which several ranks cannot "
                                     "share")
                if self.rollout.asynchronous:
                    raise ValueError("cluster.colocated=true with rollout.asynchronous=true: generation in the "
                                     "trainer's process cannot run ahead of training; set one of them to false")
                for key in ("generation_workers", "cpus_per_generation_worker", "gpus_per_generation_worker"):
                    if key in c.model_fields_set:
                        raise ValueError(f"cluster.{key} does not apply with cluster.colocated=true (generation "
                                         "runs in the driver's process, or on the policy group's ranks)")
                if "method" in self.weight_sync.model_fields_set:
                    raise ValueError("weight_sync.method does not apply with cluster.colocated=true: the generator "
                                     "samples from the trained module, or from a copy each policy rank fills in its "
                                     "own process")
            c = self.cluster
            if c.reward_workers:
                self._check_reward_group()
            if (c.policy_workers or c.reference_workers or c.teacher_workers or c.reward_workers) and c.address is None:
                wanted = {"cluster.policy_workers x cpus_per_policy_worker":
                              c.policy_workers * c.cpus_per_policy_worker,
                          "cluster.generation_workers x cpus_per_generation_worker":
                              0 if c.colocated else c.generation_workers * c.cpus_per_generation_worker,
                          "cluster.environment_workers x cpus_per_environment_worker":
                              0 if c.reward_workers else c.environment_workers * c.cpus_per_environment_worker,
                          "cluster.reference_workers x cpus_per_scoring_worker":
                              c.reference_workers * c.cpus_per_scoring_worker,
                          "cluster.teacher_workers x cpus_per_scoring_worker":
                              c.teacher_workers * c.cpus_per_scoring_worker,
                          "cluster.reward_workers x cpus_per_scoring_worker":
                              c.reward_workers * c.cpus_per_scoring_worker}
                wanted = {key: value for key, value in wanted.items() if value}
                if sum(wanted.values()) > c.num_cpus:
                    listed = " + ".join(f"{key} = {value:g}" for key, value in wanted.items())
                    raise ValueError(f"the actors ask for more CPUs than the local Ray instance offers: {listed} > "
                                     f"cluster.num_cpus={c.num_cpus}; raise cluster.num_cpus (Ray counts slots, not "
                                     "cores: on a laptop the actors then share its cores) or lower the CPUs per "
                                     "worker")
        elif self.cluster.colocated:
            raise ValueError("cluster.colocated applies to cluster.backend=ray (with backend=local generation "
                             "already shares the trainer's process)")
        elif self.cluster.policy_workers:
            raise ValueError("cluster.policy_workers needs cluster.backend=ray (under torchrun the ranks are the "
                             "processes torchrun starts: --nproc-per-node)")
        else:
            for key in ("reference_workers", "teacher_workers", "reward_workers", "gpus_per_generation_worker",
                        "gpus_per_environment_worker", "environment_concurrency", "cpus_per_scoring_worker", "gpus_per_scoring_worker"):
                if key in self.cluster.model_fields_set:
                    raise ValueError(f"cluster.{key} needs cluster.backend=ray (Ray worker groups and their "
                                     "placement)")

    def _check_reward_group(self) -> None:
        """cluster.reward_workers: one reward model (environment.kind=reward_model, or one mixture component of that
        kind) scored by the group, the environment in the driver (its environment actors' keys do not apply)."""
        c, environment = self.cluster, self.environment
        if environment.kind == "reward_model":
            models = 1
        elif environment.kind == "mixture":
            models = sum(component.kind == "reward_model" for component in environment.options.components)
        else:
            models = 0
        if models != 1:
            found = (f"{models} reward_model components" if models else f"environment.kind={environment.kind}, "
                     "which loads no reward model")
            raise ValueError(f"cluster.reward_workers={c.reward_workers} scores one reward model in a group of its "
                             "own: it needs environment.kind=reward_model, or a mixture with one reward_model "
                             f"component; this run has {found}; set cluster.reward_workers=0")
        for key in ("environment_workers", "cpus_per_environment_worker", "gpus_per_environment_worker",
                    "environment_concurrency"):
            if key in c.model_fields_set:
                raise ValueError(f"cluster.{key} does not apply with cluster.reward_workers={c.reward_workers}: the "
                                 "environment then runs in the driver process and its reward model in the reward "
                                 f"group; remove cluster.{key} or set cluster.reward_workers=0")
        if self.rollout.asynchronous and environment.kind == "mixture":
            for component in environment.options.components:
                if component.kind == "math" and component.options.num_workers == 0:
                    raise ValueError(f"the mixture's math component {component.name!r} has num_workers=0, which scores "
                                     "in the calling thread; with cluster.reward_workers and asynchronous rollouts "
                                     "the environment runs in the driver's rollout threads, and math-verify times "
                                     "itself with signal.alarm (main thread only): give it num_workers >= 1")

    def check_scoring_groups(self, needs_reference: bool, teacher: TeacherSection | None) -> None:
        """ValueError for a reference or teacher group (cluster.reference_workers, teacher_workers) that would load
        a model nothing reads, or that cannot hold the scorer: the recipe says whether its KL terms need the
        reference and which teacher it has."""
        c = self.cluster
        if c.reference_workers and not needs_reference:
            raise ValueError(f"cluster.reference_workers={c.reference_workers}: this run has no KL term to the "
                             "reference (loss.reference_kl_penalty, and for PPO gae.kl_coef, are 0), so no reference "
                             "is loaded; set cluster.reference_workers=0 or give a KL penalty")
        if c.reference_workers and self.lora.enabled:
            raise ValueError(f"cluster.reference_workers={c.reference_workers} with lora.enabled=true: a LoRA "
                             "policy's reference is its own weights with the adapters off (no second copy); set "
                             "cluster.reference_workers=0")
        if c.teacher_workers and teacher is None:
            raise ValueError(f"cluster.teacher_workers={c.teacher_workers}: this run has no teacher (on-policy "
                             "distillation: advantage.estimator=opd with teacher:); set cluster.teacher_workers=0")
        if c.teacher_workers and teacher.backend != "transformers":
            raise ValueError(f"cluster.teacher_workers={c.teacher_workers} with teacher.backend={teacher.backend}: "
                             "teacher actors run the transformers backend for now; set teacher.backend=transformers "
                             "or cluster.teacher_workers=0")


class GRPOConfig(OnlineRLConfig):
    """Online RL with verifiable rewards: sample groups of completions, score them, compute group-relative
    advantages, and update with the clipped policy-gradient loss (GRPO, DAPO, GSPO, CISPO, RLOO, Dr. GRPO, GDPO)."""

    output_dir: str = "runs/grpo"
    """Run directory: config.yaml, metrics.jsonl, checkpoints/, final/. Re-running with the same directory resumes."""

    advantage: AdvantageSection = Field(default_factory=AdvantageSection)
    """Advantage estimator."""

    teacher: TeacherSection | None = None
    """advantage.estimator=opd: the teacher, {name_or_path, dtype, offload, backend}, whose log-probabilities of
    the sampled tokens (under rollout.temperature) make the advantages; it must use the policy's tokenizer. null
    otherwise."""

    @model_validator(mode="after")
    def _check(self) -> GRPOConfig:
        self.check_online_rl("GRPO")
        self.check_scoring_groups(self.loss.reference_kl_penalty > 0, self.teacher)
        if (self.advantage.estimator == "opd") != (self.teacher is not None):
            raise ValueError("advantage.estimator='opd' and teacher go together: on-policy distillation needs "
                             "teacher.name_or_path, and a teacher is read only by advantage.estimator='opd'")
        if self.teacher is not None and self.teacher.route:
            raise ValueError("teacher.route applies to posttrain distill with several teachers")
        if self.teacher is not None and self.teacher.precompute:
            raise ValueError("teacher.precompute applies to posttrain distill; on-policy samples are new each step")
        if self.teacher is not None and self.teacher.backend == "vllm":
            if self.rollout.temperature != 1.0:
                raise ValueError(f"teacher.backend=vllm with rollout.temperature={self.rollout.temperature:g}: OPD "
                                 "scores the samples under the rollout temperature, and vLLM computes prompt "
                                 "log-probabilities from the raw logits whatever the request's temperature; set "
                                 "rollout.temperature=1 or teacher.backend=transformers")
            if self.rollout.backend == "vllm":
                raise ValueError("teacher.backend=vllm with rollout.backend=vllm: the sampler and the teacher would "
                                 "be two vLLM engines in one process, which is not built; set one of them to "
                                 "transformers")
        if "opd_reward_weight" in self.advantage.model_fields_set and self.advantage.estimator != "opd":
            raise ValueError("advantage.opd_reward_weight applies only to advantage.estimator='opd'")
        if (self.advantage.estimator == "opd" and self.advantage.opd_reward_weight > 0
                and self.rollout.num_generations_per_prompt < 2):
            raise ValueError("advantage.opd_reward_weight > 0 adds the grpo advantage, which compares samples of a "
                             "group: rollout.num_generations_per_prompt must be at least 2")
        if self.advantage.estimator in ("grpo", "rloo", "gdpo") and self.rollout.num_generations_per_prompt < 2:
            raise ValueError(f"advantage.estimator={self.advantage.estimator!r} compares samples of a group: "
                             "rollout.num_generations_per_prompt must be at least 2")
        if self.environment.normalize_rewards and self.advantage.estimator == "gdpo":
            raise ValueError("environment.normalize_rewards does not apply to advantage.estimator='gdpo', which "
                             "normalizes each reward component within its group itself; leave it false")
        return self


class CriticSection(NumericSection):
    """PPO's learned value model (posttrain.workers.value): a scalar head on its own backbone."""

    init_from: str = "policy"
    """policy: the policy's starting model (its backbone, a fresh head); or a model directory / hub id, e.g. a
    `posttrain rm` reward model (backbone and head)."""

    learning_rate: float = Field(1.0e-5, gt=0)
    """The critic's own learning rate (AdamW; the rest of trainer.* applies to it too)."""

    value_clip: float | None = Field(0.2, gt=0)
    """ε of the clipped value loss: the new value may move at most ε from the one that computed the advantages
    before its error stops counting; null: plain squared error."""

    warmup_steps: int = Field(0, ge=0)
    """RL steps at the start during which only the critic trains (critic_warmup_steps): the policy waits for
    values worth a baseline."""


class GAESection(NumericSection):
    """Generalized advantage estimation (posttrain.advantages.gae_advantages) and the per-token rewards it reads."""

    gamma: float = Field(1.0, ge=0, le=1)
    """Discount per token."""

    lam: float = Field(0.95, ge=0, le=1)
    """λ of the policy's advantages."""

    value_lam: float | None = Field(None, ge=0, le=1)
    """λ of the critic's return targets; null: the same as lam (1.0 trains the critic on Monte-Carlo returns)."""

    kl_coef: float = Field(0.0, ge=0)
    """KL-in-reward: kl_coef·KL(π_old‖π_ref) per token subtracted from the rewards (InstructGPT's penalty); > 0 loads
    a frozen reference. loss.reference_kl_penalty is the loss-side alternative."""

    whiten_advantages: bool = True
    """Whiten the advantages over the batch's valid tokens (mean 0, std 1)."""


class PPOConfig(OnlineRLConfig):
    """Online RL with a learned critic: sample completions, score them, compute token-level advantages with GAE
    from the critic's values, and update the policy with the clipped policy-gradient loss and the critic with
    the clipped value loss (PPO, Schulman et al. 2017; for language models Ziegler et al. 2019, Ouyang et al. 2022).
    The prompt, rollout, environment, loss and update sections are the same as GRPO's."""

    output_dir: str = "runs/ppo"
    """Run directory: config.yaml, metrics.jsonl, checkpoints/ (policy/ and critic/), final/ (the policy)."""

    critic: CriticSection = Field(default_factory=CriticSection)
    """The value model."""

    gae: GAESection = Field(default_factory=GAESection)
    """Advantages."""

    @model_validator(mode="before")
    @classmethod
    def _no_advantage_section(cls, value: Any) -> Any:
        if isinstance(value, dict) and "advantage" in value:
            raise ValueError("advantage.* does not apply to PPO: its advantages come from the critic through GAE "
                             "(set gae.gamma, gae.lam, gae.whiten_advantages)")
        return value

    @model_validator(mode="after")
    def _check(self) -> PPOConfig:
        self.check_online_rl("PPO")
        self.check_scoring_groups(self.loss.reference_kl_penalty > 0 or self.gae.kl_coef > 0, None)
        if self.rollout.dynamic_sampling:
            raise ValueError("rollout.dynamic_sampling filters groups with equal rewards, a GRPO device; PPO's "
                             "baseline is the critic, so leave it off")
        if self.critic.warmup_steps >= self.trainer.max_steps:
            raise ValueError(f"critic.warmup_steps={self.critic.warmup_steps} leaves no step of "
                             f"trainer.max_steps={self.trainer.max_steps} for the policy")
        return self


class QuickstartConfig(Section):
    """RL from verifiable rewards on two CPU cores: the tiny model learns addition from a small labelled pool with
    SFT, then improves with GRPO on unlabelled prompts scored by a verifier; a control continues SFT instead."""

    output_dir: str = "runs/quickstart"
    """Where each stage writes its run directory, and where summary.json and curves.png go."""

    overwrite_output_dir: bool = False
    """Write into an output_dir that already holds files posttrain did not put there (see the training recipes)."""

    @field_validator("output_dir")
    @classmethod
    def _a_folder(cls, value: str) -> str:
        return _run_folder(value)

    sft: SFTConfig
    """The SFT stage (defaults: configs/sft_arithmetic_small.yaml; override as sft.trainer.max_steps=...)."""

    grpo: GRPOConfig
    """The GRPO stage, started from the SFT stage's model (defaults: configs/grpo_arithmetic.yaml)."""

    control_steps: int = Field(1500, ge=0)
    """The control: this many more SFT steps on the same labelled pool, from the SFT stage's model (default: as many
    optimizer steps as the GRPO stage takes; 0: skip)."""

    eval: ArithmeticEvalSection = Field(default_factory=lambda: ArithmeticEvalSection(num_examples=800))
    """Held-out evaluation before and after each stage (800 problems: a stage's accuracy has a standard error
    of at most 1.8 points)."""


# SFTConfig, DPOConfig and DistillConfig, defined before the evaluation sections, name them in their annotations
# (DistillConfig validated without the rebuild, but kept the unresolved name where --help reads the field's type).
SFTConfig.model_rebuild()
DPOConfig.model_rebuild()
DistillConfig.model_rebuild(force=True)
