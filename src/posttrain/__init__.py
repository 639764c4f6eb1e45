"""posttrain: post-training for language models.

    import posttrain
    result = posttrain.train("sft", "configs/sft_arithmetic.yaml", train_data=rows,
                             overrides={"trainer.max_steps": 100})

The Python API (`train`, `evaluate`, `generate`, docs/python-api.md) lives in posttrain.api. Importing this package
imports only its version: torch, transformers and the recipes load when one of those names is first used, so that
`import posttrain` stays instant in a notebook or a script that only reads a config.
"""

from posttrain.version import __version__

_API_NAMES = ("train", "evaluate", "generate", "ConfigError", "DataError", "RunError")
"""The names posttrain.api offers at the top level, loaded on first use."""

__all__ = ["__version__", *_API_NAMES]


def __getattr__(name: str) -> object:
    # PEP 562: called only for names not defined above. The API imports torch and every recipe (seconds), which
    # `import posttrain` must not pay.
    if name in _API_NAMES:
        from posttrain import api

        return getattr(api, name)
    raise AttributeError(f"module 'posttrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_API_NAMES})
