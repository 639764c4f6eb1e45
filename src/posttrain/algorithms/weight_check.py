"""`posttrain grpo --check-weight-sync` (and ppo): does the generator sample from exactly the trainer's weights?

With the run's config, without writing a run: the policy is built from model.name_or_path and a generator that
keeps its own copy of the weights (cluster.backend=ray: the Ray generation workers; local: a copy in this process,
what each rank of a data-parallel run keeps). The check samples a few prompts, takes one optimizer step on them (so
the weights to sync are not the ones the generator loaded from disk), pushes the weights, and compares:

- every tensor's SHA-256 on the trainer and on each generation worker (bitwise equality);
- the log-probabilities of a freshly sampled batch computed by the trainer and by the generator's copy with the
  same forward pass (bitwise equal on CPU in float32 when the weights are);
- the log-probabilities the sampler reported for its tokens against the trainer's: the mismatch a training step
  logs as generator_logprob_error(_max, _fraction). The sampler decodes with a KV cache and (with top-p/top-k)
  renormalises, so this one is small but need not be 0; it is reported, not required.

It passes when the versions match the policy's, every digest matches, and the teacher-forced log-probabilities
are bitwise equal.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from posttrain.algorithms.common import configure_torch, seed_everything
from posttrain.algorithms.rl import load_prompts, policy_generator, rollout_sampling
from posttrain.algorithms.rollout import PromptRow, run_episodes, to_batch
from posttrain.config.schema import OnlineRLConfig
from posttrain.data.types import RolloutBatch
from posttrain.distributed.builders import build_policy
from posttrain.distributed.cluster import start_cluster, stops_clusters
from posttrain.distributed.weight_check import InProcessCopy, weight_digests
from posttrain.envs.base import EnvStep, Message, single_turn_step
from posttrain.errors import RunError
from posttrain.generation.base import SamplingParams
from posttrain.models.loading import default_device, load_tokenizer, resolve_model_path
from posttrain.workers.objectives import PolicyGradientObjective


@dataclass(frozen=True)
class WeightSyncCheck:
    """What `check_weight_sync` found."""

    backend: str
    """cluster.backend: ray (generation actors) or local (a copy in this process)."""
    workers: int
    """Generators compared (each generation actor)."""
    version: int
    """The policy version pushed (1: after the check's one optimizer step)."""
    generator_versions: list[int]
    """The version each generator says it holds."""
    tensors: int
    """Tensors compared per generator."""
    bytes_sent: int
    """Bytes the push sent (to each generator)."""
    sync_seconds: float
    differing_tensors: list[str]
    """Names of the tensors whose digest differs from the trainer's on any generator (none when the sync is exact)."""
    logprobs_bitwise_equal: bool
    """The generator's copy gives the batch's sampled tokens exactly the trainer's log-probabilities."""
    logprob_max_difference: float
    """max |log π_trainer − log π_generator copy| over the sampled tokens (0 when bitwise equal)."""
    sampled_mismatch_mean: float
    """mean |log π_trainer − the sampler's reported log-probability| over the sampled tokens."""
    sampled_mismatch_max: float
    tokens: int
    """Sampled tokens compared."""

    @property
    def passed(self) -> bool:
        return (not self.differing_tensors and self.logprobs_bitwise_equal
                and all(v == self.version for v in self.generator_versions))

    def summary(self) -> str:
        verdict = "ok" if self.passed else "MISMATCH"
        lines = [f"weight sync {verdict}: backend={self.backend}, {self.workers} generator(s), policy version "
                 f"{self.version} (generators hold {self.generator_versions})",
                 f"  weights: {self.tensors - len(self.differing_tensors)}/{self.tensors} tensors bitwise equal, "
                 f"{self.bytes_sent / 2**20:.2f} MiB sent in {self.sync_seconds:.3f} s"
                 + (f"; differing: {', '.join(self.differing_tensors[:5])}" if self.differing_tensors else ""),
                 f"  log-probabilities of {self.tokens} sampled tokens, trainer vs the generator's copy: "
                 + ("bitwise equal" if self.logprobs_bitwise_equal
                    else f"differ, max |difference| {self.logprob_max_difference:.3g}"),
                 f"  trainer vs the sampler's own log-probabilities: mean |difference| "
                 f"{self.sampled_mismatch_mean:.3g}, max {self.sampled_mismatch_max:.3g}"]
        return "\n".join(lines)


class _Unscored:
    """Scores every reply 0: the check needs sampled tokens, not rewards."""

    def step(self, message_logs: list[list[Message]], metadata: list[dict]) -> EnvStep:
        return single_turn_step([0.0] * len(message_logs), [None] * len(message_logs), metadata)


def check_weight_sync(cfg: OnlineRLConfig, num_prompts: int = 4) -> WeightSyncCheck:
    """Run the check of the module docstring with `cfg`'s model, data (its first `num_prompts` prompts), rollout
    sampling and cluster; a local Ray instance is started in a temporary folder and shut down afterwards."""
    with tempfile.TemporaryDirectory(prefix="posttrain-check-") as scratch:
        return _check(cfg, num_prompts, Path(scratch))


@stops_clusters
def _check(cfg: OnlineRLConfig, num_prompts: int, scratch: Path) -> WeightSyncCheck:
    if cfg.cluster.colocated and not cfg.cluster.policy_workers:
        raise RunError("--check-weight-sync with cluster.colocated=true and cluster.policy_workers=0: the generator "
                       "samples from the trained module itself, so there is no copy to compare; weight_sync/bytes is "
                       "0 at every step")
    if cfg.cluster.backend == "ray" and cfg.rollout.backend == "vllm":
        raise RunError("--check-weight-sync with rollout.backend=vllm on Ray generation workers: the engine keeps the "
                       "weights in its own layout (q/k/v fused, sharded), so there is no copy to compare tensor by "
                       "tensor; each actor checks that every weight of a push arrived, and every step logs "
                       "generator_logprob_error, the trainer's log-probabilities against the engine's")
    configure_torch(cfg.trainer)
    seed_everything(cfg.seed)
    tokenizer = load_tokenizer(cfg.model, padding_side="right")
    rows, _ = load_prompts(cfg.data.train_files, cfg.data, cfg.prompt, None, tokenizer, limit=num_prompts)
    device = default_device()
    cluster = start_cluster(cfg.cluster, cfg.weight_sync, scratch)
    policy = build_policy(cfg.model, cfg.lora, cfg.trainer, tokenizer, device, cluster=cluster)
    if cluster is not None:
        generator = policy_generator(cfg, tokenizer, policy, cluster)
    else:
        model = cfg.model.model_copy(update={"name_or_path": resolve_model_path(cfg.model.name_or_path)})
        generator = InProcessCopy(model, tokenizer, cfg.rollout.generation_batch_size, cfg.seed, device)
        policy.push_weights(generator)
    sampling, _ = rollout_sampling(cfg.rollout)
    temperature = cfg.rollout.temperature

    # One optimizer step, so that the weights pushed are not those the generator loaded from disk.
    batch = _sampled_batch(rows, generator, tokenizer, replace(sampling, seed=cfg.seed))
    signs = torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(batch))])
    loss = PolicyGradientObjective(cfg.loss.resolved(max_completion_tokens=cfg.rollout.max_new_tokens),
                                   temperature=temperature)
    policy.forward_backward(replace(batch, advantages=signs), loss)
    policy.optim_step()
    started = time.perf_counter()
    sync = policy.push_weights(generator)
    sync_seconds = time.perf_counter() - started

    trainer_digests = weight_digests(policy.named_weights())
    differing = sorted({name for digests in generator.weight_digests() for name in trainer_digests
                        if digests.get(name) != trainer_digests[name]})
    versions = generator.actor_versions() if cluster is not None else [generator.weights_version]

    fresh = _sampled_batch(rows, generator, tokenizer, replace(sampling, seed=cfg.seed + 1))
    sampled = fresh.loss_mask.bool()
    trainer = policy.logprobs(fresh, temperature)
    copy = generator.logprobs(fresh, cfg.trainer, temperature)
    difference = (trainer - copy).abs()[sampled]
    mismatch = (trainer - fresh.generator_logprobs).abs()[sampled]
    return WeightSyncCheck(
        backend=cfg.cluster.backend, workers=len(versions), version=policy.version, generator_versions=versions,
        tensors=len(trainer_digests), bytes_sent=int(sync["weight_sync/bytes"]), sync_seconds=sync_seconds,
        differing_tensors=differing, logprobs_bitwise_equal=bool(torch.equal(trainer[sampled], copy[sampled])),
        logprob_max_difference=float(difference.max()) if difference.numel() else 0.0,
        sampled_mismatch_mean=float(mismatch.mean()) if mismatch.numel() else 0.0,
        sampled_mismatch_max=float(mismatch.max()) if mismatch.numel() else 0.0, tokens=int(sampled.sum()))


def _sampled_batch(rows: list[PromptRow], generator, tokenizer, sampling: SamplingParams) -> RolloutBatch:
    """Two samples of each prompt row, unscored, as a RolloutBatch."""
    episodes, _ = run_episodes(rows, 0, 2, generator, _Unscored(), tokenizer, sampling, max_turns=1)
    return to_batch(episodes, tokenizer.pad_token_id, {}, False, [0.0] * len(episodes))
