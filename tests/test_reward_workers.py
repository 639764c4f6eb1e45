"""Reward workers and the code sandbox under abuse: rewards float32 cannot hold, a training process that
dies while workers hang, output floods, memory hogs, processes that leave their session, and the sandbox's
unisolated fallback."""

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import reward_fns_for_worker_tests
import torch

from posttrain.algorithms.rollout import PromptRow, run_episodes, to_batch
from posttrain.algorithms.environments import build_recipe_environment
from posttrain.config.environments import CodeOptions, environment_section
from posttrain.envs import sandbox
from posttrain.envs.base import EnvStep
from posttrain.envs.code import CodeEnvironment, UnisolatedSandboxError
from posttrain.envs.python_reward import PythonRewardEnvironment
from posttrain.envs.registry import build_environment
from posttrain.envs.rewards import OUTPUT_TAIL_BYTES, RewardErrorBudget
from posttrain.generation.base import Completion, GenerationOutput, SamplingParams

FNS_FILE = str(Path(reward_fns_for_worker_tests.__file__))
GONE_WITHIN_S = 5.0
"""How long killed processes may take to disappear (the supervisor notices within 0.1 s; slack for a busy machine)."""


def logs(*replies: str) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": r}] for i, r in enumerate(replies)]


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (an ended process nobody has reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(b")") + 2 :][:1] != b"Z"


def wait_until_gone(pids: list[int], timeout_s: float = GONE_WITHIN_S) -> list[int]:
    """The pids still alive after `timeout_s` (empty when every process ended in time)."""
    deadline = time.monotonic() + timeout_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]


def recorded_pids(pid_dir: Path, count: int, timeout_s: float = 30.0) -> list[list[int]]:
    """Wait for `count` hung calls to record their pids (worker, supervisor, child, grandchild)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        records = [p for p in pid_dir.iterdir() if p.suffix != ".tmp"]
        if len(records) == count:
            return [[int(pid) for pid in p.read_text().split()] for p in records]
        time.sleep(0.05)
    raise AssertionError(f"only {len(records)} of {count} calls started within {timeout_s} s")


# --- row 7: a reward float32 cannot hold ------------------------------------------------------------------


class RawRewards:
    """An environment that returns its rewards unchecked, as a user's own environment may."""

    def __init__(self, rewards):
        self.rewards = rewards

    def step(self, message_logs, metadata):
        n = len(message_logs)
        return EnvStep(self.rewards[:n], [True] * n, [None] * n, [None] * n, [dict(m) for m in metadata])


class FixedGenerator:
    weights_version = 0

    def generate(self, prompts, params, num_samples=1):
        completion = Completion(prompt_ids=[], token_ids=[5, 6], logprobs=[-0.1, -0.2], text="x", finish_reason="stop")
        return GenerationOutput([[completion] * num_samples for _ in prompts], num_generated_tokens=2)

    def update_weights(self, version, weights):
        self.weights_version = version
        return 0


def test_reward_outside_float32_range_is_masked_and_counted():
    # A reward function's 1e308 is caught where rewards are validated ...
    step = PythonRewardEnvironment(f"{FNS_FILE}:huge", num_workers=0).step(logs("huge", "fine"), [{}, {}])
    assert step.rewards == [None, 0.5]
    assert "returned 1e+308, outside float32's range" in step.errors[0]

    # ... and any environment's, scalar or component, before it reaches a float32 tensor.
    rows = [PromptRow("q", [1, 2], {})]
    environment = RawRewards([1e308, {"a": 1.0, "b": -1e39}, 0.25, float("nan")])
    episodes, _ = run_episodes(rows, 0, 4, FixedGenerator(), environment, None, SamplingParams(), max_turns=1)
    assert [e.reward for e in episodes] == [None, None, 0.25, None]
    assert episodes[0].error == "RawRewards: the reward returned 1e+308, outside float32's range (|reward| <= 3.403e+38) used in training"
    assert episodes[1].error.startswith("RawRewards: the reward component 'b' returned -1e+39, outside float32's range")
    assert "returned nan" in episodes[3].error
    counts = RewardErrorBudget(max_error_fraction=1.0).record([e.error for e in episodes])
    assert (counts.step_errors, counts.step_samples) == (3, 4)
    batch = to_batch(episodes, pad_token_id=0, weights={}, overlong_filtering=False, penalties=[0.0] * 4)
    assert batch.valid.tolist() == [False, False, True, False]
    assert batch.rewards.tolist() == [0.0, 0.0, 0.25, 0.0] and torch.isfinite(batch.rewards).all()
    assert batch.loss_mask[[0, 1, 3]].sum() == 0


# --- row 8: workers never outlive the training process ----------------------------------------------------


TRAINER = textwrap.dedent("""
    import signal
    import sys
    from posttrain.envs.python_reward import PythonRewardEnvironment

    # Ctrl-C's behaviour even when this test runs in a background job, whose children inherit SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    functions, pid_dir = sys.argv[1], sys.argv[2]
    with PythonRewardEnvironment(functions, timeout_s=300, num_workers=2) as env:
        env.step([[{"role": "assistant", "content": c}] for c in "ab"], [{"pid_dir": pid_dir}] * 2)
""")


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGKILL, signal.SIGINT], ids=["SIGTERM", "SIGKILL", "SIGINT"])
def test_workers_and_their_children_die_with_the_training_process(tmp_path, signal_number):
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, f"{FNS_FILE}:hangs_after_starting_children", str(tmp_path)])
    try:
        records = recorded_pids(tmp_path, count=2)
        pids = [pid for record in records for pid in record]
        assert all(alive(pid) for pid in pids)
        trainer.send_signal(signal_number)
        trainer.wait(timeout=30)
        assert wait_until_gone(pids) == [], "worker, supervisor, child or grandchild outlived the training process"
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()


# --- row 9: output, memory, and processes that leave the session -----------------------------------------


def test_output_is_captured_capped_and_shown_only_in_the_failure(capfd):
    with PythonRewardEnvironment(f"{FNS_FILE}:floods_output", num_workers=1) as env:
        ok = env.step(logs("fine"), [{}])
        failed = env.step(logs("fail"), [{}])
    assert ok.rewards == [1.0] and ok.errors == [None]
    assert failed.rewards == [None]
    error = failed.errors[0]
    assert "ValueError: failed after a flood; its output (" in error
    assert "the last words of the call" in error and "Traceback" not in error
    total = int(error.split("its output (")[1].split(" bytes")[0])
    assert total > 6_000_000  # counted, but only the last OUTPUT_TAIL_BYTES kept
    assert len(error) < OUTPUT_TAIL_BYTES * 2 + 300
    console = capfd.readouterr()
    assert "xxxx" not in console.out + console.err and "yyyy" not in console.out + console.err
    assert len(console.out) + len(console.err) < 10_000


def test_memory_limit_fails_the_call_and_the_worker_keeps_serving():
    section = environment_section({"kind": "python", "options": {"functions": [f"{FNS_FILE}:allocates"],
                                                                  "num_workers": 1}, "worker_memory_mb": 256})
    with build_recipe_environment(section) as env:
        assert env._pool.memory_limit_mb == 256
        step = env.step(logs("1", "512", "1"), [{}] * 3)
        assert env._pool.workers_replaced == 0  # the MemoryError was the call's, not the worker's end
    assert step.rewards == [1.0, None, 1.0]
    assert "MemoryError" in step.errors[1] and "worker_memory_mb=256 MiB" in step.errors[1]
    assert RewardErrorBudget(max_error_fraction=1.0).record(step.errors).step_errors == 1
    with pytest.raises(ValueError, match="set environment.worker_memory_mb instead"):
        environment_section({"kind": "python", "options": {"functions": [f"{FNS_FILE}:allocates"],
                                                           "worker_memory_mb": 1}})


def test_timeout_kills_children_that_left_the_session(tmp_path):
    with PythonRewardEnvironment(f"{FNS_FILE}:hangs_after_starting_children", timeout_s=3.0, num_workers=1) as env:
        started = time.monotonic()
        step = env.step(logs("a"), [{"pid_dir": str(tmp_path)}])
        elapsed = time.monotonic() - started
        [(worker, supervisor, child, grandchild)] = recorded_pids(tmp_path, count=1)
        assert step.rewards == [None] and "timed out after 3 s (worker killed)" in step.errors[0]
        assert elapsed < 3.0 + 2.0, elapsed
        assert wait_until_gone([worker, supervisor, child, grandchild]) == []
        assert env._pool.workers_replaced == 1


# --- the code sandbox's unisolated fallback ----------------------------------------------------------------


def test_code_environment_refuses_the_unisolated_fallback_unless_allowed(monkeypatch):
    fallback = sandbox.SandboxInfo(namespaces=False, namespace_error="unshare: [Errno 1] Operation not permitted",
                                   audit_hook=True, python=sandbox._program_python(), bubblewrap=None)
    monkeypatch.setattr(sandbox, "sandbox_info", lambda: fallback)
    with pytest.raises(UnisolatedSandboxError) as refused:
        CodeEnvironment()
    message = str(refused.value)
    assert "namespace isolation does not work here (unshare: [Errno 1] Operation not permitted)" in message
    assert "not a security boundary" in message and "/etc/shadow" in message
    assert "environment.options.allow_unisolated_fallback=true" in message
    with pytest.warns(RuntimeWarning, match="without namespace isolation"):
        env = build_environment(CodeOptions(allow_unisolated_fallback=True))
    program = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    step = env.step(logs(program), [{"tests": [{"input": "1 2", "output": "3"}]}])
    assert step.rewards == [1.0] and step.errors == [None]
