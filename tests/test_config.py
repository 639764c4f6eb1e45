from pathlib import Path

import pytest

from posttrain.config import ConfigError, SFTConfig, load_config, parse_overrides


def test_overrides_are_typed_and_nested():
    tree = parse_overrides(["trainer.max_steps=5", "trainer.learning_rate=1e-3", "data.train_files=[a.jsonl,b.jsonl]",
                            "trainer.max_grad_norm=null", "data.packing=true", "output_dir=runs/x"])
    assert tree == {"trainer": {"max_steps": 5, "learning_rate": 1e-3, "max_grad_norm": None},
                    "data": {"train_files": ["a.jsonl", "b.jsonl"], "packing": True}, "output_dir": "runs/x"}


def test_yaml_then_overrides(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  max_steps: 7\n  learning_rate: 1.0e-4\ndata:\n  train_files: [x.jsonl]\n")
    cfg = load_config(SFTConfig, path, ["trainer.max_steps=9"])
    assert cfg.trainer.max_steps == 9
    assert cfg.trainer.learning_rate == 1e-4
    assert cfg.data.train_files == ["x.jsonl"]
    assert cfg.trainer.micro_batch_size == 8  # schema default


def test_defaults_include(tmp_path: Path):
    (tmp_path / "base.yaml").write_text("seed: 3\ntrainer:\n  max_steps: 7\n  learning_rate: 0.5\ndata:\n  train_files: [x]\n")
    (tmp_path / "variant.yaml").write_text("defaults: [base.yaml]\ntrainer:\n  learning_rate: 0.25\n")
    cfg = load_config(SFTConfig, tmp_path / "variant.yaml")
    assert (cfg.seed, cfg.trainer.max_steps, cfg.trainer.learning_rate) == (3, 7, 0.25)


def test_unknown_key_names_path_and_suggests():
    with pytest.raises(ConfigError) as err:
        load_config(SFTConfig, None, ["data.train_files=[x]", "trainer.learning_rat=1e-3"])
    assert "trainer.learning_rat: unknown key; did you mean trainer.learning_rate?" in str(err.value)


def test_unknown_section_suggests():
    with pytest.raises(ConfigError) as err:
        load_config(SFTConfig, None, ["data.train_files=[x]", "trainr.max_steps=3"])
    assert "trainr: unknown key; did you mean trainer?" in str(err.value)


def test_wrong_type_names_path_and_expected_type():
    with pytest.raises(ConfigError) as err:
        load_config(SFTConfig, None, ["data.train_files=[x]", "trainer.max_steps=abc", "data.format=csv"])
    message = str(err.value)
    assert "2 invalid settings" in message
    assert "trainer.max_steps: expected int, got 'abc' (str)" in message
    assert "data.format: expected one of 'auto', 'text'" in message


def test_yaml_error_names_line(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text("trainer:\n  max_steps: 3\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:\d+: invalid YAML"):
        load_config(SFTConfig, path)


def test_missing_file_and_bad_override():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(SFTConfig, "/nonexistent/c.yaml")
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        load_config(SFTConfig, None, ["trainer.max_steps"])
    with pytest.raises(ConfigError, match=r"bad override 'data.train_files=\[a\[:3\]\]'.*quote values"):
        load_config(SFTConfig, None, ["data.train_files=[a[:3]]"])
    assert parse_overrides(["data.train_files=['a[:3]',b]"]) == {"data": {"train_files": ["a[:3]", "b"]}}


def test_cross_field_validation():
    with pytest.raises(ConfigError, match="data.train_files is empty"):
        load_config(SFTConfig, None, [])
    with pytest.raises(ConfigError, match="has no SFT target"):
        load_config(SFTConfig, None, ["data.train_files=[x]", "data.format=preference"])


def test_shipped_configs_validate():
    from posttrain.config import DistillConfig, DPOConfig, RMConfig
    from posttrain.config.schema import GRPOConfig, PPOConfig

    root = Path(__file__).resolve().parents[1] / "configs"
    shipped = sorted(root.glob("*.yaml"))
    assert len(shipped) >= 15
    schemas = {"sft": SFTConfig, "dpo": DPOConfig, "rm": RMConfig, "ppo": PPOConfig, "distill": DistillConfig}
    for path in shipped:
        # Every other preset is an online RL one (grpo, dapo, gspo, cispo, rloo, dr_grpo, gdpo).
        load_config(schemas.get(path.name.split("_")[0], GRPOConfig), path)


@pytest.mark.parametrize("override", [
    "loss.ratio_clip_low=true", "loss.kl_clamp=false", "loss.tis_lower_bound=true", "advantage.component_weights={a: true}",
    "rollout.temperature=true", "rollout.num_generations_per_prompt=true", "trainer.max_steps=true",
    "trainer.max_grad_norm=false",
])
def test_a_boolean_is_not_a_number_in_the_rl_sections(override):
    # pydantic's lax mode reads true as 1 and false as 0; here it is a config error naming the key.
    from posttrain.config.schema import GRPOConfig

    key = override.partition("=")[0]
    with pytest.raises(ConfigError, match=rf"{key}: expected a number.*boolean"):
        load_config(GRPOConfig, None, ["data.train_files=[x]", override])


def test_booleans_and_numbers_still_load_where_they_belong():
    from posttrain.config.schema import GRPOConfig

    cfg = load_config(GRPOConfig, None, ["data.train_files=[x]", "rollout.dynamic_sampling=true", "loss.ratio_clip_low=1",
                                         "loss.ratio_clip_c=3", "advantage.component_weights={a: 2}",
                                         "advantage.normalize_std=false", "trainer.max_grad_norm=null"])
    assert cfg.rollout.dynamic_sampling is True and cfg.loss.ratio_clip_low == 1.0
    assert cfg.advantage.component_weights == {"a": 2.0} and cfg.trainer.max_grad_norm is None
    # SFT's trainer section is the same class: a boolean step count is refused there too.
    with pytest.raises(ConfigError, match="trainer.max_steps: expected a number"):
        load_config(SFTConfig, None, ["data.train_files=[x]", "trainer.max_steps=true"])


@pytest.mark.parametrize("overrides, message", [
    (["loss.clip_mode=cispo", "loss.ratio_level=sequence", "loss.aggregation=seq-mean-token-mean"],
     "clip_mode='cispo' with ratio_level='sequence' is not defined"),
    (["loss.tis_lower_bound=0.5"], "tis_lower_bound applies to importance_correction 'tis' or 'seq-tis'"),
    (["loss.importance_correction=seq-tis", "loss.tis_lower_bound=3"], "tis_lower_bound .* below is_threshold_high"),
    (["loss.kl_output_clamp=0"], "loss.kl_output_clamp"),
])
def test_policy_loss_knobs_that_do_not_combine_fail_at_load(overrides, message):
    from posttrain.config.schema import GRPOConfig

    with pytest.raises(ConfigError, match=message):
        load_config(GRPOConfig, None, ["data.train_files=[x]", *overrides])
    cfg = load_config(GRPOConfig, None, ["data.train_files=[x]", "loss.importance_correction=seq-tis",
                                         "loss.tis_lower_bound=0.5", "loss.kl_output_clamp=10"])
    loss = cfg.loss
    assert (loss.importance_correction, loss.tis_lower_bound, loss.kl_output_clamp) == ("seq-tis", 0.5, 10.0)
