"""One hostile request never takes the engine down: constraints that conflict follow a rule,
constraints no output can satisfy are refused before admission naming their field, a slow
compilation holds up nothing behind it, and a request whose row cannot be sampled ends alone
while the innocent requests beside it finish with their undisturbed text.

Offline on the default model's tokenizer and layout, small (conftest), and a tiny random
one, and through a real mesh (1 prefill + 1 decode worker) with innocent streams running beside
each hostile request."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mesh_support import Mesh, start_mesh

from pdmesh import LLM, SamplingParams
from pdmesh.errors import InvalidRequest
from pdmesh.sampling_params import StructuredOutputsParams as SO

INNOCENT = ["What is the capital of France?", "Count from one to five:", "Name a colour."]
GREEDY = SamplingParams(max_tokens=24, temperature=0)
# What an xgrammar source location looks like: "[01:53:18] /project/cpp/x.cc:4944: ".
LOCATION = re.compile(r"\.(cc|h|cpp):\d+|\[\d\d:\d\d:\d\d\]")

UNSATISFIABLE = [
    pytest.param(SO(json={"$ref": "#"}), "structured_outputs.json", id="schema-is-its-own-ref"),
    pytest.param(
        SO(json={"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
        "structured_outputs.json",
        id="definition-refers-to-itself",
    ),
    pytest.param(
        SO(json={"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
        "structured_outputs.json",
        id="required-property-is-the-schema",
    ),
    pytest.param(SO(grammar="root ::= root"), "structured_outputs.grammar", id="rule-is-itself"),
    pytest.param(SO(grammar='root ::= "a" root'), "structured_outputs.grammar", id="no-base-case"),
    pytest.param(
        SO(grammar='root ::= x\nx ::= "(" x ")"'), "structured_outputs.grammar", id="nested-loop"
    ),
    pytest.param(SO(json={"enum": []}), "structured_outputs.json", id="empty-enum"),
    pytest.param(
        SO(json={"type": "integer", "minimum": 5, "maximum": 1}),
        "structured_outputs.json",
        id="empty-range",
    ),
]


def _texts(outputs: list) -> list[str]:
    return [o.outputs[0].text for o in outputs]


@pytest.fixture(scope="module")
def undisturbed(small_llm: LLM) -> list[str]:
    return _texts(small_llm.generate(INNOCENT, GREEDY))


@pytest.mark.parametrize(("so", "field"), UNSATISFIABLE)
def test_constraints_no_output_can_satisfy_are_refused_naming_the_field(
    small_llm: LLM, so: SO, field: str
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        small_llm.generate("Answer:", SamplingParams(max_tokens=8, structured_outputs=so))
    assert caught.value.field == field
    assert str(caught.value).startswith(field), caught.value
    assert not LOCATION.search(str(caught.value)), caught.value  # no C++ source locations
    assert small_llm.generate("Hello", SamplingParams(max_tokens=2))[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "so",
    [SO(regex="(t1){1000000}"), SO(regex="((ab){200}){200}"), SO(grammar='root ::= ("x"){20000}')],
    ids=["one-count", "nested-counts", "grammar"],
)
def test_repetition_the_compiler_would_unroll_for_minutes_is_refused(
    small_llm: LLM, so: SO
) -> None:
    started = time.perf_counter()
    with pytest.raises(InvalidRequest, match="at most 10,000") as caught:
        small_llm.generate("Answer:", SamplingParams(max_tokens=8, structured_outputs=so))
    assert caught.value.field == f"structured_outputs.{so.kind}"
    assert time.perf_counter() - started < 5  # refused before compiling


def test_a_constraint_past_the_size_limit_is_refused(small_llm: LLM) -> None:
    from pdmesh.engine.sample.structured import MAX_SPEC_CHARS

    big = SO(choice=["x" * 1000] * (MAX_SPEC_CHARS // 1000 + 1))
    with pytest.raises(InvalidRequest, match="at most") as caught:
        small_llm.generate("Answer:", SamplingParams(max_tokens=8, structured_outputs=big))
    assert caught.value.field == "structured_outputs.choice"


@pytest.mark.parametrize(
    ("so", "extra", "allowed"),
    [
        # The grammar wins over min_tokens: once the choice is written, EOS is allowed.
        (SO(choice=["yes", "no"]), {"min_tokens": 8}, {"yes", "no"}),
        (SO(regex="[ab]{2}"), {"min_tokens": 12}, {"aa", "ab", "ba", "bb"}),
        # The mask comes before temperature and the filters: they cannot remove every token.
        (SO(choice=["yes", "no"]), {"temperature": 1e-30, "top_p": 1e-9}, {"yes", "no"}),
        (SO(choice=["yes", "no"]), {"temperature": 1e30, "top_p": 1e-9, "top_k": 1}, {"yes", "no"}),
    ],
    ids=["choice+min_tokens", "regex+min_tokens", "tiny-temperature", "huge-temperature"],
)
def test_conflicting_constraints_follow_the_rule_beside_innocent_requests(
    small_llm: LLM, undisturbed: list[str], so: SO, extra: dict, allowed: set[str]
) -> None:
    hostile = SamplingParams(max_tokens=16, seed=3, structured_outputs=so, **extra)
    outs = small_llm.generate([*INNOCENT, "Answer:"], [GREEDY] * len(INNOCENT) + [hostile])
    assert _texts(outs[:-1]) == undisturbed
    out = outs[-1].outputs[0]
    assert (out.text, out.finish_reason) in {(a, "stop") for a in allowed}, out
    assert outs[-1].error is None


def test_min_tokens_alone_still_holds_eos_back(small_llm: LLM) -> None:
    out = small_llm.generate(
        "Say OK.", SamplingParams(max_tokens=12, min_tokens=10, temperature=0)
    )[0].outputs[0]
    assert len(out.token_ids) >= 10


def test_a_slow_compilation_holds_up_no_cheap_one(small_model_folder: Path) -> None:
    from pdmesh.engine.models.info import ModelInfo
    from pdmesh.engine.sample.structured import Grammars

    info = ModelInfo.load(small_model_folder)
    grammars = Grammars(small_model_folder, info.vocab_size, info.eos_token_ids)
    grammars.compile(SO(regex="warm"))  # builds the compiler (reads the vocabulary) once
    slow = SO(regex='[^"]{1,6000}')  # a short text that takes seconds to compile
    started = time.perf_counter()
    worker = threading.Thread(target=grammars.compile, args=(slow,))
    worker.start()
    time.sleep(0.05)
    with pytest.raises(InvalidRequest):
        grammars.compile(SO(json={"type": "integer", "minimum": 9, "maximum": 1}))
    assert grammars.compile(SO(regex="[0-9]+")) is not None
    cheap_done = time.perf_counter() - started
    worker.join()
    slow_done = time.perf_counter() - started
    assert cheap_done < slow_done / 2, (cheap_done, slow_done)


def test_compiles_past_the_concurrency_bound_are_refused_as_overload(
    small_model_folder: Path,
) -> None:
    from pdmesh.engine.models.info import ModelInfo
    from pdmesh.engine.sample.structured import MAX_CONCURRENT_COMPILES, Grammars
    from pdmesh.errors import Overloaded

    info = ModelInfo.load(small_model_folder)
    grammars = Grammars(small_model_folder, info.vocab_size, info.eos_token_ids)
    grammars.compile(SO(regex="warm"))

    def slow(k: int) -> SO:  # distinct texts, none served from the cache; seconds each
        return SO(regex=f'[^"]{{1,{6000 + k}}}')

    workers = [
        threading.Thread(target=grammars.compile, args=(slow(k),))
        for k in range(MAX_CONCURRENT_COMPILES)
    ]
    for w in workers:
        w.start()
    time.sleep(0.1)
    with pytest.raises(Overloaded, match="compiling already"):
        grammars.compile(SO(regex="[0-9]+"))
    for w in workers:
        w.join()
    # A slot comes back when its compilation ends (one past COMPILE_TIMEOUT_S runs on to its
    # end: a thread cannot be stopped), whatever the load.
    deadline = time.monotonic() + 120
    while True:
        try:
            assert grammars.compile(SO(regex="[0-9]+")) is not None
            break
        except Overloaded:
            assert time.monotonic() < deadline
            time.sleep(0.5)


@pytest.fixture(scope="module")
def nan_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A tiny Llama whose embedding of one token is NaN: a prompt holding it has non-finite
    logits in its own rows only."""
    from safetensors.torch import load_file, save_file
    from support import make_tiny_model

    folder = make_tiny_model(tmp_path_factory.mktemp("nan-llama"), "llama")
    (weights,) = folder.glob("*.safetensors")
    tensors = load_file(weights)
    poisoned = 7
    tensors["model.embed_tokens.weight"][poisoned] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    return folder, poisoned


def test_non_finite_logits_end_only_their_request(nan_model: tuple[Path, int]) -> None:
    folder, poisoned = nan_model
    llm = LLM(model=str(folder), kv_cache_tokens=2048, dtype="float32")
    try:
        prompts = [
            {"prompt_token_ids": ids} for ids in ([11, 12, 13, 14], [21, 22, 23], [31, 32, 33])
        ]
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        outs = llm.generate([*prompts, {"prompt_token_ids": [40, poisoned, 41]}], params)
        assert [o.outputs[0].token_ids for o in outs[:-1]] == alone
        hostile = outs[-1]
        assert hostile.outputs[0].finish_reason == "error"
        assert hostile.error is not None and hostile.error.status == "INTERNAL"
        assert "not finite" in hostile.error.message
        # The engine runs on, and the hostile request's blocks came back.
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert again == alone
        stats = llm.engine.stats()
        assert stats.kv_blocks_used == 0, stats  # no block held once every request ended
    finally:
        llm.close()


# -- through the mesh -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh(small_model_folder: Path) -> Iterator[Mesh]:
    m = start_mesh(
        "--prefill", "1", "--decode", "1", "--kv-cache-tokens", "16384",
        http=True, model=small_model_folder,
    )  # fmt: skip
    try:
        yield m
    finally:
        m.stop()


def _post(mesh: Mesh, body: dict) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    assert mesh.http is not None
    req = urllib.request.Request(
        mesh.http + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


HOSTILE_BODIES = [
    # (body extras, expected status); prompts long enough to be prefilled remotely as well.
    ({"structured_outputs": {"choice": ["yes", "no"]}, "min_tokens": 8}, 200),
    ({"structured_outputs": {"regex": "[ab]{2}"}, "min_tokens": 12}, 200),
    ({"structured_outputs": {"choice": ["yes", "no"]}, "temperature": 1e-30, "top_p": 1e-9}, 200),
    ({"structured_outputs": {"json": {"$ref": "#"}}}, 400),
    (
        {
            "structured_outputs": {
                "json": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
            }
        },
        400,
    ),
    ({"structured_outputs": {"grammar": "root ::= root"}}, 400),
    ({"structured_outputs": {"grammar": 'root ::= "a" root'}}, 400),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"$ref": "#"}},
            }
        },
        400,
    ),
]


def test_hostile_requests_beside_innocent_streams_through_the_mesh(
    mesh: Mesh, undisturbed: list[str]
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    long_prompt = "Answer the question after this long preamble. " * 12 + "Answer:"
    pids = dict(mesh.pids)
    with ThreadPoolExecutor(8) as pool:
        for extras, status in HOSTILE_BODIES:
            innocent = [
                pool.submit(_post, mesh, {"prompt": p, "max_tokens": 24, "temperature": 0})
                for p in INNOCENT
            ]
            hostile = [
                pool.submit(_post, mesh, {"prompt": p, "max_tokens": 16, "seed": 1, **extras})
                for p in ("Answer:", long_prompt)
            ]
            for future in hostile:
                code, body = future.result()
                assert code == status, (extras, code, body)
                if code == 400:
                    message = body["error"]["message"]
                    assert "structured_outputs" in message or "response_format" in message, body
                    assert not LOCATION.search(message), message
            texts = []
            for future in innocent:
                code, body = future.result()
                assert code == 200, body
                texts.append(body["choices"][0]["text"])
            assert texts == undisturbed, extras
    for pid in pids.values():  # every service is the process it started as
        os.kill(pid, 0)  # raises when that process is gone (a restarted worker is a new one)
    for address in mesh.prefill + mesh.decode:
        assert mesh.stats(address).kv_blocks_used == 0  # nothing held once every request ended
    assert mesh.proc.poll() is None
