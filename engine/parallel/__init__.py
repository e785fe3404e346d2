"""What a model's layers are split over: the process group of tensor / expert parallelism
(`group.py`), process-group set-up and moving bytes and tensors between ranks (`comm.py`), which
layers a pipeline stage owns and what crosses between stages (`pipeline.py`), and the one-shot
all-reduce over symmetric memory (`symm_all_reduce.py`).

May import: torch, `engine.config` and the shared leaves. Never the layers, the models or the
runner (they import this package).
"""
