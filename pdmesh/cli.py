"""`pdmesh`: one command for every service and tool."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--kv-cache-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)


def _engine_options(args: argparse.Namespace) -> dict:
    return {
        "model": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "kv_cache_tokens": args.kv_cache_tokens,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
    }


def cmd_generate(args: argparse.Namespace) -> int:
    if not args.offline:
        print("pdmesh generate: only --offline is available in this version", file=sys.stderr)
        return 2
    from pdmesh import LLM, SamplingParams

    llm = LLM(**_engine_options(args))
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate([args.prompt], params)[0]
    completion = out.outputs[0]
    if args.json:
        print(
            json.dumps(
                {
                    "text": completion.text,
                    "token_ids": completion.token_ids,
                    "prompt_token_ids": out.prompt_token_ids,
                    "finish_reason": completion.finish_reason,
                }
            )
        )
    else:
        print(completion.text)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    # Until the mesh lands this runs the offline engine on a chat prompt, as `make up` promises.
    from pdmesh import LLM, SamplingParams

    llm = LLM(**_engine_options(args))
    question = args.prompt
    out = llm.chat(
        [{"role": "user", "content": question}], SamplingParams(max_tokens=64, temperature=0)
    )
    print(f"Q: {question}\nA: {out[0].outputs[0].text}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if not args.offline:
        print("pdmesh bench: only --offline is available in this version", file=sys.stderr)
        return 2
    from pdmesh.bench.offline import run_offline_bench

    return run_offline_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdmesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("--offline", action="store_true", help="run the engine in this process")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="apply the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--json", action="store_true", help="print JSON with token ids")
    _engine_args(g)
    g.set_defaults(func=cmd_generate)

    u = sub.add_parser("up", help="start pdmesh on the default model")
    u.add_argument("--prompt", default="What is the capital of France?")
    _engine_args(u)
    u.set_defaults(func=cmd_up)

    b = sub.add_parser("bench", help="throughput benchmark against transformers")
    b.add_argument("--offline", action="store_true", help="benchmark the in-process engine")
    b.add_argument("--num-requests", type=int, default=32)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json-out", default=None, help="write the figures as JSON here")
    b.add_argument("--skip-peer", action="store_true", help="do not run transformers")
    _engine_args(b)
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"pdmesh: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
