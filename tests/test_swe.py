"""SWE-style repository tasks: the bundled tasks' gold patches resolve them; empty patches, patches that break a
PASS_TO_PASS test, edit the tests or print fake PASSED lines do not; the checkout hides history past base_commit;
agent commands cannot reach the network or leave the checkout; an episode that applies the gold edit through
str_replace earns 1 and one that does nothing 0, in a GRPO step too; task and prediction files fail naming the line
and field."""

import json
import shutil
import threading
from pathlib import Path

import pytest

from posttrain.algorithms import grpo as grpo_module
from posttrain.algorithms.environments import build_recipe_environment
from posttrain.algorithms.grpo import train_grpo
from posttrain.algorithms.rollout import PromptRow, run_episodes
from posttrain.cli import main
from posttrain.config import load_config
from posttrain.config.schema import GRPOConfig
from posttrain.data.tokenize import tokenize_prompt
from posttrain.envs import sandbox
from posttrain.envs.swe.bundled import SPECS, ensure_bundled_tasks
from posttrain.envs.swe.environment import SweEnvironment, prompt_rows, swe_prompt
from posttrain.envs.swe.scoring import git, make_checkout, score_patch
from posttrain.envs.swe.tasks import SweTaskError, load_predictions, load_tasks
from posttrain.envs.tools import ToolCall, ToolContext, parser_of
from posttrain.generation.base import Completion, GenerationOutput, SamplingParams
from posttrain.logging import read_metrics
from posttrain.models.tiny import build_tokenizer
from forced_tool_calls import FirstTurnForced
from rl_configs import TINY_RL
from tool_templates import QWEN25

pytestmark = pytest.mark.skipif(not sandbox.sandbox_info().namespaces,
                                reason="SWE tests run only inside the sandbox's namespaces")


@pytest.fixture(scope="module")
def tasks():
    return {task.instance_id: task for task in load_tasks(ensure_bundled_tasks())}


def edited_patch(task, tmp_path, edits):
    """The diff that `edits` ({path: (old, new)} or {path: new content}) make to a checkout of the task."""
    checkout = tmp_path / "edit"
    make_checkout(task.repo_path, task.base_commit, checkout)
    for path, edit in edits.items():
        target = checkout / path
        if isinstance(edit, tuple):
            text = target.read_text()
            assert edit[0] in text, edit[0]
            target.write_text(text.replace(*edit))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(edit)
    git(["add", "-A"], checkout)
    patch = git(["diff", "--cached", "HEAD"], checkout).stdout.decode()
    shutil.rmtree(checkout)
    assert patch
    return patch


def test_the_gold_patch_resolves_every_bundled_task(tasks):
    assert len(tasks) == len(SPECS) == 5
    for task in tasks.values():
        result = score_patch(task, task.patch)
        assert result.status == "resolved" and result.reward == 1.0, (task.instance_id, result)
        assert set(result.fail_to_pass.values()) == {"passed"} and set(result.pass_to_pass.values()) == {"passed"}
        assert result.reset_paths == ()


def test_the_bundled_tasks_fail_without_a_fix_and_build_the_same_commits(tasks, tmp_path, monkeypatch):
    clamp = tasks["posttrain__clamp-1"]
    # Only the test patch: the FAIL_TO_PASS test fails (it is a real test), the PASS_TO_PASS ones pass.
    result = score_patch(clamp, "diff --git a/README b/README\nnew file mode 100644\n--- /dev/null\n+++ b/README\n"
                         "@@ -0,0 +1 @@\n+notes\n")
    assert result.status == "unresolved"
    assert result.fail_to_pass == {"tests/test_clamp.py::test_above": "failed"}
    assert set(result.pass_to_pass.values()) == {"passed"}
    monkeypatch.setenv("POSTTRAIN_CACHE_DIR", str(tmp_path))
    again = {task.instance_id: task.base_commit for task in load_tasks(ensure_bundled_tasks())}
    assert again == {task.instance_id: task.base_commit for task in tasks.values()}


def test_an_empty_patch_scores_0(tasks):
    for patch in ("", "  \n"):
        result = score_patch(tasks["posttrain__clamp-1"], patch)
        assert result.status == "empty_patch" and result.reward == 0.0


def test_a_patch_that_breaks_a_pass_to_pass_test_scores_0(tasks, tmp_path):
    task = tasks["posttrain__clamp-1"]
    # Fixes values above the range (FAIL_TO_PASS passes) but drops the lower bound (test_below breaks).
    patch = edited_patch(task, tmp_path, {"numbers_util.py": (
        "    if value < low:\n        return low\n", "    if value > high:\n        return high\n")})
    result = score_patch(task, patch)
    assert result.fail_to_pass == {"tests/test_clamp.py::test_above": "passed"}
    assert result.pass_to_pass["tests/test_clamp.py::test_below"] == "failed"
    assert result.status == "unresolved" and result.reward == 0.0


def test_a_patch_that_edits_the_tests_scores_0(tasks, tmp_path):
    task = tasks["posttrain__clamp-1"]
    rewritten = "def test_above():\n    pass\n\n\ndef test_inside():\n    pass\n\n\ndef test_below():\n    pass\n"
    # A hook that marks every test passed: it works where pytest loads it (checked once by hand with the reset off).
    cheat_conftest = ("import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\n"
                      "def pytest_runtest_makereport(item, call):\n"
                      "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n")
    for edits in ({"tests/test_clamp.py": rewritten}, {"conftest.py": cheat_conftest},
                  {"tests/conftest.py": cheat_conftest, "pytest.ini": "[pytest]\naddopts = -p no:python\n"}):
        result = score_patch(task, edited_patch(task, tmp_path, edits))
        assert set(result.reset_paths) == set(edits), result
        assert result.fail_to_pass == {"tests/test_clamp.py::test_above": "failed"}, (edits, result)
        assert result.status == "unresolved" and result.reward == 0.0


def test_a_patch_that_prints_fake_passed_lines_scores_0(tasks, tmp_path):
    task = tasks["posttrain__clamp-1"]
    fake = ("import sys\nfor test in ('test_above', 'test_inside', 'test_below'):\n"
            "    print(f'tests/test_clamp.py::{test} PASSED')\nprint('=== 3 passed in 0.01s ===')\n")
    printing = edited_patch(task, tmp_path, {"numbers_util.py": ("def clamp", fake + "\n\ndef clamp")})
    result = score_patch(task, printing)
    assert result.fail_to_pass == {"tests/test_clamp.py::test_above": "failed"} and result.reward == 0.0
    # ... and one that prints them and exits before pytest can report anything
    exiting = edited_patch(task, tmp_path, {"numbers_util.py": ("def clamp", fake + "import os\nos._exit(0)\n\n\n"
                                                                "def clamp")})
    result = score_patch(task, exiting)
    assert result.fail_to_pass == {"tests/test_clamp.py::test_above": "missing"} and result.reward == 0.0
    assert "wrote no report" in result.error


def test_a_patch_that_hangs_the_tests_is_stopped_at_the_deadline_and_scores_0(tasks, tmp_path):
    task = tasks["posttrain__clamp-1"]
    hanging = edited_patch(task, tmp_path, {"numbers_util.py": ("def clamp", "while True:\n    pass\n\n\ndef clamp")})
    result = score_patch(task, hanging, test_timeout_s=2.0)
    assert result.status == "unresolved" and result.reward == 0.0
    assert result.error == "pytest wrote no report: the test run timed out" and result.seconds < 15


def test_a_patch_that_does_not_apply_is_an_error(tasks):
    result = score_patch(tasks["posttrain__clamp-1"], "diff --git a/nope.py b/nope.py\n--- a/nope.py\n+++ b/nope.py\n"
                         "@@ -1 +1 @@\n-x\n+y\n")
    assert result.status == "error" and result.reward == 0.0 and not result.infrastructure_failure
    assert "does not apply" in result.error


def test_the_checkout_has_no_history_past_base_commit(tasks, tmp_path):
    task = tasks["posttrain__clamp-1"]
    fix_commit = git(["rev-parse", "main"], task.repo_path).stdout.decode().strip()
    assert fix_commit != task.base_commit  # the source repository holds the fix ...
    checkout = tmp_path / "checkout"
    make_checkout(task.repo_path, task.base_commit, checkout)
    assert git(["rev-list", "--all", "--count"], checkout).stdout.decode().strip() == "1"  # ... the checkout does not
    assert git(["cat-file", "-e", fix_commit], checkout).returncode != 0
    assert git(["cat-file", "-e", task.base_commit], checkout).returncode != 0
    assert "return high" not in (checkout / "numbers_util.py").read_text()


def test_the_sandbox_binds_host_folders_writable_or_read_only(tmp_path):
    writable, readable = tmp_path / "writable", tmp_path / "readable"
    writable.mkdir()
    readable.mkdir()
    (readable / "data.txt").write_text("read me")
    sandbox.give_to_sandbox(str(writable))
    program = (f"open({str(writable / 'out.txt')!r}, 'w').write(open({str(readable / 'data.txt')!r}).read())\n"
               f"try:\n    open({str(readable / 'new.txt')!r}, 'w')\nexcept OSError as error:\n"
               "    print(type(error).__name__, error.errno)\n")
    result = sandbox.run_sandboxed(program, time_limit_s=10, memory_limit_mb=256, output_limit_bytes=1000,
                                   audit_hook=False, writable_dirs=(str(writable),), readable_dirs=(str(readable),))
    assert result.succeeded, result.stderr
    assert result.stdout == "OSError 30\n"  # EROFS: the read-only folder
    assert (writable / "out.txt").read_text() == "read me" and not (readable / "new.txt").exists()
    with pytest.raises(ValueError, match="writable_dirs needs audit_hook=False"):
        sandbox.run_sandboxed("", time_limit_s=1, memory_limit_mb=64, output_limit_bytes=10,
                              writable_dirs=(str(writable),))
    with pytest.raises(ValueError, match="existing absolute path"):
        sandbox.run_sandboxed("", time_limit_s=1, memory_limit_mb=64, output_limit_bytes=10, audit_hook=False,
                              writable_dirs=("relative",))


def tool(environment, name):
    return environment._tools.tools[name]


def test_agent_commands_cannot_reach_the_network_or_leave_the_checkout(tasks, tmp_path):
    environment = SweEnvironment(list(tasks.values()))
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    try:
        checkout = Path(environment._with_checkout({"instance_id": "posttrain__clamp-1"}, 0)["tool_workdir"])
        context = ToolContext(workdir=checkout)
        bash = tool(environment, "bash")
        answer = bash.run({"command": "python -c \"import socket; socket.create_connection(('1.1.1.1', 80), "
                                      "timeout=3)\" 2>&1 | tail -1; (exec 3<>/dev/tcp/127.0.0.1/22) 2>&1 | tail -1"},
                          context)
        assert "Network is unreachable" in answer and "Connected" not in answer, answer
        answer = bash.run({"command": f"cat {secret}; echo escaped > {tmp_path}/written; echo x > /tmp/x; "
                                      "ls /root /home; cat ../../../etc/hostname; echo done"}, context)
        assert "host secret" not in answer and "\ndone\n" in answer, answer
        assert not (tmp_path / "written").exists()
        assert "Read-only file system" in answer or "No such file" in answer
        answer = bash.run({"command": "echo inside > made.txt && cat made.txt"}, context)
        assert answer == "exit code 0\ninside\n" and (checkout / "made.txt").read_text() == "inside\n"
        with pytest.raises(Exception, match="outside the repository checkout"):
            tool(environment, "view").run({"path": "../../../etc/passwd"}, context)
        (checkout / "link.txt").symlink_to(secret)
        for name, arguments in (("view", {"path": "link.txt"}),
                                ("str_replace", {"path": "link.txt", "old_str": "host", "new_str": "x"})):
            with pytest.raises(Exception, match="outside the repository checkout"):
                tool(environment, name).run(arguments, context)
        assert secret.read_text() == "host secret"
    finally:
        environment.close()


class ScriptedGenerator:
    """Replies from a list per turn (the same for every episode); turn counts assistant turns in the prompt."""

    weights_version = 0

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.lock = tokenizer, replies, threading.Lock()

    def generate(self, prompts, params, num_samples=1):
        completions = []
        for prompt in prompts:
            turn = self.tokenizer.decode(prompt).count("<|im_start|>assistant")
            text = self.replies[min(turn, len(self.replies)) - 1]
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [
                self.tokenizer.convert_tokens_to_ids("<|im_end|>")]
            completions.append([Completion(prompt, ids, [-0.5] * len(ids), text, "stop")] * num_samples)
        return GenerationOutput(completions, num_generated_tokens=sum(len(c[0].token_ids) for c in completions))

    def update_weights(self, version, weights):
        return 0


def test_an_episode_applying_the_gold_edit_through_str_replace_earns_1_and_a_do_nothing_episode_0(tasks):
    tokenizer = build_tokenizer()
    tokenizer.chat_template = QWEN25
    task = tasks["posttrain__clamp-1"]
    hermes = parser_of("hermes")
    view = hermes.render([ToolCall("view", {"path": "numbers_util.py"})])
    edit = hermes.render([ToolCall("str_replace", {"path": "numbers_util.py", "old_str": "        return low\n",
                                                   "new_str": "        return low\n    if value > high:\n"
                                                              "        return high\n"})])
    environment = build_recipe_environment({"kind": "swe", "options": {"tool_call_format": "hermes"}})
    try:
        question = [{"role": "user", "content": swe_prompt(task)}]
        prompt = PromptRow(question, tokenize_prompt(question, tokenizer, environment.tool_use.tools),
                           {"instance_id": task.instance_id})
        rewards = {}
        for name, replies in (("gold", [view, edit, "Done."]), ("nothing", ["I cannot fix it."]),
                              ("looks only", [view, "Done."])):
            episodes, _ = run_episodes([prompt], 0, 1, ScriptedGenerator(tokenizer, replies), environment,
                                       tokenizer, SamplingParams(max_new_tokens=400), max_turns=4)
            (episode,) = episodes
            assert episode.done and episode.error is None, episode.error
            rewards[name] = episode.reward
            if name == "gold":
                assert episode.metadata["tool_calls"] == 2 and episode.metadata["tool_errors"] == 0
                assert episode.metadata["swe_status"] == "resolved" and episode.metadata["correct"]
                assert "return value" in episode.messages[2]["content"]  # view's answer: the file's lines
        assert rewards == {"gold": 1.0, "nothing": 0.0, "looks only": 0.0}
    finally:
        environment.close()


# ---- files ---------------------------------------------------------------------------------------------------

def write_rows(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def test_task_files_load_lists_or_json_strings_and_fail_naming_line_and_field(tasks, tmp_path):
    row = tasks["posttrain__clamp-1"].as_row()
    repos = tasks["posttrain__clamp-1"].repo_path.parent
    listed = {**row, "instance_id": "listed", "FAIL_TO_PASS": ["tests/test_clamp.py::test_above"]}
    encoded = {**row, "instance_id": "encoded", "FAIL_TO_PASS": '["tests/test_clamp.py::test_above"]'}
    loaded = load_tasks(write_rows(tmp_path / "ok.jsonl", [listed, encoded]), repos)
    assert [task.fail_to_pass for task in loaded] == [("tests/test_clamp.py::test_above",)] * 2
    assert loaded[0].repo_path == tasks["posttrain__clamp-1"].repo_path
    bad_cases = [
        ({k: v for k, v in row.items() if k != "test_patch"}, "field 'test_patch'"),
        ({**row, "PASS_TO_PASS": "not json"}, "field 'PASS_TO_PASS' is a string but not a JSON list"),
        ({**row, "FAIL_TO_PASS": [1]}, "field 'FAIL_TO_PASS' must be a list of test ids"),
        ({**row, "test_command": "make test"}, "field 'test_command'"),
        ({**row, "repo": "someone/elsewhere"}, "no git repository for repo 'someone/elsewhere'"),
        ("{not json", "not a JSON object"),
    ]
    for bad, message in bad_cases:
        bad = bad if isinstance(bad, str) else {**bad, "instance_id": "second"}
        path = write_rows(tmp_path / "bad.jsonl", [row, bad])
        with pytest.raises(SweTaskError, match="bad.jsonl:2: ") as error:
            load_tasks(path, repos)
        assert message in str(error.value)
    with pytest.raises(SweTaskError, match="bad.jsonl:2: instance_id 'posttrain__clamp-1' repeats line 1"):
        load_tasks(write_rows(tmp_path / "bad.jsonl", [row, row]), repos)
    with pytest.raises(SweTaskError, match="preds.jsonl:1: field 'model_patch' must be a string"):
        load_predictions(write_rows(tmp_path / "preds.jsonl", [{"instance_id": "x", "model_patch": 3}]))


def test_swe_eval_writes_a_report_per_instance_and_names_an_unknown_instance(tasks, tmp_path, capsys):
    clamp, leap = tasks["posttrain__clamp-1"], tasks["posttrain__leap-1"]
    predictions = write_rows(tmp_path / "preds.jsonl", [
        {"instance_id": clamp.instance_id, "model_patch": clamp.patch, "model_name_or_path": "m"},
        {"instance_id": leap.instance_id, "model_patch": None, "model_name_or_path": "m"}])
    output = tmp_path / "out"
    assert main(["swe-eval", "--predictions", str(predictions), "--output", str(output)]) == 0
    report = json.loads((output / "report.json").read_text())
    assert report["total_instances"] == 5 and report["submitted_instances"] == 2
    assert report["resolved_ids"] == [clamp.instance_id] and report["empty_patch_ids"] == [leap.instance_id]
    assert report["unresolved_instances"] == 0 and report["error_instances"] == 0
    instance = json.loads((output / "instances" / f"{clamp.instance_id}.json").read_text())
    assert instance["status"] == "resolved" and instance["model_name_or_path"] == "m"
    assert instance["fail_to_pass"] == {"tests/test_clamp.py::test_above": "passed"}
    assert "2 of 5 instances submitted: 1 resolved, 0 unresolved, 0 error, 1 empty patch" in capsys.readouterr().out
    unknown = write_rows(tmp_path / "unknown.jsonl", [{"instance_id": "posttrain__clamp-2", "model_patch": "x"}])
    assert main(["swe-eval", "--predictions", str(unknown), "--output", str(output)]) == 1
    assert ("unknown.jsonl:1: instance_id 'posttrain__clamp-2' is not one of the 5 tasks; did you mean "
            "'posttrain__clamp-1'?") in capsys.readouterr().err


GOLD_EDIT = ToolCall("str_replace", {"path": "numbers_util.py", "old_str": "        return low\n",
                                     "new_str": "        return low\n    if value > high:\n        return high\n"})


def FirstTurnAppliesTheGoldEdit(inner, tokenizer) -> FirstTurnForced:
    """The policy's generator, except that a first turn is the clamp task's gold edit through str_replace; later
    turns are the model's own (the embedded model calls no tool, so its reply ends the episode)."""
    return FirstTurnForced(inner, tokenizer, lambda text: GOLD_EDIT)


@pytest.mark.slow  # about 30 s: the embedded model's step on 1,000-token prompts
def test_grpo_with_the_swe_environment_runs_a_step_and_rewards_the_gold_edit(tasks, tmp_path, tiny_model_dir,
                                                                             monkeypatch):
    prompts = write_rows(tmp_path / "prompts.jsonl", prompt_rows([tasks["posttrain__clamp-1"]]) * 2)
    policy_generator = grpo_module.policy_generator
    monkeypatch.setattr(grpo_module, "policy_generator", lambda cfg, tokenizer, policy, cluster=None:
                        FirstTurnAppliesTheGoldEdit(policy_generator(cfg, tokenizer, policy), tokenizer))
    cfg = load_config(GRPOConfig, None, [*TINY_RL, f"data.train_files=['{prompts}']", "environment.kind=swe",
                                         "environment.options={tool_call_format: hermes}", f"output_dir={tmp_path}/run",
                                         "trainer.max_steps=1", "trainer.save_every=0", "trainer.micro_batch_size=4",
                                         "rollout.max_turns=2", "rollout.max_new_tokens=4", "data.max_length=1024",
                                         "rollout.prompts_per_step=2", "rollout.num_generations_per_prompt=2"])
    with pytest.warns(RuntimeWarning, match="does not render tools"):  # the embedded ChatML template
        train_grpo(cfg)
    (record,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert record["reward/mean"] == 1.0 and record["tools/calls_mean"] == 1.0 and record["tools/errors_mean"] == 0.0
