"""Data-parallel training: the same worker protocols across processes.

`distributed.builders` chooses the workers a recipe gets (local, or FSDP2 under torchrun); `distributed.fsdp` holds
the sharded workers. The process-group helpers every layer may use (rank, barrier, gathers that name a failed rank)
are `posttrain.process_group`, below the workers. See docs/distributed.md.
"""
