"""`pdmesh`: one command for every service and tool.

Every flag can also come from the environment: `--kv-cache-tokens 4096` is
`PDMESH_KV_CACHE_TOKENS=4096` (what compose files and Kubernetes manifests set).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from pdmesh import envs


def engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2)")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--device", default="auto")
    g.add_argument("--tensor-parallel-size", type=int, default=1)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-tokens", type=int, default=None)
    g.add_argument("--kv-cache-memory-fraction", type=float, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="MoE experts split over the tensor-parallel ranks (all-to-all) instead of sharded",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="launch each decode step before reading the previous one's tokens "
        "(default: on with CUDA graphs)",
    )
    g.add_argument("--load-format", default="auto", help="auto | dummy (random weights)")
    g.add_argument("--skip-tokenizer-init", action="store_true", help="token ids only")


def engine_options(args: argparse.Namespace) -> dict:
    return {
        "model": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "tensor_parallel_size": args.tensor_parallel_size,
        "block_size": args.block_size,
        "kv_cache_tokens": args.kv_cache_tokens,
        "kv_cache_memory_fraction": args.kv_cache_memory_fraction,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "enable_prefix_caching": not args.no_prefix_caching,
        "enable_expert_parallel": args.enable_expert_parallel,
        "seed": args.seed,
        "enforce_eager": args.enforce_eager,
        "async_scheduling": args.async_scheduling,
        "load_format": args.load_format,
        "skip_tokenizer_init": args.skip_tokenizer_init,
    }


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


def tls_config(args: argparse.Namespace) -> Any:
    """The TLSConfig the TLS flags describe, or None (plaintext)."""
    from pdmesh.serving.tls import TLSConfig

    return TLSConfig.from_flags(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)


def sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")


def _env_defaults(parser: argparse.ArgumentParser) -> None:
    """Take defaults from PDMESH_<FLAG> environment variables (flags still win)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _env_defaults(sub)
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


def build_parser() -> argparse.ArgumentParser:
    from pdmesh import commands, healthcheck

    parser = argparse.ArgumentParser(
        prog="pdmesh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    commands.add_generate(sub)
    commands.add_up(sub)
    commands.add_services(sub)
    commands.add_bench(sub)
    healthcheck.add_healthcheck(sub)
    _env_defaults(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
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
