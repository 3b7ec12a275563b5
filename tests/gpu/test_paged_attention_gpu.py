"""The Triton paged decode attention kernel on the GPU == the torch reference, and CUDA-graph safe.

Run on the GPU machine: `python -m pytest tests/gpu/test_paged_attention_gpu.py -q -s` (prints errors).
float32: the kernel (IEEE dots) against the reference in float64, tight. bfloat16: relative error
||out - ref|| / ||ref|| < 1e-2 against the reference in bfloat16 (HF's computation). Every pool slot no
row reads is NaN and the output is NaN before the call, so a read past a length or an unwritten
output element shows. Shapes include Qwen3-8B's decode step (b=256, 32/8 heads, head_dim 128, page 64,
lengths 1..2500) and the split-K path (small batches, and forced splits).
"""

from __future__ import annotations

import pytest
import torch

from bench.decode_attention import stored_as
from dflash_pipeline.shared.generation.decoder import to_cache_dtype
from dflash_pipeline.shared.generation.paged_attention import (
    _paged_decode_attention_triton,
    paged_decode_attention,
    paged_decode_attention_reference,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

DEV = "cuda"


def make_case(b, heads, kv_heads, head_dim, page, max_len, dtype, seed, spare_pages=5):
    """Random q; a pool whose rows own disjoint scattered pages; lengths in 1..max_len with 1, page
    multiples and the full capacity among them; all unread slots NaN; table entries past a row's
    last page point at an all-NaN page."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    max_pages = -(-max_len // page)
    num_pages = b * max_pages + spare_pages
    q = torch.randn(b, heads, head_dim, generator=g, device=DEV).to(dtype)
    k = torch.randn(num_pages, page, kv_heads, head_dim, generator=g, device=DEV).to(dtype)
    v = torch.randn(num_pages, page, kv_heads, head_dim, generator=g, device=DEV).to(dtype)
    table = torch.randperm(num_pages, generator=g, device=DEV)[: b * max_pages].view(b, max_pages).int()
    lengths = torch.randint(1, max_len + 1, (b,), generator=g, device=DEV)
    fixed = torch.tensor([1, max_pages * page, page, 2 * page, page + 1, max_len], device=DEV)
    n = min(b, len(fixed))
    lengths[:n] = fixed[:n].clamp(max=max_pages * page)
    lengths = lengths[torch.randperm(b, generator=g, device=DEV)]
    poison_unread(k, v, table, lengths)
    return q, k, v, table, lengths


def poison_unread(k, v, table, lengths):
    """NaN into every slot no row reads; table entries past each row's pages -> an unread page."""
    page, max_pages = k.shape[1], table.shape[1]
    slot = torch.arange(max_pages * page, device=DEV)
    read = slot[None, :] < lengths[:, None]  # [b, S]
    flat = (table.long()[:, slot // page] * page + slot % page)[read]
    used = torch.zeros(k.shape[0] * page, dtype=torch.bool, device=DEV)
    used[flat] = True
    k.view(-1, *k.shape[2:])[~used] = float("nan")
    v.view(-1, *v.shape[2:])[~used] = float("nan")
    free = int((~used.view(-1, page).any(1)).nonzero()[0])
    past = torch.arange(max_pages, device=DEV)[None, :] >= (-(-lengths // page))[:, None]
    table[past] = free


def reference(case, scale, dtype=None, rows: int = 16):
    """The torch reference (in `dtype`, default q's), a few rows at a time to bound its memory (it
    gathers and repeats every row's full capacity)."""
    q, k, v, table, lengths = case
    if dtype is not None:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return torch.cat(
        [
            paged_decode_attention_reference(q[i : i + rows], k, v, table[i : i + rows], lengths[i : i + rows], scale)
            for i in range(0, len(q), rows)
        ]
    )


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


SHAPES = [  # b, heads, kv_heads, head_dim, page, max_len
    (1, 4, 4, 16, 16, 40),
    (7, 8, 2, 32, 16, 300),
    (33, 16, 4, 64, 32, 1000),
    (5, 32, 8, 128, 64, 2500),
    (64, 32, 8, 128, 64, 1000),
    (256, 32, 8, 128, 64, 2500),  # Qwen3-8B decode at batch 256
    (3, 64, 8, 128, 64, 700),  # group 8
    (4, 32, 2, 128, 128, 3000),  # group 16
    (9, 16, 16, 256, 16, 200),  # head_dim 256, no GQA
]


@pytest.mark.parametrize("splits", [None, 1, 4])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference(dtype, shape, splits):
    b, heads, kv_heads, head_dim, page, max_len = shape
    case = make_case(*shape, dtype, seed=sum(shape))
    scale = head_dim**-0.5
    out = torch.full_like(case[0], float("nan"))
    if splits is None:
        got = paged_decode_attention(*case, scale, out=out)
    else:
        got = _paged_decode_attention_triton(*case, scale, out=out, num_splits=splits)
    assert got is out
    assert torch.isfinite(out).all(), "NaN in the output: an element unwritten or an unread slot read"
    if dtype == torch.float32:
        ref = reference(case, scale, torch.float64)
        err = (out.double() - ref).abs().max().item()
        print(f"\n{shape} {dtype} splits={splits}: max abs err vs float64 {err:.2e}")
        assert err < 2e-5
    else:
        ref = reference(case, scale)
        assert torch.isfinite(ref).all()
        err = rel(out, ref)
        print(f"\n{shape} {dtype} splits={splits}: rel err vs bf16 reference {err:.2e}")
        assert err < 1e-2


@pytest.mark.parametrize("value_order", ["thd", "hdt"])
@pytest.mark.parametrize("splits", [None, 1, 4])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[5], SHAPES[6]], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype,f16_dots", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_kernel_reads_fp8_pages_as_the_pages_converted_first(dtype, f16_dots, shape, splits, value_order):
    """An fp8 KV cache: the kernel converts each page as it loads it, so it computes the attention
    over the pages converted to q's dtype (NaN-poisoned unread slots stay unread in fp8 too); with
    f16_dots (the default for a 16-bit q), to float16 (at least as precise as bfloat16 for fp8 values).
    Values stored token-minor (hdt: `bench.decode_attention --layout vt`) give the same attention: the
    kernel reads pages through their strides."""
    case = make_case(*shape, dtype, seed=sum(shape) + 1)
    q, k, v, table, lengths = case
    k8, v8 = k.to(torch.float8_e4m3fn), stored_as(v.to(torch.float8_e4m3fn), value_order)
    scale = shape[3] ** -0.5
    out = _paged_decode_attention_triton(q, k8, v8, table, lengths, scale, num_splits=splits, f16_dots=f16_dots)
    if splits is None and f16_dots == (dtype != torch.float32):  # the public path takes the same launch
        assert torch.equal(paged_decode_attention(q, k8, v8, table, lengths, scale), out)
    assert torch.isfinite(out).all()
    converted = (q, k8.to(dtype), v8.to(dtype), table, lengths)
    if dtype == torch.float32:
        err = (out.double() - reference(converted, scale, torch.float64)).abs().max().item()
        print(f"\nfp8 pages {shape} {dtype} splits={splits}: max abs err vs float64 {err:.2e}")
        assert err < 2e-5
    else:
        err = rel(out, reference(converted, scale))
        print(f"\nfp8 pages {shape} {dtype} splits={splits}: rel err vs bf16 reference {err:.2e}")
        assert err < 1e-2


@pytest.mark.parametrize("value_order", ["thd", "hdt"])
@pytest.mark.parametrize("splits", [None, 4])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_finite_value_tails_give_the_masked_launchs_attention(kv_dtype, splits, value_order):
    """`finite_value_tails`: each row's last value page loaded unmasked, its slots past the length
    finite garbage (every other unread slot still NaN), on pages of either dtype in either value order.
    The garbage is cast as the engine writes its cache (`to_cache_dtype`): a plain cast to fp8 makes
    NaN of values beyond +-448 on CUDA, which this test saw on an H200 (bench/RESULTS.md run 14)."""
    shape = SHAPES[5]  # Qwen3-8B decode at batch 256
    q, k, v, table, lengths = make_case(*shape, torch.bfloat16, seed=sum(shape) + 2)
    page = shape[4]
    g = torch.Generator(device=DEV).manual_seed(3)
    for r, n in enumerate(lengths.tolist()):
        if n % page:
            tail = (page - n % page, *v.shape[2:])
            v[table[r, (n - 1) // page], n % page :] = 100 * torch.randn(tail, generator=g, device=DEV)
    k, v = k.to(kv_dtype), stored_as(to_cache_dtype(v, kv_dtype), value_order)
    scale = shape[3] ** -0.5
    masked = _paged_decode_attention_triton(q, k, v, table, lengths, scale, num_splits=splits)
    got = _paged_decode_attention_triton(q, k, v, table, lengths, scale, num_splits=splits, finite_value_tails=True)
    assert torch.isfinite(got).all()
    err = rel(got, masked)
    print(f"\n{kv_dtype} pages, values {value_order}, splits={splits}: rel err vs the masked launch {err:.2e}")
    assert err < 1e-3


def test_fp8_pages_with_a_bfloat16_q_beyond_float16s_range():
    """The float16 dots of fp8 pages clamp q to float16's range: a bfloat16 q entry of 1e5 (inf in
    float16) leaves the output finite, the attention of the clamped q."""
    shape = SHAPES[5]
    q, k, v, table, lengths = make_case(*shape, torch.bfloat16, seed=5)
    q[0, 0, :4] = torch.tensor([1e5, -1e5, 7e4, 3.0])
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    scale = shape[3] ** -0.5
    out = paged_decode_attention(q, k8, v8, table, lengths, scale)
    assert torch.isfinite(out).all()
    clamped = (q.float().clamp(-65504, 65504), k8.float(), v8.float(), table, lengths)
    assert rel(out, reference(clamped, scale)) < 1e-2


def test_default_returns_new_tensor_and_int64_lengths():
    q, k, v, table, lengths = make_case(6, 8, 2, 64, 16, 200, torch.bfloat16, seed=1)
    a = paged_decode_attention(q, k, v, table, lengths, 0.125)
    b = paged_decode_attention(q, k, v, table, lengths.long(), 0.125)
    assert a.shape == q.shape and a.dtype == q.dtype and torch.equal(a, b)


def test_non_contiguous_q():
    q, k, v, table, lengths = make_case(6, 8, 2, 64, 16, 200, torch.float32, seed=2)
    qt = q.transpose(0, 1).contiguous().transpose(0, 1)  # [b, h, d] view with other strides
    assert not qt.is_contiguous()
    torch.testing.assert_close(
        paged_decode_attention(qt, k, v, table, lengths, 0.125),
        paged_decode_attention(q, k, v, table, lengths, 0.125),
        rtol=1e-6,
        atol=1e-6,
    )


def test_page_size_checked():
    q, k, v, table, lengths = make_case(2, 4, 2, 16, 8, 40, torch.float32, seed=0)
    with pytest.raises(ValueError, match="page_size"):
        paged_decode_attention(q, k, v, table, lengths, 1.0)


@pytest.mark.parametrize("splits", [None, 1, 4])
@pytest.mark.parametrize("b", [8, 256])
def test_cuda_graph_capture_and_replay(b, splits):
    """Captured once; lengths, block table and q then change in place (the pool too), and replays
    give the reference's results for the new contents."""
    shape = (b, 32, 8, 128, 64, 2500)
    q, k, v, table, lengths = make_case(*shape, torch.bfloat16, seed=b)
    scale = 128**-0.5

    def step():
        return _paged_decode_attention_triton(q, k, v, table, lengths, scale, num_splits=splits)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile / warm up outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    assert rel(out, reference((q, k, v, table, lengths), scale)) < 1e-2

    for seed in (10, 11):
        q2, k2, v2, table2, lengths2 = make_case(*shape, torch.bfloat16, seed=seed + b)
        for dst, src in ((q, q2), (k, k2), (v, v2), (table, table2), (lengths, lengths2)):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        assert torch.isfinite(out).all()
        err = rel(out, reference((q, k, v, table, lengths), scale))
        print(f"\ngraph b={b} splits={splits} replay seed {seed}: rel err {err:.2e}")
        assert err < 1e-2
