"""The planner: switches workers of either role between prefill and decode with the load
(`--planner`). `config.py` its settings, `policy.py` what it decides from an observation (pure),
`slo.py` the attainment the router measures, `loop.py` the loop in the router that observes and
switches (through router/roles.py, as `pdmesh role` does)."""
