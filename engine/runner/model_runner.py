"""Runs one scheduled step: a single forward over a flat batch, then sampling."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch

from pdmesh import envs
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.eplb.balancer import ExpertBalancer
from pdmesh.engine.kv_cache.host.pool import HostPool, OffloadNow, plan_slots
from pdmesh.engine.kv_cache.paged import KVCache, KVCacheSpec, plan_num_blocks
from pdmesh.engine.layers.attention import AttentionMetadata
from pdmesh.engine.layers.moe import FusedMoE
from pdmesh.engine.layers.quantization.registry import apply_quantization, resolve_quantization
from pdmesh.engine.models.info import ModelInfo
from pdmesh.engine.outputs import PositionLogprobs
from pdmesh.engine.parallel.comm import all_reduce_min
from pdmesh.engine.parallel.group import SINGLE, ParallelGroup
from pdmesh.engine.parallel.pipeline import SINGLE_STAGE, PipelineStage
from pdmesh.engine.parallel.symm_all_reduce import symmetric_all_reduce
from pdmesh.engine.runner.cuda_graphs import DecodeGraphs
from pdmesh.engine.runner.dp_attention import agree, moe_exchange, note_rows, pad_idle_step
from pdmesh.engine.runner.step_handle import StepHandle
from pdmesh.engine.runner.step_inputs import StepInputs, prepare_inputs
from pdmesh.engine.runner.step_sampling import StepSampler, greedy_tokens, plain_greedy
from pdmesh.engine.sample import structured
from pdmesh.engine.scheduling.batch import ScheduledBatch
from pdmesh.engine.spec_decode.verify import Verify
from pdmesh.engine.weights import init_dummy_weights, load_named, load_weights
from pdmesh.kv_transfer.connector import KVBinding, KVConnector, KVHeads


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class Followers(Protocol):
    """Rank 0's tensor-parallel followers (engine/executor/driver.py)."""

    def send_step(self, inputs: StepInputs, plan: torch.Tensor | None) -> None:
        """Hand the step to the other ranks, before rank 0 runs it."""
        ...

    def call(self, message: object) -> list[object | None]: ...


def _on_device(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run a method with the runner's GPU as the current device. The current device is per
    thread, and Triton kernels and CUDA graphs use it: a worker on cuda:1 steps from a thread of
    its own (tensor-parallel followers step on the thread that built them, set in __init__)."""

    @functools.wraps(fn)
    def wrapper(self: ModelRunner, *args: Any, **kwargs: Any) -> Any:
        if self.device.type != "cuda":
            return fn(self, *args, **kwargs)
        with torch.cuda.device(self.device):
            return fn(self, *args, **kwargs)

    return wrapper


class ModelRunner:
    def __init__(
        self,
        info: ModelInfo,
        config: EngineConfig,
        device: torch.device,
        max_model_len: int,
        tp: ParallelGroup = SINGLE,
        kv_connector: KVConnector | None = None,
        followers: Followers | None = None,
        stage: PipelineStage = SINGLE_STAGE,
    ) -> None:
        """kv_connector: the KV plane's hooks on this rank (bound here, once the cache exists).
        followers: on rank 0 of a parallel worker, the ranks each step is sent to. stage: this
        rank's pipeline stage (its layers; engine/parallel/pipeline.py)."""
        self.info = info
        self.stage = stage
        self.device = device
        if device.type == "cuda":
            torch.cuda.set_device(device)  # for this (the building) thread
        self.dtype = dtype = config.torch_dtype(device)
        self.block_size = block_size = config.block_size
        tp = moe_exchange(tp, config, device)
        # Data-parallel attention: the MoE layers' group is every data-parallel rank, and each
        # step those ranks agree on its size (`agree`, dp_attention.py); None otherwise.
        self.dp = tp.moe if tp.moe is not None and tp.moe.data_parallel else None
        with torch.device(device), _default_dtype(dtype):
            model = info.model_cls(info.hf_config, max_model_len, tp, stage)
            apply_quantization(model, resolve_quantization(config.quantization, info.hf_config))
        # Placement is made explicit: a torch.device context can be overridden by a default-device
        # mode left behind by other code in the process (seen with transformers on CUDA).
        model.to(device)
        if config.load_format == "dummy":
            init_dummy_weights(model, config.seed)
        else:
            load_weights(model, info.folder)
        self.model = model.eval()
        # EPLB: re-places the experts between steps from their counted load (every rank).
        self.balancer: ExpertBalancer | None = None
        if config.enable_eplb:
            moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
            self.balancer = ExpertBalancer(
                moe, config.eplb_window_size, config.eplb_step_interval, tp.moe_group
            )
        attn_layers = model.attention_layers()
        self.kv_spec = KVCacheSpec(
            num_layers=len(attn_layers),
            num_kv_heads=attn_layers[0].num_kv_heads,
            head_dim=info.head_dim,
            block_size=block_size,
            dtype=config.kv_cache_torch_dtype(dtype),  # fp8: float8 e4m3 (layers/attention.py)
        )
        num_blocks = plan_num_blocks(
            self.kv_spec, device, config.kv_cache_tokens, config.kv_cache_memory_fraction
        )
        world = stage.world if stage.size > 1 else tp
        if world.size > 1:  # every rank must hold the same blocks
            num_blocks = all_reduce_min(num_blocks, world)
        self.kv_cache = KVCache(self.kv_spec, num_blocks, device)
        self.kv_cache.bind(attn_layers)
        self.host_pool: HostPool | None = None  # the host tier (engine/kv_cache/host/pool.py)
        if config.kv_offload_gib > 0 and config.enable_prefix_caching:
            slots = plan_slots(self.kv_spec, config.kv_offload_gib, world.size)
            if world.size > 1:  # every rank must hold the same slots
                slots = all_reduce_min(slots, world)
            self.host_pool = HostPool(self.kv_spec, slots, device)
        self.step_sampler = StepSampler(config.seed, info.eos_token_ids, device)
        self.steps_sampled_last = 0  # pipeline steps sampled on the last stage (step_sampling.py)
        # Decode steps replay CUDA graphs. With tensor parallelism every rank captures the same
        # graphs, their all-reduces over symmetric memory (NCCL stays out of the graphs: its
        # vocab all-gather for the logits runs after the replay).
        self.graphs: DecodeGraphs | None = None
        # The torch reference kernels sync with the host: only the Triton ones are captured.
        capturable = envs.kernel_backend() != "torch"
        if device.type == "cuda" and capturable:  # compiled now, not mid-step (attention.py)
            attn_layers[0].warm_up(dtype, max_model_len)
        max_batch = min(config.max_num_seqs, 512)
        # A pipeline stage captures its own layers (the sends and receives between stages stay
        # outside its graphs); a stage of several TP ranks, its all-reduces over symmetric memory
        # among its own ranks.
        if device.type == "cuda" and capturable and not config.enforce_eager:
            # Expert parallelism's all_to_all sizes its exchange on the host: eager.
            if tp.size > 1 and (not tp.expert_parallel or tp.moe_all_reduce):
                hidden = info.hf_config.hidden_size
                fast = symmetric_all_reduce(tp, max_batch * hidden, dtype)
                # Every rank replays graphs or none does: a rank stepping eagerly would wait
                # forever in an all-reduce its peers run inside their graphs.
                if all_reduce_min(int(fast is not None), tp) and fast is not None:
                    tp.fast["all_reduce"] = fast
            if tp.size == 1 or "all_reduce" in tp.fast:
                self.graphs = DecodeGraphs(
                    model,
                    device,
                    block_size,
                    max_batch,
                    max_model_len,
                    logits=tp.size == 1,
                    stage=stage,
                    hidden_size=info.hf_config.hidden_size,
                    dtype=dtype,
                    before_forward=self._note_rows if self.dp is not None else None,
                )
        # Every stage replays or none does: a stage sends a whole bucket to a graph's buffer,
        # where an eager one sends and expects the step's rows only.
        if stage.size > 1 and device.type == "cuda":
            replays = all_reduce_min(int(self.graphs is not None), stage.world)
            self.graphs = self.graphs if replays else None
        self.tp = tp
        self.followers = followers
        self.kv_connector = kv_connector
        self._saving = False  # a step with a KV plan runs: the connector saves after each layer
        if kv_connector is not None:
            first_layer = stage.layers.start if stage.layers is not None else 0
            kv_connector.bind(KVBinding(self.kv_cache.data, self.kv_heads, followers, first_layer))
            for i, layer in enumerate(attn_layers):
                layer.register_forward_hook(self._after_attention(i))

    def load_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the weights with named checkpoint tensors already in memory."""
        load_named(self.model, tensors, "the tensors given")

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def kv_heads(self) -> KVHeads:
        """The global KV heads this rank's cache holds."""
        return KVHeads.of_rank(self.info.num_kv_heads, self.tp.rank, self.tp.size)

    def prepare(self, batch: ScheduledBatch, next_ids: torch.Tensor | None = None) -> StepInputs:
        """The step's inputs (`prepare_inputs`, step_inputs.py). next_ids ([B] on the device,
        decode-only batches): the tokens a step still on the device samples for them."""
        return prepare_inputs(batch, self.block_size, self.device, next_ids)

    @torch.inference_mode()
    def forward_logits(self, inputs: StepInputs) -> torch.Tensor | None:
        """The model over the flat batch; logits [S, V] of the rows to sample (None if none)."""
        host = inputs.host
        if self.host_pool is not None:
            # Evicted blocks out before anything overwrites them, then host hits in.
            self.host_pool.copy(self.kv_cache.data, host.offloads, host.loads, host.overlap_loads)
        if inputs.block_copies is not None:  # before any layer writes this step's K/V
            self.kv_cache.copy_blocks(inputs.block_copies)
        meta, graphs = inputs.meta, None if self._saving else self.graphs
        n, num_sampled = inputs.input_ids.numel(), len(inputs.sample_seq_index)
        stage, carry = self.stage, None
        fits = graphs is not None and graphs.covers(n, meta.num_decode_tokens, num_sampled)
        bucket = None
        if self.dp is not None:  # every data-parallel rank replays the same bucket, or none does
            most, all_fit = agree(self.dp, n, fits)
            fits = fits and all_fit
            bucket = graphs.bucket(most) if fits and graphs is not None else None
            self.dp.step_tokens[:] = [0 if fits else most, 0]
        if graphs is not None and fits:
            if not stage.is_first:
                stage.recv_into(graphs.carry(graphs.bucket(n)))
            out = graphs.run(inputs.input_ids, inputs.positions, meta, bucket)
            if stage.is_last:
                return out
            # [2, bs, H]: a copy, as the next replay of this bucket overwrites the graph's
            # output while the send may still read it (the send runs on NCCL's stream).
            stage.send_next(out.clone())
            return None
        if not stage.is_first:
            carry = stage.recv_prev((2, n, self.info.hidden_size), self.dtype)
        if self.dp is not None:
            self._note_rows(inputs.meta)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, carry)
        if not stage.is_last:
            stage.send_next(hidden)
            return None
        if not inputs.logits_indices.numel():
            return None
        return self.model.compute_logits(hidden[inputs.logits_indices])

    @_on_device
    @torch.inference_mode()
    def idle_step(self) -> bool:
        """A data-parallel rank with nothing to run: join the step the other ranks run (their
        MoE layers' collectives) with padding rows only. False: no rank ran anything."""
        assert self.dp is not None, "idle steps are for data-parallel attention"
        if not pad_idle_step(self.dp, self.graphs, self.model, self.device):
            return False
        if self.balancer is not None:
            self.balancer.after_step()
        return True

    def _note_rows(self, meta: AttentionMetadata) -> None:
        """The rows the MoE layers are about to run (`note_rows`, dp_attention.py)."""
        assert self.dp is not None
        note_rows(self.dp, meta)

    def offload_now(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """Copy these (evicted block, host slot) pairs to the host tier on every rank before
        returning (between steps), and finish the loads still running beside a step."""
        if self.host_pool is None or not (pairs or self.host_pool.loading):
            return
        flat = [x for pair in pairs for x in pair]
        if self.followers is not None:
            self.followers.call(OffloadNow(tuple(flat)))
        self.host_pool.offload_now(self.kv_cache.data, flat)

    @property
    def has_planner(self) -> bool:
        """Steps carry KV plans: the engine launches them one at a time."""
        return self.kv_connector is not None and self.kv_connector.plans_steps

    def _after_attention(self, layer: int) -> Callable[..., None]:
        def hook(*_: object) -> None:
            if self._saving:
                assert self.kv_connector is not None
                self.kv_connector.save_layer(layer)

        return hook

    @torch.inference_mode()
    def forward_with_plan(
        self, inputs: StepInputs, plan: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The forward of one step with its KV plan in force (followers run steps this way)."""
        if plan is None or self.kv_connector is None:
            return self.forward_logits(inputs)
        self.kv_connector.start_step(plan)
        self._saving = True
        try:
            return self.forward_logits(inputs)
        finally:
            self._saving = False
            self.kv_connector.end_step()

    @_on_device
    def follow_step(self, inputs: StepInputs, plan: torch.Tensor | None) -> None:
        """A follower rank's part of a step; the last pipeline stage hands rank 0 the logits,
        or the tokens of a step of plain greedy rows (engine/runner/step_sampling.py)."""
        logits = self.forward_with_plan(inputs, plan)
        if logits is not None and self.stage.sends_back:
            greedy = inputs.host.greedy  # [2, S] ids instead of [S, V] logits (see launch)
            self.stage.send_back(torch.stack(greedy_tokens(logits)) if greedy else logits)
        if self.balancer is not None:
            self.balancer.after_step()

    @_on_device
    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, next_ids: torch.Tensor | None = None) -> StepHandle:
        """Queue `batch`'s forward and sampling on the device; `collect` reads the tokens. The
        host does not wait for the device here (seeded sampling aside), so it can prepare the
        next step meanwhile. next_ids: see `prepare`."""
        inputs = self.prepare(batch, next_ids)
        plan = self.kv_connector.plan_step(batch) if self.kv_connector is not None else None
        seqs = [batch.seqs[i] for i in inputs.sample_seq_index]
        # Speculative decoding: a sequence with draft tokens samples a row per draft as well.
        verify = Verify.of(seqs)
        if verify is not None:
            seqs = verify.row_seqs
        # Pipeline stages: a step of plain greedy rows is sampled on the last stage.
        inputs.host.greedy = self.stage.size > 1 and plain_greedy(seqs, inputs, verify)
        if self.followers is not None:  # every rank runs the step; rank 0 samples
            self.followers.send_step(inputs, plan)
        masks = structured.start_masks(seqs, self.info.vocab_size)  # while the forward runs
        logits = self.forward_with_plan(inputs, plan)
        if self.balancer is not None:  # between this step and the next, as every rank does
            self.balancer.after_step()
        handle = StepHandle(len(batch.seqs), inputs.sample_seq_index, None, verify=verify)
        rows = len(inputs.host.logits_indices)
        if self.stage.size > 1 and rows:
            # The last stage computes the logits: receive them (or its tokens) without waiting,
            # so the next batch can start on this stage meanwhile (batches in flight, LLMEngine).
            if inputs.host.greedy:
                self.steps_sampled_last += 1
                arriving = self.stage.irecv_back((2, rows), torch.int64)

                def use(ids: torch.Tensor) -> None:  # [2, S]: tokens, flagged
                    StepSampler.take(handle, ids[0], ids[1])
            else:
                arriving = self.stage.irecv_back((rows, self.info.vocab_size), self.dtype)

                def use(logits: torch.Tensor) -> None:
                    self.step_sampler.sample(handle, logits, seqs, batch, inputs, masks)

            def sample_arrived() -> None:
                arriving(use)
                if handle.tokens is not None and handle.tokens.is_cuda:
                    # Sampled on the stage's own stream: a step launched ahead reads them here.
                    handle.tokens.record_stream(torch.cuda.current_stream())

            handle.sample = sample_arrived
        elif logits is not None:
            self.step_sampler.sample(handle, logits, seqs, batch, inputs, masks)
        return handle

    @_on_device
    def collect(self, handle: StepHandle) -> list[int | None]:
        """The sampled token of each sequence of a launched step (None: its KV is incomplete)."""
        sampled: list[int | None] = [None] * handle.num_seqs
        for i, token in zip(handle.sample_seq_index, handle.read(), strict=True):
            sampled[i] = token
        return sampled

    def collect_logprobs(
        self, handle: StepHandle, sampled: list[int | None]
    ) -> list[PositionLogprobs | None] | None:
        """After `collect`: each sequence's log-probabilities of its sampled token (None where
        not asked for; None for all when no row asked)."""
        if handle.logprobs is None:
            return None
        top, wanted = handle.logprobs
        chosen = [sampled[i] for i in handle.sample_seq_index]
        rows = top.rows(chosen, wanted)  # type: ignore[arg-type]
        out: list[PositionLogprobs | None] = [None] * handle.num_seqs
        for i, row in zip(handle.sample_seq_index, rows, strict=True):
            out[i] = row
        return out

    def expert_counts(self) -> list[int] | None:
        """Tokens routed to each expert, summed over MoE layers (None for dense models)."""
        counts = [m.expert_counts for m in self.model.modules() if hasattr(m, "expert_counts")]
        if not counts:
            return None
        return torch.stack(counts).sum(0).tolist()
