"""pdmesh.text's tokenizer and chat template give transformers' ids and text token for token:
the default model's byte-level BPE and the tests' word-level tokenizer, on generated text
(Unicode edge cases included) and conversations."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import save_word_tokenizer
from transformers import AutoTokenizer

from pdmesh.checkpoint.source import resolve_model_folder
from pdmesh.errors import InvalidRequest
from pdmesh.text.chat_template import chat_token_ids
from pdmesh.text.tokenizer import Tokenizer

# Valid text only: lone surrogates are refused before any tokenizer (pdmesh.validation).
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=200)
SPECIALS = st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "\n", " ", "\x00"])
MIXED = st.lists(st.one_of(TEXT, SPECIALS), max_size=6).map("".join)
SETTINGS = settings(max_examples=200, deadline=None, database=None)
# A template with `{% generation %}` (transformers marks assistant turns with it) and a
# raise_exception, as the tests' chat models have.
WORD_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role') }}{% endif %}{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}{% endgeneration %}{% else %}{{ m['role'] }} "
    "{{ m['content'] }} {% endif %}{% endfor %}{% if add_generation_prompt %}assistant{% endif %}"
)


@pytest.fixture(scope="module")
def default_pair() -> tuple[Tokenizer, object]:
    folder = resolve_model_folder(None)
    return Tokenizer.load(folder), AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def word_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Tokenizer, object]]:
    folder: Path = tmp_path_factory.mktemp("word")
    save_word_tokenizer(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = WORD_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    yield Tokenizer.load(folder), AutoTokenizer.from_pretrained(folder)


def _hf_chat(hf: object, messages: list[dict[str, str]]) -> list[int]:
    ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)  # type: ignore[attr-defined]
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@SETTINGS
@given(text=MIXED)
def test_default_model_encode_decode_match_transformers(
    default_pair: tuple[Tokenizer, object], text: str
) -> None:
    ours, hf = default_pair
    ids = hf.encode(text)  # type: ignore[attr-defined]
    assert ours.encode(text) == ids
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(  # type: ignore[attr-defined]
            ids, skip_special_tokens=skip
        )


@SETTINGS
@given(
    messages=st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "assistant"]), "content": MIXED}
        ),
        min_size=1,
        max_size=4,
    )
)
def test_default_model_chat_template_matches_transformers(
    default_pair: tuple[Tokenizer, object], messages: list[dict[str, str]]
) -> None:
    ours, hf = default_pair
    assert chat_token_ids(ours, messages) == _hf_chat(hf, messages)


@SETTINGS
@given(
    words=st.lists(st.integers(0, 600).map(lambda i: f"t{i}"), max_size=30).map(" ".join),
    role=st.sampled_from(["system", "user", "assistant"]),
)
def test_word_tokenizer_and_template_match_transformers(
    word_pair: tuple[Tokenizer, object], words: str, role: str
) -> None:
    ours, hf = word_pair
    assert ours.encode(words) == hf.encode(words)  # type: ignore[attr-defined]
    assert ours.decode(ours.encode(words)) == hf.decode(hf.encode(words))  # type: ignore[attr-defined]
    messages = [{"role": role, "content": words}, {"role": "user", "content": "t1 t2"}]
    assert chat_token_ids(ours, messages) == _hf_chat(hf, messages)


def test_a_refused_conversation_names_the_messages(word_pair: tuple[Tokenizer, object]) -> None:
    ours, _ = word_pair
    with pytest.raises(InvalidRequest, match="refused these messages: unknown role") as err:
        chat_token_ids(ours, [{"role": "critic", "content": "t1"}])
    assert err.value.field == "messages"
    with pytest.raises(InvalidRequest, match="non-empty list"):
        chat_token_ids(ours, [])
