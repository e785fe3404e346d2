"""`pdmesh`: one command for every service and tool.

Every flag can also come from the environment: `--kv-cache-tokens 4096` is
`PDMESH_KV_CACHE_TOKENS=4096` (what compose files and Kubernetes manifests set).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pdmesh import drain, healthcheck, role
from pdmesh.bench import command as bench_command
from pdmesh.commands import local, services
from pdmesh.flags import env_defaults


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's flags, with defaults from PDMESH_<FLAG> variables."""
    parser = argparse.ArgumentParser(
        prog="pdmesh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    local.add_generate(sub)
    local.add_up(sub)
    services.add_services(sub)
    bench_command.add_bench(sub)
    healthcheck.add_healthcheck(sub)
    drain.add_drain(sub)
    role.add_role(sub)
    env_defaults(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ARGV and run the subcommand: its exit code (2 for a ValueError, which is printed as
    one line, no traceback)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"pdmesh: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
