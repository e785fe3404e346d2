"""Running a scheduled step on a device: the model runner (`model_runner.py`: one forward over
a flat batch, then sampling), the step's inputs built on the host (`step_inputs.py`), a launched
step's handle (`step_handle.py`), decode CUDA graphs (`cuda_graphs.py`), and the runner's part
in expert parallelism and data-parallel attention (`dp_attention.py`).

May import: the models and layers, `engine.kv_cache`, `engine.sample`, `engine.parallel`,
`engine.eplb`, `engine.spec_decode.verify`, the KV connector. Never the engine loop or a service.
"""
