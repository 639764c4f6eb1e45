"""Data-parallel training: the same worker protocols across processes.

`distributed.builders` chooses the workers a recipe gets (local, or FSDP2 under torchrun); `distributed.fsdp` holds
the sharded workers; `distributed.env` the process-group helpers every layer may use (rank, barrier, gathers with
deadlines). This package's own module imports nothing, so the lower layers can reach `distributed.env` without
pulling in the workers. See docs/distributed.md.
"""
