"""HLE- and GDPval-format judged tasks: row schemas, loaders and the environments that score them with an LLM judge."""
