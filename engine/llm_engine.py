"""The engine loop shared by every worker: add requests, step, stream deltas, abort."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pdmesh import envs
from pdmesh.checkpoint.source import resolve_model_folder
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.eplb.balancer import EplbStats
from pdmesh.engine.executor.driver import TPDriver, rank_device
from pdmesh.engine.kv_cache.block_manager import BlockManager
from pdmesh.engine.kv_cache.host.index import HostIndex
from pdmesh.engine.models.info import ModelInfo
from pdmesh.engine.outputs import (
    EngineStats,
    FirstTokens,
    ForkStats,
    RequestOutput,
    StepDelta,
    mark_request_ends,
)
from pdmesh.engine.parallel.group import SINGLE, ParallelGroup
from pdmesh.engine.parallel.pipeline import SINGLE_STAGE, check_world
from pdmesh.engine.runner.model_runner import ModelRunner
from pdmesh.engine.sample.sampler import Sampler
from pdmesh.engine.sample.structured import Grammars
from pdmesh.engine.scheduling.burst import PrefillRate
from pdmesh.engine.scheduling.choices import (
    Limits,
    check_choices,
    check_first_tokens,
    new_sequences,
)
from pdmesh.engine.scheduling.request import Request
from pdmesh.engine.scheduling.scheduler import Scheduler
from pdmesh.engine.sequence import Sequence
from pdmesh.engine.spec_decode.speculator import make_speculator
from pdmesh.engine.stats import eplb_stats, expert_counts, log_kv_cache, with_spec_and_host_tier
from pdmesh.engine.step_loop import StepLoop
from pdmesh.engine.warm_up import warm_up
from pdmesh.errors import InvalidRequest
from pdmesh.kernels.cpu.threads import set_cpu_threads
from pdmesh.kv_transfer.connector import ExternalBlocks, KVConnector
from pdmesh.logger import get_logger
from pdmesh.sampling_params import SamplingParams
from pdmesh.text.tokenizer import Tokenizer
from pdmesh.validation import check_prompt_ids

log = get_logger(__name__)


class LLMEngine:
    """One engine: a single process, or rank 0 of a tensor-parallel worker whose other ranks it
    starts itself (see tp_follower). `kv_connector`: the KV plane a service wires in (every
    rank runs one, built from its `follower_options()`)."""

    def __init__(
        self,
        config: EngineConfig,
        kv_connector: KVConnector | None = None,
        moe_group: ParallelGroup | None = None,
    ) -> None:
        """moe_group: data-parallel attention (engine/data_parallel/): every data-parallel
        rank, which this engine's MoE layers split their experts over."""
        self.config = config = config.with_batch_defaults(offline=False)
        if (threads := envs.num_threads()) is not None:
            set_cpu_threads(threads)
        self.info = ModelInfo.load(resolve_model_folder(config.model))
        self.info.check_parallel(
            config.tensor_parallel_size,
            config.enable_expert_parallel,
            # Under data-parallel attention EPLB places the experts over every replica's ranks
            # (checked by the front, engine/data_parallel/front.py).
            config.num_redundant_experts if config.enable_eplb and moe_group is None else None,
        )
        check_world(config, self.info.num_layers)
        self.tokenizer = None if config.skip_tokenizer_init else Tokenizer.load(self.info.folder)
        device = config.torch_device()
        rank0 = rank_device(device, 0)
        max_len = config.max_len_for(self.info.max_position)
        self.tp_driver: TPDriver | None = None
        group, stage = SINGLE, SINGLE_STAGE
        if config.world_size > 1:
            options = kv_connector.follower_options() if kv_connector is not None else None
            self.tp_driver = TPDriver(config, device, self.info.num_layers, options)
            group, stage = self.tp_driver.tp, self.tp_driver.stage
        if moe_group is not None:
            group = dataclasses.replace(group, moe=moe_group)
        try:
            self.runner = ModelRunner(
                self.info, config, rank0, max_len, group, kv_connector, self.tp_driver, stage
            )
        except BaseException:
            self.close()
            raise
        capacity = self.runner.num_blocks * config.block_size
        if capacity < max_len:
            if config.max_model_len is not None:
                raise ValueError(
                    f"max_model_len ({max_len}) is larger than the KV cache ({capacity} tokens); "
                    "raise kv_cache_tokens / kv_cache_memory_fraction or lower max_model_len"
                )
            log.warning(
                "max_model_len lowered from %d to the KV cache's %d tokens", max_len, capacity
            )
            max_len = capacity
        self.max_model_len = max_len
        pool = self.runner.host_pool
        self.host_index = HostIndex(pool.num_slots) if pool is not None else None
        blocks = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching, self.host_index
        )
        self.limits = Limits(max_len, config.block_size, blocks.num_blocks, config.max_num_seqs)
        self.scheduler = Scheduler(
            blocks,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            overlap_loads=rank0.type == "cuda",  # copies beside a forward: a stream of their own
        )
        self._requests: dict[str, Request] = {}
        # Speculative decoding (engine/spec_decode/speculator.py); None: off.
        self.speculator = make_speculator(
            config.speculative,
            max_len,
            target=self.info,
            engine_config=config,
            device=rank0,
            capacity_tokens=capacity,
        )
        self.grammars = Grammars(self.info.folder, self.info.vocab_size, self.info.eos_token_ids)
        # Launching, the steps in flight and outputting their tokens (engine/step_loop.py).
        self.steps = StepLoop(
            config,
            self.runner,
            self.scheduler,
            self.speculator,
            self._requests,
            eos_token_ids=self.info.eos_token_ids,
            max_model_len=max_len,
        )
        kv_bytes = self.runner.kv_cache.nbytes
        log_kv_cache(self.runner.num_blocks, config.block_size, kv_bytes, max_len, pool)
        # Kernels compile now, not in a user's step (engine/warm_up.py). Data-parallel
        # attention's replicas step in lockstep: one warming alone would wait for the others.
        if rank0.type == "cuda" and self.runner.dp is None:
            warm_up(self)

    # -- requests -----------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequest(
                "prompt must be token ids: this engine runs without a tokenizer.", "prompt"
            )
        return list(self.tokenizer.encode(prompt))

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        num_output_tokens: int = 0,
    ) -> Sequence:
        """Queue a request; raises ValueError (naming the field) for bad input, among it more
        sequences (n, best_of) than this worker can ever hold. Returns the sequence that runs
        the prompt (the request's choices fork from it, see `is_finished`).
        `num_output_tokens`: the prompt's last tokens are output a lost worker already produced
        (a resumed request; see Sequence)."""
        request = self._new_request(request_id, prompt, params, arrival_time, num_output_tokens)
        self._requests[request_id] = request
        self.scheduler.add(request.seq)
        return request.seq

    def _new_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None,
        num_output_tokens: int,
    ) -> Request:
        """A request's record, not yet registered; raises ValueError for bad input."""
        if request_id in self._requests:
            raise InvalidRequest(f"request_id {request_id!r} is already in use", "request_id")
        if not isinstance(params, SamplingParams):
            raise InvalidRequest("sampling_params must be a SamplingParams", "sampling_params")
        if params.stop and self.tokenizer is None:
            raise InvalidRequest(
                "stop strings need a tokenizer; this engine runs without one.", "stop"
            )
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        check_prompt_ids(token_ids, self.info.vocab_size, self.max_model_len, "prompt_token_ids")
        if not 0 <= num_output_tokens < min(len(token_ids), params.max_tokens):
            raise InvalidRequest(
                f"num_output_tokens_sent must be in [0, {min(len(token_ids), params.max_tokens)})"
                f" (fewer than the prompt's tokens and max_tokens), got {num_output_tokens}.",
                "num_output_tokens_sent",
            )
        check_choices(params, len(token_ids) - num_output_tokens, num_output_tokens, self.limits)
        seqs = new_sequences(request_id, token_ids, params, text, arrival_time, num_output_tokens)
        for seq in seqs if params.structured_outputs is not None else ():
            seq.grammar = self.grammars.matcher(params.structured_outputs)
        return Request.start(seqs, self.tokenizer)

    # -- prompts prefilled by another worker ---------------------------------------------------
    def reserve_prefill(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        num_output_tokens: int = 0,
    ) -> ExternalBlocks | None:
        """Hold blocks for the whole prompt (after this worker's prefix-cache hit) so another
        worker can fill them. None when blocks or sequence slots are short right now; raises
        ValueError (naming the field) for bad input."""
        request = self._new_request(request_id, prompt, params, arrival_time, num_output_tokens)
        reservation = self.scheduler.reserve(request.seq)
        if reservation is not None:
            self._requests[request_id] = request
            self.runner.offload_now(self.scheduler.take_offloads())
        return reservation

    def cached_prefix_tokens(self, prompt: list[int]) -> int:
        """Prompt tokens this worker's prefix cache holds now."""
        return self.scheduler.cached_prefix_tokens(prompt)

    def commit_prefill(
        self, request_id: str, first: FirstTokens, defer_caching: bool = False
    ) -> list[StepDelta]:
        """The prompt's KV is in its blocks and its first tokens were sampled (with what else the
        prefill worker computed): the request forks into its sequences (sharing the prompt's
        blocks) and decodes; a delta per sequence. `first`: see `check_first_tokens`.
        defer_caching: publish the prompt's blocks in the prefix cache after the next step (or
        when it finishes): hashing a long prompt does not hold back its first token."""
        request = self._requests[request_id]
        check_first_tokens(request.seq.params, first)
        self.scheduler.commit(request_id, defer_caching)
        seqs = [c.seq for c in request.choices]  # forked: running from the next step
        for seq in seqs:
            if seq.generator is not None and not seq.params.greedy:
                # The prefill worker drew the first token from this seed: skip that draw here
                # so the rest matches a single-worker run.
                Sampler.skip_draw(seq.generator)
        if request.prompt_logprobs is not None and first.prompt_logprobs is not None:
            request.prompt_logprobs = first.prompt_logprobs
        deltas = [
            self.steps.append_token(
                request, seq, token, first.logprobs[i] if first.logprobs else None
            )
            for i, (seq, token) in enumerate(zip(seqs, first.token_ids, strict=True))
        ]
        return mark_request_ends(deltas, self.is_finished)

    def release_prefill(self, request_id: str) -> None:
        """The remote prefill failed: free the blocks and prefill the prompt here instead."""
        self.scheduler.release(request_id)

    def is_reserved(self, request_id: str) -> bool:
        return self.scheduler.is_reserved(request_id)

    def abort_request(self, request_id: str) -> StepDelta | None:
        """End every choice of a request still running (its blocks freed); one delta (index 0)
        for the whole request, or None when it had ended already."""
        request = self._requests.get(request_id)
        if request is None or request.is_finished:
            return None
        for choice in request.choices:
            if not choice.seq.is_finished:  # choices never forked end with the first
                self.steps.end(choice.seq, "abort")
        return StepDelta(request_id, [], "", "abort", request_finished=True)

    def request(self, request_id: str) -> Request | None:
        """The request as the loop serves it (None: not known here)."""
        return self._requests.get(request_id)

    def is_finished(self, request_id: str) -> bool:
        """Whether every choice of the request has ended (`get_output` is then its result; the
        delta that ended it has `request_finished`). False for a request not known here."""
        request = self._requests.get(request_id)
        return request is not None and request.is_finished

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or a step on the device still to handle."""
        return self.scheduler.has_unfinished() or bool(self.steps.inflight)

    def num_waiting_for_blocks(self) -> int:
        """Queued requests beyond what the KV cache can take now (see Scheduler)."""
        return self.scheduler.num_waiting_for_blocks()

    # -- the loop (engine/step_loop.py) -------------------------------------------------------
    def step(self) -> list[StepDelta]:
        """Run a step and return its deltas. The step handled may be one launched by an earlier
        call (async scheduling, pipeline stages), and others may be on the device on return."""
        return self.steps.step()

    @property
    def stalled(self) -> bool:
        """The last step could do nothing: queued requests wait for blocks that prompts being
        prefilled elsewhere hold."""
        return self.steps.stalled

    @property
    def group_busy(self) -> bool:
        """Under data-parallel attention: whether any rank ran anything in the last step."""
        return self.steps.group_busy

    @property
    def async_scheduling(self) -> bool:
        """Whether a step's next one is launched before its tokens are read."""
        return self.steps.async_scheduling

    @property
    def prefill_rate(self) -> PrefillRate:
        """Seconds a token costs in prefill-heavy steps, as this engine measured them."""
        return self.steps.prefill_rate

    @property
    def most_in_flight(self) -> int:
        """The most batches on the device at once so far."""
        return self.steps.most_in_flight

    # -- results ------------------------------------------------------------------------------
    def get_output(self, request_id: str) -> RequestOutput:
        """The request's result so far: n completions, index 0 .. n-1 (with best_of > n the n
        with the highest cumulative log-probability, best first)."""
        return self._requests[request_id].output()

    def release(self, request_id: str) -> None:
        """Forget a finished request's results (nothing happens while a choice still runs)."""
        request = self._requests.get(request_id)
        if request is not None and request.is_finished:
            del self._requests[request_id]

    def expert_counts(self) -> list[int] | None:
        """Tokens routed to each expert since start, over every rank (None: a dense model)."""
        ep = self.config.enable_expert_parallel
        return expert_counts(self.runner.expert_counts(), self.tp_driver, ep)

    def eplb_stats(self) -> EplbStats | None:
        """EPLB's figures over every rank, now (None: EPLB off). Between steps only: the
        followers are asked."""
        return eplb_stats(self.runner.balancer, self.tp_driver)

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (nothing to do for one rank)."""
        if self.tp_driver is not None:
            self.tp_driver.shutdown()

    def stopper(self) -> Callable[[], None]:
        """What stops this engine's other ranks, holding nothing else (an owner's finalizer
        must not keep the engine's memory alive)."""
        driver = self.tp_driver
        return driver.shutdown if driver is not None else lambda: None

    def stats(self) -> EngineStats:
        bs, spec = self.config.block_size, self.speculator
        block_bytes = self.info.kv_block_bytes(bs, self.runner.kv_spec.dtype.itemsize)
        return with_spec_and_host_tier(
            self.scheduler.stats(),
            spec.stats if spec is not None else None,
            self.host_index,
            self.runner.host_pool,
            bs,
            block_bytes,
        )

    def fork_stats(self) -> ForkStats:
        """Blocks shared by requests' choices and copies on write, since start."""
        return self.scheduler.fork_stats()

    @property
    def steps_launched_ahead(self) -> int:
        """Steps launched before the previous one's tokens were read (async scheduling)."""
        return self.scheduler.num_lookaheads
