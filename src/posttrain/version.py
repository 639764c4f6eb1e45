"""The package version, in a module of its own so that any layer can read it without importing the package's
top level (which offers the Python API, `posttrain.train`)."""

__version__ = "0.1.0"
