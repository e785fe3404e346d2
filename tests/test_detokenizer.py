"""Incremental detokenization never splits a character; stop strings are held back, not undone."""

from __future__ import annotations

from pdmesh import LLM
from pdmesh.text.detokenizer import IncrementalDetokenizer

TEXT = "Café crème 🍰 — 東京タワー ✓ naïve Ωmega 👩‍👩‍👧 end"


def test_deltas_are_whole_characters_and_add_up(default_llm: LLM) -> None:
    tok = default_llm.get_tokenizer()
    ids = tok.encode(TEXT)
    prompt = tok.encode("Say:")
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(t).text for t in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)
    # Some emoji span several tokens: then some step must have produced no text.
    assert "" in deltas[:-1]


def test_stop_string_spanning_tokens_is_cut_and_never_streamed(default_llm: LLM) -> None:
    tok = default_llm.get_tokenizer()
    ids = tok.encode("alpha beta gamma STOPWORD delta")
    detok = IncrementalDetokenizer(tok, [], stop=("STOPWORD",))
    streamed = ""
    stopped = False
    for t in ids:
        delta = detok.add(t)
        streamed += delta.text
        if delta.stopped:
            stopped = True
            break
    assert stopped
    assert streamed == "alpha beta gamma "
    assert "STOP" not in streamed
