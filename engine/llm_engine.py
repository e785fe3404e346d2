"""The engine loop shared by every worker: add requests, step, stream deltas, abort."""

from __future__ import annotations

import time
from typing import Any

import torch

from pdmesh import envs
from pdmesh.engine.block_manager import BlockManager
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.detokenizer import IncrementalDetokenizer
from pdmesh.engine.model_info import ModelInfo
from pdmesh.engine.model_runner import ModelRunner
from pdmesh.engine.model_source import resolve_model_folder
from pdmesh.engine.outputs import (
    CompletionOutput,
    EngineStats,
    RequestMetrics,
    RequestOutput,
    Reservation,
    StepDelta,
)
from pdmesh.engine.overlap import InFlight, next_decode
from pdmesh.engine.parallel import SINGLE
from pdmesh.engine.sampler import Sampler
from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.engine.scheduler import Scheduler
from pdmesh.engine.sequence import Sequence, SequenceStatus
from pdmesh.engine.tp_driver import TPDriver, rank_device
from pdmesh.logger import get_logger

log = get_logger(__name__)


def resolve_max_model_len(config: EngineConfig, info: ModelInfo) -> int:
    """The longest sequence served (before the KV cache's capacity may lower it)."""
    max_len = config.max_model_len or info.max_position
    if max_len > info.max_position:
        log.warning("max_model_len %d exceeds the model's %d positions", max_len, info.max_position)
    return max_len


def load_tokenizer(folder: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


class LLMEngine:
    """One engine: a single process, or rank 0 of a tensor-parallel worker whose other ranks it
    starts itself (`rank_extension`: "module:Class" run on those ranks, see tp_follower)."""

    def __init__(
        self,
        config: EngineConfig,
        rank_extension: str | None = None,
        extension_options: dict[str, Any] | None = None,
    ) -> None:
        self.config = config
        if (threads := envs.num_threads()) is not None:
            torch.set_num_threads(threads)
        self.info = ModelInfo.load(resolve_model_folder(config.model))
        self.info.check_parallel(config.tensor_parallel_size, config.enable_expert_parallel)
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(self.info.folder)
        device = config.torch_device()
        max_len = resolve_max_model_len(config, self.info)
        self.tp_driver: TPDriver | None = None
        group = SINGLE
        if config.tensor_parallel_size > 1:
            self.tp_driver = TPDriver(config, device, rank_extension, extension_options)
            group = self.tp_driver.group
        try:
            self.runner = ModelRunner(self.info, config, rank_device(device, 0), max_len, tp=group)
        except BaseException:
            self.close()
            raise
        if self.tp_driver is not None:
            self.tp_driver.attach(self.runner)
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
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens
        )
        self._seqs: dict[str, Sequence] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._texts: dict[str, str] = {}
        self._reserved: dict[str, Sequence] = {}
        # The last step could do nothing: queued requests wait for blocks that prompts being
        # prefilled elsewhere hold (their KV's arrival is what unblocks it).
        self.stalled = False
        # Async scheduling (see overlap.py): on with CUDA graphs unless the config says.
        self.async_scheduling = (
            config.async_scheduling
            if config.async_scheduling is not None
            else self.runner.graphs is not None
        )
        self._inflight: InFlight | None = None
        self.steps_launched_ahead = 0  # steps launched before the previous one's tokens were read
        self._free_after_step: list[Sequence] = []  # ended while `_inflight` runs
        log.info(
            "KV cache: %s tokens (%d blocks of %d, %.2f GiB); "
            "maximum concurrency for %s tokens per request: %.2fx",
            f"{capacity:,}",
            self.runner.num_blocks,
            config.block_size,
            self.runner.kv_cache.nbytes / 2**30,
            f"{max_len:,}",
            capacity / max_len,
        )

    # -- requests -----------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt must be token ids: this engine runs without a tokenizer.")
        return list(self.tokenizer.encode(prompt))

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        num_output_tokens: int = 0,
    ) -> Sequence:
        """Queue a request; raises ValueError (naming the field) for bad input.
        `num_output_tokens`: the prompt's last tokens are output a lost worker already produced
        (a resumed request; see Sequence)."""
        seq = self._new_sequence(request_id, prompt, params, arrival_time, num_output_tokens)
        self.scheduler.add(seq)
        return seq

    def _new_sequence(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None,
        num_output_tokens: int = 0,
        validated: bool = False,
    ) -> Sequence:
        if request_id in self._seqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine runs without one.")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if not validated:
            self.validate_prompt(token_ids)
        if not 0 <= num_output_tokens < min(len(token_ids), params.max_tokens):
            raise ValueError(
                f"num_output_tokens_sent must be in [0, {min(len(token_ids), params.max_tokens)})"
                f" (fewer than the prompt's tokens and max_tokens), got {num_output_tokens}."
            )
        seq = Sequence(request_id, token_ids, params, text, arrival_time, num_output_tokens)
        detok = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids, params.skip_special_tokens, params.stop
        )
        # Replay the output already streamed (by a lost worker): the detokenizer ends up holding
        # back exactly what that worker held back, and its text was sent already.
        sent_text = "".join(detok.add(t).text for t in seq.output_token_ids)
        if seq.generator is not None and not params.greedy:
            for _ in range(num_output_tokens):  # each streamed token was one draw of the seed
                Sampler.skip_draw(seq.generator, self.info.vocab_size)
        self._seqs[request_id] = seq
        self._detok[request_id] = detok
        self._texts[request_id] = sent_text
        return seq

    # -- prompts prefilled by another worker ---------------------------------------------------
    def reserve_prefill(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        num_output_tokens: int = 0,
    ) -> Reservation | None:
        """Hold blocks for the whole prompt (after this worker's prefix-cache hit) so another
        worker can fill them. None when blocks or sequence slots are short right now."""
        if request_id in self._seqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.validate_prompt(list(prompt))
        probe = Sequence(request_id, list(prompt), params)
        prefix = self.block_manager.match_prefix(probe)
        new_tokens = probe.num_tokens - len(prefix) * self.block_manager.block_size
        busy = self.scheduler.num_running + len(self._reserved)
        # No overtaking: the blocks of requests queued ahead stay theirs, and nothing is held
        # while one of them waits for blocks.
        queued_blocks, beyond = self.scheduler.waiting_demand()
        if (
            busy >= self.config.max_num_seqs
            or beyond
            or not self.block_manager.can_allocate(probe, new_tokens, prefix, queued_blocks)
        ):
            return None
        seq = self._new_sequence(
            request_id, prompt, params, arrival_time, num_output_tokens, validated=True
        )
        self.block_manager.allocate(seq, new_tokens, prefix)
        seq.num_cached_tokens = seq.num_computed_tokens
        seq.status = SequenceStatus.PREFILLING
        self._reserved[request_id] = seq
        return Reservation(seq, len(prefix), seq.block_table[len(prefix) :])

    def cached_prefix_tokens(self, prompt: list[int]) -> int:
        """Prompt tokens this worker's prefix cache holds now."""
        probe = Sequence("", list(prompt), SamplingParams())
        return len(self.block_manager.match_prefix(probe)) * self.block_manager.block_size

    def commit_prefill(
        self, request_id: str, first_token: int, defer_caching: bool = False
    ) -> StepDelta:
        """The prompt's KV is in its blocks and `first_token` was sampled: start decoding.
        defer_caching: publish the prompt's blocks in the prefix cache after the next step (or
        when it finishes), so hashing a long prompt does not hold back its first token."""
        seq = self._reserved.pop(request_id)
        seq.num_computed_tokens = seq.num_tokens
        if not defer_caching:
            self.block_manager.cache_full_blocks(seq)
        if seq.generator is not None and not seq.params.greedy:
            # The prefill worker drew the first token from this seed: skip that draw here so
            # the rest matches a single-worker run.
            Sampler.skip_draw(seq.generator, self.info.vocab_size)
        self.scheduler.add_running(seq)
        return self._append(seq, first_token)

    def release_prefill(self, request_id: str) -> None:
        """The remote prefill failed: free the blocks and prefill the prompt here instead."""
        seq = self._reserved.pop(request_id)
        self.block_manager.free(seq)
        self.scheduler.add(seq)

    def is_reserved(self, request_id: str) -> bool:
        return request_id in self._reserved

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt must not be empty (it has 0 tokens).")
        vocab = self.info.vocab_size
        bad = [
            t
            for t in token_ids
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab
        ]
        if bad:
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab}), got {bad[0]!r}.")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; the model's max length (max_model_len) is "
                f"{self.max_model_len}, which must leave room for at least one new token."
            )

    def abort_request(self, request_id: str) -> StepDelta | None:
        seq = self._seqs.get(request_id)
        if seq is None or seq.is_finished:
            return None
        self._reserved.pop(request_id, None)
        self._end(seq, "abort")
        return StepDelta(request_id, [], "", "abort")

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or a step on the device still to handle."""
        return self.scheduler.has_unfinished() or self._inflight is not None

    def num_waiting_for_blocks(self) -> int:
        """Queued requests beyond what the KV cache can take now (see Scheduler)."""
        return self.scheduler.num_waiting_for_blocks()

    # -- the loop -----------------------------------------------------------------------------
    def step(self) -> list[StepDelta]:
        """Run a step and return its deltas. With async scheduling the step handled may be one
        launched by the previous call, and the next may already be on the device on return."""
        cur = self._inflight
        if cur is None:
            batch = self.scheduler.schedule()
            self.stalled = not batch and bool(self._reserved)
            if not batch:
                if self.scheduler.has_unfinished() and not self.stalled:
                    raise RuntimeError("scheduler made no progress with requests pending")
                return []
            cur = InFlight(batch, self.runner.launch(batch))
        self.stalled = False
        self._inflight = self._launch_next(cur) if self.async_scheduling else None
        sampled = self.runner.collect(cur.handle)
        for seq in self._free_after_step:  # ended while `cur` ran: it no longer writes to them
            self.block_manager.free(seq)
        self._free_after_step = []
        deltas: list[StepDelta] = []
        for seq, n, token in zip(cur.batch.seqs, cur.batch.num_new_tokens, sampled, strict=True):
            if seq.is_finished:
                continue  # aborted while the step ran: its token is dropped
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
            if token is not None:
                deltas.append(self._append(seq, token))
        return deltas

    def _launch_next(self, cur: InFlight) -> InFlight | None:
        if self.runner.has_planner:
            return None  # steps that push KV are planned one at a time
        nxt = next_decode(cur, self.scheduler, self.block_manager, self.max_model_len)
        if nxt is None:
            return None
        batch, token_ids = nxt
        self.steps_launched_ahead += 1
        return InFlight(batch, self.runner.launch(batch, next_ids=token_ids))

    def _end(self, seq: Sequence, reason: str) -> None:
        """Finish `seq`; its blocks are freed once no step on the device writes to them."""
        held = self._inflight is not None and self._inflight.holds(seq)
        self.scheduler.finish(seq, reason, free_blocks=not held)
        if held:
            self._free_after_step.append(seq)
        seq.finished_time = time.monotonic()

    def _append(self, seq: Sequence, token: int) -> StepDelta:
        seq.append_token(token)
        params = seq.params
        detok = self._detok[seq.request_id]
        if (not params.ignore_eos and token in self.info.eos_token_ids) or (
            token in params.stop_token_ids
        ):
            # The stop token's own text is not output; text held back for stop strings is.
            return self._finish(seq, token, detok.flush(), "stop")
        delta = detok.add(token)
        if delta.stopped:
            return self._finish(seq, token, delta.text, "stop")
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return self._finish(seq, token, delta.text + detok.flush(), "length")
        self._texts[seq.request_id] += delta.text
        return StepDelta(seq.request_id, [token], delta.text, None)

    def _finish(self, seq: Sequence, token: int, text: str, reason: str) -> StepDelta:
        self.block_manager.cache_full_blocks(seq)  # any left (commit_prefill may defer them)
        self._end(seq, reason)
        self._texts[seq.request_id] += text
        return StepDelta(seq.request_id, [token], text, reason)

    # -- results ------------------------------------------------------------------------------
    def get_output(self, request_id: str) -> RequestOutput:
        seq = self._seqs[request_id]
        return RequestOutput(
            request_id=request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    0, self._texts[request_id], seq.output_token_ids, seq.finish_reason
                )
            ],
            finished=seq.is_finished,
            num_cached_tokens=seq.num_cached_tokens,
            metrics=RequestMetrics(
                seq.arrival_time, seq.first_token_time, seq.finished_time, seq.num_preemptions
            ),
        )

    def release(self, request_id: str) -> None:
        """Forget a finished request's results."""
        seq = self._seqs.get(request_id)
        if seq is not None and seq.is_finished:
            del self._seqs[request_id], self._detok[request_id], self._texts[request_id]

    def expert_counts(self) -> list[int] | None:
        """Tokens routed to each expert since start, over every rank (None: a dense model)."""
        counts = self.runner.expert_counts()
        if counts is None or self.tp_driver is None or not self.config.enable_expert_parallel:
            return counts  # without EP every rank routes every token: rank 0 saw them all
        for reply in self.tp_driver.control("expert_counts", {}):
            counts = [a + b for a, b in zip(counts, reply["counts"], strict=True)]
        return counts

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (nothing to do for one rank)."""
        if self.tp_driver is not None:
            self.tp_driver.shutdown()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_blocks_total=bm.num_blocks,
            num_blocks_used=bm.num_used_blocks,
            num_blocks_free=bm.num_free_blocks,
            prefix_queried_tokens=bm.prefix_queried_tokens,
            prefix_hit_tokens=bm.prefix_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            steps_launched_ahead=self.steps_launched_ahead,
        )
