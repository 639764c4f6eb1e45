"""TRL's argument names (SFTConfig, DPOConfig, GRPOConfig, RewardConfig and the TrainingArguments they share) and
the posttrain key each one is, per recipe, or why posttrain has none. The loader quotes an entry when a config
holds one of these names where posttrain has no such key ("TRL's per_device_train_batch_size is
trainer.micro_batch_size"); docs/from-trl.md is the same table for reading, and a test checks every key named here
against the recipes' schemas.

The bottom layer: imports nothing of the package.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TRAINING_RECIPES = ("sft", "dpo", "rm", "grpo", "ppo", "distill")


@dataclass(frozen=True)
class TrlName:
    """Where one TRL argument goes in posttrain."""

    keys: dict[str, str] = field(default_factory=dict)
    """{recipe: the posttrain key (dotted), or key=value where one value is TRL's setting}; "*" stands for every
    training recipe not listed."""
    note: str | dict[str, str] = ""
    """What differs in meaning or unit, said after the key; or {recipe: that} ("*" for the others)."""
    unsupported: str = ""
    """When posttrain has no such setting: why ("not supported, because ..." follows)."""

    def key_for(self, recipe: str) -> str | None:
        return self.keys.get(recipe, self.keys.get("*") if recipe in TRAINING_RECIPES else None)

    def applies_to(self, recipe: str) -> bool:
        """Whether the name means something for `recipe` (eval and generate take only the names listed for them)."""
        return recipe in TRAINING_RECIPES or recipe in self.keys

    def explain(self, name: str, recipe: str) -> str:
        """One sentence: TRL's `name` is KEY (note), or is not supported, because ..."""
        key = self.key_for(recipe)
        if key is None:
            why = self.unsupported or f"posttrain {recipe} has no such setting"
            return f"TRL's {name} is not supported, because {why}"
        note = self.note if isinstance(self.note, str) else self.note.get(recipe, self.note.get("*", ""))
        return f"TRL's {name} is {key}" + (f" ({note})" if note else "")


def _all(key: str, note: str = "") -> TrlName:
    return TrlName({"*": key}, note)


def _no(why: str) -> TrlName:
    return TrlName(unsupported=why)


_RL = ("grpo", "ppo")

TRL_NAMES: dict[str, TrlName] = {
    # TrainingArguments, shared by every TRL trainer
    "per_device_train_batch_size": _all("trainer.micro_batch_size",
                                        "examples per forward/backward pass; examples per optimizer step = "
                                        "micro_batch_size × gradient_accumulation_steps"),
    "per_device_eval_batch_size": _all("trainer.eval_batch_size"),
    "gradient_accumulation_steps": _all("trainer.gradient_accumulation_steps"),
    "learning_rate": _all("trainer.learning_rate"),
    "num_train_epochs": TrlName({"sft": "trainer.num_epochs", "dpo": "trainer.num_epochs", "rm": "trainer.num_epochs",
                                 "distill": "trainer.num_epochs"},
                                "passes over the training set; trainer.max_steps is then derived from its size",
                                unsupported="an RL step draws rollout.prompts_per_step prompts and runs until "
                                            "trainer.max_steps; set trainer.max_steps"),
    "max_steps": _all("trainer.max_steps"),
    "warmup_steps": _all("trainer.warmup_steps"),
    "warmup_ratio": _all("trainer.warmup_steps", "a number of steps: warmup_ratio × trainer.max_steps"),
    "lr_scheduler_type": _all("trainer.lr_scheduler", "cosine, linear or constant"),
    "lr_scheduler_kwargs": _all("trainer.min_lr_ratio", "the final learning rate as a fraction of the peak"),
    "weight_decay": _all("trainer.weight_decay"),
    "adam_beta1": _all("trainer.adam_beta1"),
    "adam_beta2": _all("trainer.adam_beta2"),
    "adam_epsilon": _all("trainer.adam_epsilon"),
    "max_grad_norm": _all("trainer.max_grad_norm"),
    "optim": _no("the optimizer is always AdamW (trainer.adam_beta1, adam_beta2, adam_epsilon, weight_decay)"),
    "bf16": _all("trainer.precision=bf16", "bf16 autocast with float32 weights; model.dtype=bfloat16 keeps the "
                 "weights themselves in bf16"),
    "fp16": _no("fp16 needs loss scaling, which posttrain does not do; trainer.precision=bf16 is the 16-bit mode"),
    "tf32": _no("posttrain leaves torch's matmul precision as it is"),
    "gradient_checkpointing": _all("model.gradient_checkpointing"),
    "torch_compile": _all("trainer.compile"),
    "logging_steps": _all("trainer.log_every"),
    "logging_strategy": _all("trainer.log_every", "a number of steps"),
    "save_steps": _all("trainer.save_every"),
    "save_strategy": _all("trainer.save_every", "a number of steps; trainer.save_every_minutes saves by time too"),
    "save_total_limit": _all("trainer.keep_last"),
    "eval_steps": _all("trainer.eval_every"),
    "eval_strategy": _all("trainer.eval_every", "a number of steps; 0 evaluates only at the end"),
    "evaluation_strategy": _all("trainer.eval_every", "a number of steps; 0 evaluates only at the end"),
    "report_to": _all("logging.wandb=true", "one switch per tracker: logging.tensorboard=true, logging.wandb=true, "
                      "logging.mlflow=true"),
    "run_name": _all("logging.run_name"),
    "logging_dir": _no("TensorBoard writes to OUTPUT/tensorboard (logging.tensorboard=true)"),
    "disable_tqdm": _all("logging.progress=none"),
    "resume_from_checkpoint": _no("a run resumes by itself from the newest checkpoint in output_dir: run the same "
                                  "command again"),
    "dataloader_num_workers": _no("the data is tokenized once before training; there is no loader process"),
    "push_to_hub": _all("hub.push_at_end"),
    "hub_model_id": _all("hub.repo_id"),
    "hub_private_repo": _all("hub.private"),
    "model_init_kwargs": _all("model.dtype", "and model.attn_implementation, model.trust_remote_code"),
    "use_liger_kernel": _all("trainer.lm_head", "trainer.lm_head=chunked never builds the full logits, which is "
                             "what Liger's fused cross-entropy saves"),
    # SFTConfig
    "max_length": TrlName({"*": "data.max_length"}, "tokens per example; grpo and ppo: the longest prompt"),
    "max_seq_length": _all("data.max_length", "tokens per example"),
    "packing": TrlName({"sft": "data.packing", "*": "trainer.packing"}),
    "padding_free": _all("trainer.packing"),
    "completion_only_loss": _all("data.completion_only_loss"),
    "assistant_only_loss": _all("data.completion_only_loss", "on messages rows the targets are the assistant's "
                                "tokens"),
    "dataset_text_field": _all("data.column_map={YOUR_FIELD: text}", "renames the column as it is read"),
    "dataset_num_proc": _no("rows are tokenized in the training process"),
    "neftune_noise_alpha": _no("posttrain adds no noise to embeddings"),
    "eos_token": _no("the tokenizer's own end-of-sequence token ends each completion; model.tokenizer_name_or_path "
                     "chooses another tokenizer"),
    "pad_token": _no("the tokenizer's own padding token is used (its end-of-sequence token when it has none)"),
    "chat_template_path": _all("model.tokenizer_name_or_path", "a tokenizer directory holding the chat template"),
    # DPOConfig
    "beta": TrlName({"dpo": "loss.beta", "grpo": "loss.reference_kl_penalty", "ppo": "loss.reference_kl_penalty"},
                    {"dpo": "the implicit reward's scale", "grpo": "the KL coefficient, KL in the loss",
                     "ppo": "the KL coefficient in the loss; gae.kl_coef puts the KL in the reward"},
                    unsupported="only dpo has a β (grpo and ppo: loss.reference_kl_penalty)"),
    "loss_type": TrlName({"dpo": "loss.type", "grpo": "loss.aggregation", "ppo": "loss.aggregation"},
                         {"dpo": "dpo is TRL's sigmoid; also ipo, cdpo, dpop, rdpo, simpo, orpo; TRL's hinge and "
                                 "others are not built",
                          "*": "token-mean is TRL's dapo and bnpo, seq-mean-token-mean its grpo, "
                               "seq-mean-token-sum-norm its dr_grpo (with advantage.normalize_std=false)"},
                         unsupported="this recipe has one loss; see `posttrain RECIPE --help` for its loss keys"),
    "label_smoothing": TrlName({"dpo": "loss.label_smoothing"}, "with loss.type=cdpo",
                               unsupported="only dpo's cdpo smooths labels"),
    "rpo_alpha": TrlName({"dpo": "loss.sft_weight"}, unsupported="only dpo adds an NLL term this way"),
    "simpo_gamma": TrlName({"dpo": "loss.simpo_gamma"}, "with loss.type=simpo", unsupported="only dpo has simpo"),
    "precompute_ref_log_probs": TrlName({"dpo": "reference=precomputed"},
                                        unsupported="only dpo has a reference to precompute"),
    "max_prompt_length": TrlName({"grpo": "data.max_length", "ppo": "data.max_length"},
                                 "the longest prompt; a longer one is a malformed row",
                                 unsupported="rows are cut as a whole at data.max_length (data.overlong: truncate "
                                             "or drop)"),
    "max_completion_length": TrlName({"grpo": "rollout.max_new_tokens", "ppo": "rollout.max_new_tokens"},
                                     unsupported="rows are cut as a whole at data.max_length (data.overlong: "
                                                 "truncate or drop)"),
    "truncation_mode": _all("data.overlong", "truncate keeps the first data.max_length tokens, drop skips the row"),
    "sync_ref_model": _no("the reference is the frozen starting model"),
    "ref_model_init_kwargs": _no("the reference is the starting model loaded as model: says"),
    "f_divergence_type": _no("the DPO family here is dpo, ipo, cdpo, dpop, rdpo, simpo and orpo (loss.type)"),
    # GRPOConfig
    "num_generations": TrlName({"grpo": "rollout.num_generations_per_prompt",
                                "ppo": "rollout.num_generations_per_prompt"},
                               unsupported="only the RL recipes sample completions while training"),
    "temperature": TrlName({"grpo": "rollout.temperature", "ppo": "rollout.temperature",
                            "distill": "rollout.temperature"}, unsupported="this recipe samples nothing"),
    "top_p": TrlName({"grpo": "rollout.top_p", "ppo": "rollout.top_p", "distill": "rollout.top_p"},
                     unsupported="this recipe samples nothing"),
    "top_k": TrlName({"grpo": "rollout.top_k", "ppo": "rollout.top_k", "distill": "rollout.top_k"},
                     unsupported="this recipe samples nothing"),
    "epsilon": TrlName({"grpo": "loss.ratio_clip_low", "ppo": "loss.ratio_clip_low"}, "and loss.ratio_clip_high",
                       unsupported="only the RL losses clip a ratio"),
    "epsilon_high": TrlName({"grpo": "loss.ratio_clip_high", "ppo": "loss.ratio_clip_high"},
                            unsupported="only the RL losses clip a ratio"),
    "num_iterations": TrlName({"grpo": "update.ppo_epochs", "ppo": "update.ppo_epochs"},
                              unsupported="only the RL recipes reuse a rollout batch"),
    "steps_per_generation": TrlName({"grpo": "update.num_minibatches", "ppo": "update.num_minibatches"},
                                    unsupported="only the RL recipes split a rollout batch"),
    "generation_batch_size": TrlName({"grpo": "rollout.prompts_per_step", "ppo": "rollout.prompts_per_step"},
                                     "prompts per step, each sampled rollout.num_generations_per_prompt times",
                                     unsupported="only the RL recipes sample while training"),
    "scale_rewards": TrlName({"grpo": "advantage.normalize_std"}, unsupported="only grpo normalizes by a group's std"),
    "mask_truncated_completions": TrlName({"grpo": "rollout.overlong_filtering", "ppo": "rollout.overlong_filtering"},
                                          unsupported="only the RL recipes sample completions"),
    "importance_sampling_level": TrlName({"grpo": "loss.ratio_level", "ppo": "loss.ratio_level"},
                                         unsupported="only the RL losses have a ratio"),
    "use_vllm": TrlName({"grpo": "rollout.backend=vllm", "ppo": "rollout.backend=vllm",
                         "distill": "rollout.backend=vllm"}, unsupported="this recipe samples nothing"),
    "vllm_gpu_memory_utilization": TrlName({"grpo": "rollout.vllm_gpu_memory_utilization",
                                            "ppo": "rollout.vllm_gpu_memory_utilization",
                                            "distill": "rollout.vllm_gpu_memory_utilization"},
                                           unsupported="this recipe samples nothing"),
    "reward_funcs": TrlName({"grpo": "environment.options.functions", "ppo": "environment.options.functions"},
                            "with environment.kind=python: import paths my_pkg.rewards:fn or file.py:fn",
                            unsupported="only the RL recipes score samples"),
    "reward_weights": TrlName({"grpo": "environment.options.functions", "ppo": "environment.options.functions"},
                              "a weight per function: [name, path, weight]",
                              unsupported="only the RL recipes score samples"),
    "log_completions": _all("logging.samples_per_step", "grpo writes that many samples per step to samples.jsonl"),
    "num_completions_to_print": _all("logging.samples_per_step"),
    # RewardConfig
    "center_rewards_coefficient": TrlName({"rm": "loss.center_rewards_coefficient"},
                                          unsupported="only rm trains a reward model"),
}
"""TRL argument name -> where it goes in posttrain."""
