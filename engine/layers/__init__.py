"""Model building blocks, parallel-aware and backed by `pdmesh.kernels`: column/row-parallel
linear layers, vocab-parallel embedding and LM head, paged attention, RMSNorm, rotary embedding,
the expert-parallel MoE layer with its expert map and moves, and quantization methods
(`quantization/`).

May import: `engine.parallel` (the group a layer is split over), `engine.weights` (checkpoint
tensors), the kernels and torch. Never the models, the runner, the scheduler or the engine loop
(an import-linter contract).
"""
