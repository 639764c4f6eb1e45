"""Issue 34's table, tried as a hostile and careless user would: each row gives a clear message (no traceback) or the
correct behaviour. One test per row; the row number is in each test's first comment."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.config import ConfigError, load_config
from posttrain.config.schema import GenerateConfig
from posttrain.errors import RunError
from posttrain.models.errors import ModelNotFoundError


def _metrics(run: Path, records: list[str]) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in records))
    return run


def test_row6_max_new_tokens_past_the_context_is_refused_naming_both(capsys, tiny_model_dir):
    # Row 6: max_new_tokens=1000000000 was accepted (4.2 GB for a one-token answer; GRPO died allocating 32 GB).
    assert main(["generate", "--model", "posttrain/tiny", "--prompt", "1+1=", "--max-new-tokens", "1000000000"]) == 1
    error = capsys.readouterr().err
    assert "max_new_tokens=1,000,000,000 is more than the model's context of 512 positions" in error
    assert "Traceback" not in error
    assert main(["eval", "--model", "posttrain/tiny", "max_new_tokens=1000000000"]) == 1  # the built-in task
    assert "is more than the model's context of 512 positions" in capsys.readouterr().err
    # The context itself is allowed.
    from posttrain.generation.transformers_backend import check_fits_context

    class Config:
        max_position_embeddings = 512

    check_fits_context(Config(), 512)
    with pytest.raises(RunError, match="max_new_tokens=513 is more"):
        check_fits_context(Config(), 513)


def test_row6_grpo_refuses_a_rollout_past_the_context_before_training(tmp_path, tiny_model_dir):
    from rl_configs import DIGITS, TINY_RL

    from posttrain.algorithms.grpo import train_grpo
    from posttrain.config.schema import GRPOConfig

    cfg = load_config(GRPOConfig, None, [*TINY_RL, *DIGITS, "trainer.max_steps=2", f"output_dir={tmp_path / 'run'}",
                                         "rollout.max_new_tokens=1000000000"])
    with pytest.raises(RunError, match=r"max_new_tokens=1,000,000,000 is more than .* rollout.max_new_tokens"):
        train_grpo(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_row7_a_huge_line_is_refused_before_tokenization(tmp_path, tiny_model_dir):
    # Row 7: one 20 MB prompt line took 95 s and 4.2 GB of tokenization before its refusal.
    import time

    from posttrain.config.schema import DataConfig, ModelConfig
    from posttrain.data import DataError, load_sft_examples
    from posttrain.models.loading import load_tokenizer

    path = tmp_path / "huge.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n"
                    + json.dumps({"prompt": "x" * 20_000_000, "completion": "2"}) + "\n")
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))
    started = time.monotonic()
    with pytest.raises(DataError, match=r"huge.jsonl:2: field 'prompt': 20,000,000 characters, more than the "
                                        r"1,000,000 a field may hold \(MAX_FIELD_CHARS"):
        load_sft_examples([str(path)], tokenizer, DataConfig())
    examples, stats = load_sft_examples([str(path)], tokenizer, DataConfig(on_error="skip"))
    assert len(examples) == 1 and stats.rows_skipped == 1
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("written, shown", [("Infinity", "inf"), ("-Infinity", "-inf"), ("1e400", "inf")])
def test_row8_an_infinite_final_value_is_reported_as_it_is(tmp_path, written, shown):
    # Row 8: a final grad_norm of +inf, -inf or 1e400 showed as NaN in the report's "Final metrics".
    from posttrain.logging.report import write_report

    run = _metrics(tmp_path / "run", ['{"step": 1, "loss": 2.0, "grad_norm": 1.5}',
                                      f'{{"step": 2, "loss": 1.0, "grad_norm": {written}}}'])
    page = write_report([run], run / "report.html").read_text()
    final = page[page.index('<section id="final">'):]
    row = final[final.index("<td>grad_norm</td>"):]
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row[: row.index("</tr>")])
    assert cells[:3] == ["grad_norm", shown, "2"]


def test_row9_a_model_path_that_is_no_model_directory_names_what_it_is(tmp_path):
    # Row 9: eval/generate --model on a run directory, checkpoints/step_N, a source folder or a file gave a
    # tokenizer traceback.
    from posttrain.models.loading import resolve_model_path

    run = tmp_path / "run"
    for folder in (run / "final", run / "checkpoints" / "step_4" / "policy"):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("")
    cases = {run: f"posttrain run directory, whose model is {run / 'final'}",
             run / "checkpoints" / "step_4": f"posttrain checkpoint, whose model is {run / 'checkpoints/step_4/policy'}",
             tmp_path / "src": "is a folder without config.json", tmp_path / "src" / "train.py": "is a file"}
    for path, message in cases.items():
        with pytest.raises(ModelNotFoundError, match=message):
            resolve_model_path(str(path))
    assert resolve_model_path(str(run / "final")) == str(run / "final")


def test_row9_the_command_says_it_without_a_traceback(tmp_path, capsys):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 1
    error = capsys.readouterr().err
    assert f"whose model is {tmp_path / 'final'}" in error and "Traceback" not in error


def test_row10_an_unwritable_eval_output_is_refused_before_the_evaluation(tmp_path, capsys, monkeypatch):
    # Row 10: eval --output to a folder or an unwritable path failed after the whole evaluation ran.
    from posttrain.algorithms import evaluate

    def no_evaluation(*args, **kwargs):
        raise AssertionError("the evaluation ran")

    monkeypatch.setattr(evaluate, "load_tokenizer", no_evaluation)
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "a_file").write_text("")
    for output, message in ((tmp_path, "is a folder; give a file name"),
                            (tmp_path / "a_file" / "out.jsonl", "cannot be written")):
        assert main(["eval", "--model", "posttrain/tiny", "--data", str(data), "--output", str(output)]) == 1
        error = capsys.readouterr().err
        assert message in error and "Traceback" not in error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "p.jsonl"]  # nothing left behind


def test_row11_a_missing_reward_function_is_a_message(tmp_path, capsys):
    # Row 11: eval with a reward function that does not exist gave a traceback (with a good message inside).
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    code = main(["eval", "--model", "posttrain/tiny", "--data", str(data), "--environment", "python",
                 "environment.options={functions: ['no_such_module_xyz:fn']}"])
    error = capsys.readouterr().err
    assert code == 1 and "no module named 'no_such_module_xyz'" in error and "Traceback" not in error


def test_row12_a_step_that_is_no_number_is_a_message(tmp_path, capsys):
    # Row 12: `posttrain report` on a metrics line with "step": "abc" gave a TypeError traceback.
    run = _metrics(tmp_path / "run", ['{"step": 1, "loss": 2.0}', '{"step": "abc", "loss": 1.0}'])
    assert main(["report", str(run)]) == 1
    assert "metrics.jsonl:2: 'step' must be a whole number, got 'abc'" in capsys.readouterr().err


def test_row13_a_number_too_long_to_read_is_a_config_error():
    # Row 13: a 5000-digit integer override gave a raw PyYAML traceback.
    with pytest.raises(ConfigError, match="a number with more than 4,300 digits"):
        load_config(GenerateConfig, None, ["max_new_tokens=" + "9" * 5000])
    with pytest.raises(ConfigError, match="more than the 100,000 an override may have"):
        load_config(GenerateConfig, None, ["prompts=[" + "x" * 100_001 + "]"])


def test_row14_report_into_a_folder_writes_report_html_there_and_leaves_nothing_behind(tmp_path, capsys,
                                                                                      monkeypatch):
    # Row 14: `posttrain report RUN --output some_dir/` failed and left a stray out.tmp in the working directory.
    run = _metrics(tmp_path / "run", ['{"step": 1, "loss": 2.0}'])
    work = tmp_path / "work"
    (work / "some_dir").mkdir(parents=True)
    monkeypatch.chdir(work)
    assert main(["report", str(run), "--output", "some_dir/"]) == 0
    assert main(["report", str(run), "--output", "new_dir/"]) == 0
    assert sorted(str(p.relative_to(work)) for p in work.rglob("*")) == [
        "new_dir", "new_dir/report.html", "some_dir", "some_dir/report.html"]
    (work / "a_file").write_text("")
    assert main(["report", str(run), "--output", "a_file/report.html"]) == 1  # cannot be written: a message
    assert "posttrain report:" in capsys.readouterr().err
    assert not list(work.rglob("*.tmp")) and not list(Path.cwd().glob("*.tmp"))


def test_row15_overrides_after_an_option_are_overrides(tmp_path, capsys):
    # Row 15: `--nproc-per-node 2` after the key=value overrides gave "unrecognized arguments: output_dir=...".
    code = main(["sft", "model.name_or_path=posttrain/tiny", "--nproc-per-node", "1", "trainer.max_stepz=1",
                 f"output_dir={tmp_path / 'run'}"])
    error = capsys.readouterr().err
    assert code == 2 and "trainer.max_stepz: unknown key; did you mean trainer.max_steps?" in error
    assert "unrecognized arguments" not in error
    # An option that is neither the recipe's nor a config key is named, with the form config keys take.
    assert main(["sft", "a=1", "--nproc-per-node", "1", "--no-such-option", "b=2"]) == 2
    assert "unrecognized option --no-such-option: config keys are given as key=value" in capsys.readouterr().err


def test_row17_a_value_out_of_range_says_only_that_and_prompt_rows_count_no_targets():
    # Row 17: num_samples=0 read "expected int, got 0 (int): Input should be greater than 0"; eval's data line
    # said "(0 target tokens)".
    from posttrain.data.dataset import DataStats

    with pytest.raises(ConfigError) as caught:
        load_config(GenerateConfig, None, ["num_samples=0", "prompts=[a]"])
    assert "num_samples: got 0: Input should be greater than 0" in str(caught.value)
    assert "expected int" not in str(caught.value)
    assert "target tokens" not in DataStats(rows_read=3, examples=3).counts()
    assert "(7 target tokens)" in DataStats(rows_read=3, examples=3, target_tokens=7).counts()
