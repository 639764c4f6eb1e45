"""Model errors, importable without loading transformers."""


class ModelNotFoundError(ValueError):
    """A model path that is neither an existing directory, an embedded model nor a hub id."""
