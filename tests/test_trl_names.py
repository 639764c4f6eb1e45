"""A TRL user's words: every posttrain key the TRL table names exists in that recipe's schema; the config error for
a TRL argument says which key to use (where the nearest spelling would be wrong); `--flag value` forms become
key=value or are answered with the key=value to type; trainer.num_epochs derives max_steps from the data;
docs/from-trl.md lists every name of the table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from posttrain import cli
from posttrain.algorithms.sft import train_sft
from posttrain.config import ConfigError, DPOConfig, RMConfig, SFTConfig, load_config
from posttrain.config.loader import tagged_members
from posttrain.config.schema import DistillConfig, GRPOConfig, PPOConfig
from posttrain.config.trl import TRAINING_RECIPES, TRL_NAMES
from posttrain.logging import read_metrics

SCHEMAS = {"sft": SFTConfig, "dpo": DPOConfig, "rm": RMConfig, "grpo": GRPOConfig, "ppo": PPOConfig,
           "distill": DistillConfig}
DOC = Path(__file__).resolve().parent.parent / "docs" / "from-trl.md"


def has_key(schema, dotted: str) -> bool:
    """Whether `dotted` is a key of `schema` (an environment's options: those of any of its kinds)."""
    annotation = schema
    for part in dotted.split("."):
        members = tagged_members(annotation)
        if members:
            if part == "kind":
                return True
            if part == "options":
                rest = dotted.split("options.", 1)[1]
                return any(has_key(m.model_fields["options"].annotation, rest) for m in members.values())
        fields = getattr(annotation, "model_fields", None)
        if fields is None:
            for arg in getattr(annotation, "__args__", ()):
                if hasattr(arg, "model_fields") and part in arg.model_fields:
                    fields = arg.model_fields
        if fields is None or part not in fields:
            return False
        annotation = fields[part].annotation
    return True


def test_every_key_the_table_names_exists_in_its_recipe():
    checked = 0
    for name, entry in TRL_NAMES.items():
        for recipe in TRAINING_RECIPES:
            key = entry.key_for(recipe)
            if key is None:
                assert entry.unsupported, f"{name}: no key for {recipe} and no reason"
                continue
            assert has_key(SCHEMAS[recipe], key.split("=")[0]), f"{name} -> {key} is no key of {recipe}"
            checked += 1
    assert checked > 150
    assert not has_key(SFTConfig, "trainer.no_such_key")  # the check itself can fail


def problems(schema, *overrides: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(schema, None, ["data.train_files=[a.jsonl]", *overrides])
    return str(caught.value)


def test_trl_names_in_a_config_name_the_posttrain_key():
    text = problems(SFTConfig, "per_device_train_batch_size=4", "save_steps=10", "num_train_epochs=3", "bf16=true",
                    "warmup_ratio=0.1", "report_to=wandb", "trainer.logging_steps=5", "max_seq_length=512")
    assert ("per_device_train_batch_size: unknown key; TRL's per_device_train_batch_size is "
            "trainer.micro_batch_size") in text
    assert "TRL's save_steps is trainer.save_every" in text
    assert "TRL's num_train_epochs is trainer.num_epochs" in text
    assert "TRL's bf16 is trainer.precision=bf16" in text
    assert "TRL's warmup_ratio is trainer.warmup_steps (a number of steps: warmup_ratio × trainer.max_steps)" in text
    assert "TRL's report_to is logging.wandb=true" in text
    assert "trainer.logging_steps: unknown key; TRL's logging_steps is trainer.log_every" in text
    assert "TRL's max_seq_length is data.max_length" in text
    # The nearest spellings the loader used to suggest, both wrong:
    assert "did you mean trainer.eval_batch_size" not in text and "did you mean max_steps" not in text
    # A typo that is no TRL name keeps its did-you-mean.
    assert "did you mean trainer.learning_rate?" in problems(SFTConfig, "trainer.learning_rat=1")


def test_the_key_of_a_trl_name_depends_on_the_recipe():
    assert "TRL's beta is loss.beta" in problems(DPOConfig, "beta=0.1")
    assert "TRL's beta is loss.reference_kl_penalty" in problems(GRPOConfig, "beta=0.04")
    assert "TRL's beta is not supported, because only dpo has a β" in problems(SFTConfig, "beta=0.1")
    assert "TRL's num_generations is rollout.num_generations_per_prompt" in problems(GRPOConfig, "num_generations=8")
    assert "TRL's loss_type is loss.aggregation" in problems(GRPOConfig, "loss_type=dr_grpo")
    assert "TRL's center_rewards_coefficient is loss.center_rewards_coefficient" in problems(
        RMConfig, "center_rewards_coefficient=0.01")
    assert "TRL's num_train_epochs is not supported, because an RL step" in problems(GRPOConfig, "num_train_epochs=1")


def test_trl_flags_on_the_command_line_are_answered_with_the_key_to_type(capsys):
    assert cli.main(["sft", "--per_device_train_batch_size", "4"]) == 2
    assert "TRL's per_device_train_batch_size is trainer.micro_batch_size; type trainer.micro_batch_size=4" in (
        capsys.readouterr().err.replace(" (examples per forward/backward pass; examples per optimizer step = "
                                        "micro_batch_size × gradient_accumulation_steps)", ""))
    assert cli.main(["sft", "--bf16"]) == 2
    assert "type trainer.precision=bf16" in capsys.readouterr().err
    assert cli.main(["sft", "--num-train-epochs=3"]) == 2
    assert "type trainer.num_epochs=3" in capsys.readouterr().err
    assert cli.main(["sft", "--no-such-thing", "1"]) == 2
    assert "unrecognized option --no-such-thing: config keys are given as key=value" in capsys.readouterr().err


def test_flags_that_are_config_keys_become_overrides(capsys):
    options = {"--config": True, "--json": False, "--prompt": True}
    recipe = cli.RECIPES["generate"]
    argv = ["--prompt", "--odd prompt", "--max-new-tokens", "3", "--json", "--system_prompt=be brief", "seed=1"]
    assert cli.flags_as_overrides(recipe, options, argv) == (
        ["--prompt", "--odd prompt", "max_new_tokens=3", "--json", "system_prompt=be brief", "seed=1"], None)
    assert cli.flags_as_overrides(cli.RECIPES["sft"], {}, ["--trainer.max_steps=5", "--seed", "-1"]) == (
        ["trainer.max_steps=5", "seed=-1"], None)
    # eval --num-samples 4 reaches the config (whose error is about what is missing), not argparse.
    assert cli.main(["eval", "--num-samples", "4"]) == 2
    err = capsys.readouterr().err
    assert "num_samples: set for an evaluation on data.files" in err and "unrecognized" not in err


def test_num_epochs_is_validated_at_load():
    assert "trainer.num_epochs=2 and trainer.max_steps=10 both say how long to train" in problems(
        SFTConfig, "trainer.num_epochs=2", "trainer.max_steps=10")
    assert "trainer.num_epochs does not apply to GRPO" in problems(GRPOConfig, "trainer.num_epochs=2")


def test_num_epochs_derives_max_steps_from_the_training_set(tmp_path, tiny_model_dir, capsys):
    args = ["data.train_files=['posttrain/arithmetic[:36]']", "data.max_length=32", "trainer.micro_batch_size=4",
            "trainer.gradient_accumulation_steps=2", "trainer.num_epochs=2", "logging.progress=plain",
            "logging.plot=false", "logging.report=false", f"output_dir={tmp_path}"]
    result = train_sft(load_config(SFTConfig, None, args))
    assert result.steps == 9  # ceil(2 × 36 / 8)
    assert read_metrics(tmp_path / "metrics.jsonl")[-1]["step"] == 9
    assert "trainer.num_epochs=2: 9 steps" in capsys.readouterr().out
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["trainer"]["num_epochs"] == 2 and "max_steps" not in saved["trainer"]
    load_config(SFTConfig, tmp_path / "config.yaml")  # the recorded config loads again


def test_from_trl_doc_lists_every_name_of_the_table():
    text = DOC.read_text()
    listed = set(re.findall(r"^\| `(\w+)` \|", text, flags=re.M))
    assert listed == set(TRL_NAMES)
