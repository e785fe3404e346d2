"""The host-memory KV tier: rank 0's index of the offloaded prefix blocks (`index.py`, no
tensors) and each rank's pool of host slots with its copies to and from the device (`pool.py`).

May import: `engine.kv_cache.paged`, `engine.parallel.comm` and the KV connector's messages.
"""
