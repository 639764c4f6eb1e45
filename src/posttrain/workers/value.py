"""The critic of PPO: a scalar value head on its own backbone, trained beside the policy.

    critic = build_critic(cfg.critic, cfg.model, cfg.trainer, tokenizer, device, schedule)
    old_values = critic.values(batch)                               # [N, T], no graph
    critic.forward_backward(batch.select(index), value_objective, normalizer)
    critic.optim_step()

The model is a scalar-head model (`posttrain.models.value_head.scalar_head_model_class`: a transformers sequence
classifier with num_labels=1, or posttrain's scalar head for architectures without one), so a critic starts from
the policy's checkpoint (backbone loaded, head fresh) or from a `posttrain rm` reward model (head included), and
its checkpoints are Hugging Face directories like a reward model's.

Values are aligned with log-probabilities: entry [n, t] is V(s_t), the value of the state *before* token t is
emitted, read from the head at position t − 1 (0 at t = 0). Then `values[:, t]` and `logprobs[:, t]` describe the
same action, and `posttrain.advantages.gae_advantages` reads both with the same mask.

`ValueWorker` is a `PolicyWorker` (optimizer, schedule, save/load, non-finite guard) whose model outputs, the
thing a loss function sees, are these [B, T] values instead of logits; `ValueOutputs` is that difference, which
the FSDP2 critic (posttrain.distributed.fsdp.FSDP2ValueWorker) shares.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from posttrain.config.schema import LoraSection, ModelConfig, TrainerConfig
from posttrain.data.types import RolloutBatch
from posttrain.models.loading import load_trainable_model
from posttrain.models.value_head import token_scores
from posttrain.workers.forward import autocast, batch_to
from posttrain.workers.local import LocalPolicyWorker
from posttrain.workers.packed import pack_batch, packed_token_scores

CRITIC = "critic"


class ValueOutputs:
    """What makes a policy worker a critic: its outputs are V(s_t) [B, T], and it has no log-probabilities."""

    def values(self, batch: RolloutBatch) -> torch.Tensor:
        """[N, T] float32 V(s_t) before each token t (0 at t = 0), eval mode, no graph, on CPU."""
        parts = []
        with self._frozen_pass():
            for chunk in self._chunks(batch):
                parts.append(self._outputs(batch_to(chunk, self.device)).cpu())
        return torch.cat(parts)

    def _outputs(self, batch: RolloutBatch, kind: str = "logits", temperature: float = 1.0) -> torch.Tensor:
        if kind != "logits":
            raise TypeError(f"a critic's outputs are its values; it has no {kind}")
        with autocast(self.trainer, self.device):
            if self.trainer.packing:
                packed = pack_batch(batch)
                scores = packed.gather(packed_token_scores(self.model, packed))[..., 0]
            else:
                scores = token_scores(self.model, batch.input_ids, batch.attention_mask)[..., 0]
        # The head at position p has read tokens ≤ p: the value of the state before token p + 1.
        return F.pad(scores.float()[:, :-1], (1, 0))

    def logprobs(self, batch, temperature: float = 1.0) -> torch.Tensor:
        raise TypeError("a critic has values, not log-probabilities: call values(batch)")


class ValueWorker(ValueOutputs, LocalPolicyWorker):
    """A critic in this process (see the module docstring)."""


def load_critic_model(init_from: str, model: ModelConfig, tokenizer, device: torch.device) -> torch.nn.Module:
    """The critic's scalar-head model: `init_from` "policy" is the policy's starting model (its backbone, a fresh
    head); any other value is a model directory or hub id, e.g. a `posttrain rm` reward model (backbone and head)."""
    source = model if init_from == "policy" else model.model_copy(update={"name_or_path": init_from})
    return load_trainable_model(source, LoraSection(), None, device, task="reward", pad_token_id=tokenizer.pad_token_id)


def build_critic(init_from: str, model: ModelConfig, trainer: TrainerConfig, tokenizer, device: torch.device,
                 schedule: TrainerConfig | None = None, resume_dir=None) -> ValueWorker:
    """The critic in this process (`load_critic_model`). `trainer` carries the critic's own learning rate; with
    `resume_dir` it is restored from a checkpoint folder."""
    worker = ValueWorker(load_critic_model(init_from, model, tokenizer, device), tokenizer, trainer, schedule,
                         role=CRITIC)
    if resume_dir is not None:
        worker.load(resume_dir)
    return worker
