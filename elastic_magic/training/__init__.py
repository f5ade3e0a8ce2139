"""Elastic training inside the ranks: State (commits, restores, resharding),
run(), the elastic data loader, random streams, and the snapshot and signed checkpoint formats."""
