"""Gathering and scattering KV blocks on one GPU: torch's index copies over bf16 elements against
`kv_transfer/pages.py` (whole blocks as 8-byte words), with a plain copy of the same bytes as the
ceiling, all in one run.

    python -m pdmesh.bench.kv_gather_gpu [--out DIR]

Shape: Llama-3.1-8B's cache pages (blocks of 16 tokens x 8 KV heads x 128 dims, bf16), 256 of
320 blocks in shuffled order, 8 layers at a time (128 MiB, as `send_layers` gathers) and one
layer (16 MiB, as a prefill pushes after each layer).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from pdmesh.bench.report import Report, out_parser
from pdmesh.kv_transfer.pages import gather_blocks, scatter_blocks

LAYERS, BLOCKS, BS, HEADS, DIM, SENT = 32, 320, 16, 8, 128, 256


def _ms(fn: Callable[[], object], repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    args = out_parser(__doc__, out_required=False).parse_args()
    cache = torch.randn(LAYERS, 2, BLOCKS, BS, HEADS, DIM, device="cuda").to(torch.bfloat16)
    ids = torch.randperm(BLOCKS, device="cuda")[:SENT]
    chunk, layer = cache[:8], cache[0]
    eight, one = chunk.numel() * 2 * SENT // BLOCKS, layer.numel() * 2 * SENT // BLOCKS  # bytes
    gathered = chunk.index_select(2, ids)
    dst = torch.empty_like(chunk)
    plain = torch.empty_like(gathered)
    assert torch.equal(gather_blocks(chunk, 2, ids), gathered)
    cases = {  # name: (bytes moved, call)
        "gather 8 layers, torch index_select (bf16)": (eight, lambda: chunk.index_select(2, ids)),
        "gather 8 layers, as words (pages.py)": (eight, lambda: gather_blocks(chunk, 2, ids)),
        "gather 1 layer, torch index_select (bf16)": (one, lambda: layer.index_select(1, ids)),
        "gather 1 layer, as words (pages.py)": (one, lambda: gather_blocks(layer, 1, ids)),
        "scatter 8 layers, torch index_copy_ (bf16)": (
            eight,
            lambda: dst.index_copy_(2, ids, gathered),
        ),
        "scatter 8 layers, as words (pages.py)": (
            eight,
            lambda: scatter_blocks(dst, 2, ids, gathered),
        ),
        "plain copy of the same bytes (ceiling)": (eight, lambda: plain.copy_(gathered)),
    }
    result: dict[str, object] = {"device": torch.cuda.get_device_name()}
    ceiling = eight / _ms(cases["plain copy of the same bytes (ceiling)"][1]) / 1e6
    for name, (moved, fn) in cases.items():
        ms = _ms(fn)
        gb_s = moved / ms / 1e6
        result[name] = {"ms": ms, "gb_s": gb_s, "of_plain_copy": gb_s / ceiling}
        print(f"{name:46s} {ms:7.3f} ms {gb_s:7.0f} GB/s  {gb_s / ceiling:5.2f} of a plain copy")
    if args.out:
        Report(args.out / "kv_gather.json", indent=1, **result).save()


if __name__ == "__main__":
    main()
