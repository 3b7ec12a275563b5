"""Decode attention over a paged KV cache: one new query token per row, attending to its own context.

Why: in continuous batching every row has its own context length. A padded [b, max_len] cache reads
(and holds) max_len tokens for every row; here a row's keys/values live in fixed-size pages from a
shared pool, found through its row of `block_table`, so memory follows the real lengths and the
kernel reads each row's own `lengths[r]` tokens only. Decode attention is memory-bound, so the bytes
read are the time spent.

Layout: `k_pages`/`v_pages` [num_pages, page_size, num_kv_heads, head_dim] with any strides (every
path reads them through their strides, so pages may be stored with their axes in another order);
token t of row r is at `k_pages[block_table[r, t // page_size], t % page_size]`. GQA as HF's
`repeat_kv`: query head h uses kv head `h // (num_heads // num_kv_heads)`.

- `paged_decode_attention`: the Triton kernel on CUDA tensors; elsewhere (the CPU) one SDPA call per
  row over exactly its own tokens, gathered page by page: no host-sync rule to keep without CUDA
  graphs, and a row reads `lengths[r]` tokens instead of the block table's whole width. The kernel
  runs one program per (row, kv head) with that kv head's G query heads as the rows of one tile
  (padded to 16 for `tl.dot`), loops over the row's pages only (the loop bound comes from the loaded
  length) with an online softmax in float32; the page ids come from registers, so Triton keeps
  num_stages - 1 pages of K and V in flight per program. With few (row, kv head) programs for the GPU
  (small batch), the pages of a row are split over several programs plus a small reduce (split-K);
  the number of splits comes from shapes only. Nothing syncs with the host and the launch grid
  depends on shapes only, so a decode step using it can be captured in a CUDA graph.
- `paged_decode_attention_reference`: plain torch, HF's own computation (gather through the block
  table, boolean mask, `scaled_dot_product_attention` in q's dtype with grouped kv heads); also
  graph-safe. The tests' reference for both paths.

The pages may also hold `KV_FP8` (an fp8 KV cache: half the bytes a decode step reads, the step's
memory-bound half): every path converts each page as it reads it, so the result is exactly the
attention over the pages converted first: to q's dtype, except in the Triton kernel for a 16-bit q,
which converts pages (and q) to float16, the cheaper conversion, exact for every fp8 value.

Requirements: `lengths[r] >= 1`; head_dim a power of two >= 16; on the Triton path page_size a
power of two >= 16 as well.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

__all__ = ["KV_FP8", "gather", "paged_decode_attention", "paged_decode_attention_reference"]

KV_FP8 = torch.float8_e4m3fn  # the one cache dtype besides q's: read back to q's dtype per page


def gather(pages: torch.Tensor, index: torch.Tensor | tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
    """`pages[index]` (a tensor indexes dim 0, a tuple the leading dims) converted to `dtype`; fp8 is
    gathered as its bytes, since not every device has an fp8 gather kernel."""
    if pages.dtype == KV_FP8:
        return pages.view(torch.uint8)[index].view(KV_FP8).to(dtype)
    return pages[index].to(dtype)


_LOG2E = 1.4426950408889634
_MAX_SPLITS = 16
_STAGES = 3  # default software-pipeline depth of the page loop: num_stages - 1 pages in flight per program
_STAGE_BUDGET = 96 * 1024  # shared memory the in-flight K/V pages may take (an H100/H200 SM has 228 KB)
_CHUNK = 64  # page ids held in registers at a time
_NO_GUARD = contextlib.nullcontext()


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor
) -> None:
    if q.dim() != 3 or k_pages.dim() != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(
            f"paged_decode_attention: expected q [b, heads, head_dim] and k_pages == v_pages "
            f"[num_pages, page_size, kv_heads, head_dim], got q {tuple(q.shape)}, "
            f"k_pages {tuple(k_pages.shape)}, v_pages {tuple(v_pages.shape)}"
        )
    b, heads, head_dim = q.shape
    kv_heads = k_pages.shape[2]
    if k_pages.shape[3] != head_dim:
        raise ValueError(f"paged_decode_attention: q head_dim {head_dim} != k_pages head_dim {k_pages.shape[3]}")
    if heads % kv_heads:
        raise ValueError(f"paged_decode_attention: num_heads {heads} is not a multiple of num_kv_heads {kv_heads}")
    if not _is_pow2(head_dim) or head_dim < 16:
        raise ValueError(f"paged_decode_attention: head_dim must be a power of two >= 16, got {head_dim}")
    if block_table.dim() != 2 or block_table.shape[0] != b or lengths.shape != (b,):
        raise ValueError(
            f"paged_decode_attention: expected block_table [b={b}, max_pages] and lengths [b], got "
            f"{tuple(block_table.shape)} and {tuple(lengths.shape)}"
        )
    if v_pages.dtype != k_pages.dtype or k_pages.dtype not in (q.dtype, KV_FP8):
        raise ValueError(
            f"paged_decode_attention: k_pages and v_pages must share q's dtype or {KV_FP8}, got "
            f"q {q.dtype}, k_pages {k_pages.dtype}, v_pages {v_pages.dtype}"
        )


def paged_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    finite_value_tails: bool = False,
) -> torch.Tensor:
    """softmax(q k^T * scale) v over each row's first `lengths[r]` cached tokens.

    q [b, num_heads, head_dim]; k_pages, v_pages [num_pages, page_size, num_kv_heads, head_dim] (q's
    dtype or `KV_FP8`); block_table [b, max_pages] int32; lengths [b] int32/int64, each in
    1..max_pages*page_size. Returns [b, num_heads, head_dim] in q's dtype (written into `out` if given).
    The Triton kernel on CUDA (no host sync: graph-safe), row by row elsewhere. `finite_value_tails`:
    the caller's word that every value slot of a row's last page is finite (the kernel then loads value
    pages unmasked; the row-by-row path reads only the row's tokens either way)."""
    if q.is_cuda:
        return _paged_decode_attention_triton(
            q, k_pages, v_pages, block_table, lengths, scale, out=out, finite_value_tails=finite_value_tails
        )
    _check(q, k_pages, v_pages, block_table, lengths)
    return _paged_decode_attention_rows(q, k_pages, v_pages, block_table, lengths, scale, out=out)


def _paged_decode_attention_rows(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row by row, as HF attends one unpadded prompt: the row's first `lengths[r]` keys and values,
    gathered from its pages, into SDPA without a mask. On the CPU the reference's gather of every row's
    whole block-table width, its masking and SDPA's copy of the masked keys cost ~4x this (one SmolLM2
    layer, 16 rows at context ~600). Reads the lengths on the host, so not for CUDA graphs."""
    _, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    out = torch.empty_like(q) if out is None else out
    for row, n in enumerate(lengths.tolist()):
        pages = block_table[row, : -(-n // page_size)].long()
        # 4-d [1, kv_heads, n, head_dim] views: SDPA's CPU flash kernel takes them as they are
        k, v = (
            gather(t, pages, q.dtype).reshape(-1, kv_heads, head_dim)[None, :n].transpose(1, 2)
            for t in (k_pages, v_pages)
        )
        out[row] = F.scaled_dot_product_attention(
            q[row, None, :, None], k, v, scale=scale, enable_gqa=heads != kv_heads
        )[0, :, 0]
    return out


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same attention in plain torch, on any device, as HF's sdpa attention computes it.

    Gathers all max_pages*page_size positions of every row through the block table, masks positions
    >= lengths[r] and calls SDPA in q's dtype, query heads grouped on kv heads as HF's `repeat_kv`. Keys
    and values at masked positions are zeroed first, so whatever an unwritten cache slot holds (even
    NaN) cannot leak in; for finite inputs this changes nothing."""
    b, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    seq = block_table.shape[1] * page_size
    table = block_table.long()
    valid = torch.arange(seq, device=q.device)[None, :] < lengths.to(q.device)[:, None]  # [b, S]
    masked = ~valid[:, :, None, None]  # [b, S, 1, 1]
    # [b, max_pages, P, kvh, D] -> [b, S, kvh, D] (a new tensor: zeroed in place) -> [b, kvh, S, D]
    k = gather(k_pages, table, q.dtype).reshape(b, seq, kv_heads, head_dim).masked_fill_(masked, 0).transpose(1, 2)
    v = gather(v_pages, table, q.dtype).reshape(b, seq, kv_heads, head_dim).masked_fill_(masked, 0).transpose(1, 2)
    # enable_gqa: kv head j serves query heads j*n_rep.. (HF's `repeat_kv` rule) without materializing
    # the repeated keys and values, whose copy cost several times the attention itself on the CPU
    out = F.scaled_dot_product_attention(
        q[:, :, None], k, v, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=heads != kv_heads
    )
    return out[:, :, 0]


# ---------------------------------------------------------------------------------------------------
# Triton path


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_splits(b: int, kv_heads: int, max_pages: int, device: torch.device) -> int:
    """Split-K factor from shapes only: enough programs for ~4 per SM, never more splits than pages
    of capacity, at most `_MAX_SPLITS`."""
    if device.type != "cuda":
        return 1
    programs = b * kv_heads
    target = 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= target:
        return 1
    return max(1, min(-(-target // programs), max_pages, _MAX_SPLITS))


def _default_stages(page_size: int, head_dim: int, element_size: int) -> int:
    """Software-pipeline depth of the page loop: num_stages - 1 pages of K and V in flight per
    program, up to `_STAGES - 1` within `_STAGE_BUDGET` of shared memory (always one if it fits at all)."""
    stage_bytes = 2 * page_size * head_dim * element_size  # one page of K and one of V
    buffers = min(_STAGES - 1, _STAGE_BUDGET // stage_bytes)
    if buffers == 0 and stage_bytes <= 160 * 1024:
        buffers = 1
    return 1 + buffers


def _default_warps(page_size: int, head_dim: int) -> int:
    """4 warps for pages up to 64 x 128 (Qwen3-8B's), 8 above (4 would spill registers)."""
    return 4 if page_size * head_dim <= 64 * 128 else 8


def _paged_decode_attention_triton(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    maxnreg: int | None = None,
    f16_dots: bool | None = None,
    finite_value_tails: bool = False,
) -> torch.Tensor:
    """The Triton launch (also runs on CPU tensors under TRITON_INTERPRET=1). `num_splits` None
    picks the split-K factor from shapes, `num_stages`/`num_warps` None their defaults below;
    `maxnreg` caps registers per thread (more programs per SM). `f16_dots` (fp8 pages, 16-bit q;
    None: on exactly then) converts the pages to float16 rather than q's dtype and runs both dots in
    float16 (q clamped to float16's range): fp8 -> f16 is one packed instruction per two elements on
    sm_89+, where fp8 -> bf16 goes through float32, and every cached byte is converted (measured on an
    H100: 1.21x the kernel's speed, bench/RESULTS.md). float16 holds every fp8 value exactly and has
    more mantissa than bfloat16. `finite_value_tails`: as in `paged_decode_attention` (the engine's
    fp8 cache, `PagedKVCache`); each value page is then loaded unmasked, since a zero probability times
    a finite value adds nothing. With values token-minor (bench.decode_attention's `vt`, the engine's
    fp8 layout), compiled for sm_90, fp8 values then come in by 16-byte copies inside the software
    pipeline and reach the tensor cores by `ldmatrix`, with no byte-wide reads (bench.kernel_ptx):
    1.34-1.36x the masked launch on the token-major fp8 layout, on an H200 (bench/RESULTS.md run 14).
    The other knobs are for the benchmark and tests."""
    _check(q, k_pages, v_pages, block_table, lengths)
    fp8_pages_16bit_q = k_pages.dtype == KV_FP8 and q.dtype != torch.float32
    if f16_dots is None:
        f16_dots = fp8_pages_16bit_q
    elif f16_dots and not fp8_pages_16bit_q:
        raise ValueError("paged_decode_attention: f16_dots is for fp8 pages and a 16-bit q")
    b, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    max_pages = block_table.shape[1]
    if not _is_pow2(page_size) or page_size < 16:
        raise ValueError(f"paged_decode_attention (Triton): page_size must be a power of two >= 16, got {page_size}")
    if block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"paged_decode_attention: block_table must be int32 or int64, got {block_table.dtype}")
    group = heads // kv_heads
    splits = _default_splits(b, kv_heads, max_pages, q.device) if num_splits is None else int(num_splits)
    splits = max(1, min(splits, max_pages))
    if out is None:
        out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"paged_decode_attention: out must be {tuple(q.shape)} {q.dtype} on {q.device}, got "
            f"{tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if b == 0 or max_pages == 0:
        return out
    if num_stages is None:
        num_stages = _default_stages(page_size, head_dim, k_pages.element_size())
    if num_warps is None:
        num_warps = _default_warps(page_size, head_dim)
    kernels = _kernels()
    meta = dict(
        GROUP=group,
        GROUP_PAD=max(16, _next_pow2(group)),
        PAGE=page_size,
        HEAD_DIM=head_dim,
        IEEE=q.dtype == torch.float32,
        F16_DOTS=f16_dots,
        FINITE_V=finite_value_tails,
        CHUNK=min(_CHUNK, _next_pow2(-(-max_pages // splits))),
        num_warps=num_warps,
        num_stages=num_stages,
        **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )
    args = (q, k_pages, v_pages, block_table, lengths)
    strides = (*q.stride(), *k_pages.stride(), *v_pages.stride(), *block_table.stride())
    qk_scale = float(scale) * _LOG2E
    # triton launches on the current device: make it q's
    guard = torch.cuda.device(q.device) if q.is_cuda and q.device.index != torch.cuda.current_device() else _NO_GUARD
    with guard:
        if splits == 1:
            kernels.attn[(b, kv_heads, 1)](
                *args, out, out, out, qk_scale, max_pages, 1, *strides, *out.stride(), 0, 0, 0, 0, SPLIT=False, **meta
            )
            return out
        return _launch_split(kernels, meta, args, strides, out, qk_scale, splits, max_pages)


def _launch_split(
    kernels, meta: dict, args: tuple, strides: tuple, out: torch.Tensor, qk_scale: float, splits: int, max_pages: int
) -> torch.Tensor:
    q = args[0]
    b, heads, head_dim = q.shape
    kv_heads = args[1].shape[2]
    # per split: the unnormalised accumulator, the running max (log2 domain) and the running sum
    acc = torch.empty((b, heads, splits, head_dim), device=q.device, dtype=torch.float32)
    m = torch.empty((b, heads, splits), device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)  # noqa: E741 - the running sum, as flash attention names it
    kernels.attn[(b, kv_heads, splits)](
        *args,
        acc,
        m,
        l,
        qk_scale,
        max_pages,
        splits,
        *strides,
        acc.stride(0),
        acc.stride(1),
        acc.stride(3),
        acc.stride(2),
        *m.stride(),
        SPLIT=True,
        **meta,
    )
    kernels.reduce[(b, heads)](
        acc,
        m,
        l,
        out,
        splits,
        *acc.stride(),
        *m.stride(),
        *out.stride(),
        HEAD_DIM=head_dim,
        SPLITS_PAD=_next_pow2(splits),
        num_warps=4,
    )
    return out


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _kernels():
    """Defines the Triton kernels on first use: triton is imported here, so this module imports
    without it, and TRITON_INTERPRET set before the first call takes effect."""
    import types

    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        table_ptr,
        len_ptr,
        o_ptr,
        m_ptr,
        l_ptr,
        qk_scale,
        max_pages,
        num_splits,
        s_qb,
        s_qh,
        s_qd,
        s_kp,
        s_kt,
        s_kh,
        s_kd,
        s_vp,
        s_vt,
        s_vh,
        s_vd,
        s_tb,
        s_tp,
        s_ob,
        s_oh,
        s_od,
        s_os,
        s_mb,
        s_mh,
        s_ms,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        PAGE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        IEEE: tl.constexpr,
        F16_DOTS: tl.constexpr,
        FINITE_V: tl.constexpr,
        SPLIT: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        """Program (row, kv head, split): the GROUP query heads of one kv head as the rows of one
        tile, over the pages [first, last) of the row; online softmax in float32 (base 2)."""
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        t = tl.arange(0, PAGE)
        g_ok = g < GROUP
        head = kvh * GROUP + g

        length = tl.load(len_ptr + row).to(tl.int32)
        n_pages = tl.minimum(tl.cdiv(length, PAGE), max_pages)
        if SPLIT:
            per_split = tl.cdiv(n_pages, num_splits)
            first = split * per_split
            last = tl.minimum(first + per_split, n_pages)
        else:
            first = 0
            last = n_pages

        q = tl.load(
            q_ptr + row.to(tl.int64) * s_qb + head[:, None] * s_qh + d[None, :] * s_qd, mask=g_ok[:, None], other=0.0
        )
        if F16_DOTS:  # a bfloat16 q beyond float16's range would become inf
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        k_tile = k_ptr + kvh.to(tl.int64) * s_kh + t[:, None] * s_kt + d[None, :] * s_kd
        v_tile = v_ptr + kvh.to(tl.int64) * s_vh + t[:, None] * s_vt + d[None, :] * s_vd
        table_row = table_ptr + row.to(tl.int64) * s_tb
        c = tl.arange(0, CHUNK)
        for c0 in range(first, last, CHUNK):
            # CHUNK page ids at once, then each page's id from registers: the K/V addresses of the
            # inner loop depend on no load of that loop, so Triton multi-buffers them (num_stages - 1
            # pages in flight per program); a tl.load of the id in the loop would keep one in flight
            ids = tl.load(table_row + (c0 + c) * s_tp, mask=c0 + c < last, other=0)
            for i in range(c0, tl.minimum(c0 + CHUNK, last)):
                page = tl.sum(tl.where(c == i - c0, ids, 0), 0).to(tl.int64)
                tok_ok = (i * PAGE + t) < length
                # an fp8 cache's pages become q's dtype here (a no-op for a cache in q's dtype; float16
                # with F16_DOTS, q converted above)
                k = tl.load(k_tile + page * s_kp, mask=tok_ok[:, None], other=0.0).to(q.dtype)
                if FINITE_V:  # the launch's `finite_value_tails`: p is 0 past the length
                    v = tl.load(v_tile + page * s_vp).to(q.dtype)
                else:
                    # with fp8 pages this reads the dot operand from shared memory a byte at a time; the
                    # page loaded whole with its tail zeroed by a select instead ran at 0.89x (fp8) and
                    # 0.95x (bf16) the kernel's speed on an H100 (bench/RESULTS.md, regeneration run 13)
                    v = tl.load(v_tile + page * s_vp, mask=tok_ok[:, None], other=0.0).to(q.dtype)
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                s = tl.where(tok_ok[None, :], s * qk_scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                if IEEE:
                    pv = tl.dot(p, v, input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * alpha[:, None] + pv
                m_i = m_new

        o_rows = o_ptr + row.to(tl.int64) * s_ob + head[:, None] * s_oh + d[None, :] * s_od
        if SPLIT:
            # unnormalised partials; an empty split leaves m = -inf, l = 0, acc = 0
            tl.store(o_rows + split * s_os, acc, mask=g_ok[:, None])
            ml = row.to(tl.int64) * s_mb + head * s_mh + split * s_ms
            tl.store(m_ptr + ml, m_i, mask=g_ok)
            tl.store(l_ptr + ml, l_i, mask=g_ok)
        else:
            tl.store(o_rows, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=g_ok[:, None])

    @triton.jit
    def split_reduce_kernel(
        acc_ptr,
        m_ptr,
        l_ptr,
        o_ptr,
        num_splits,
        s_ab,
        s_ah,
        s_as,
        s_ad,
        s_mb,
        s_mh,
        s_ms,
        s_ob,
        s_oh,
        s_od,
        HEAD_DIM: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
    ):
        """Program (row, head): combines the splits' partials (split 0 is never empty)."""
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        sp = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, HEAD_DIM)
        sp_ok = sp < num_splits
        ml = row * s_mb + head * s_mh + sp * s_ms
        m = tl.load(m_ptr + ml, mask=sp_ok, other=float("-inf"))
        l = tl.load(l_ptr + ml, mask=sp_ok, other=0.0)  # noqa: E741 - the running sum
        acc = tl.load(
            acc_ptr + row * s_ab + head * s_ah + sp[:, None] * s_as + d[None, :] * s_ad, mask=sp_ok[:, None], other=0.0
        )
        m_all = tl.max(m, 0)
        w = tl.exp2(m - m_all)  # empty splits: exp2(-inf) = 0
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
        tl.store(o_ptr + row * s_ob + head * s_oh + d * s_od, out.to(o_ptr.dtype.element_ty))

    return types.SimpleNamespace(attn=paged_decode_kernel, reduce=split_reduce_kernel)
