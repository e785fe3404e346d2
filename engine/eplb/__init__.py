"""Expert-parallel load balancing: where each MoE layer's experts live, from their counted
load (`placement.py`, pure functions, no torch.distributed), and the balancer every rank runs
after each step to count load and move experts (`balancer.py`).

May import: `engine.layers` (the MoE layer and its expert moves), `engine.parallel`, the KV
connector's messages. Never the runner, the scheduler or a service.
"""
