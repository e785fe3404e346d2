"""The CPU kernels (`pdmesh.kernels.cpu`) against dense float64 math, and against the
references they stand in for; and that CPU tensors reach them unless PDMESH_KERNEL_BACKEND=torch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_kernel_references import MIXED, _dense_attention, _paged

from pdmesh.kernels import linear, paged_decode_attention, silu_and_mul_linear
from pdmesh.kernels.activation import silu_and_mul_ref
from pdmesh.kernels.attention import paged_decode_attention_ref, store_kv_cache_ref
from pdmesh.kernels.backend import cpu_kernels_wrapped, pick
from pdmesh.kernels.cpu import attention as cpu_attention
from pdmesh.kernels.cpu import jit, kv_store, norm, onednn_linear, paged_decode
from pdmesh.kernels.cpu import prologue as cpu_prologue
from pdmesh.kernels.cpu import rotary as cpu_rotary
from pdmesh.kernels.linear import linear_ref
from pdmesh.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from pdmesh.kernels.prologue import rotary_and_store_kv_unfused
from pdmesh.kernels.rotary import apply_rotary_ref


@pytest.mark.parametrize("mkl_rows", [0, 2])
@pytest.mark.parametrize("rows", [1, 3, 16, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_matches_float64(
    rows: int, bias: bool, mkl_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both of the paths it takes (oneDNN; MKL for a few rows on Intel CPUs) and their packed
    weights' bookkeeping."""
    monkeypatch.setattr(onednn_linear, "MKL_MAX_ROWS", mkl_rows)
    x, w = torch.randn(rows, 576), torch.randn(960, 576) * 0.05
    b = torch.randn(960) if bias else None
    want = F.linear(x.double(), w.double(), b.double() if bias else None)
    torch.testing.assert_close(onednn_linear.linear(x, w, b).double(), want, rtol=1e-5, atol=1e-4)
    gated = torch.randn(rows, 2 * 576)
    want = F.linear(silu_and_mul_ref(gated.double()), w.double())
    got = onednn_linear.silu_and_mul_linear(gated, w)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    assert (id(w) in onednn_linear._packed) == (rows > mkl_rows)  # packed for oneDNN only


def test_onednn_linear_leaves_other_dtypes_and_shapes_to_the_reference() -> None:
    w = torch.randn(64, 32)
    x16 = torch.randn(5, 32, dtype=torch.bfloat16)
    assert torch.equal(onednn_linear.linear(x16, w.bfloat16()), linear_ref(x16, w.bfloat16()))
    x3 = torch.randn(2, 5, 32)
    assert torch.equal(onednn_linear.linear(x3, w), linear_ref(x3, w))


@pytest.mark.parametrize("rows", [1, 8, 70])  # 70: the parallel loop
def test_cpu_rms_norm_matches_the_reference(rows: int) -> None:
    """Alone and fused with the residual add: the sum x + residual bit for bit, the normalized
    rows within float32's last bits of the reference (its sum of squares is ordered otherwise)."""
    g = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, 576, generator=g) * 4, torch.randn(rows, 576, generator=g)
    weight = torch.randn(576, generator=g)
    got, summed = norm.fused_add_rms_norm(x, residual, weight, 1e-5)
    want, want_summed = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    assert torch.equal(summed, want_summed)
    torch.testing.assert_close(got, want, rtol=4e-7, atol=0)
    torch.testing.assert_close(norm.rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6),
                               rtol=4e-7, atol=0)  # fmt: skip
    x16 = x.bfloat16()  # other dtypes: the reference itself
    assert torch.equal(norm.rms_norm(x16, weight.bfloat16(), 1e-5),
                       rms_norm_ref(x16, weight.bfloat16(), 1e-5))  # fmt: skip


def test_cpu_kv_store_writes_what_the_reference_writes() -> None:
    """Keys and values (a strided view, as the QKV projection's split gives them) land in their
    slots, padding (-1) skipped, nothing else touched."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 3 * 2 * 16, generator=g)
    key = qkv[:, 32:64].view(5, 2, 16)
    value = qkv[:, 64:].view(5, 2, 16)
    slots = torch.tensor([7, -1, 0, 31, 16])
    caches = [torch.randn(4, 8, 2, 16, generator=g) for _ in range(2)]
    want = [c.clone() for c in caches]
    kv_store.store_kv_cache(key, value, *caches, slots)
    store_kv_cache_ref(key, value, *want, slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    assert pick("store_kv_cache", key, store_kv_cache_ref) is kv_store.store_kv_cache


@pytest.mark.parametrize("path", ["numba", "sdpa"])
@pytest.mark.parametrize(
    "contexts", [[70], [1, 15, 16, 17, 100], MIXED], ids=["batch1", "batch5", "batch19"]
)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 2), (8, 1)])
def test_cpu_paged_decode_matches_dense(
    heads: int, kv_heads: int, contexts: list[int], path: str
) -> None:
    k_cache, v_cache, tables, kv = _paged(contexts, kv_heads, 32, num_blocks=160)
    q = torch.randn(len(contexts), heads, 32)
    lens = torch.tensor(contexts, dtype=torch.int32)
    attend = {
        "numba": paged_decode.paged_decode_attention,
        "sdpa": cpu_attention.grouped_sdpa_decode,
    }[path]
    out = attend(q, k_cache, v_cache, tables, lens, 32**-0.5)
    for i, ctx in enumerate(contexts):
        ref = _dense_attention(q[i : i + 1].double(), *kv[i], torch.tensor([ctx - 1]), 32**-0.5)
        torch.testing.assert_close(out[i].double(), ref[0], rtol=1e-5, atol=1e-5)


def test_a_step_plan_serves_only_its_own_step() -> None:
    """Layers of one step share a plan; the next step's tables (new tensors, other lengths, or
    the same lengths in other pages) get their own."""
    k_cache, v_cache, tables, _ = _paged(MIXED, 3, 32, num_blocks=160)
    q = torch.randn(len(MIXED), 9, 32)
    lens = torch.tensor(MIXED, dtype=torch.int32)
    first = cpu_attention.grouped_sdpa_decode(q, k_cache, v_cache, tables, lens, 0.2)
    plan = cpu_attention._last
    again = cpu_attention.grouped_sdpa_decode(q, k_cache, v_cache, tables, lens, 0.2)
    assert cpu_attention._last is plan and torch.equal(first, again)
    for step in range(3):
        grown = [min(n + step + 1, 100) for n in MIXED]  # a decode step later
        tables2 = tables.flip(0).contiguous() if step == 2 else tables.clone()
        lens2 = torch.tensor(grown[::-1] if step == 2 else grown, dtype=torch.int32)
        got = cpu_attention.grouped_sdpa_decode(q, k_cache, v_cache, tables2, lens2, 0.2)
        want = paged_decode_attention_ref(q, k_cache, v_cache, tables2, lens2, 0.2)
        assert cpu_attention._last is not plan
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_cpu_tensors_get_the_cpu_kernels_unless_the_torch_backend_is_forced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = torch.randn(2, 8)
    assert pick("linear", x, linear_ref) is onednn_linear.linear
    assert pick("paged_decode_attention", x, paged_decode_attention_ref) is (
        cpu_attention.paged_decode_attention
    )
    assert pick("silu_and_mul", x, linear_ref) is linear_ref  # no CPU kernel: the reference
    monkeypatch.setenv("PDMESH_KERNEL_BACKEND", "torch")
    assert pick("linear", x, linear_ref) is linear_ref
    # The wrappers callers use go the same way.
    w = torch.randn(4, 8)
    torch.testing.assert_close(linear(x, w), x @ w.T)
    assert silu_and_mul_linear(torch.randn(2, 16), w).shape == (2, 4)
    assert paged_decode_attention is not None


def test_fp32_decode_reads_pages_in_place_and_other_dtypes_take_sdpa(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fp32 with caches as allocated goes to the Numba kernel; bf16, or a cache that is a strided
    view (which the kernel would have to copy whole), to the SDPA path."""
    k_cache, v_cache, tables, _ = _paged(MIXED, 3, 32, num_blocks=160)
    q = torch.randn(len(MIXED), 9, 32)
    lens = torch.tensor(MIXED, dtype=torch.int32)
    taken = []
    for name in ("paged_decode_attention", "grouped_sdpa_decode"):
        module = paged_decode if name == "paged_decode_attention" else cpu_attention
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _r=real, _n=name: taken.append(_n) or _r(*a))
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.2)
    got = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    bf16 = [t.bfloat16() for t in (q, k_cache, v_cache)]
    cpu_attention.paged_decode_attention(*bf16, tables, lens, 0.2)
    strided = k_cache.transpose(1, 2).contiguous().transpose(1, 2)
    cpu_attention.paged_decode_attention(q, strided, v_cache, tables, lens, 0.2)
    assert taken == ["paged_decode_attention", "grouped_sdpa_decode", "grouped_sdpa_decode"]


def test_a_packed_weight_is_packed_again_after_a_write_and_dropped_with_its_weight() -> None:
    """The blocked copy oneDNN reads follows its weight: a weight written in place (new weights
    loaded) is packed again, and the copy goes when the weight does."""
    x, w = torch.randn(4, 24), torch.randn(40, 24)
    before = onednn_linear.linear(x, w)
    packed = onednn_linear.packed_weight(w)
    assert onednn_linear.packed_weight(w) is packed  # packed once
    w.mul_(2)
    torch.testing.assert_close(onednn_linear.linear(x, w), 2 * before, rtol=1e-5, atol=1e-5)
    assert onednn_linear.packed_weight(w) is not packed
    key = id(w)
    del w
    assert key not in onednn_linear._packed


@pytest.mark.parametrize("tokens", [1, 16, 200])  # one thread below PARALLEL_ROWS, the pool above
@pytest.mark.parametrize("rot_dim", [32, 16])  # whole head, and a partial rotary (the rest passes)
def test_cpu_rotary_equals_the_reference_bit_for_bit(tokens: int, rot_dim: int) -> None:
    """Query and key come as strided views of one projection, as the attention layer splits it."""
    qkv = torch.randn(tokens, (6 + 2 + 2) * 32)
    q = qkv[:, : 6 * 32].view(tokens, 6, 32)
    k = qkv[:, 6 * 32 : 8 * 32].view(tokens, 2, 32)
    cache = torch.randn(4096, rot_dim)
    positions = torch.randint(0, 4096, (tokens,))
    got = cpu_rotary.apply_rotary(positions, q, k, cache)
    want = apply_rotary_ref(positions, q, k, cache)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    halves = [t.bfloat16() for t in (q, k)]  # other dtypes: the reference
    got16 = cpu_rotary.apply_rotary(positions, *halves, cache)
    assert all(
        torch.equal(g, w)
        for g, w in zip(got16, apply_rotary_ref(positions, *halves, cache), strict=True)
    )
    assert pick("apply_rotary", q, apply_rotary_ref) is cpu_rotary.apply_rotary


@pytest.mark.parametrize("tokens", [1, 8, 100])  # decode steps, and a prefill on the pool
@pytest.mark.parametrize("rot_dim", [32, 16])
def test_cpu_prologue_equals_rotary_then_store_bit_for_bit(tokens: int, rot_dim: int) -> None:
    """One Numba call for the query's rotation, the key's into its slot and the value's copy:
    the query and both caches exactly as the rotary and store kernels leave them."""
    qkv = torch.randn(tokens, (6 + 2 + 2) * 32)
    q, k, v = (t.view(tokens, -1, 32) for t in qkv.split([6 * 32, 2 * 32, 2 * 32], dim=-1))
    rope = torch.randn(4096, rot_dim)
    positions = torch.randint(0, 4096, (tokens,))
    slots = torch.randperm(16 * 16)[:tokens]
    slots[tokens // 2] = -1  # a padding token: nothing of it stored
    caches = [[torch.full((16, 16, 2, 32), 7.0) for _ in range(2)] for _ in range(2)]
    args = (positions, q, k, v, rope)
    got = cpu_prologue.rotary_and_store_kv(*args, *caches[0], slots)
    want = rotary_and_store_kv_unfused(*args, *caches[1], slots)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(*caches, strict=True))
    assert pick("rotary_and_store_kv", q, rotary_and_store_kv_unfused) is (
        cpu_prologue.rotary_and_store_kv
    )


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4)])
def test_cpu_prefill_of_few_tokens_reads_pages_and_the_rest_takes_the_reference(
    heads: int, kv_heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mixed batch: short prefills over cached prefixes (a verify step's shape), a fresh short
    prompt, and longer prefills (fresh and over a prefix); every row equals dense float64
    attention, whichever path computed it, and only the long ones reach the reference."""
    contexts = [1, 40, 16, 100, 30, 57]
    q_lens = [1, 9, 16, 17, 30, 3]  # FEW_QUERIES = 16: the 4th and 5th are the reference's
    k_cache, v_cache, tables, kv = _paged(contexts, kv_heads, 32, num_blocks=160)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), heads, 32)
    lens = torch.tensor(contexts, dtype=torch.int32)
    seen = []
    real = cpu_attention.paged_prefill_attention_ref

    def spy(query, k, v, cu_q, ctx, tables_, scale):
        seen.append(ctx.tolist())
        return real(query, k, v, cu_q, ctx, tables_, scale)

    monkeypatch.setattr(cpu_attention, "paged_prefill_attention_ref", spy)
    out = cpu_attention.paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, 32**-0.5)
    assert seen == [[100, 30]]
    for i, (ctx, ql) in enumerate(zip(contexts, q_lens, strict=True)):
        qi = q[cu[i] : cu[i + 1]].double()
        want = _dense_attention(qi, *kv[i], torch.arange(ctx - ql, ctx), 32**-0.5)
        torch.testing.assert_close(out[cu[i] : cu[i + 1]].double(), want, rtol=1e-5, atol=1e-5)
    bf16 = [t.bfloat16() for t in (q, k_cache, v_cache)]  # other dtypes: the reference, whole
    cpu_attention.paged_prefill_attention(*bf16, cu, lens, tables, 32**-0.5)
    assert seen[1] == contexts


def test_a_kernel_without_a_writable_cache_is_compiled_in_the_process() -> None:
    """Code with no file (as from a read-only install without a home) has nowhere to cache:
    plain `njit(cache=True)` fails at decoration; the kernels' decorator compiles it anyway."""
    from numba import njit

    scope: dict[str, Any] = {}
    exec("def plus_one(x):\n    return x + 1\n", scope)
    with pytest.raises(RuntimeError, match="cannot cache"):
        njit(cache=True)(scope["plus_one"])
    assert jit.njit_cached()(scope["plus_one"])(41) == 42


def test_cpu_prefill_of_one_token_over_a_cached_prefix_runs_on_the_calling_thread() -> None:
    """One query row (a one-token continuation of a cached prompt): the kernel's single-job path
    (no thread pool) equals dense float64 attention; and a batch of one decode row likewise."""
    k_cache, v_cache, tables, kv = _paged([45], 3, 32, num_blocks=16)
    q = torch.randn(1, 9, 32)
    cu, lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([45], dtype=torch.int32)
    out = cpu_attention.paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, 32**-0.5)
    want = _dense_attention(q.double(), *kv[0], torch.tensor([44]), 32**-0.5)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    decode = paged_decode.paged_decode_attention(q, k_cache, v_cache, tables, lens, 32**-0.5)
    torch.testing.assert_close(decode.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("batch", [1, 2])
def test_non_finite_values_of_one_sequence_stay_in_its_rows(value: float, batch: int) -> None:
    """A sequence whose query or keys are not finite (a poisoned request) gets non-finite rows;
    the kernel raises nothing, whether it runs one job or a pool's, and the other sequences'
    rows are what they would be without it."""
    k_cache, v_cache, tables, _ = _paged([20, 33], 3, 32, num_blocks=16)
    q = torch.randn(2, 9, 32)
    lens = torch.tensor([20, 33], dtype=torch.int32)
    clean = paged_decode.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.2)
    for poison in ("query", "keys"):
        qp, kp = q.clone(), k_cache.clone()
        if poison == "query":
            qp[0] = value
        else:
            kp[tables[0, 0]] = value
        got = paged_decode.paged_decode_attention(
            qp[:batch], kp, v_cache, tables[:batch], lens[:batch], 0.2
        )
        assert not torch.isfinite(got[0]).all()
        if batch == 2:
            torch.testing.assert_close(got[1], clean[1], rtol=0, atol=0)


def test_the_decode_step_bench_times_every_cpu_kernel_of_a_step() -> None:
    """`python -m pdmesh.bench.decode_step_cpu`: each CPU kernel a decode step runs is timed
    (a kernel renamed or no longer reached would show as a missing or zero part)."""
    from pdmesh.bench.decode_step_cpu import PARTS, measure

    figures = measure(batch=2, prompt_len=8, steps=2)
    assert all(figures[part] > 0 for part in PARTS.values()), figures
    assert figures["step_ms"] >= sum(figures[part] for part in set(PARTS.values()))


def test_a_wrapped_cpu_kernel_runs_its_wrapper_until_the_block_ends() -> None:
    """What the CPU benches time kernels with: `linear` on a CPU tensor goes through the
    wrapper inside the block, with the kernel's own result, and not after it."""
    calls: list[str] = []

    def wrap(name: str, fn: Any) -> Any:
        return lambda *a, **k: (calls.append(name), fn(*a, **k))[1]

    x, w = torch.randn(3, 8), torch.randn(5, 8)
    with cpu_kernels_wrapped(wrap, ["linear"]):
        torch.testing.assert_close(linear(x, w), x @ w.T)
    assert calls == ["linear"]
    linear(x, w)
    assert calls == ["linear"]
    missing = pytest.raises(ValueError, match="no CPU kernel registered as 'nonesuch'")
    with missing, cpu_kernels_wrapped(wrap, ["nonesuch"]):
        pass
