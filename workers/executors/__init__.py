"""Where an engine's ranks run and how a step plan reaches them: in this process (`uni`), one
process per rank (`mp`), or rank actors (registered by cluster/control); the rank loop, the
rank group they share, torch.distributed groups, and which shard a rank holds (`parallel`)."""
