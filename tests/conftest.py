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
