"""A model's tokenizer from its Hugging Face folder, through the `tokenizers` library only.

transformers' tokenizers import torch when it is installed, which would cost the router ~0.5 GB
and seconds of start-up; this reads the same files (tokenizer.json, tokenizer_config.json and a
chat template) and applies the same settings transformers' `TokenizersBackend` does, so its ids
and text are transformers' own (tests/test_tokenizer.py compares them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as Backend

# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES): the chat template sees them.
SPECIAL_TOKEN_NAMES = tuple(
    f"{n}_token" for n in ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
)


class Tokenizer:
    """encode / decode as transformers' tokenizer of the same folder does (its defaults:
    special tokens added on encode, kept on decode). Callers may share one across threads only
    one at a time (the Rust tokenizer may refuse concurrent use: "Already borrowed")."""

    def __init__(
        self,
        backend: Backend,
        special_tokens: dict[str, str],
        chat_template: str | None = None,
        clean_up_spaces: bool = False,
    ) -> None:
        self.backend = backend
        self.special_tokens = special_tokens  # {"bos_token": "<s>", ...}
        self.chat_template = chat_template
        self._clean_up_spaces = clean_up_spaces

    @classmethod
    def load(cls, folder: Path | str) -> Tokenizer:
        """ValueError ("model: ...") when the folder has no usable tokenizer.json."""
        folder = Path(folder)
        try:
            backend = Backend.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception for a missing or bad file
            raise ValueError(f"model: cannot load {folder / 'tokenizer.json'}: {e}") from None
        config = _read_config(folder / "tokenizer_config.json")
        special = {
            name: _token_text(config[name])
            for name in SPECIAL_TOKEN_NAMES
            if config.get(name) is not None
        }
        # As transformers does: no truncation or padding for one text; named special tokens
        # are added tokens (never split); an explicit add_bos/eos_token rewrites the template.
        backend.no_truncation()
        backend.no_padding()
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in special.values()]
        )
        if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:
            backend.post_processor = _bos_eos_processor(
                backend,
                special.get("bos_token") if config.get("add_bos_token") else None,
                special.get("eos_token") if config.get("add_eos_token") else None,
            )
        clean_up = bool(config.get("clean_up_tokenization_spaces", False))
        is_bpe = json.loads(backend.to_str())["model"]["type"] == "BPE"
        return cls(backend, special, _chat_template(folder, config), clean_up and not is_bpe)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self._clean_up_spaces else text

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"model: cannot read {path}: {e}") from None
    return config if isinstance(config, dict) else {}


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return value["content"] if isinstance(value, dict) else str(value)


def _bos_eos_processor(backend: Backend, bos: str | None, eos: str | None) -> Any:
    """transformers' `update_post_processor`: bos + text + eos, each only when asked for."""
    single = f"{bos + ':0 ' if bos else ''}$A:0{' ' + eos + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if bos else ''} $B:1{' ' + eos + ':1' if eos else ''}"
    tokens = [(t, backend.token_to_id(t)) for t in (bos, eos) if t]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=tokens)


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's template (its "default" when named)."""
    path = folder / "chat_template.jinja"
    if path.exists():
        return path.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template if isinstance(template, str) else None


# transformers' `clean_up_tokenization` (WordPiece-era spacing before punctuation): each loses
# its leading space.
_CLEAN_UP = (" .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're")


def _clean_up(text: str) -> str:
    for spaced in _CLEAN_UP:
        text = text.replace(spaced, spaced.strip())
    return text
