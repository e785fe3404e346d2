"""Scheduling: continuous batching with chunked prefill and preemption (`scheduler.py`), a
request's several choices (`choices.py`), a request as the loop serves it with its stop rules
(`request.py`), and the next decode step launched before the current one is read (`overlap.py`).

May import: `engine.sequence`, `engine.outputs`, `engine.kv_cache`, `engine.sample`,
`engine.runner.step_handle`, the KV connector's types, and the shared leaves (`pdmesh.*`).
Never the model runner, the models or the executor.
"""
