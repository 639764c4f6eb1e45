"""Computer use: OSWorld-style tasks on an Xvfb desktop (see environment.py and docs/agents.md)."""
