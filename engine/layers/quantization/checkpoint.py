"""Which quantization a checkpoint's `quantization_config` (config.json) describes.

Read: compressed-tensors' float-quantized format (llm-compressor's FP8 / FP8_DYNAMIC schemes:
float8 weights with per-channel or per-tensor `weight_scale`), transformers' `fbgemm_fp8`
(per-channel) and the `fp8` format of AutoFP8 / vLLM (per-tensor scales). Block-wise FP8
(`weight_block_size`) and every other scheme are refused with the reason. Static activation
scales (`input_scale`) are ignored: activations are always scaled per token, as they come.
"""

from __future__ import annotations

from typing import Any

_SUPPORTED = (
    "compressed-tensors (float-quantized, 8-bit float weights per channel or per tensor), "
    "fbgemm_fp8, fp8 (per-tensor, no weight_block_size)"
)


def _refuse(why: str) -> ValueError:
    return ValueError(f"model: quantization_config {why}; pdmesh reads {_SUPPORTED}.")


def _check_compressed_tensors(qc: dict[str, Any]) -> None:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _refuse(f"format {fmt!r} is not float-quantized")
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise _refuse(f"group {name!r} has {w.get('num_bits')}-bit {w.get('type')} weights")
        if w.get("strategy") not in ("channel", "tensor") or not w.get("symmetric", True):
            raise _refuse(
                f"group {name!r}: weight strategy {w.get('strategy')!r} (symmetric "
                f"{w.get('symmetric', True)}) is not a symmetric per-channel or per-tensor scale"
            )


def checkpoint_quantization(hf_config: Any) -> str | None:
    """ "fp8" for an FP8 checkpoint pdmesh reads, None for an unquantized one; ValueError naming
    the scheme for any other."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        _check_compressed_tensors(qc)
    elif method == "fp8":
        if qc.get("weight_block_size"):
            raise _refuse(f"weight_block_size {qc['weight_block_size']} (block-wise FP8)")
    elif method != "fbgemm_fp8":
        raise _refuse(f"quant_method {method!r} is not supported")
    return "fp8"
