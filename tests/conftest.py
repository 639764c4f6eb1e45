import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory):
    """Embedded models and datasets are built into a per-session cache, never the user's."""
    previous = os.environ.get("POSTTRAIN_CACHE_DIR")
    os.environ["POSTTRAIN_CACHE_DIR"] = str(tmp_path_factory.mktemp("posttrain-cache"))
    yield
    if previous is None:
        os.environ.pop("POSTTRAIN_CACHE_DIR", None)
    else:
        os.environ["POSTTRAIN_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def tiny_model_dir(_isolated_cache) -> Path:
    from posttrain.models.tiny import ensure_embedded_model

    return ensure_embedded_model("posttrain/tiny")


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """An untrained reward model (the tiny backbone, a head seeded fresh) saved with its tokenizer: its scores differ
    from reply to reply (tests/test_mixture.py, tests/test_ray_distill.py)."""
    import torch

    from posttrain.config.schema import ModelConfig
    from posttrain.models.loading import load_reward_backbone, load_tokenizer

    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))
    torch.manual_seed(0)
    model = load_reward_backbone(ModelConfig(name_or_path=str(tiny_model_dir)), tokenizer.pad_token_id)
    directory = tmp_path_factory.mktemp("rm")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
