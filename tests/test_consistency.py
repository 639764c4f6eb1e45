"""Small inconsistencies that each cost a user an afternoon: R-DPO with α = 0 (plain DPO) refused at load; a LoRA
run's announcement gives trainable and total parameters and the fraction; `--help` documents the keys of
`evaluation:` sets; `generate` and `eval` send a prompt to the model the same way by default. (The embedded chat
model ending its turns at <|im_end|> is tests/test_tiny_model.py's.)"""

from __future__ import annotations

import pytest
import torch

from posttrain.algorithms.common import announce_run
from posttrain.cli import main
from posttrain.config import ConfigError, DPOConfig, load_config
from posttrain.config.schema import GenerateConfig, LoraSection, ModelConfig, PromptSection
from posttrain.models.loading import load_trainable_model


def test_rdpo_with_alpha_zero_is_refused_naming_the_key():
    pairs = "data.train_files=['posttrain/arithmetic-preference[:8]']"
    with pytest.raises(ConfigError, match=r"loss.type='rdpo' with loss.rdpo_alpha=0 is plain DPO.*loss.rdpo_alpha"):
        load_config(DPOConfig, None, [pairs, "loss.type=rdpo"])
    assert load_config(DPOConfig, None, [pairs, "loss.type=rdpo", "loss.rdpo_alpha=0.01"]).loss.rdpo_alpha == 0.01


class Messages:
    """What announce_run needs of a RunLogger: its directory, its recipe, and the lines it prints."""

    def __init__(self, output_dir):
        self.output_dir, self.recipe, self.lines = output_dir, "sft", []

    def message(self, text: str) -> None:
        self.lines.append(text)


class CountingPolicy:
    """num_parameters and device of a policy worker over `model`, as LocalPolicyWorker counts them."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.device = model, torch.device("cpu")

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad or not trainable_only)


def test_a_lora_run_announces_trainable_and_total_parameters_and_the_fraction(tmp_path, tiny_model_dir):
    model = load_trainable_model(ModelConfig(name_or_path="posttrain/tiny"), LoraSection(enabled=True, r=4), None,
                                 torch.device("cpu"))
    policy = CountingPolicy(model)
    trainable, total = policy.num_parameters(trainable_only=True), policy.num_parameters()
    assert 0 < trainable < total
    log = Messages(tmp_path)
    announce_run(log, "8 rows", None, [], policy, "8 examples per step")
    line = next(text for text in log.lines if text.startswith("training "))
    assert (f"training {trainable / 1e6:.2f}M of {total / 1e6:.2f}M parameters ({trainable:,} of {total:,}: "
            f"{trainable / total:.2%}) on cpu") in line
    # A full fine-tune trains every parameter: one number, as before.
    model.requires_grad_(True)
    announce_run(log, "8 rows", None, [], policy, "8 examples per step")
    assert log.lines[-1].startswith(f"training {total / 1e6:.2f}M parameters on cpu")


@pytest.mark.parametrize("recipe", ["sft", "dpo", "grpo", "distill"])
def test_help_documents_the_keys_of_evaluation_sets(recipe, capsys):
    with pytest.raises(SystemExit):
        main([recipe, "--help"])
    out = capsys.readouterr().out
    for key in ("evaluation[].name  str = (required)", "evaluation[].data.files  list[str] = []",
                "evaluation[].every  int = 0", "evaluation[].num_samples  int = 1", "evaluation[].environment  "):
        assert f"  {key}" in out, key


def test_generate_and_eval_share_one_chat_template_default_and_say_which(capsys):
    assert GenerateConfig.model_fields["chat_template"].default is False
    assert PromptSection.model_fields["use_chat_template"].default is False  # eval's, as the RL recipes'
    for recipe in ("generate", "eval"):
        with pytest.raises(SystemExit):
            main([recipe, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert "--chat-template" in out and "default: the prompt text as it is" in out
