"""Incremental detokenization with stop strings.

Text is produced a token at a time without ever splitting a multi-byte character: a piece that
decodes to a replacement character is held until the next token completes it. With stop
strings, the tail that could still become a stop string is held back too, so a streamed delta
never has to be taken back.
"""

from __future__ import annotations

from typing import NamedTuple

from pdmesh.text.tokenizer import Tokenizer

# Tokens of prompt context decoded with each new token, so that tokenizers which drop a leading
# space at the start of a decode (SentencePiece) still give the right text.
_CONTEXT_TOKENS = 6


class TextDelta(NamedTuple):
    text: str
    stopped: bool  # a stop string was found; the text ends just before it


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self.text = ""  # decoded output text so far (including held-back text)
        self._emitted = 0  # characters of `text` already handed out

    def _decode(self, ids: list[int]) -> str:
        assert self._tokenizer is not None
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> TextDelta:
        """Feed one output token; return the text that is now final."""
        if self._tokenizer is None:  # an engine without a tokenizer: token ids only
            return TextDelta("", False)
        self._tokens.append(token_id)
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._tokens[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._tokens)
        if self._stop:
            # A new stop string includes a new character, so it starts after the emitted text
            # (the held-back tail is exactly long enough for that).
            start = self._emitted
            cut = min(
                (i for i in (self.text.find(s, start) for s in self._stop) if i >= 0), default=-1
            )
            if cut >= 0:
                self.text = self.text[:cut]
                return TextDelta(self._take(len(self.text)), True)
        return TextDelta(self._take(len(self.text) - self._holdback), False)

    def flush(self) -> str:
        """The held-back text, once the request ends for a reason other than a stop string."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        out = self.text[self._emitted : upto]
        self._emitted = upto
        return out
