"""Which worker a recipe gets: local in one process, FSDP2-sharded under torchrun or on a Ray policy group (the
same protocols).

Under torchrun (or `posttrain RECIPE --nproc-per-node N`, which starts it) `build_policy`, `build_critic` and
`build_scorer` return FSDP2 workers sharded over the ranks (distributed/fsdp.py); in a single process the local
workers. `build_teacher` picks a teacher's scorer by its backend: `build_scorer`'s, or a vLLM engine in this
process (generation/vllm_scorer.py; one process only). The recipe loops call these and are otherwise unaware of
the number of processes. See docs/distributed.md and docs/design.md (how another kind of worker plugs in here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from posttrain.config.schema import LoraSection, ModelConfig, TeacherSection, TrainerConfig
from posttrain.process_group import is_distributed, world_size
from posttrain.errors import RunError
from posttrain.distributed.fsdp import FSDP2ScoringWorker, FSDP2ValueWorker, build_fsdp_policy
from posttrain.generation.vllm_backend import import_vllm
from posttrain.generation.vllm_scorer import VLLMScoringWorker
from posttrain.models.loading import load_causal_lm, load_trainable_model
from posttrain.models.lora import TaskKind
from posttrain.workers import local, value
from posttrain.workers.base import CriticWorker, PolicyWorker, ScoringWorker


def build_policy(model: ModelConfig, lora: LoraSection, trainer: TrainerConfig, tokenizer, device: torch.device,
                 task: TaskKind = "causal_lm", schedule: TrainerConfig | None = None,
                 resume_dir: Path | None = None, cluster: Any | None = None) -> PolicyWorker:
    """The policy worker of a recipe: local in one process, FSDP2-sharded under torchrun, or with a Ray `cluster`
    whose cluster.policy_workers > 0 FSDP2-sharded over that many actors (distributed/ray_policy.py)."""
    if cluster is not None and cluster.section.policy_workers:
        return cluster.policy(model, lora, trainer, tokenizer, task=task, schedule=schedule, resume_dir=resume_dir)
    if not is_distributed():
        return local.build_policy(model, lora, trainer, tokenizer, device, task, schedule, resume_dir)
    def load(on: torch.device) -> torch.nn.Module:
        return load_trainable_model(model, lora, None, on, task=task, pad_token_id=tokenizer.pad_token_id)

    unsharded = (lambda: load(torch.device("cpu"))) if lora.enabled else None
    return build_fsdp_policy(load(device), tokenizer, trainer, schedule, resume_dir, unsharded)


def build_critic(init_from: str, model: ModelConfig, trainer: TrainerConfig, tokenizer, device: torch.device,
                 schedule: TrainerConfig | None = None, resume_dir: Path | None = None,
                 cluster: Any | None = None) -> CriticWorker:
    """PPO's critic (posttrain.workers.value): local in one process, FSDP2-sharded under torchrun, or on the Ray
    policy group's actors beside the policy (as `build_policy`)."""
    if cluster is not None and cluster.section.policy_workers:
        return cluster.critic(init_from, model, trainer, tokenizer, schedule=schedule, resume_dir=resume_dir)
    if not is_distributed():
        return value.build_critic(init_from, model, trainer, tokenizer, device, schedule, resume_dir)
    worker = FSDP2ValueWorker(value.load_critic_model(init_from, model, tokenizer, device), tokenizer, trainer,
                              schedule)
    if resume_dir is not None:
        worker.load(resume_dir)
    return worker


def build_scorer(model: ModelConfig, trainer: TrainerConfig, device: torch.device,
                 role: str = "reference", offload: bool = False, cluster: Any | None = None,
                 group_name: str | None = None) -> ScoringWorker:
    """A frozen scoring worker: local in one process (with `offload`, its weights in CPU memory between passes),
    FSDP2-sharded under torchrun (offload refused there); with a Ray `cluster`, a group of its own when the cluster
    section gives `role` actors (cluster.reference_workers, teacher_workers; named `group_name` when a run has
    several of `role`), else over the policy group when it has one."""
    if cluster is not None and cluster.section.scoring_workers(role):
        return cluster.scoring_group(model, trainer, role=role, offload=offload, name=group_name)
    if cluster is not None and cluster.section.policy_workers:
        return cluster.scorer(model, trainer, role=role, offload=offload)
    if not is_distributed():
        return local.build_scorer(model, trainer, device, role, offload)
    if offload:
        raise RunError(f"{role} offload runs in one process for now; run without torchrun, or set offload=false "
                       "(an FSDP2 scorer holds only its shard of the weights)")
    return FSDP2ScoringWorker(load_causal_lm(model, device=device), trainer, role)


def build_teacher(teacher: TeacherSection, trainer: TrainerConfig, device: torch.device, *,
                  max_length: int | None = None, topk: int = 20, cluster: Any | None = None,
                  group_name: str | None = None) -> ScoringWorker:
    """A frozen teacher by its teacher.backend: transformers, `build_scorer` (with teacher.offload); vllm, a vLLM
    engine in this process (generation/vllm_scorer.py) taking rows of up to `max_length` tokens (None: the
    model's own limit) and top-k requests up to `topk`; with a Ray `cluster`, a transformers teacher runs in
    cluster.teacher_workers actors of its own (named `group_name` when there are several teachers), or sharded over
    the policy group's ranks. RunError under torchrun for vllm."""
    if teacher.backend == "transformers":
        return build_scorer(teacher.as_model(), trainer, device, role="teacher", offload=teacher.offload,
                            cluster=cluster, group_name=group_name)
    check_teacher_backend(teacher)
    return VLLMScoringWorker(teacher.name_or_path, role="teacher", dtype=teacher.dtype,
                             gpu_memory_utilization=teacher.vllm_gpu_memory_utilization,
                             max_model_len=None if max_length is None else max_length + 1, max_logprobs=topk)


def check_teacher_backend(teacher: TeacherSection) -> None:
    """For a vLLM teacher, before any model loads: RunError in a data-parallel run (its engine runs in one process
    on one GPU, and under torchrun every rank would start its own in a process group that vLLM's in-process
    engine does not expect); ImportError, saying how to install it, without the vllm package."""
    if teacher.backend != "vllm":
        return
    if is_distributed():
        raise RunError(f"teacher {teacher.name_or_path}: backend=vllm runs in one process for now; run without "
                       "torchrun, or set the teacher's backend=transformers (an FSDP2 scorer under torchrun)")
    import_vllm(f"teacher {teacher.name_or_path} with backend=vllm")


def check_split(trainer: TrainerConfig) -> None:
    """A step's micro-batches are divided among the ranks (sft, dpo, rm): gradient_accumulation_steps must be a
    multiple of them. Called before any model loads; nothing to check in one process."""
    n = world_size()
    if trainer.gradient_accumulation_steps % n:
        raise ValueError(
            f"trainer.gradient_accumulation_steps={trainer.gradient_accumulation_steps} does not split over {n} "
            f"processes: each optimizer step's trainer.micro_batch_size x trainer.gradient_accumulation_steps "
            f"examples are divided among the ranks by micro-batch, so gradient_accumulation_steps must be a "
            f"multiple of {n} (the same config then makes the same update on any number of processes)")
