import json
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.cli import main


def test_top_level_help_lists_recipes_and_common_keys(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for recipe in ("sft", "eval", "quickstart"):
        assert recipe in out
    for key in ("output_dir", "seed", "trainer.max_steps", "trainer.learning_rate", "trainer.micro_batch_size",
                "trainer.gradient_accumulation_steps", "trainer.save_every", "trainer.keep_last", "trainer.eval_every",
                "model.name_or_path", "data.train_files", "data.eval_files"):
        assert f"  {key}  " in out, key
    assert "Peak learning rate of AdamW." in out


def test_recipe_help_lists_every_field_with_default_and_doc(capsys):
    with pytest.raises(SystemExit):
        main(["sft", "--help"])
    out = capsys.readouterr().out
    assert "  trainer.learning_rate  float = 2e-05" in out
    assert "  data.packing  bool = false" in out
    assert "Pack each micro-batch's examples" in out
    assert "  logging.tensorboard  bool = false" in out


def test_quickstart_help_shows_preset_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["quickstart", "--help"])
    out = capsys.readouterr().out
    assert '  sft.data.train_files  list[str] = ["posttrain/arithmetic:train[:500]"]' in out
    assert "  grpo.rollout.num_generations_per_prompt  int = 8" in out


def test_invalid_config_exits_2_with_key_path(capsys):
    assert main(["sft", "data.train_files=[x.jsonl]", "trainer.lerning_rate=1"]) == 2
    err = capsys.readouterr().err
    assert "trainer.lerning_rate: unknown key; did you mean trainer.learning_rate?" in err


def test_bad_data_exits_1_naming_file_and_line(tmp_path: Path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": "2+2=", "completion": 4}\n')
    assert main(["sft", f"data.train_files=[{data}]", f"output_dir={tmp_path / 'run'}"]) == 1
    err = capsys.readouterr().err
    assert "train.jsonl:2" in err and "completion" in err
    assert not (tmp_path / "run" / "final").exists()


def test_eval_json_on_base_model(tiny_model_dir):
    result = subprocess.run([sys.executable, "-m", "posttrain.cli", "eval", "--model", str(tiny_model_dir),
                             "--task", "arithmetic", "--json", "num_examples=20"],
                            check=True, capture_output=True, text=True)
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert payload["task"] == "arithmetic" and payload["num_examples"] == 20
    assert payload["accuracy"] == 0.0  # an untrained model does not add


def test_missing_model_directory_is_a_clear_error(tmp_path: Path, capsys):
    assert main(["eval", "--model", str(tmp_path / "runs" / "nope" / "final"), "--task", "arithmetic"]) == 1
    assert "model not found" in capsys.readouterr().err
