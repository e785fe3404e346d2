"""The KV cache and its tiers: block bookkeeping with hash-chained prefix caching
(`block_manager.py`, no tensors), the paged cache tensors and how many blocks fit (`paged.py`),
and the host-memory tier under the device cache (`host/`).

May import: `engine.sequence`, `engine.parallel.comm` (host/device copies), the KV connector's
types and the shared leaves. Never the scheduler, the runner or the models.
"""
