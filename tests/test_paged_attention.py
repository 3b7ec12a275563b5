"""Paged decode attention on CPU: the torch reference against a naive float64 loop, row independence,
unwritten cache slots, argument checks; the Triton kernel under the Triton interpreter (if triton is
installed) against the reference.

The interpreter must be switched on (TRITON_INTERPRET=1) before triton is first imported, so its
cases run in a subprocess (`_interpreter_cases`). Its `tl.dot` on bfloat16 multiplies the raw
uint16 bit patterns (triton 3.9 `InterpreterBuilder.create_dot` calls np.matmul on the storage), so
bfloat16 is only checked on the GPU (tests/gpu/test_paged_attention_gpu.py); float32 and float16 here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.decode_attention import stored_as
from dflash_pipeline.shared.generation.paged_attention import paged_decode_attention, paged_decode_attention_reference


def make_case(
    b: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    page: int,
    max_pages: int,
    dtype: torch.dtype,
    seed: int,
    spare_pages: int = 7,
    poison: bool = True,
):
    """Random q and a page pool whose rows own disjoint, scattered pages. Lengths cover 1, exact page
    multiples and full capacity. With `poison`, every pool slot that no row reads (past a row's
    length, unowned pages) is NaN, and table entries past a row's last page point at a poisoned page."""
    g = torch.Generator().manual_seed(seed)
    num_pages = b * max_pages + spare_pages
    q = torch.randn(b, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(num_pages, page, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_pages, page, kv_heads, head_dim, generator=g).to(dtype)
    table = torch.randperm(num_pages, generator=g)[: b * max_pages].view(b, max_pages).to(torch.int32)
    cap = max_pages * page
    fixed = [1, page, cap, 2 * page, page + 1, cap - 1]
    lengths = torch.randint(1, cap + 1, (b,), generator=g)
    lengths[: min(b, len(fixed))] = torch.tensor([min(x, cap) for x in fixed][:b])
    lengths = lengths[torch.randperm(b, generator=g)]
    if poison:
        used = torch.zeros(num_pages, page, dtype=torch.bool)
        for r in range(b):
            for t in range(int(lengths[r])):
                used[table[r, t // page], t % page] = True
        k[~used] = float("nan")
        v[~used] = float("nan")
        free = int((~used.any(1)).nonzero()[0])  # an unowned (all-NaN) page
        for r in range(b):
            table[r, -(-int(lengths[r]) // page) :] = free
    return q, k, v, table, lengths


def naive(q, k_pages, v_pages, block_table, lengths, scale) -> torch.Tensor:
    """Row by row in float64: contiguous gather of the row's tokens, explicit softmax."""
    b, heads, head_dim = q.shape
    page, kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = heads // kv_heads
    out = torch.empty(b, heads, head_dim, dtype=torch.float64)
    for r in range(b):
        n = int(lengths[r])
        pages = block_table[r, : -(-n // page)].long()
        k = k_pages[pages].reshape(-1, kv_heads, head_dim)[:n].double()
        v = v_pages[pages].reshape(-1, kv_heads, head_dim)[:n].double()
        for h in range(heads):
            s = k[:, h // group] @ q[r, h].double() * scale
            p = torch.exp(s - s.max())
            out[r, h] = (p / p.sum()) @ v[:, h // group]
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("page", [4, 8])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_naive_float64(dtype, heads, kv_heads, page):
    q, k, v, table, lengths = make_case(9, heads, kv_heads, 16, page, 6, dtype, seed=heads * 10 + page)
    scale = 16**-0.5
    out = paged_decode_attention_reference(q, k, v, table, lengths, scale)
    ref = naive(q, k, v, table, lengths, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    else:
        assert rel_err(out, ref) < 1e-2
    # the dispatcher's CPU path (row by row, each row's own tokens only) computes the same
    rows = paged_decode_attention(q, k, v, table, lengths, scale)
    if dtype == torch.float32:
        torch.testing.assert_close(rows.double(), ref, rtol=1e-5, atol=1e-6)
    else:
        assert rel_err(rows, ref) < 1e-2


def test_dispatcher_accepts_int64_lengths_and_out():
    q, k, v, table, lengths = make_case(5, 8, 2, 16, 8, 4, torch.float32, seed=3)
    ref = paged_decode_attention(q, k, v, table, lengths.to(torch.int32), 0.3)
    out = torch.full_like(q, float("nan"))
    got = paged_decode_attention(q, k, v, table, lengths.to(torch.int64), 0.3, out=out)
    assert got is out and torch.equal(out, ref)


def change_row(case, row: int, seed: int):
    """Same inputs except row `row`: new length, new pages (spare ones) with new contents, new q."""
    q, k, v, table, lengths = (t.clone() for t in case)
    g = torch.Generator().manual_seed(seed)
    owned = set(table.flatten().tolist())
    spare = [p for p in range(k.shape[0]) if p not in owned]
    page = k.shape[1]
    n_new = min(len(spare), table.shape[1])
    lengths[row] = int(torch.randint(1, n_new * page + 1, (1,), generator=g))
    for p in table[row].tolist() + spare:
        k[p] = torch.randn(k[p].shape, generator=g).to(k.dtype)
        v[p] = torch.randn(v[p].shape, generator=g).to(v.dtype)
    table[row] = torch.tensor(spare[:n_new] + [spare[0]] * (table.shape[1] - n_new), dtype=table.dtype)
    q[row] = torch.randn(q[row].shape, generator=g).to(q.dtype)
    return q, k, v, table, lengths


BOTH_CPU_PATHS = pytest.mark.parametrize(
    "attention", [paged_decode_attention_reference, paged_decode_attention], ids=["reference", "rows"]
)


@BOTH_CPU_PATHS
def test_rows_are_independent(attention):
    case = make_case(6, 8, 2, 16, 8, 5, torch.float32, seed=11, spare_pages=6)
    before = attention(*case, 0.25)
    for row in (0, 3, 5):
        after = attention(*change_row(case, row, seed=row), 0.25)
        others = [r for r in range(6) if r != row]
        assert torch.equal(after[others], before[others])
        assert not torch.equal(after[row], before[row])


@BOTH_CPU_PATHS
def test_unread_slots_never_leak(attention):
    """NaN in every slot past the lengths (make_case poisons them): nothing NaN comes out, and the
    result equals the same inputs with those slots zeroed."""
    q, k, v, table, lengths = make_case(7, 4, 2, 16, 4, 5, torch.float32, seed=5)
    out = attention(q, k, v, table, lengths, 0.25)
    assert torch.isfinite(out).all()
    clean = attention(q, k.nan_to_num(0.0), v.nan_to_num(0.0), table, lengths, 0.25)
    assert torch.equal(out, clean)


def test_argument_checks():
    q, k, v, table, lengths = make_case(2, 4, 2, 16, 4, 3, torch.float32, seed=0, poison=False)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(q[..., :12], k[..., :12], v[..., :12], table, lengths, 1.0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention(q[:, :3], k, v, table, lengths, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention(q.double(), k, v, table, lengths, 1.0)
    with pytest.raises(ValueError, match="must share q's dtype or torch.float8_e4m3fn"):
        paged_decode_attention(q, k.to(torch.float8_e4m3fn), v, table, lengths, 1.0)
    from dflash_pipeline.shared.generation.paged_attention import _paged_decode_attention_triton

    with pytest.raises(ValueError, match="f16_dots is for fp8 pages and a 16-bit q"):
        _paged_decode_attention_triton(q, k, v, table, lengths, 1.0, f16_dots=True)


def test_launch_defaults_come_from_shapes(monkeypatch):
    """Split-K factor, pipeline depth and warps: functions of shapes only (graph capture needs it)."""
    import dflash_pipeline.shared.generation.paged_attention as pa

    monkeypatch.setattr(pa, "_sm_count", lambda index: 132)  # an H200
    cuda = torch.device("cuda", 0)
    assert pa._default_splits(256, 8, 40, cuda) == 1  # 2048 programs already
    assert pa._default_splits(64, 8, 40, cuda) == 2
    assert pa._default_splits(1, 8, 40, cuda) == pa._MAX_SPLITS
    assert pa._default_splits(1, 8, 3, cuda) == 3  # never more splits than pages
    assert pa._default_splits(1, 8, 40, torch.device("cpu")) == 1
    assert pa._default_stages(64, 128, 2) == 3  # Qwen3-8B bf16: two pages of K and V in flight
    assert pa._default_stages(64, 128, 4) == 2
    assert pa._default_stages(128, 256, 4) == 1  # a page of K and V over 160 KB: no pipelining
    assert pa._default_warps(64, 128) == 4 and pa._default_warps(128, 128) == 8


# --------------------------------------------------------------------------------------------------
# The Triton kernel under the interpreter (CPU tensors), in a subprocess with TRITON_INTERPRET=1.

INTERPRETER_UNAVAILABLE = "TRITON-INTERPRETER-UNAVAILABLE"


def _interpreter_cases() -> None:
    """Runs in the subprocess. Prints INTERPRETER_UNAVAILABLE if the interpreter cannot even run a
    trivial kernel; raises AssertionError on a wrong result."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def _probe(x_ptr, BLOCK: tl.constexpr):
            i = tl.arange(0, BLOCK)
            tl.store(x_ptr + i, tl.load(x_ptr + i) + 1.0)

        x = torch.zeros(16)
        _probe[(1,)](x, BLOCK=16)
        assert torch.equal(x, torch.ones(16))
    except Exception as e:  # noqa: BLE001 - any failure here means "cannot run", not "wrong result"
        print(f"{INTERPRETER_UNAVAILABLE}: {type(e).__name__}: {e}")
        return

    from dflash_pipeline.shared.generation.paged_attention import _paged_decode_attention_triton

    cases = [  # b, heads, kv_heads, head_dim, page, max_pages, splits
        (6, 4, 4, 16, 16, 4, 1),
        (6, 8, 4, 16, 16, 4, 1),
        (6, 16, 4, 32, 16, 5, 1),
        (6, 8, 1, 16, 32, 3, 1),
        (6, 32, 8, 16, 16, 4, 1),  # Qwen3-8B's group of 4
        (6, 8, 2, 16, 16, 6, 3),  # split-K, some splits empty for short rows
        (5, 4, 1, 16, 16, 5, 5),
        (4, 8, 2, 16, 16, 2, 8),  # more splits asked than pages: clamped
    ]
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        for i, (b, heads, kv_heads, head_dim, page, max_pages, splits) in enumerate(cases):
            if dtype == torch.float16 and i not in (1, 4, 5):
                continue
            case = make_case(b, heads, kv_heads, head_dim, page, max_pages, dtype, seed=100 + i)
            scale = head_dim**-0.5
            out = torch.full_like(case[0], float("nan"))
            got = _paged_decode_attention_triton(*case, scale, out=out, num_splits=splits)
            assert got is out
            ref = naive(*case, scale)
            err = rel_err(out, ref)
            assert torch.isfinite(out).all(), (dtype, b, heads, kv_heads, splits, "unwritten or NaN output")
            assert err < tol, (dtype, b, heads, kv_heads, splits, err)
            if dtype == torch.float32:
                torch.testing.assert_close(out, paged_decode_attention_reference(*case, scale), rtol=1e-5, atol=1e-6)
            print(f"ok {dtype} b={b} heads={heads}/{kv_heads} hd={head_dim} page={page} splits={splits} rel={err:.2e}")

    # page ids read CHUNK at a time: with tiny chunks, rows cross several chunk boundaries
    import dflash_pipeline.shared.generation.paged_attention as pa

    saved, pa._CHUNK = pa._CHUNK, 2
    try:
        for splits in (1, 2):
            case = make_case(4, 8, 2, 16, 16, 7, torch.float32, seed=9)
            got = _paged_decode_attention_triton(*case, 0.25, num_splits=splits)
            torch.testing.assert_close(got.double(), naive(*case, 0.25), rtol=1e-5, atol=1e-6)
    finally:
        pa._CHUNK = saved

    # rows are independent in the kernel too; int64 lengths
    case = make_case(5, 8, 2, 16, 16, 3, torch.float32, seed=7, spare_pages=3)
    for splits in (1, 2):
        before = _paged_decode_attention_triton(*case, 0.25, num_splits=splits)
        q, k, v, table, lengths = change_row(case, 2, seed=1)
        after = _paged_decode_attention_triton(q, k, v, table, lengths.to(torch.int64), 0.25, num_splits=splits)
        assert torch.equal(after[[0, 1, 3, 4]], before[[0, 1, 3, 4]])
        torch.testing.assert_close(after.double(), naive(q, k, v, table, lengths, 0.25), rtol=1e-5, atol=1e-6)
    # pages stored in another axis order are read through their strides
    case = make_case(5, 8, 2, 16, 16, 4, torch.float32, seed=11)
    for order in ("hdt", "htd"):
        q, k, v, table, lengths = case
        got = _paged_decode_attention_triton(q, stored_as(k, order), stored_as(v, order), table, lengths, 0.25)
        torch.testing.assert_close(got.double(), naive(*case, 0.25), rtol=1e-5, atol=1e-6)
    # finite_value_tails: each row's last value page loaded unmasked, its tail past the length finite
    # garbage (the rest of the pool NaN as before); NaN there instead shows the load is unmasked
    for dtype in (torch.float32, torch.float16):
        q, k, v, table, lengths = make_case(6, 8, 2, 16, 16, 4, dtype, seed=13)
        finite = v.clone()
        for r in range(len(q)):
            n = int(lengths[r])
            if n % 16:
                finite[table[r, (n - 1) // 16], n % 16 :] = 100 * torch.randn(16 - n % 16, 2, 16).to(dtype)
        for order, splits in (("thd", 1), ("hdt", 2)):
            got = _paged_decode_attention_triton(
                q, k, stored_as(finite, order), table, lengths, 0.25, num_splits=splits, finite_value_tails=True
            )
            assert rel_err(got, naive(q, k, finite, table, lengths, 0.25)) < (1e-5 if dtype == torch.float32 else 2e-3)
            poisoned = _paged_decode_attention_triton(
                q, k, stored_as(v, order), table, lengths, 0.25, num_splits=splits, finite_value_tails=True
            )
            assert poisoned.isnan().any(), "finite_value_tails left the value load masked"
    # fp8 pages and a bfloat16 q: float16 dots by default, q clamped to float16's range (1e5 -> 65504)
    q, k, v, table, lengths = make_case(6, 8, 2, 16, 16, 4, torch.bfloat16, seed=3)
    q[0, 0, :2] = torch.tensor([1e5, -1e5])
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    got = _paged_decode_attention_triton(q, k8, v8, table, lengths, 0.25)
    assert torch.isfinite(got).all(), "a bfloat16 q beyond float16's range made the fp8 path non-finite"
    assert torch.equal(got, _paged_decode_attention_triton(q, k8, v8, table, lengths, 0.25, f16_dots=True))
    ref = naive(q.float().clamp(-65504, 65504), k8.float(), v8.float(), table, lengths, 0.25)
    assert rel_err(got, ref) < 1e-2, rel_err(got, ref)
    from dflash_pipeline.shared.generation.decoder import PagedKVCache, to_cache_dtype

    # the engine's fp8 cache as its decode step launches on it: values token-minor, the value pages loaded
    # unmasked; the slots past each row's length hold what an earlier request left (clamped when written;
    # every slot of the even pages) or the zeros the cache starts with. (The interpreter converts an fp8
    # NaN to 480, so that the load is unmasked shows on the GPU only: tests/gpu/test_paged_attention_gpu.py.)
    q, k, v, table, lengths = make_case(6, 8, 2, 16, 16, 4, torch.bfloat16, seed=17)
    cache = PagedKVCache.allocate(1, len(k), 16, 2, 16, torch.float8_e4m3fn, torch.device("cpu"))
    earlier = torch.arange(len(k) * 16).view(-1, 16)[::2].flatten()
    stale = to_cache_dtype(
        1000 * torch.randn(len(earlier), 2, 16, generator=torch.Generator().manual_seed(5)), cache.dtype
    )
    cache.write(0, cache.slots(earlier), stale, stale)
    own = (~k.isnan()).flatten(0, 1).all(-1).all(-1).nonzero()[:, 0]  # every row's tokens' slots
    cache.write(0, cache.slots(own), *(to_cache_dtype(t.flatten(0, 1)[own], cache.dtype) for t in (k, v)))
    k8, v8 = cache.keys[0], cache.values[0]
    for splits in (1, 3):
        got = _paged_decode_attention_triton(
            q, k8, v8, table, lengths, 0.25, num_splits=splits, finite_value_tails=cache.finite_value_tails
        )
        assert torch.equal(got, _paged_decode_attention_triton(q, k8, v8, table, lengths, 0.25, num_splits=splits))
        ref = naive(q.float(), k8.float(), v8.float(), table, lengths, 0.25)
        assert rel_err(got, ref) < 1e-2, rel_err(got, ref)
    try:
        _paged_decode_attention_triton(*make_case(2, 4, 2, 16, 8, 3, torch.float32, seed=0), 1.0)
    except ValueError as e:
        assert "page_size" in str(e)
    else:
        raise AssertionError("page_size 8 accepted on the Triton path")
    print("interpreter cases passed")


def test_triton_kernel_under_interpreter():
    pytest.importorskip("triton")
    here = Path(__file__).resolve().parent
    code = f"import sys; sys.path.insert(0, {str(here)!r}); import test_paged_attention as t; t._interpreter_cases()"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=here.parent, capture_output=True, text=True, timeout=900
    )
    if proc.returncode == 0 and INTERPRETER_UNAVAILABLE in proc.stdout:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-8000:]}"
    assert "interpreter cases passed" in proc.stdout


@BOTH_CPU_PATHS
@pytest.mark.parametrize("order", ["hdt", "htd"])
def test_pages_are_read_through_their_strides(attention, order):
    """Pages stored with their axes in another order (e.g. values token-minor, `bench.decode_attention
    --layout vt`) are the same pages: the same attention, unread NaN slots still unread."""
    q, k, v, table, lengths = make_case(7, 8, 2, 16, 4, 5, torch.float32, seed=22)
    got = attention(q, stored_as(k, order), stored_as(v, order), table, lengths, 0.25)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, attention(q, k, v, table, lengths, 0.25))


@BOTH_CPU_PATHS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_pages_read_as_the_pages_converted_first(attention, dtype):
    """An fp8 KV cache: each path converts the pages to q's dtype as it reads them, so its result is the
    same path's over the converted pages, exactly (NaN in unread slots included: fp8 holds NaN too)."""
    q, k, v, table, lengths = make_case(7, 8, 2, 16, 4, 5, dtype, seed=21)
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    out = attention(q, k8, v8, table, lengths, 0.25)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert torch.equal(out, attention(q, k8.to(dtype), v8.to(dtype), table, lengths, 0.25))
    assert not torch.equal(out, attention(q, k, v, table, lengths, 0.25))  # the rounding is there to see
