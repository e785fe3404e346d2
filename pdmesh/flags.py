"""Flags several commands share: the engine's (made from `EngineConfig`'s fields), TLS and
sampling; and defaults from `PDMESH_<FLAG>` environment variables.

Field `max_num_seqs` is `--max-num-seqs` with the field's type, default and help; a bool off by
default is a switch (`--enforce-eager`), one on by default the switch its metadata names
(`--no-prefix-caching`), one that may be unset `--x / --no-x`. `engine_options` reads the flags
into `EngineConfig` keyword arguments, `engine_argv` writes those back as flags (what `pdmesh up`
hands its workers): a new field needs no edit here.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Mapping
from dataclasses import Field, fields
from typing import TYPE_CHECKING, Any, TypeVar

from pdmesh import envs
from pdmesh.engine.config import EngineConfig

if TYPE_CHECKING:
    from pdmesh.router.planner.config import PlannerConfig
    from pdmesh.serving.tls import TLSConfig

T = TypeVar("T")
TLS_FLAGS = ("tls_cert", "tls_key", "tls_ca", "tls_server_name")
_ENGINE_HINTS = typing.get_type_hints(EngineConfig)


def _value_type(f: Field[Any]) -> type:
    """The field's type without `| None`: int, float, str or bool."""
    hint = _ENGINE_HINTS[f.name]
    if isinstance(hint, types.UnionType):
        (hint,) = (t for t in typing.get_args(hint) if t is not type(None))
    return hint


def _flag(f: Field[Any]) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def engine_args(p: argparse.ArgumentParser) -> None:
    """Add a flag for every `EngineConfig` field, in an "engine" group."""
    g = p.add_argument_group("engine")
    for f in fields(EngineConfig):
        flag, kind, help = _flag(f), _value_type(f), f.metadata["help"]
        if kind is not bool:
            g.add_argument(flag, type=kind, default=f.default, help=help)
        elif f.default is None:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help)
        else:
            if f.default is True and "flag" not in f.metadata:
                raise TypeError(f"EngineConfig.{f.name}: a default-on bool names its off flag")
            g.add_argument(flag, action="store_true", help=help)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags of a parsed command line as `EngineConfig` keyword arguments."""
    options = {}
    for f in fields(EngineConfig):
        value = getattr(args, _flag(f)[2:].replace("-", "_"))
        options[f.name] = not value if f.default is True else value  # --no-x: off
    return options


def engine_argv(options: Mapping[str, Any]) -> list[str]:
    """Engine options (`EngineConfig` keyword arguments; missing ones keep their default) as the
    flags that `engine_args` parses back to the same options."""
    argv: list[str] = []
    for f in fields(EngineConfig):
        value, flag = options.get(f.name, f.default), _flag(f)
        if value is None:
            continue
        if _value_type(f) is not bool:
            argv += [flag, str(value)]
        elif f.default is None:
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif value != f.default:  # a switch is given only to change its default
            argv.append(flag)
    return argv


def from_args(cls: type[T], args: argparse.Namespace, **values: Any) -> T:
    """The config dataclass `cls` from parsed flags named as its fields (a field without one keeps
    its default); `values` gives the fields whose flag has another name or needs converting."""
    names = [f.name for f in fields(cls) if f.name not in values]  # type: ignore[arg-type]
    return cls(**{n: getattr(args, n) for n in names if hasattr(args, n)}, **values)


def tls_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS (every gRPC hop; all unset: plaintext)")
    g.add_argument("--tls-cert", default=None, help="PEM certificate chain of this process")
    g.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    g.add_argument(
        "--tls-ca",
        default=None,
        help="PEM CA bundle peers must chain to; servers then require client certificates",
    )
    g.add_argument(
        "--tls-server-name", default=None, help="the name to verify in servers' certificates"
    )


def tls_config(args: argparse.Namespace) -> TLSConfig | None:
    """The TLSConfig the TLS flags describe, or None (plaintext)."""
    from pdmesh.serving.tls import TLSConfig

    return TLSConfig.from_flags(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)


def tls_argv(args: argparse.Namespace) -> list[str]:
    """The TLS flags that were set, as a command line (what `pdmesh up` hands every child)."""
    argv: list[str] = []
    for name in TLS_FLAGS:
        value = getattr(args, name)
        if value:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


# The planner's knobs: PlannerConfig field -> (flag, flag units per field unit, help).
PLANNER_FLAGS: dict[str, tuple[str, int, str]] = {
    "interval_s": ("--planner-interval-s", 1, "seconds between the planner's looks"),
    "slo_ttft_s": (
        "--slo-ttft-ms",
        1000,
        "target time to first token (ms), --load-aware-disagg's too",
    ),
    "slo_itl_s": ("--slo-itl-ms", 1000, "target time between tokens (ms)"),
    "attainment": ("--slo-attainment", 1, "share within target below which a side is starved"),
    "kv_low": ("--planner-kv-low", 1, "decode KV use that may give up a worker"),
    "kv_high": ("--planner-kv-high", 1, "decode KV use that is starved"),
    "sustain": ("--planner-sustain", 1, "intervals in a row a condition holds before a switch"),
    "dwell_s": ("--planner-dwell-s", 1, "least seconds between two switches"),
}


def _flag_dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def planner_args(p: argparse.ArgumentParser) -> None:
    """The router's planner and load-aware conditional disaggregation (router and `up`)."""
    from pdmesh.router.planner.config import PlannerConfig

    g = p.add_argument_group("planner (roles that move with the load; docs/mesh.md, Roles)")
    g.add_argument(
        "--planner",
        action="store_true",
        help="switch workers of either role between prefill and decode with the load",
    )
    for name, (flag, per, help) in PLANNER_FLAGS.items():
        default = getattr(PlannerConfig, name)
        kind = int if isinstance(default, int) else float
        g.add_argument(flag, type=kind, default=default * per, help=help)
    g.add_argument(
        "--load-aware-disagg",
        action="store_true",
        help="prefill a prompt on its decode worker when the prefill queue would cost it more "
        "than its prefill costs the decode worker's batch",
    )
    g.add_argument(
        "--slo-itl-p99-ms",
        type=float,
        default=None,
        help="target for the p99 of each stream's gaps between tokens (ms): with "
        "--load-aware-disagg, a decode worker running streams prefills nothing that would "
        "stall them longer",
    )


def planner_config(args: argparse.Namespace) -> PlannerConfig | None:
    """The PlannerConfig of the planner flags, or None without --planner."""
    from pdmesh.router.planner.config import PlannerConfig

    if not args.planner:
        return None
    values = {}
    for name, (flag, per, _) in PLANNER_FLAGS.items():
        value = getattr(args, _flag_dest(flag))
        values[name] = value / per if per != 1 else value
    return PlannerConfig(**values)


def planner_argv(args: argparse.Namespace) -> list[str]:
    """The planner flags as a command line (what `pdmesh up` hands its router)."""
    argv = ["--load-aware-disagg"] if args.load_aware_disagg else []
    if args.planner:
        argv.append("--planner")
        for flag, _, _ in PLANNER_FLAGS.values():
            argv += [flag, str(getattr(args, _flag_dest(flag)))]
    elif args.load_aware_disagg:  # the TTFT target it keeps
        argv += ["--slo-ttft-ms", str(args.slo_ttft_ms)]
    if args.slo_itl_p99_ms is not None:
        argv += ["--slo-itl-p99-ms", str(args.slo_itl_p99_ms)]
    return argv


def sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")


def env_defaults(parser: argparse.ArgumentParser) -> None:
    """Take defaults from PDMESH_<FLAG> environment variables (flags still win), in every
    subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                env_defaults(sub)
            continue
        if not action.option_strings or action.dest == "help":
            continue
        value = envs.flag_env(action.dest)
        if not value:  # unset, or set empty (as compose files do for "use the default")
            continue
        if isinstance(action, argparse._StoreTrueAction | argparse.BooleanOptionalAction):
            action.default = value.lower() in ("1", "true", "yes", "on")
        else:
            action.default = value
