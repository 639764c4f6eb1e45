"""A reward that takes a fixed time per call: the digit fraction of each completion, after sleeping
POSTTRAIN_BENCH_REWARD_SECONDS (default 0.5) seconds — a stand-in for a judge or a sandbox, for benchmarks/scale.py."""

import os
import time


def slow_digit_fraction(prompts, completions, **kwargs):
    time.sleep(float(os.environ.get("POSTTRAIN_BENCH_REWARD_SECONDS", "0.5")))
    return [sum(ch.isdigit() for ch in c) / len(c) if c else 0.0 for c in completions]
