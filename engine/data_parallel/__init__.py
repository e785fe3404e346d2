"""Data parallelism (`data_parallel_size`, vLLM's name): that many engine replicas behind one
front end (`front.py`), the replicas after the first as processes of this node (`replica.py`),
and what crosses between them, as JSON (`codec.py`).

Dense models: the replicas run independently, requests spread by load. MoE models with
`enable_expert_parallel`: attention is data-parallel (each replica its own requests and KV
cache) and the experts split over every replica's ranks, which step in lockstep; a replica with
nothing to run joins each step's MoE exchange with padding rows (engine/layers/moe.py).

May import: the engine loop (llm_engine) and everything below it.
"""
