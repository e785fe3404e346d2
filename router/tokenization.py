"""The router's tokenizer, on a thread of its own.

A text of megabytes takes seconds to tokenize; on the event loop that would stall every stream
the router relays. Hugging Face's Rust tokenizer releases the GIL while it works, so a thread
keeps the loop free. One thread only: a fast tokenizer used from two threads at once can fail
("Already borrowed"). Texts that cannot fit in `max_model_len` tokens whatever they say (more
characters than that many of the vocabulary's longest tokens) are refused before any work.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pdmesh.errors import InvalidRequest
from pdmesh.text.chat_template import chat_token_ids
from pdmesh.text.tokenizer import Tokenizer


def longest_token_chars(tokenizer: Tokenizer) -> int:
    """An upper bound on the characters one token stands for (its vocabulary string: byte-level
    BPE spells each byte as one character, SentencePiece a space as one)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) + 1


class RouterTokenizer:
    """`encode` / `encode_chat` on the tokenizer's thread; InvalidRequest for a text too long."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_chars = max_model_len * longest_token_chars(tokenizer)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pdmesh-tokenizer")

    def _check_chars(self, n: int, what: str, field: str) -> None:
        if n > self.max_chars:
            raise InvalidRequest(
                f"{what} has {n:,} characters, more than any prompt that fits in the model's "
                f"max length can have ({self.max_chars:,}).",
                field,
            )

    async def encode(self, text: str) -> list[int]:
        self._check_chars(len(text), "the prompt", "prompt")
        return await self._run(lambda: list(self.tokenizer.encode(text)))

    async def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if isinstance(messages, list):  # else chat_token_ids says what is wrong
            contents = (m.get("content") for m in messages if isinstance(m, dict))
            chars = sum(len(c) for c in contents if isinstance(c, str))
            self._check_chars(chars, "the chat", "messages")
        return await self._run(lambda: chat_token_ids(self.tokenizer, messages))

    async def _run(self, fn: Any) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
