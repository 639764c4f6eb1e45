"""Rewards that take a fixed time per call — a stand-in for a judge or a sandbox: after sleeping
POSTTRAIN_BENCH_REWARD_SECONDS (default 0.5) seconds, the digit fraction of each completion (benchmarks/scale.py) or
the arithmetic task's exact match (benchmarks/seeds.py's asynchronous-GRPO comparison)."""

import os
import time

from posttrain.envs.arithmetic import correct_reward


def _sleep() -> None:
    time.sleep(float(os.environ.get("POSTTRAIN_BENCH_REWARD_SECONDS", "0.5")))


def slow_digit_fraction(prompts, completions, **kwargs):
    _sleep()
    return [sum(ch.isdigit() for ch in c) / len(c) if c else 0.0 for c in completions]


def slow_correct(prompts, completions, answer, **kwargs):
    _sleep()
    return correct_reward(prompts, completions, answer)
