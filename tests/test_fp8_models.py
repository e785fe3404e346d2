"""FP8 models on the CPU (the reference kernels): quantized at load against transformers running
the same W8A8 arithmetic, and FP8 checkpoints as compressed-tensors / AutoFP8 write them.

The transformers side is built here, independently of pdmesh's code: each nn.Linear (the MoE
routers and the LM head aside) quantizes its weight per output row and its input per token to
float8 e4m3 and multiplies them in fp32; MoE experts get their weights' fp8 round trip
(pdmesh's experts are weight-only FP8).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support import hf_greedy, load_hf, make_tiny_model, random_prompts
from torch import nn

from pdmesh import LLM, SamplingParams

FP8 = torch.float8_e4m3fn
NEW_TOKENS = 16


def quantize(w: torch.Tensor, per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 rows, scales [R]) with the largest magnitude of each row (or of all) at 448."""
    amax = w.abs().amax() if per_tensor else w.abs().amax(dim=-1)
    scale = amax.clamp_min(1e-12).float() / 448.0
    s = scale if per_tensor else scale[..., None]
    return (w.float() / s).clamp(-448, 448).to(FP8), scale


def _w8a8_forward(linear: nn.Linear):
    q, s = quantize(linear.weight.detach())

    def forward(x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).float()
        xq, xs = quantize(x2)
        y = (xq.float() @ q.float().t()) * xs[:, None] * s[None, :]
        if linear.bias is not None:
            y = y + linear.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)

    return forward


def hf_fp8(folder: Path) -> nn.Module:
    hf = load_hf(folder)
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, nn.Linear) and name != "lm_head" and not name.endswith(".gate"):
                module.forward = _w8a8_forward(module)
            elif name.endswith(".experts"):
                for p in module.parameters():  # stacked [E, rows, K]: weight-only fp8
                    q, s = quantize(p)
                    p.copy_(q.float() * s[..., None])
    return hf


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_quantized_at_load_matches_transformers_w8a8(tmp_path: Path, arch: str) -> None:
    folder = make_tiny_model(tmp_path / arch, arch)
    prompts = random_prompts([5, 23, 40])
    llm = LLM(str(folder), quantization="fp8", kv_cache_tokens=1024)
    weights = dict(llm.engine.runner.model.named_parameters())
    assert weights["model.layers.0.self_attn.qkv_proj.weight"].dtype == FP8
    if arch == "qwen3_moe":
        assert weights["model.layers.0.mlp.w13_weight"].dtype == FP8
        assert weights["model.layers.0.mlp.gate.weight"].dtype == torch.float32  # the router
    hf = hf_fp8(folder)
    expected = [hf_greedy(hf, p, NEW_TOKENS, ignore_eos=True) for p in prompts]
    assert _greedy(llm, prompts) == expected


def _write_fp8_checkpoint(src: Path, dst: Path, quantization_config: dict, per_tensor: bool):
    """`src`'s model with every projection and expert matrix as float8 + weight_scale."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors: dict[str, torch.Tensor] = {}
    for name, t in load_file(src / "model.safetensors").items():
        quantized = name.endswith("proj.weight") or ".experts." in name
        if not quantized or name.endswith("mlp.gate.weight"):
            tensors[name] = t
            continue
        q, scale = quantize(t, per_tensor)
        tensors[name] = q
        # compressed-tensors writes per-channel scales as [N, 1]; per-tensor ones as a scalar.
        tensors[name + "_scale"] = scale if per_tensor else scale[:, None]
        tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor(1.0)  # ignored
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


COMPRESSED_TENSORS = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token"},
        }
    },
}


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_compressed_tensors_checkpoint_loads_as_quantizing_at_load(tmp_path, arch) -> None:
    """Per-channel fp8 rows and scales are the ones quantizing at load makes: the same bits,
    the same tokens; the checkpoint's config alone turns FP8 on."""
    src = make_tiny_model(tmp_path / arch, arch)
    ckpt = _write_fp8_checkpoint(src, tmp_path / "fp8", COMPRESSED_TENSORS, per_tensor=False)
    online = LLM(str(src), quantization="fp8", kv_cache_tokens=1024)
    stored = LLM(str(ckpt), kv_cache_tokens=1024)
    a = dict(online.engine.runner.model.named_parameters())
    b = dict(stored.engine.runner.model.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(
            a[name].view(torch.uint8) if a[name].dtype == FP8 else a[name],
            b[name].view(torch.uint8) if b[name].dtype == FP8 else b[name],
        ), name
    prompts = random_prompts([7, 30])
    assert _greedy(stored, prompts) == _greedy(online, prompts)


def test_per_tensor_fp8_checkpoint_keeps_each_matrix_scale(tmp_path: Path) -> None:
    """AutoFP8's format: one scale per matrix. q, k and v (one merged matrix here) keep their
    own scales: the dequantized weights are exactly the checkpoint's."""
    src = make_tiny_model(tmp_path / "llama", "llama")
    config = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    ckpt = _write_fp8_checkpoint(src, tmp_path / "fp8", config, per_tensor=True)
    llm = LLM(str(ckpt), kv_cache_tokens=1024)
    params = dict(llm.engine.runner.model.named_parameters())
    stored = load_file(ckpt / "model.safetensors")
    pre = "model.layers.1.self_attn"
    expected = torch.cat(
        [
            stored[f"{pre}.{p}_proj.weight"].float() * stored[f"{pre}.{p}_proj.weight_scale"]
            for p in "qkv"
        ]
    )
    got = params[f"{pre}.qkv_proj.weight"].float() * params[f"{pre}.qkv_proj.weight_scale"][:, None]
    assert torch.equal(got, expected)
    assert len(_greedy(llm, random_prompts([9]))[0]) == NEW_TOKENS


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "weight_block_size"),
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    ],
)
def test_unsupported_quantized_checkpoints_are_refused(tmp_path, config, message) -> None:
    src = make_tiny_model(tmp_path / "llama", "llama")
    ckpt = _write_fp8_checkpoint(src, tmp_path / "q", config, per_tensor=False)
    with pytest.raises(ValueError, match=message):
        LLM(str(ckpt), kv_cache_tokens=1024)
