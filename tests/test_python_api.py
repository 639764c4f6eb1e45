"""The Python API (posttrain.api, docs/python-api.md): the command line's configs and runs from a function call, rows
in memory read as files are, one progress bar, and an `import posttrain` that loads no torch."""

from __future__ import annotations

import builtins
import json
import re
import runpy
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import transformers

import posttrain
from posttrain import api
from posttrain.cli import RECIPES, main
from posttrain.config import ConfigError, ModelConfig, SFTConfig, load_config
from posttrain.config.presets import preset_path
from posttrain.data.errors import DataError
from posttrain.data.loading import iter_records
from posttrain.logging import read_metrics
from posttrain.logging.progress import RichProgress, TqdmProgress, create_progress
from posttrain.models.loading import load_causal_lm

REPO = Path(__file__).resolve().parent.parent

TINY_RUN = """\
model: {name_or_path: posttrain/tiny}
data: {max_length: 32}
trainer: {max_steps: 4, micro_batch_size: 8, eval_every: 2, save_every: 0, learning_rate: 1.0e-3, warmup_steps: 0}
logging: {plot: false, report: false}
"""
"""Four steps of SFT on the embedded tiny model: a few seconds."""


def addition_rows(count: int, start: int = 0) -> list[dict[str, str]]:
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)][start:start + count]
    return [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a, b in pairs]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def losses(run_dir: Path, key: str = "loss") -> list[float]:
    return [record[key] for record in read_metrics(run_dir / "metrics.jsonl") if key in record]


# ---- import posttrain stays light ------------------------------------------------------------------------------


def test_import_posttrain_loads_no_torch_until_the_api_is_used():
    code = ("import sys, json; import posttrain; before = {m: m in sys.modules for m in ('torch', 'transformers', "
            "'datasets')}; posttrain.train; print(json.dumps([before, 'torch' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"}, check=True).stdout
    before, after = json.loads(out)
    assert before == {"torch": False, "transformers": False, "datasets": False}
    assert after is True  # the check sees torch once something does import it: it can fail
    assert {"train", "evaluate", "generate", "ConfigError", "DataError"} <= set(dir(posttrain))
    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        posttrain.trian


# ---- configs: the command line's, from any form -----------------------------------------------------------------


def test_every_training_recipe_of_the_cli_is_offered_with_its_schema():
    trained = {name: recipe.schema for name, recipe in RECIPES.items() if name not in ("eval", "generate",
                                                                                           "quickstart")}
    assert {name: trainer.schema for name, trainer in api.TRAINERS.items()} == trained


@pytest.mark.parametrize("recipe, preset", [
    ("sft", "sft_arithmetic.yaml"), ("dpo", "dpo_arithmetic.yaml"), ("rm", "rm_arithmetic.yaml"),
    ("grpo", "grpo_arithmetic.yaml"), ("ppo", "ppo_arithmetic.yaml"), ("distill", "distill_kd_arithmetic.yaml"),
])
def test_a_file_with_overrides_gives_the_clis_config(recipe, preset):
    path = preset_path(preset)
    cli = load_config(RECIPES[recipe].schema, path, ["trainer.max_steps=70", "seed=3", "output_dir=runs/x"])
    from_file, _ = api.resolve_config(api.TRAINERS[recipe].schema, path,
                                      {"trainer.max_steps": 70, "seed": 3, "output_dir": "runs/x"})
    assert from_file == cli
    assert from_file.trainer.max_steps == 70 and from_file.seed == 3  # the overrides did reach it


def test_yaml_text_a_dict_and_a_config_object_give_the_same_config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(TINY_RUN)
    cli = load_config(SFTConfig, path, ["data.train_files=[a.jsonl]", "trainer.max_steps=9"])
    overrides = {"data.train_files": ["a.jsonl"], "trainer.max_steps": 9}
    for config in (path, str(path), TINY_RUN, json.loads(json.dumps(cli.model_dump(exclude_unset=True))),
                   load_config(SFTConfig, path, ["data.train_files=[b.jsonl]"])):
        resolved, rows = api.resolve_config(SFTConfig, config, overrides)
        assert resolved == cli, type(config)
        assert rows == {}


def test_an_unknown_key_is_the_clis_error(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(TINY_RUN)
    assert main(["sft", "--config", str(path), "data.train_files=[a.jsonl]", "trainer.max_stepz=3"]) == 2
    cli_message = capsys.readouterr().err.split("\n", 1)[1].strip()  # after "posttrain sft: invalid config"
    with pytest.raises(ConfigError) as raised:
        posttrain.train("sft", path, train_data=["a.jsonl"], overrides={"trainer.max_stepz": 3})
    assert str(raised.value) == cli_message
    assert "trainer.max_stepz: unknown key; did you mean trainer.max_steps?" in cli_message


def test_bad_arguments_are_config_errors_naming_what(tmp_path):
    with pytest.raises(ConfigError, match="unknown recipe 'sfd': one of sft, dpo, rm, grpo, ppo, distill"):
        posttrain.train("sfd")
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        posttrain.train("sft", str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="config text:2: invalid YAML"):
        posttrain.train("sft", "trainer:\n\tmax_steps: 3\n")
    with pytest.raises(ConfigError, match="is a DPOConfig; this recipe takes a SFTConfig"):
        posttrain.train("sft", load_config(RECIPES["dpo"].schema, None, ["data.train_files=[a.jsonl]"]))
    with pytest.raises(ConfigError, match="data.train_files is set twice, by overrides and by the train_data"):
        posttrain.train("sft", None, overrides={"data.train_files": ["a.jsonl"]}, train_data=["b.jsonl"])
    with pytest.raises(ConfigError, match=r"data.train_files: expected list\[str\], got 'a.jsonl'"):
        posttrain.train("sft", {"data": {"train_files": "a.jsonl"}})  # as the command line refuses it
    with pytest.raises(ConfigError, match="bad override key 'trainer..max_steps'"):
        posttrain.train("sft", None, overrides={"trainer..max_steps": 3})
    with pytest.raises(ConfigError, match=r"^train_data: a DatasetDict \(splits train\); give one split of it, e.g. dataset\['train'\]$"):
        posttrain.train("sft", None, train_data=datasets.DatasetDict({"train": datasets.Dataset.from_list(
            addition_rows(2))}))


# ---- rows in memory ---------------------------------------------------------------------------------------------


def test_rows_in_memory_become_named_sources_wherever_a_config_takes_files():
    rows, more = addition_rows(3), datasets.Dataset.from_list(addition_rows(3, start=3))
    cfg, registered = api.resolve_config(RECIPES["grpo"].schema, {
        "data": {"train_files": ["posttrain/arithmetic", rows]},
        "evaluation": [{"name": "add", "every": 1, "data": {"files": more}}],
    }, data={"data.eval_files": ("eval_data", rows)})
    assert cfg.data.train_files == ["posttrain/arithmetic", "memory:data.train_files[1]"]
    assert cfg.data.eval_files == ["memory:eval_data"]
    assert cfg.evaluation[0].data.files == ["memory:evaluation[0].data.files"]
    assert registered == {"memory:data.train_files[1]": rows, "memory:eval_data": rows,
                          "memory:evaluation[0].data.files": more}


def test_in_memory_rows_are_read_and_validated_as_a_files_rows(tmp_path, capsys):
    rows = addition_rows(4) + [{"prompt": "1+1=", "completion": 2}]
    file = write_jsonl(tmp_path / "train.jsonl", rows)
    config = {"output_dir": str(tmp_path / "run"), "model": {"name_or_path": "posttrain/tiny"}}
    with pytest.raises(DataError) as from_file:
        posttrain.train("sft", config, train_data=str(file))
    with pytest.raises(DataError) as from_memory:
        posttrain.train("sft", config, train_data=rows)
    assert str(from_file.value) == f"{file}:5: field 'completion': expected a string, got int"
    assert str(from_memory.value) == "train_data[4]: field 'completion': expected a string, got int"

    with pytest.raises(DataError, match=r"^train_data\[1\]: expected a dict \(one row: column name -> value\), got "
                                        r"str$"):
        posttrain.train("sft", config, train_data=[rows[0], "2+2=4"])
    only_prompts = datasets.Dataset.from_list([{"prompt": "1+1="}, {"prompt": "2+2="}])
    with pytest.raises(DataError, match=r"^eval_data\[0\]: has a prompt but no completion"):
        posttrain.train("sft", config, train_data=rows[:4], eval_data=only_prompts)
    # Skipping, when asked for, counts in-memory rows as it counts a file's.
    skipped = tmp_path / "skip"
    result = posttrain.train("sft", {**config, "output_dir": str(skipped)}, train_data=rows, overrides={
        "data.on_error": "skip", "trainer.max_steps": 1, "trainer.micro_batch_size": 2, "logging.progress": "none"})
    assert result.steps == 1
    out = capsys.readouterr().out
    assert ("data: 5 rows read: 4 examples (12 target tokens), 1 skipped as malformed, 0 truncated, 0 dropped as "
            "overlong; first skipped:\n  train_data[4]: field 'completion': expected a string, got int"
            in out)


def test_an_in_memory_name_outside_its_call_says_what_it_was():
    with pytest.raises(DataError, match="memory:train_data: names rows held in memory by a posttrain.train"):
        list(iter_records("memory:train_data"))


# ---- runs: the command line's, step for step ---------------------------------------------------------------------


def test_a_run_from_python_with_rows_in_memory_equals_the_cli_run_on_files(tmp_path, tiny_model_dir, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(TINY_RUN)
    train_rows, eval_rows = addition_rows(64), addition_rows(16, start=100)
    train_file, eval_file = write_jsonl(tmp_path / "train.jsonl", train_rows), write_jsonl(tmp_path / "eval.jsonl",
                                                                                            eval_rows)
    assert main(["sft", "--config", str(config), f"data.train_files=[{train_file}]",
                 f"data.eval_files=[{eval_file}]", f"output_dir={tmp_path / 'cli'}"]) == 0

    result = posttrain.train("sft", config, train_data=train_rows, eval_data=datasets.Dataset.from_list(eval_rows),
                             overrides={"output_dir": tmp_path / "api"})

    cli_losses, api_losses = losses(tmp_path / "cli"), losses(tmp_path / "api")
    assert len(api_losses) == 4 and api_losses == cli_losses
    assert losses(tmp_path / "api", "eval_loss") == losses(tmp_path / "cli", "eval_loss") != []
    assert api_losses[-1] < api_losses[0]  # it trained: the loss went down over four steps
    assert (result.steps, result.final_loss) == (4, api_losses[-1])
    assert result.eval_loss == losses(tmp_path / "api", "eval_loss")[-1]
    assert result.final_dir == tmp_path / "api" / "final" and (result.final_dir / "config.json").is_file()


PROMPTS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 20) for b in range(10, 20)]
PAIRS = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
         for a in range(10, 20) for b in range(10, 20)]
TINY_RL = {"model.name_or_path": "posttrain/tiny", "data.max_length": 32, "rollout.prompts_per_step": 4,
           "rollout.num_generations_per_prompt": 2, "rollout.max_new_tokens": 4, "trainer.micro_batch_size": 8}


@pytest.mark.parametrize("recipe, rows, overrides", [
    ("dpo", PAIRS, {"model.name_or_path": "posttrain/tiny", "data.max_length": 32, "trainer.micro_batch_size": 4}),
    ("rm", PAIRS, {"model.name_or_path": "posttrain/tiny", "data.max_length": 32, "trainer.micro_batch_size": 4}),
    ("grpo", PROMPTS, TINY_RL),
])
def test_other_recipes_train_on_rows_in_memory(recipe, rows, overrides, tmp_path, tiny_model_dir):
    common = {"trainer.max_steps": 2, "trainer.save_every": 0, "logging.progress": "none", "logging.plot": False,
              "logging.report": False}
    result = posttrain.train(recipe, None, train_data=rows,
                             overrides={**overrides, **common, "output_dir": tmp_path / "run"})
    assert result.steps == 2 and (result.final_dir / "config.json").is_file()
    assert [record["step"] for record in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    bad = [*rows[:3], {**rows[3], "prompt": None}]
    with pytest.raises(DataError, match=r"^train_data\[3\]: field 'prompt'"):
        posttrain.train(recipe, None, train_data=bad, overrides={**overrides, **common,
                                                                 "output_dir": tmp_path / "bad"})


# ---- progress: one bar, the libraries' bars off -----------------------------------------------------------------


class ZMQInteractiveShell:
    """What IPython's get_ipython() returns inside a Jupyter kernel (rich and tqdm read its class name)."""


def test_auto_progress_is_tqdm_in_a_notebook_and_rich_on_a_terminal(monkeypatch):
    monkeypatch.setattr(builtins, "get_ipython", lambda: ZMQInteractiveShell(), raising=False)
    in_notebook = create_progress("auto", recipe="sft", total_steps=3)
    in_notebook.close()
    monkeypatch.delattr(builtins, "get_ipython")
    assert isinstance(in_notebook, TqdmProgress)
    forced = create_progress("rich", recipe="sft", total_steps=3)
    forced.close()
    assert isinstance(forced, RichProgress)


def test_the_tqdm_bar_counts_steps_from_a_resumed_step_and_shows_the_key_metrics(capfd):
    bar = TqdmProgress(recipe="dpo", total_steps=10, start_step=4)
    bar.update(5, {"loss": 0.693, "step_seconds": 2.0})
    bar.message("checkpoint saved")
    bar.close()
    out, err = capfd.readouterr()
    assert "dpo:  50%" in err and "5/10" in err and "loss 0.693" in err and "step_seconds" not in err
    assert out == "checkpoint saved\n"  # messages go to stdout, as the other displays print them


BAR_FRAME = re.compile(r"(?:^|[\r\n])([^\r\n:|]+): +\d+%\|")
"""The description of every tqdm frame ("sft:  50%|...", "Loading weights: 100%|...")."""


def test_a_run_shows_one_bar_and_no_library_bars(tmp_path, tiny_model_dir, capfd, monkeypatch):
    transformers.utils.logging.enable_progress_bar()  # as in a fresh notebook (the CLI's tests turn them off)
    load_causal_lm(ModelConfig())  # control: a library bar, as a run would show it without posttrain's care
    assert "Loading weights" in BAR_FRAME.findall(capfd.readouterr().err)

    monkeypatch.setattr(builtins, "get_ipython", lambda: ZMQInteractiveShell(), raising=False)
    result = posttrain.train("sft", TINY_RUN, train_data=addition_rows(64), overrides={
        "output_dir": tmp_path / "run", "trainer.eval_every": 0})
    captured = capfd.readouterr()
    assert set(BAR_FRAME.findall(captured.err)) == {"sft"}, captured.err
    assert "4/4" in captured.err.split("\r")[-1]
    assert "data: 64 rows read" in captured.err + captured.out  # the run's messages still show
    assert result.steps == 4
    assert transformers.utils.logging.is_progress_bar_enabled()  # the library's setting is back after the run


# ---- the example script -------------------------------------------------------------------------------------------


def test_the_example_script_runs_end_to_end(tmp_path, tiny_model_dir, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["python_api.py", "--steps", "3", "--held-out", "20", "--output-dir",
                                             "runs/example"])
    runpy.run_path(str(REPO / "examples" / "python_api.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert re.search(r"trained 3 steps: loss \d+\.\d+, held-out loss \d+\.\d+", out), out
    assert "12+30=" in out and re.search(r"held-out accuracy \d+\.\d% on 20 problems", out), out
    assert len(read_metrics(tmp_path / "runs" / "example" / "metrics.jsonl")) == 3
