"""Engine configuration: one frozen dataclass, checked when built.

Each field carries its command-line help (`metadata["help"]`; `metadata["flag"]` where the flag
is not `--field-name`): pdmesh/flags.py makes every engine command's flags and the pass-through
of `pdmesh up` to its workers from these fields, so an option is listed here only.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from pdmesh.engine.spec_decode.config import SpeculativeConfig
from pdmesh.logger import get_logger

if TYPE_CHECKING:
    import torch

log = get_logger(__name__)

# dtype names -> torch attribute names; torch itself is imported only when an engine is built, so
# reading this config (the CLI's parser) stays light.
_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}


# Quantization methods (pdmesh.engine.layers.quantization.registry holds them; named here so that
# reading this config does not import torch).
QUANTIZATIONS = ("fp8",)

# KV cache dtypes, vLLM's names: auto is the model's dtype; fp8 (alias fp8_e4m3) is float8 e4m3
# (torch.float8_e4m3fn), with a scale per layer for K and one for V (docs/kv-cache.md).
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}


def batch_defaults(device_type: str, memory: int, name: str, offline: bool) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) where the config leaves them unset. GPUs take
    vLLM's defaults (engine/arg_utils.py: large ones from 70 GiB, A100s excepted: larger steps
    cost it throughput there); CPUs keep the budget their steps were tuned with."""
    if device_type != "cuda":
        return 256, 2048
    if memory >= 70 * 2**30 and "a100" not in name.lower():
        return 1024, 16384 if offline else 8192
    return 256, 8192 if offline else 2048


def _check_positive(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")


def option(default: Any, help: str, flag: str | None = None) -> Any:
    """A config field with the help of its command-line flag (and the flag's spelling where it
    is not `--field-name`)."""
    metadata = {"help": help} if flag is None else {"help": help, "flag": flag}
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine (one worker). Names follow vLLM."""

    model: str | None = option(None, "HF folder or .gguf (default: embedded SmolLM2)")
    dtype: str = option("auto", "auto (bfloat16 on GPU, float32 on CPU) | " + " | ".join(_DTYPES))
    device: str = option("auto", "auto | cpu | cuda[:N]")
    tensor_parallel_size: int = option(1, "ranks (GPUs) the model is sharded over")
    pipeline_parallel_size: int = option(
        1, "stages the model's layers are split over (TP x PP ranks)"
    )
    data_parallel_size: int = option(
        1,
        "engine replicas behind this one (each TP x PP ranks), requests spread by load; MoE "
        "models with enable_expert_parallel run attention data-parallel and split the experts "
        "over every replica's ranks",
    )
    distributed_executor_backend: str = option(
        "mp", "where the other ranks run: mp (processes on this node) | ray (a Ray cluster)"
    )
    nnodes: int = option(1, "nodes of a static multi-node launch (mp; torchrun's --nnodes)")
    node_rank: int = option(0, "this node's index of --nnodes (0 serves; the others follow)")
    master_addr: str = option("127.0.0.1", "multi-node: node 0's address every node can reach")
    master_port: int = option(29501, "multi-node: the port node 0's rendezvous listens on")
    block_size: int = option(16, "tokens per KV cache block")
    kv_cache_tokens: int | None = option(None, "KV cache tokens (default: by memory fraction)")
    kv_cache_memory_fraction: float | None = option(
        None, "KV cache share of the GPU's memory (default 0.9) or of free RAM (default 0.1)"
    )
    kv_offload_gib: float = option(
        0.0,
        "host memory (GiB, over the worker's ranks) for KV blocks evicted from the device's "
        "prefix cache, loaded back instead of recomputed (pinned on GPUs); 0: off (and without "
        "prefix caching)",
    )
    max_num_seqs: int | None = option(
        None, "requests running at once, at most (default: 256; 1,024 on GPUs of 70 GiB or more)"
    )
    max_num_batched_tokens: int | None = option(
        None,
        "per-step token budget, prefill chunks + decodes (default: 2,048 on CPUs; on GPUs "
        "vLLM's: 16,384 through LLM and 8,192 served on GPUs of 70 GiB or more, else 8,192 / "
        "2,048)",
    )
    max_model_len: int | None = option(None, "prompt + output tokens (default: the model's)")
    enable_prefix_caching: bool = option(True, "no KV reuse across prompts", "--no-prefix-caching")
    enable_expert_parallel: bool = option(
        False, "MoE experts split over the tensor-parallel ranks (all-to-all) instead of sharded"
    )
    enable_eplb: bool = option(
        False, "expert-parallel load balancing: replicate hot experts, re-place them from load"
    )
    num_redundant_experts: int = option(
        0, "EPLB: physical expert slots beyond the model's experts (replicas of hot ones)"
    )
    eplb_window_size: int = option(1000, "EPLB: steps of expert load the placement is made from")
    eplb_step_interval: int = option(3000, "EPLB: steps between placement recomputations")
    seed: int = option(0, "seed of unseeded sampling and of dummy weights")
    quantization: str | None = option(
        None,
        "fp8: float8 e4m3 weights (per-channel scales, quantized at load) and per-token "
        "activations; unset: as the checkpoint is (an FP8 checkpoint runs fp8)",
    )
    kv_cache_dtype: str = option(
        "auto",
        "auto (the model's dtype) | fp8 (float8 e4m3: half of bf16's KV bytes; alias fp8_e4m3); "
        "prefill and decode workers need the same one",
    )
    load_format: str = option("auto", "auto (the checkpoint's) | dummy (random weights: speed)")
    skip_tokenizer_init: bool = option(False, "no tokenizer: token ids in and out, no text")
    enforce_eager: bool = option(False, "no CUDA graphs (GPU decode steps run eagerly)")
    async_scheduling: bool | None = option(
        None, "launch each decode step before reading the last one's tokens (default: with graphs)"
    )
    speculative_config: str | None = option(
        None,
        "speculative decoding, JSON as vLLM's (a dict from LLM(...)), e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' or '
        '\'{"model": PATH, "num_speculative_tokens": 4}\' (README: Speculative decoding)',
    )

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(
                f"model must be a path or None (the default model), got {self.model!r}."
            )
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(
                f"dtype must be auto or one of {', '.join(_DTYPES)}, got {self.dtype!r}."
            )
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}.")
        _check_positive("tensor_parallel_size", self.tensor_parallel_size)
        _check_positive("pipeline_parallel_size", self.pipeline_parallel_size)
        _check_positive("data_parallel_size", self.data_parallel_size)
        _check_positive("block_size", self.block_size)
        _check_positive("kv_cache_tokens", self.kv_cache_tokens, allow_none=True)
        _check_positive("max_num_seqs", self.max_num_seqs, allow_none=True)
        _check_positive("max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)
        _check_positive("max_model_len", self.max_model_len, allow_none=True)
        fraction = self.kv_cache_memory_fraction
        if fraction is not None and not (isinstance(fraction, int | float) and 0 < fraction <= 1):
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {fraction!r}.")
        gib = self.kv_offload_gib
        if not isinstance(gib, int | float) or isinstance(gib, bool) or gib < 0:
            raise ValueError(f"kv_offload_gib must be a number of GiB >= 0, got {gib!r}.")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}.")
        if self.async_scheduling not in (None, True, False):
            raise ValueError(
                f"async_scheduling must be true, false or unset, got {self.async_scheduling!r}."
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)} or unset, got "
                f"{self.quantization!r}."
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                f"{self.kv_cache_dtype!r} (fp8 is float8 e4m3; fp8_e5m2 is not supported)."
            )
        self._check_eplb()
        self._check_nodes()
        self._check_speculative()
        if self.block_size > 1024:
            raise ValueError(f"block_size must be at most 1024 tokens, got {self.block_size}.")

    def _check_eplb(self) -> None:
        # The model-dependent checks (an MoE model; slots divisible by the ranks) are in
        # pdmesh.engine.eplb.placement.check_eplb, run once the model's config is read.
        _check_positive("eplb_window_size", self.eplb_window_size)
        _check_positive("eplb_step_interval", self.eplb_step_interval)
        r = self.num_redundant_experts
        if not isinstance(r, int) or isinstance(r, bool) or r < 0:
            raise ValueError(f"num_redundant_experts must be an integer >= 0, got {r!r}.")
        if not self.enable_eplb:
            if r:
                raise ValueError(
                    f"num_redundant_experts={r} needs enable_eplb (replicas exist only with EPLB)."
                )
            return
        if self.quantization is not None:
            raise ValueError(
                f"enable_eplb does not support quantization={self.quantization!r} yet (the "
                "expert moves do not carry the fp8 scales); drop one of them."
            )
        if self.pipeline_parallel_size > 1:
            raise ValueError(
                "enable_eplb does not support pipeline parallelism yet (got "
                f"pipeline_parallel_size={self.pipeline_parallel_size}); use "
                "tensor_parallel_size with enable_expert_parallel alone."
            )
        if (
            not self.enable_expert_parallel
            or self.tensor_parallel_size * self.data_parallel_size < 2
        ):
            raise ValueError(
                "enable_eplb balances experts over expert-parallel ranks: it needs "
                "enable_expert_parallel and tensor_parallel_size x data_parallel_size >= 2 (got "
                f"enable_expert_parallel={self.enable_expert_parallel}, "
                f"tensor_parallel_size={self.tensor_parallel_size}, "
                f"data_parallel_size={self.data_parallel_size})."
            )

    def _check_nodes(self) -> None:
        backend = self.distributed_executor_backend
        if backend not in ("mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be mp or ray, got {backend!r}.")
        if backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError(
                "distributed_executor_backend='ray' needs Ray, which is not installed: "
                "pip install 'pdmesh[ray]' (or use the mp backend)."
            )
        _check_positive("nnodes", self.nnodes)
        n, r = self.nnodes, self.node_rank
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < n:
            raise ValueError(f"node_rank must be in [0, nnodes - 1] = [0, {n - 1}], got {r!r}.")
        if not isinstance(self.master_port, int) or not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be a TCP port (1-65535), got {self.master_port!r}.")
        if self.data_parallel_size > 1 and (n > 1 or backend != "mp"):
            raise ValueError(
                f"data_parallel_size={self.data_parallel_size} runs its replicas as processes of "
                "this node: it needs nnodes=1 and distributed_executor_backend='mp' (for more "
                "nodes, run a worker per node behind the router)."
            )
        if n == 1:
            return
        if backend == "ray":
            raise ValueError(
                f"nnodes={n} is a static launch of the mp backend; with "
                "distributed_executor_backend='ray' Ray places the ranks: leave nnodes at 1."
            )
        if self.world_size % n:
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size} x pipeline_parallel_size "
                f"{self.pipeline_parallel_size} = {self.world_size} ranks do not divide over "
                f"nnodes={n}: each node runs world_size / nnodes ranks."
            )

    def _check_speculative(self) -> None:
        """A dict (LLM(speculative_config={...})) is kept as its JSON text: one form for the
        flags and the pass-through to workers."""
        if self.speculative_config is None:
            return
        spec = SpeculativeConfig.parse(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec.to_json())
        if self.pipeline_parallel_size > 1:
            raise ValueError(
                "speculative_config does not support pipeline parallelism yet (got "
                f"pipeline_parallel_size={self.pipeline_parallel_size})."
            )

    def with_batch_defaults(self, offline: bool) -> EngineConfig:
        """This config with `max_num_seqs` and `max_num_batched_tokens` set where unset, from the
        device and the use (`offline`: through LLM; else a served worker), as vLLM does: a step
        of many tokens spreads the host's per-step work (scheduling, inputs, launches, the
        followers' copy of them) over more of them, which on a large GPU pays."""
        if self.max_num_seqs is not None and self.max_num_batched_tokens is not None:
            return self
        device, memory, name = self.torch_device(), 0, ""
        if device.type == "cuda":
            import torch

            props = torch.cuda.get_device_properties(device)
            memory, name = props.total_memory, props.name
        seqs, tokens = batch_defaults(device.type, memory, name, offline)
        return dataclasses.replace(
            self,
            max_num_seqs=self.max_num_seqs or seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or tokens,
        )

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed speculative_config (None: speculation off)."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def ranks_per_node(self) -> int:
        """The ranks each node of a static multi-node launch runs (all of them on one node)."""
        return self.world_size // self.nnodes

    @property
    def world_size(self) -> int:
        """The worker's ranks: tensor-parallel size x pipeline-parallel size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def max_len_for(self, max_position: int) -> int:
        """The longest sequence served with a model of `max_position` positions (before the KV
        cache's capacity may lower it)."""
        max_len = self.max_model_len or max_position
        if max_len > max_position:
            log.warning("max_model_len %d exceeds the model's %d positions", max_len, max_position)
        return max_len

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, _DTYPES[self.dtype])

    def kv_cache_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """What the paged KV cache stores: the model's dtype (auto) or float8 e4m3 (fp8)."""
        import torch

        name = KV_CACHE_DTYPES[self.kv_cache_dtype]
        return model_dtype if name is None else getattr(torch, name)
