"""Greedy exact-match evaluation on a built-in task's held-out split."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from posttrain.algorithms.common import chunks
from posttrain.config.schema import EvalConfig
from posttrain.envs import arithmetic
from posttrain.models.loading import default_device, load_causal_lm, load_tokenizer


@dataclass(frozen=True)
class EvalResult:
    task: str
    accuracy: float
    num_examples: int
    mean_response_tokens: float
    samples: list[dict[str, str]] = field(default_factory=list)
    """The first few (prompt, answer, completion) triples, for a look at what the model does."""

    def to_json(self) -> dict:
        return {"task": self.task, "accuracy": self.accuracy, "num_examples": self.num_examples,
                "mean_response_tokens": self.mean_response_tokens, "samples": self.samples}


@torch.no_grad()
def generate_greedy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str],
                    max_new_tokens: int, batch_size: int) -> tuple[list[str], list[int]]:
    """Greedy completions (decoded, special tokens removed) and their lengths in tokens."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    tokenizer.padding_side = "left"
    texts, lengths = [], []
    for group in chunks(prompts, batch_size):
        encoded = tokenizer(group, return_tensors="pt", padding=True).to(device)
        output = model.generate(**encoded, max_new_tokens=max_new_tokens, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        new_tokens = output[:, encoded["input_ids"].shape[1]:]
        texts += tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
        # Length up to and including the first eos (or the whole budget when none was produced).
        is_eos = new_tokens == tokenizer.eos_token_id
        has_eos = is_eos.any(dim=1)
        first_eos = is_eos.int().argmax(dim=1)
        lengths += torch.where(has_eos, first_eos + 1, torch.full_like(first_eos, new_tokens.shape[1])).tolist()
    tokenizer.padding_side = "right"
    model.train(was_training)
    return texts, lengths


def evaluate_arithmetic(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, num_examples: int = 200,
                        seed: int = 0, batch_size: int = 200, max_new_tokens: int = 8) -> EvalResult:
    problems = arithmetic.sample_problems("heldout", num_examples, seed=seed)
    completions, lengths = generate_greedy(model, tokenizer, [p.prompt for p in problems], max_new_tokens, batch_size)
    scores = [arithmetic.exact_match(c, p.answer) for c, p in zip(completions, problems)]
    samples = [{"prompt": p.prompt, "answer": p.answer, "completion": c} for p, c in zip(problems[:5], completions)]
    return EvalResult("arithmetic", sum(scores) / len(scores), len(scores), sum(lengths) / len(lengths), samples)


def run_eval(cfg: EvalConfig) -> EvalResult:
    tokenizer = load_tokenizer(cfg.model)
    model = load_causal_lm(cfg.model, device=default_device())
    return evaluate_arithmetic(model, tokenizer, cfg.num_examples, cfg.seed, cfg.batch_size, cfg.max_new_tokens)
