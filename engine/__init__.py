"""The engine core shared by prefill and decode workers.

Top level: the offline API (`llm.py`), the engine loop every worker drives (`llm_engine.py`, its
steps in `step_loop.py`, its figures in `stats.py`), its configuration (`config.py`), what it
hands back (`outputs.py`), a sequence's state (`sequence.py`), checkpoint reading (`weights.py`),
and the two ways a request's KV crosses the engine's edge whole (`migration.py`,
`external_prefix.py`). The rest is one folder a concern:

- `scheduling/`  continuous batching, a request's choices and stop rules, the overlapped step
- `kv_cache/`    block bookkeeping, the paged cache tensors, the host-memory tier (`host/`)
- `sample/`      sampling, penalties, logprobs, structured output
- `spec_decode/` speculative decoding: proposers, verification, the verified step
- `runner/`      one forward over a flat batch, step inputs, CUDA graphs
- `parallel/`    process groups, collectives, pipeline stages (what layers are split over)
- `executor/`    rank 0's driver, the follower ranks, and where they run (mp, nodes, Ray)
- `eplb/`        expert-parallel load balancing: placement from load, applied on every rank
- `models/`, `layers/`  the model code, parallel-aware, backed by `pdmesh.kernels`

Imports point down: the engine never imports a service (import-linter checks it).
"""
