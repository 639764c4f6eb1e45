"""A stand-in generator for tool-using runs: the policy's generator, except that every first turn is a given tool
call (the embedded models call no tools of their own). Later turns, those after a tool message, are the model's."""

from __future__ import annotations

from collections.abc import Callable

from posttrain.envs.tools import ToolCall, parser_of
from posttrain.generation.base import Completion, GenerationOutput, SubmittedBlock


class FirstTurnForced:
    """`call_for(prompt_text)`: the ToolCall a first turn makes, rendered in the Hermes format and ended with
    <|im_end|>; with `with_version`, `call_for(prompt_text, version)`, version: the oldest weights version that
    sampled the call's first turns (as its output says, else the generator's). `forced` counts the samples
    replaced."""

    def __init__(self, inner, tokenizer, call_for: Callable[..., ToolCall], with_version: bool = False):
        self.inner, self.tokenizer, self.call_for, self.with_version = inner, tokenizer, call_for, with_version
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.forced = 0

    @property
    def weights_version(self):
        return self.inner.weights_version

    def update_weights(self, version, weights):
        return self.inner.update_weights(version, weights)

    def generate(self, prompts, params, num_samples=1):
        return self.forced_output(prompts, self.inner.generate(prompts, params, num_samples))

    def submit(self, prompts, params, num_samples=1):
        """A call sent now and answered later (asynchronous rollouts), forced as `generate` is."""
        answer = self.inner.submit(prompts, params, num_samples)
        return lambda: self.forced_output(prompts, answer())

    def submit_blocks(self, prompts, params, num_samples=1):
        """`submit` in the inner generator's blocks (one per generation actor), each forced as `generate` is."""
        return [SubmittedBlock(block.start, block.stop,
                               lambda block=block: self.forced_output(prompts[block.start:block.stop], block.wait()))
                for block in self.inner.submit_blocks(prompts, params, num_samples)]

    def forced_output(self, prompts, output):
        completions = []
        version = min(output.extra.get("weights_versions") or [self.inner.weights_version])
        for prompt, samples in zip(prompts, output.completions):
            text = self.tokenizer.decode(prompt)
            if "<|im_start|>tool" in text:  # a later turn: the model's own
                completions.append(samples)
                continue
            call = parser_of("hermes").render([self.call_for(text, version) if self.with_version else
                                               self.call_for(text)])
            ids = self.tokenizer(call, add_special_tokens=False)["input_ids"] + [self.im_end]
            completions.append([Completion(prompt, ids, [-1.0] * len(ids), call, "stop")] * len(samples))
            self.forced += len(samples)
        return GenerationOutput(completions, output.seconds, sum(len(c.token_ids) for s in completions for c in s),
                                output.extra)
