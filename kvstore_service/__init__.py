"""The KV store service (`pdmesh kvstore`): full KV blocks shared by every worker, addressed by
the chained prefix hash of their tokens, held within a byte budget (docs/architecture.md). Workers
reach it through `client.py` only; importing this package imports nothing else."""
