"""`posttrain generate`: a model's completions of a few prompts, for a quick look at a checkpoint.

Prompts come from the command line or from the `prompt` column of files (read, formatted and tokenized as GRPO and
`posttrain eval` read theirs, `rl.load_prompts`), are sent through the tokenizer's chat template when it has one
(unless `chat_template` is off), and are sampled by the transformers generator of every recipe.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.algorithms.rl import build_generator, format_prompt, load_prompts
from posttrain.algorithms.rollout import PromptRow
from posttrain.config.schema import GenerateConfig, PromptSection
from posttrain.data.formats import PromptOnlyRow
from posttrain.data.tokenize import tokenize_prompt
from posttrain.generation.base import SamplingParams
from posttrain.models.loading import load_tokenizer


@dataclass(frozen=True)
class GeneratedSample:
    prompt_index: int
    sample: int
    """Its number among its prompt's samples, from 0."""
    prompt: str
    """The prompt as the model saw it (decoded prompt tokens: the chat template's rendering included)."""
    completion: str
    """The completion, special tokens removed."""
    num_tokens: int
    finish_reason: str
    """stop (eos or a stop string) or length (max_new_tokens ran out)."""

    def to_json(self) -> dict:
        return {"prompt_index": self.prompt_index, "sample": self.sample, "prompt": self.prompt,
                "completion": self.completion, "num_tokens": self.num_tokens, "finish_reason": self.finish_reason}


def generate(cfg: GenerateConfig) -> list[GeneratedSample]:
    """cfg.num_samples completions of every prompt, prompt by prompt."""
    tokenizer = load_tokenizer(cfg.model)
    prompt = PromptSection(use_chat_template=cfg.chat_template and tokenizer.chat_template is not None,
                           system_prompt=cfg.system_prompt)
    if cfg.prompts:
        rows = []
        for number, text in enumerate(cfg.prompts, start=1):
            formatted = format_prompt(PromptOnlyRow(text, {}), prompt, f"--prompt {number}")
            rows.append(PromptRow(formatted, tokenize_prompt(formatted, tokenizer), {}))
    else:
        rows, _ = load_prompts(cfg.data.files, cfg.data.data_config(), prompt, None, tokenizer,
                               limit=cfg.num_examples)
    generator = build_generator(cfg.model, "transformers", tokenizer, batch_size=cfg.batch_size, seed=cfg.seed)
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                            top_k=cfg.top_k, seed=cfg.seed)
    output = generator.generate([row.prompt_ids for row in rows], params, num_samples=cfg.num_samples)
    return [
        GeneratedSample(index, sample, tokenizer.decode(row.prompt_ids), completion.text, len(completion.token_ids),
                        completion.finish_reason)
        for index, (row, completions) in enumerate(zip(rows, output.completions, strict=True))
        for sample, completion in enumerate(completions)
    ]
