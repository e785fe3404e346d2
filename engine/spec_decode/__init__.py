"""Speculative decoding: its settings (`config.py`), the proposers and their registry
(`speculator.py`: n-gram; `draft.py`: a draft model), verification in one target forward
(`verify.py`) and the engine's handling of a verified step (`step.py`).

May import: `engine.sequence`, `engine.outputs`, `engine.sample`, and (the draft proposer only)
`engine.runner` and `engine.kv_cache` to run its own small model.
"""
