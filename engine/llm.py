"""The offline API: `LLM(...).generate(prompts, sampling_params)`, named as in vLLM."""

from __future__ import annotations

import itertools
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from pdmesh.engine.config import EngineConfig
from pdmesh.engine.data_parallel.front import DataParallelEngine
from pdmesh.engine.llm_engine import LLMEngine
from pdmesh.engine.outputs import RequestOutput
from pdmesh.processes import keep_freed_memory
from pdmesh.sampling_params import SamplingParams
from pdmesh.text.chat_messages import check_tools
from pdmesh.text.chat_template import Message, chat_token_ids

PromptType = str | dict[str, Any]


class LLM:
    """An engine in this process. `model=None` serves the embedded default model."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        config = EngineConfig.from_kwargs(model=model, **engine_options)
        config = config.with_batch_defaults(offline=True)
        if config.torch_device().type == "cpu":
            keep_freed_memory()  # each prefill's activations reused, not faulted in again
        self.engine: LLMEngine | DataParallelEngine
        if config.data_parallel_size > 1:
            self.engine = DataParallelEngine(config)
        else:
            self.engine = LLMEngine(config)
        self._ids = itertools.count()
        self._hf_tokenizer: Any = None
        # Other ranks and replicas stop with this object (or at exit), never outlive it. The
        # finalizer holds only what stops them: holding the engine would keep its memory alive.
        self._finalizer = weakref.finalize(self, self.engine.stopper())

    def close(self) -> None:
        """Stop the engine's other ranks, if any. The LLM is unusable afterwards."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (transformers' AutoTokenizer, loaded on the first
        call), as vLLM's `LLM.get_tokenizer` returns; the engine itself uses pdmesh.text."""
        if self._hf_tokenizer is None:
            from transformers import AutoTokenizer

            self._hf_tokenizer = AutoTokenizer.from_pretrained(self.engine.info.folder)
        return self._hf_tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order, with `n` completions each (SamplingParams.n).
        A prompt is a string or `{"prompt_token_ids": [...]}`."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        inputs = [self._prompt_input(p) for p in prompts]
        return self._run(inputs, sampling_params, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (chat template applied).
        `tools`: OpenAI function definitions, rendered by the chat template as vLLM's `LLM.chat`
        renders them; messages may hold tool calls and `tool` results. The reply is the
        model's text (the router's parsers read calls out of it)."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tokenizer = self.engine.tokenizer
        checked = check_tools(tools) if tools else None
        inputs = [chat_token_ids(tokenizer, conv, checked) for conv in conversations]  # type: ignore[arg-type]
        return self._run(inputs, sampling_params, use_tqdm)

    def _prompt_input(self, prompt: PromptType) -> str | list[int]:
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"]
        raise ValueError(
            f"each prompt must be a string or {{'prompt_token_ids': [...]}}, got {prompt!r:.80}."
        )

    def _run(
        self,
        inputs: list[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(inputs)
        else:
            params = list(sampling_params)
            if len(params) != len(inputs):
                raise ValueError(
                    f"sampling_params has {len(params)} entries for {len(inputs)} prompts."
                )
        engine = self.engine
        ids: list[str] = []
        try:
            for prompt, p in zip(inputs, params, strict=True):
                request_id = f"offline-{next(self._ids)}"
                engine.add_request(request_id, prompt, p)
                ids.append(request_id)
        except Exception:
            for request_id in ids:  # leave the engine as it was
                engine.abort_request(request_id)
                engine.release(request_id)
            raise
        with _progress(len(ids), use_tqdm) as advance:
            while engine.has_unfinished_requests():
                for delta in engine.step():
                    if delta.request_finished:  # n > 1: each of its choices has ended
                        advance()
        outputs = [engine.get_output(i) for i in ids]
        for request_id in ids:
            engine.release(request_id)
        return outputs


@contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Callable[[], None]]:
    """Advances a rich progress bar over finished requests, shown on a terminal for batches > 1."""
    if not (enabled and total > 1 and sys.stderr.isatty()):
        yield lambda: None
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("generating", total=total)
        yield lambda: bar.advance(task)
