"""Batched, KV-cached sampling with a transformers model, on CPU or GPU.

`TransformersGenerator` samples from the very model the trainer updates (no weight copy, so
`update_weights` only records the version), which is what a single-process CPU run wants; with `owns_weights` it
samples from its own copy, which `update_weights` refreshes bucket by bucket (each rank of a data-parallel run,
whose trained model is sharded, keeps such a copy). Prompts are
left-padded into one batch per `batch_size` rows; each step feeds one new token per row through
the model's KV cache. A row stops at an eos token or once its decoded text contains a stop
string; the batch stops when every row has.

Logprobs are those of the distribution actually sampled from: logits divided by the
temperature, then top-k and top-p applied and renormalized. With top_k=0 and top_p=1 (the
RL defaults) this equals log_softmax(logits / temperature), which is what the trainer
recomputes; otherwise the two differ by the renormalization and importance-sampling
correction accounts for it.
"""

from __future__ import annotations

import inspect
import time

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from posttrain.errors import RunError
from posttrain.generation.base import Completion, GenerationOutput, SamplingParams, weight_buckets


def check_fits_context(model_config, max_new_tokens: int) -> None:
    """Refuse (RunError) a max_new_tokens past the model's context: the generator allocates max_new_tokens positions
    per row up front, so a huge value fails as an allocation error (or takes gigabytes) before a single token, and
    past the context the model has no positions to give anyway. The prompt's length is left out, so that every
    rank of a data-parallel run (each with its own prompts) decides alike. Models whose config names no context
    length (max_position_embeddings) are not checked."""
    context = getattr(model_config, "max_position_embeddings", None)  # not every architecture's config has one
    if isinstance(context, int) and max_new_tokens > context:
        raise RunError(f"max_new_tokens={max_new_tokens:,} is more than the model's context of {context:,} positions "
                       "(max_position_embeddings in its config.json); lower it (max_new_tokens for eval and "
                       "generate, rollout.max_new_tokens for the RL recipes)")


class TransformersGenerator:
    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, batch_size: int = 256,
                 seed: int = 0, owns_weights: bool = False, weights_version: int = 0):
        self.model = model
        self.owns_weights = owns_weights
        self.weights_version = weights_version
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.device = next(model.parameters()).device
        self.rng = torch.Generator(device=self.device).manual_seed(seed)
        self.pad_token_id = tokenizer.pad_token_id
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        # transformers renamed the KV-cache argument and output from past_key_values to cache (5.2x).
        self.cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def update_weights(self, version: int, weights) -> int:
        """Load the trainer's weights into this generator's own copy, bucket by bucket, every weight of the model
        exactly once; when it samples from the trainer's model object itself, only record `version` (nothing is
        read: for a LoRA policy that would merge and unmerge the adapters, which rounds the base weights)."""
        if not self.owns_weights:
            self.weights_version = version
            return 0
        expected = set(self.model.state_dict())
        loaded: set[str] = set()
        sent = 0
        with torch.no_grad():
            for bucket in weight_buckets(weights):
                _, unexpected = self.model.load_state_dict(dict(bucket), strict=False)
                if unexpected:
                    raise ValueError(f"weights this generator's model has no place for: {unexpected[:5]}")
                loaded.update(name for name, _ in bucket)
                sent += sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
        if missing := sorted(expected - loaded):
            raise ValueError(f"weight update of version {version} left weights unset: {missing[:5]}")
        self.weights_version = version
        return sent

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, num_samples: int = 1) -> GenerationOutput:
        started = time.perf_counter()
        if params.seed is not None:
            self.rng.manual_seed(params.seed)
        params.check_seeds_fit(len(prompts))
        check_fits_context(self.model.config, params.max_new_tokens)
        was_training = self.model.training
        self.model.eval()
        prompts_per_batch = max(1, self.batch_size // num_samples)
        flat: list[Completion] = []
        for start in range(0, len(prompts), prompts_per_batch):
            batch = prompts[start : start + prompts_per_batch]
            rng = self.rng if params.seeds is None else self._row_streams(params.seeds[start : start + len(batch)],
                                                                          num_samples)
            flat += self._generate_batch(batch, params, num_samples, rng)
        self.model.train(was_training)
        grouped = [flat[i * num_samples : (i + 1) * num_samples] for i in range(len(prompts))]
        return GenerationOutput(grouped, time.perf_counter() - started, sum(len(c.token_ids) for c in flat))

    def _row_streams(self, seeds: tuple[int, ...], num_samples: int) -> list[torch.Generator]:
        """One generator per row of a batch: sample j of prompt i seeded `seeds[i] + j`. CPU generators whatever
        the model's device: a row's uniforms are then the same on every device, and a decoding step draws them
        on the host and copies them over once instead of launching a kernel per row."""
        return [torch.Generator().manual_seed(seed + j) for seed in seeds for j in range(num_samples)]

    def _generate_batch(self, unique_prompts: list[list[int]], params: SamplingParams, num_samples: int,
                        rng: torch.Generator | list[torch.Generator]) -> list[Completion]:
        """`num_samples` completions of each prompt. Each prompt is prefilled once and its KV cache repeated for
        its samples, which then decode as separate rows."""
        width = max(len(p) for p in unique_prompts)
        input_ids = torch.full((len(unique_prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(unique_prompts), width), dtype=torch.long)
        for row, prompt in enumerate(unique_prompts):  # left padding: every prompt ends at the last column
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt):] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        eos = torch.tensor(self.eos_token_ids, device=self.device)

        output = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=True)
        cache, next_logits = getattr(output, self.cache_name), output.logits[:, -1]
        if num_samples > 1:
            cache.batch_repeat_interleave(num_samples)
            next_logits = next_logits.repeat_interleave(num_samples, dim=0)
            attention_mask = attention_mask.repeat_interleave(num_samples, dim=0)
            position_ids = position_ids.repeat_interleave(num_samples, dim=0)
        prompts = [prompt for prompt in unique_prompts for _ in range(num_samples)]
        batch = len(prompts)

        tokens = torch.empty((batch, params.max_new_tokens), dtype=torch.long, device=self.device)
        logprobs = torch.zeros((batch, params.max_new_tokens), device=self.device)
        finished = torch.zeros(batch, dtype=torch.bool, device=self.device)
        lengths = torch.full((batch,), params.max_new_tokens, dtype=torch.long, device=self.device)
        next_position = position_ids[:, -1:] + 1
        steps = 0
        for t in range(params.max_new_tokens):
            token, token_logprob = sample_next_token(next_logits, params, rng)
            token = torch.where(finished, self.pad_token_id, token)
            tokens[:, t], logprobs[:, t] = token, torch.where(finished, 0.0, token_logprob)
            steps = t + 1
            newly_done = ~finished & torch.isin(token, eos)
            if params.stop_strings:
                newly_done |= self._stop_string_hits(tokens[:, : t + 1], finished, params.stop_strings)
            lengths = torch.where(newly_done, t + 1, lengths)
            finished |= newly_done
            if bool(finished.all()) or t + 1 == params.max_new_tokens:
                break
            attention_mask = torch.cat([attention_mask, torch.ones((batch, 1), dtype=torch.long, device=self.device)], 1)
            output = self.model(input_ids=token[:, None], attention_mask=attention_mask, position_ids=next_position,
                                use_cache=True, **{self.cache_name: cache})
            cache, next_logits = getattr(output, self.cache_name), output.logits[:, -1]
            next_position = next_position + 1

        tokens_list, logprobs_list, lengths_list = tokens[:, :steps].tolist(), logprobs[:, :steps].tolist(), lengths.tolist()
        finished_list = finished.tolist()
        completions = []
        for row in range(batch):
            n = lengths_list[row]
            ids = tokens_list[row][:n]
            completions.append(Completion(
                prompt_ids=list(prompts[row]),
                token_ids=ids,
                logprobs=logprobs_list[row][:n],
                text=self.tokenizer.decode(ids, skip_special_tokens=True),
                finish_reason="stop" if finished_list[row] else "length",
            ))
        return completions

    def _stop_string_hits(self, tokens: torch.Tensor, finished: torch.Tensor, stop_strings: tuple[str, ...]) -> torch.Tensor:
        """Rows (not yet finished) whose decoded completion now contains a stop string."""
        hits = torch.zeros_like(finished)
        for row in (~finished).nonzero().flatten().tolist():
            text = self.tokenizer.decode(tokens[row].tolist(), skip_special_tokens=True)
            if any(s in text for s in stop_strings):
                hits[row] = True
        return hits


def sample_next_token(logits: torch.Tensor, params: SamplingParams,
                      rng: torch.Generator | list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from logits [B, V]; return (tokens [B], their logprobs [B]) under the sampling distribution.

    temperature 0 is greedy (logprob 0, the distribution being a point mass). `rng` is one generator for the
    whole batch, or one per row (each row's token then depends on its own stream only).
    """
    logits = logits.float()
    if params.temperature == 0:
        token = logits.argmax(-1)
        return token, torch.zeros(token.shape, device=logits.device)
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already reach top_p (the top token always stays).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    logprobs = logits.log_softmax(-1)
    if isinstance(rng, torch.Generator):
        token = torch.multinomial(logprobs.exp(), 1, generator=rng).squeeze(-1)
    else:
        token = _draw_per_row(logprobs.exp(), rng)
    return token, logprobs.gather(-1, token[:, None]).squeeze(-1)


def _draw_per_row(probs: torch.Tensor, streams: list[torch.Generator]) -> torch.Tensor:
    """Inverse-CDF sampling of one token per row of probs [B, V], row b with one uniform from streams[b]. A
    token of probability 0 is never drawn: the first index whose cumulative sum exceeds the draw has mass."""
    if len(streams) != probs.shape[0]:
        raise ValueError(f"{len(streams)} sampling streams for {probs.shape[0]} rows")
    uniforms = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in streams]).to(probs.device)
    # float64: the cumulative sum over a 152k vocabulary stays exact enough that each token keeps its own mass.
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1]
    if not bool((torch.isfinite(total) & (total > 0)).all()):
        raise FloatingPointError("sampling probabilities with NaN or no mass (the logits were NaN or all -inf)")
    below_total = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, below_total[:, None], right=True).squeeze(-1)


def _eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every id that ends a completion: the tokenizer's eos and the model's generation-config eos ids."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    generation_eos = model.generation_config.eos_token_id
    if isinstance(generation_eos, int):
        ids.add(generation_eos)
    elif generation_eos:
        ids.update(generation_eos)
    if not ids:
        raise ValueError("the tokenizer and model define no eos token; completions could never end")
    return sorted(ids)
