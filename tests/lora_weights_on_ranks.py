"""Run under torchrun by tests/test_distributed.py: restore a LoRA policy from a checkpoint folder (written by one
process) on every rank, and have rank 0 save the merged weights `named_weights()` gives, for comparison with a
local worker's.

    torchrun --standalone --nproc-per-node 2 tests/lora_weights_on_ranks.py CHECKPOINT_POLICY_DIR OUT.safetensors
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from posttrain.config.schema import LoraSection, ModelConfig, TrainerConfig
from posttrain.distributed.builders import build_policy
from posttrain.process_group import init_from_env, is_main, world_size
from posttrain.models.loading import load_tokenizer

if __name__ == "__main__":
    policy_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    init_from_env()
    assert world_size() == 2
    model = ModelConfig(name_or_path="posttrain/tiny")
    tokenizer = load_tokenizer(model, padding_side="right")
    policy = build_policy(model, LoraSection(enabled=True, r=4, alpha=8), TrainerConfig(num_threads=1), tokenizer,
                          torch.device("cpu"), resume_dir=policy_dir)
    weights = {name: tensor.contiguous() for name, tensor in policy.named_weights()}
    if is_main():
        save_file(weights, out)
