import math
import threading
import time
from pathlib import Path

import pytest
import reward_fns_for_tests

from posttrain.envs.arithmetic_env import ArithmeticEnvironment
from posttrain.envs.base import EnvStep
from posttrain.envs.math import MathEnvironment
from posttrain.envs.python_reward import PythonRewardEnvironment
from posttrain.config import ConfigError, load_config
from posttrain.config.environments import MathOptions, PythonOptions, environment_section
from posttrain.config.schema import GRPOConfig
from posttrain.envs.registry import EnvironmentOptionError, build_environment
from posttrain.envs.rewards import (
    RewardError,
    RewardErrorBudget,
    RewardFunctionImportError,
    combine_components,
    load_function,
    score_in_process,
    validate_reward,
)

FNS = reward_fns_for_tests.__name__  # the module path as the tests' sys.path sees it
FNS_FILE = str(Path(reward_fns_for_tests.__file__))


def logs(*replies: str) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": reply}]
        for i, reply in enumerate(replies)
    ]


def assert_single_turn(step: EnvStep, n: int) -> None:
    assert step.done == [True] * n
    assert step.observations == [None] * n
    assert len(step.rewards) == len(step.errors) == len(step.metadata) == n


# --- arithmetic -------------------------------------------------------------------------------


def test_arithmetic_exact_match():
    step = ArithmeticEnvironment().step(logs("42", " 42\nbecause", "41", ""), [{"answer": "42"}] * 4)
    assert_single_turn(step, 4)
    assert step.rewards == [1.0, 1.0, 0.0, 0.0]
    assert step.errors == [None] * 4
    assert [m["correct"] for m in step.metadata] == [True, True, False, False]
    assert step.metadata[2] == {"answer": "42", "correct": False, "extracted_answer": "41"}


def test_arithmetic_rejects_missing_answer_and_logs_without_a_reply():
    with pytest.raises(ValueError, match=r"'answer' column, but row 1"):
        ArithmeticEnvironment().step(logs("1", "2"), [{"answer": "1"}, {"prompt": "1+1="}])
    with pytest.raises(ValueError, match="must end with the assistant's reply"):
        ArithmeticEnvironment().step([[{"role": "user", "content": "1+1="}]], [{"answer": "2"}])
    with pytest.raises(ValueError, match="2 message logs but 1 metadata"):
        ArithmeticEnvironment().step(logs("1", "2"), [{"answer": "1"}])


# --- math -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def math_env():
    with MathEnvironment(timeout_s=5.0, num_workers=1, reward_components=True) as env:
        yield env


def test_math_verify_equalities(math_env):
    replies = [
        r"So the result is \boxed{\frac{1}{2}}.",
        "The answer is 42",
        r"First 3, then 7, so \boxed{41}",
        "I do not know.",
        r"$x = 2$ but the final answer is \boxed{3}",
    ]
    golds = ["0.5", "42", "42", "42", "3"]
    step = math_env.step(logs(*replies), [{"answer": g} for g in golds])
    assert_single_turn(step, 5)
    assert step.errors == [None] * 5
    # Wrong or missing answers score 0 (they are wrong, not unscorable).
    assert [r["correct"] for r in step.rewards] == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert [r["format"] for r in step.rewards] == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert [m["correct"] for m in step.metadata] == [True, True, False, False, True]
    assert step.metadata[2]["extracted_answer"] == "41"


def test_math_latex_gold_and_unparseable_gold(math_env):
    golds = [{"answer": r"\frac{1}{2}"}, {"answer": r"$\sqrt{2}$"}, {"answer": ""}]
    step = math_env.step(logs("0.5", r"\boxed{\sqrt{2}}", "42"), golds)
    assert [r and r["correct"] for r in step.rewards[:2]] == [1.0, 1.0]
    assert step.rewards[2] is None
    assert "could not parse the gold answer" in step.errors[2]


def test_math_scalar_reward_with_format_weight_in_process():
    env = MathEnvironment(num_workers=0, format_weight=0.25)
    step = env.step(logs(r"\boxed{7}", "7", r"\boxed{8}"), [{"answer": "7"}] * 3)
    assert step.rewards == [1.25, 1.0, 0.25]
    assert env.reward_weights == {"correct": 1.0, "format": 0.25}
    assert combine_components({"correct": 1.0, "format": 1.0}, env.reward_weights) == 1.25


def test_math_in_process_refuses_worker_threads():
    env = MathEnvironment(num_workers=0)
    raised = []

    def score_in_a_thread():
        raised.append(pytest.raises(RuntimeError, env.step, logs("1"), [{"answer": "1"}]))

    thread = threading.Thread(target=score_in_a_thread)
    thread.start()
    thread.join()
    assert "main thread" in str(raised[0].value)


# --- python reward functions -----------------------------------------------------------------


@pytest.fixture(scope="module")
def exceptions_env():
    with PythonRewardEnvironment(f"{FNS}:raises_on_bad", timeout_s=2.0) as env:
        yield env


def test_python_reward_raising_is_masked_and_counted(exceptions_env):
    step = exceptions_env.step(logs("good", "bad", "good"), [{}] * 3)
    assert_single_turn(step, 3)
    assert step.rewards == [1.0, None, 1.0]
    assert step.errors[0] is None and step.errors[2] is None
    assert "ValueError: cannot score 'bad'" in step.errors[1] and "raises_on_bad" in step.errors[1]
    counts = RewardErrorBudget(max_error_fraction=0.5).record(step.errors)
    assert (counts.step_errors, counts.step_samples, counts.step_error_fraction) == (1, 3, pytest.approx(1 / 3))


def test_python_reward_timeout_kills_the_worker_and_later_calls_work():
    timeout_s = 0.5
    with PythonRewardEnvironment(f"{FNS}:sleeps_on_slow", timeout_s=timeout_s, num_workers=2) as env:
        env.step(logs("warm up"), [{}])  # start the workers outside the timed call
        start = time.monotonic()
        step = env.step(logs("a", "slow", "b", "c"), [{}] * 4)
        elapsed = time.monotonic() - start
        assert step.rewards == [1.0, None, 1.0, 1.0]
        assert "timed out after 0.5 s" in step.errors[1]
        assert elapsed < timeout_s + 1.0, elapsed
        assert env._pool.workers_replaced == 1
        start = time.monotonic()
        assert env.step(logs("a", "b", "c"), [{}] * 3).rewards == [1.0, 1.0, 1.0]
        assert time.monotonic() - start < 2.0


def test_python_reward_worker_crash_is_masked():
    with PythonRewardEnvironment(f"{FNS}:exits_process", num_workers=1) as env:
        step = env.step(logs("ok", "crash", "ok"), [{}] * 3)
        assert step.rewards == [1.0, None, 1.0]
        assert "exited with code 3" in step.errors[1]


def test_python_reward_unpicklable_value_is_masked():
    with PythonRewardEnvironment(f"{FNS}:returns_local_class_instance", num_workers=1) as env:
        step = env.step(logs("a"), [{}])
    assert step.rewards == [None] and "cannot be sent between processes" in step.errors[0]


def test_python_reward_nan_none_inf_and_wrong_types_are_masked():
    with PythonRewardEnvironment(f"{FNS}:nan_or_none", num_workers=0) as env:
        step = env.step(logs("nan", "none", "inf", "text", "fine"), [{}] * 5)
    assert step.rewards == [None, None, None, None, 0.5]
    assert "returned nan" in step.errors[0]
    assert "returned None" in step.errors[1]
    assert "returned inf" in step.errors[2]
    assert "returned str '1.0', expected a float" in step.errors[3]


@pytest.mark.parametrize("samples_per_call", [1, 3])
def test_python_reward_wrong_number_of_values_fails_the_whole_call(samples_per_call):
    with PythonRewardEnvironment(f"{FNS}:one_value_too_many", num_workers=1, samples_per_call=samples_per_call) as env:
        step = env.step(logs("a", "b", "c"), [{}] * 3)
    assert step.rewards == [None] * 3
    assert all(f"returned {samples_per_call + 1} values for {samples_per_call} completions" in e for e in step.errors)
    with pytest.raises(RewardError, match="3 of 3 samples"):
        RewardErrorBudget().record(step.errors)


def test_python_reward_single_value_is_not_broadcast():
    env = PythonRewardEnvironment(f"{FNS}:scalar_not_list", num_workers=0, samples_per_call=2)
    step = env.step(logs("a", "b"), [{}] * 2)
    assert step.rewards == [None, None]
    assert "returned float, expected a list of 2 values" in step.errors[0]


def test_several_functions_give_named_components():
    functions = [("exact", f"{FNS}:exact", 1.0), {"name": "length", "path": f"{FNS_FILE}:length", "weight": 0.5}]
    with PythonRewardEnvironment(functions, num_workers=2) as env:
        step = env.step(logs("4", "12"), [{"answer": "4"}, {"answer": "5"}])
        assert step.rewards == [{"exact": 1.0, "length": 1.0}, {"exact": 0.0, "length": 2.0}]
        assert env.reward_weights == {"exact": 1.0, "length": 0.5}
        assert step.metadata == [{"answer": "4"}, {"answer": "5"}]
    summed = PythonRewardEnvironment(functions, num_workers=0, reward_components=False)
    assert summed.step(logs("4", "12"), [{"answer": "4"}, {"answer": "5"}]).rewards == [1.5, 1.0]


def test_one_failing_function_masks_the_sample_of_a_combination():
    functions = [("length", f"{FNS}:length", 1.0), ("guard", f"{FNS}:raises_on_bad", 1.0)]
    step = PythonRewardEnvironment(functions, num_workers=0).step(logs("bad", "ok"), [{}] * 2)
    assert step.rewards == [None, {"length": 2.0, "guard": 1.0}]
    assert "'guard'" in step.errors[0] and "cannot score" in step.errors[0]


def test_functions_receive_only_the_columns_they_name(tmp_path):
    file = tmp_path / "strict.py"
    file.write_text("def f(completions, answer):\n    return [float(c == a) for c, a in zip(completions, answer)]\n")
    step = PythonRewardEnvironment(f"{file}:f", num_workers=0).step(logs("1", "2"), [{"answer": "1", "extra": 0}] * 2)
    assert step.rewards == [1.0, 0.0]


def test_import_path_errors(tmp_path):
    (tmp_path / "broken_import.py").write_text("import a_module_that_does_not_exist\n")
    (tmp_path / "syntax_error.py").write_text("def f(:\n")
    cases = {
        "no_colon_here": "must look like 'package.module:function'",
        "no_such_package_xyz.rewards:f": "no module named 'no_such_package_xyz'",
        f"{tmp_path}/missing.py:f": "does not exist",
        f"{FNS}:no_such_function": r"has no attribute .no_such_function. \(its public callables: .*exact",
        f"{FNS}:NOT_CALLABLE": "'NOT_CALLABLE' .* is a int, not a callable",
        f"{tmp_path}/syntax_error.py:f": "raised SyntaxError",
        f"{tmp_path}/broken_import.py:f": "raised ModuleNotFoundError: No module named 'a_module_that_does_not_exist'",
    }
    for path, message in cases.items():
        with pytest.raises(RewardFunctionImportError, match=message):
            load_function(path)
    with pytest.raises(RewardFunctionImportError, match="no module named 'no_such_package_xyz'"):
        PythonRewardEnvironment("no_such_package_xyz.rewards:f")


def test_module_found_but_its_imports_fail(tmp_path, monkeypatch):
    (tmp_path / "rewards_with_bad_import.py").write_text("import a_module_that_does_not_exist\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    message = "was found but importing it failed.*a_module_that_does_not_exist"
    with pytest.raises(RewardFunctionImportError, match=message):
        load_function("rewards_with_bad_import:f")


# --- helpers and the error budget --------------------------------------------------------------


def test_validate_reward():
    assert validate_reward(1) == (1.0, None)
    assert validate_reward(True) == (1.0, None)
    assert validate_reward({"a": 0.5, "b": 2}) == ({"a": 0.5, "b": 2.0}, None)
    assert validate_reward({"a": math.nan})[1] == "component 'a' returned nan, expected a finite float"
    assert validate_reward({})[0] is None
    assert validate_reward([1.0])[1].startswith("returned list")


def test_score_in_process_masks_exceptions():
    outcomes = score_in_process(lambda x: 1.0 / x, [{"x": 2}, {"x": 0}])
    assert outcomes[0].value == 0.5 and outcomes[0].error is None
    assert outcomes[1].value is None and outcomes[1].error.startswith("ZeroDivisionError")


def test_error_budget_raises_only_past_the_fraction():
    budget = RewardErrorBudget(max_error_fraction=0.5)
    counts = budget.record([None, "e1", "e2", None])  # exactly 0.5: tolerated
    assert (counts.step_errors, counts.run_errors, counts.run_samples) == (2, 2, 4)
    counts = budget.record([None] * 4)
    assert (counts.step_error_fraction, counts.run_error_fraction) == (0.0, 0.25)
    with pytest.raises(RewardError) as raised:
        budget.record(["timed out", "timed out", "ValueError: x", "KeyError: y", "TypeError: z"] + [None] * 3)
    message = str(raised.value)
    assert "5 of 8 samples" in message and "0.625 > max_error_fraction 0.5" in message
    assert "7 of 16 samples failed over the run" in message
    assert "[sample 0, 2×] timed out" in message and "KeyError: y" in message
    assert "TypeError: z" not in message and "1 other distinct errors" in message
    state = budget.state_dict()
    resumed = RewardErrorBudget(max_error_fraction=0.5)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == {"run_errors": 7, "run_samples": 16}
    with pytest.raises(RewardError):
        RewardErrorBudget(max_error_fraction=0.0).record([None, "e"])
    RewardErrorBudget(max_error_fraction=1.0).record(["e", "e"])


def test_build_environment():
    assert isinstance(build_environment(environment_section({"kind": "arithmetic"}).options), ArithmeticEnvironment)
    env = build_environment(PythonOptions(functions=[f"{FNS}:length"], num_workers=0))
    assert env.step(logs("abc"), [{}]).rewards == [3.0]
    assert build_environment(MathOptions(num_workers=0, timeout_s=2.0)).timeout_s == 2.0
    with pytest.raises(ValueError, match="environment kind must be one of arithmetic, code, cua, gdpval, hle, judge, "
                                         "math, mixture, python, reward_model"):
        environment_section({"kind": "chess"})
    with pytest.raises(ValueError, match="timeout_seconds"):
        MathOptions(timeout_seconds=3)
    with pytest.raises(ConfigError, match="environment.options.timeout_seconds: the math environment has no option "
                                          "'timeout_seconds' \\(did you mean timeout_s\\?\\); its options are"):
        load_config(GRPOConfig, None, ["data.train_files=[x]", "environment.kind=math",
                                       "environment.options.timeout_seconds=3"])
    with pytest.raises(EnvironmentOptionError, match="environment.options of the math environment: timeout_s"):
        build_environment(MathOptions(timeout_s=-1.0, num_workers=0))


def test_math_verify_timeout_masks_the_sample(math_env):
    start = time.monotonic()
    step = math_env.step(logs(r"\boxed{9^{9^{9^{9^{9}}}}}", r"\boxed{2}"), [{"answer": "1"}, {"answer": "2"}])
    assert step.rewards[0] is None and "math-verify took longer than" in step.errors[0]
    assert step.rewards[1] == {"correct": 1.0, "format": 1.0}
    assert time.monotonic() - start < math_env.timeout_s
