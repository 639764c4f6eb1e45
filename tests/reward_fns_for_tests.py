"""Tiny batched reward functions for tests/test_envs.py (imported by module name and by file path)."""

import os
import time


def exact(prompts, completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def raises_on_bad(prompts, completions, **kwargs):
    out = []
    for c in completions:
        if c == "bad":
            raise ValueError(f"cannot score {c!r}")
        out.append(1.0)
    return out


def sleeps_on_slow(prompts, completions, **kwargs):
    for c in completions:
        if c == "slow":
            time.sleep(60)
    return [1.0] * len(completions)


def nan_or_none(prompts, completions, **kwargs):
    return [{"nan": float("nan"), "none": None, "inf": float("inf"), "text": "1.0"}.get(c, 0.5) for c in completions]


def one_value_too_many(prompts, completions, **kwargs):
    return [1.0] * (len(completions) + 1)


def scalar_not_list(prompts, completions, **kwargs):
    return 1.0


def exits_process(prompts, completions, **kwargs):
    if "crash" in completions:
        os._exit(3)
    return [1.0] * len(completions)


def pid(prompts, completions, **kwargs):
    return [float(os.getpid())] * len(completions)


NOT_CALLABLE = 3


def returns_local_class_instance(prompts, completions, **kwargs):
    # A local class cannot be pickled back to the training process.
    class Score(float):
        pass

    return [Score(1.0) for _ in completions]


def digit_fraction(prompts, completions, **kwargs):
    """Dense, learnable reward for GRPO loop tests: the fraction of the completion's characters that are digits."""
    return [sum(ch.isdigit() for ch in c) / len(c) if c else 0.0 for c in completions]


def fails_every_fourth(prompts, completions, **kwargs):
    """Masks every fourth sample of each call (None), scores the rest by digit fraction."""
    scores = digit_fraction(prompts, completions)
    return [None if i % 4 == 0 else s for i, s in enumerate(scores)]


_scored_before_hanging = 0


def digit_fraction_then_never_answers(prompts, completions, **kwargs):
    """digit_fraction for the first 64 completions a process scores (two GRPO steps of 8 prompts x 4 samples), then
    a call that never returns (a stuck judge); with num_workers=0 nothing times it out but the caller's deadline."""
    global _scored_before_hanging
    _scored_before_hanging += len(completions)
    if _scored_before_hanging > 64:
        time.sleep(3600)
    return digit_fraction(prompts, completions, **kwargs)


_calls_before_straggling = 0


def digit_fraction_third_call_straggles(prompts, completions, **kwargs):
    """digit_fraction, but the third call a process makes takes 12 s (a judge that straggles once): with
    rollout.group_timeout_s each group of a round is scored by a call of its own, so one group straggles."""
    global _calls_before_straggling
    _calls_before_straggling += 1
    if _calls_before_straggling == 3:
        time.sleep(12)
    return digit_fraction(prompts, completions, **kwargs)


def digit_fraction_or_constant(prompts, completions, **kwargs):
    """digit_fraction for prompts whose characters' code points sum to an odd number, 0.5 for the others: about half
    the groups carry no reward variance, whatever the policy writes (dynamic sampling filters them)."""
    scores = digit_fraction(prompts, completions)
    return [score if sum(map(ord, str(prompt))) % 2 else 0.5 for prompt, score in zip(prompts, scores)]
