"""Rank 0's driver of a tensor- or pipeline-parallel worker (`driver.py`), the follower ranks
(`follower.py`, `python -m pdmesh.engine.executor.follower`), the step message between them
(`step_codec.py`), and where the followers run (`distributed_executor_backend`, vLLM's name):
local processes (`mp`, `processes.py`; also across nodes as a static launch, `nodes.py`) or Ray
actors (`ray`, `ray_actors.py`), behind one launcher contract (`base.py`).

May import: everything below the engine loop (runner, models, parallel, eplb, kv_cache). The
engine loop imports the driver; the follower builds its own model runner.
"""
