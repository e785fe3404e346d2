"""The `pdmesh` subcommands but `bench` (bench/command.py), `healthcheck`
(pdmesh/healthcheck.py), `drain` and `role`: their flags and what they run, a module a group.

- `local.py`     `generate` (one prompt, offline or from a router) and `up` (a local mesh)
- `services.py`  `router` and `kvstore`, and the registration of every service's subcommand
- `workers.py`   `decode`, `worker` (either role) and `prefill`
- `args.py`      a service's parser and the flag groups several subcommands share

Only `pdmesh/cli.py` imports this package (import-linter checks it).
"""
