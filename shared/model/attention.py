"""DFlash training attention: the mask rule, its flex `BlockMask`, its dense twin, and the kernels.

Layout of one training row (one pack): the queries are N blocks of B tokens (query `n*B + k` is
token k of block n); the keys are the S context tokens of the pack followed by the same N*B block
tokens (KV_LEN = S + N*B). Block n has an anchor `a_n` (index into the packed context), the document
`d_n` the anchor belongs to, and a valid flag `v_n` (padding blocks are invalid).

The rule (identical in `dflash_mask_mod` and `dense_mask`, which are written independently):
- a token of block n sees context key j iff `v_n`, `j < a_n` (strictly before the anchor: the anchor
  token itself is position 0 of the block) and `context_doc[j] == d_n` (no leakage across packed
  documents; padding context has doc -1, which no valid block has);
- it sees every token of its own block (bidirectional, unless causal) and no token of any other block;
- an invalid block sees nothing: its rows are fully masked and every backend returns zeros there.
- causal (the reference's `is_causal` layers): token k of its block sees block tokens k' <= k only
  (the context before the anchor is always earlier);
- optional sliding window W, as the reference applies it at inference (`q_pos - k_pos < W`, and in
  non-causal layers also `k_pos - q_pos < W`, over absolute positions): token k of block n sees
  context key j only if `a_n + k - j < W`, and block token k' only if `|k - k'| < W` (pack-index
  differences equal position differences inside a doc).
Layers of different kinds (the reference's `layer_types` and `is_causal`) get one mask each.

Kernels: `flex_attention_eager` is uncompiled flex (its math implementation, with a backward even
on CPU, see `_allow_cpu_backward`); `flex_attention_compiled` is `torch.compile(flex_attention,
dynamic=False)`, built once per process (only the compiled kernel is fused; eager flex is an O(S^2)
reference; compiled flex on CPU has no backward). S is always `context_doc.shape[1]`. Shapes must
stay fixed per shape bucket (S and N*B multiples of 128, see `shape_bucket`) so steps with new
anchors/documents reuse the compiled graph; `CompileCounter` counts graphs compiled in a scope so
tests can prove it.

Triton shared-memory OOM: some GPU/shape/dtype combinations make the default flex tile sizes need
more shared memory than the chip has ("out of resource: shared memory"). The compiled call catches
that error and retries with the next, smaller rung of `KERNEL_OPTION_FALLBACKS`, keeping the rung
that worked for the rest of the process. The backward kernel is compiled lazily and fails inside
`loss.backward()`, where no retry is possible: `calibrate_kernel_options` runs forward and backward
at given shapes down the ladder and pins the first rung that works. `dflash-train` does not call it
(the first rung fits every shape measured on the H200); a GPU whose shared memory is smaller needs it. Explicit `kernel_options` passed by the caller are never overridden.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.nn.attention.flex_attention as _flex_module
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

log = logging.getLogger(__name__)

FLEX_BLOCK = 128  # flex's sparse block size; bucketed shapes are multiples of it

# Largest tiles first; {} means inductor's defaults for the device. Backward tiles keep
# BLOCK_N1 % BLOCK_M1 == 0 and BLOCK_M2 % BLOCK_N2 == 0, which the flex backward requires.
KERNEL_OPTION_FALLBACKS: tuple[dict, ...] = (
    {},
    {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32, "num_stages": 2},
    {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_M1": 16, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 16, "num_stages": 1},
)


def shape_bucket(length: int, multiple: int = FLEX_BLOCK) -> int:
    """Smallest multiple of `multiple` holding `length` (fixed shapes avoid recompiles)."""
    return max(multiple, -(-length // multiple) * multiple)


def dflash_mask_mod(
    anchor_pos: torch.Tensor,
    block_doc: torch.Tensor,
    block_valid: torch.Tensor,
    context_doc: torch.Tensor,
    block_size: int,
    window: int | None = None,
    causal: bool = False,
) -> Callable:
    """The mask rule as a flex `mask_mod(b, h, q_idx, kv_idx)`; tensors are [batch, N] / [batch, S]."""
    N, S, B = anchor_pos.shape[1], context_doc.shape[1], block_size

    def mask_mod(b, h, q_idx, kv_idx):
        n = torch.clamp(q_idx // B, max=N - 1)
        k = q_idx - n * B
        anchor = anchor_pos[b, n]
        in_context = kv_idx < S
        j = torch.clamp(kv_idx, max=S - 1)
        sees_context = in_context & (kv_idx < anchor) & (context_doc[b, j] == block_doc[b, n])
        offset = kv_idx - S - n * B  # position of the key inside block n (in [0, B) for own block)
        sees_block = (~in_context) & (offset >= 0) & (offset < B)
        if causal:
            sees_block = sees_block & (offset <= k)
        if window is not None:
            sees_context = sees_context & (anchor + k - kv_idx < window)
            sees_block = sees_block & ((offset - k).abs() < window)
        return block_valid[b, n] & (sees_context | sees_block)

    return mask_mod


def _check_shapes(anchor_pos, block_doc, block_valid, context_doc) -> None:
    if (
        not (anchor_pos.shape == block_doc.shape == block_valid.shape)
        or anchor_pos.dim() != 2
        or context_doc.dim() != 2
        or context_doc.shape[0] != anchor_pos.shape[0]
    ):
        raise ValueError(
            f"mask inputs must be anchor_pos/block_doc/block_valid [batch, N] and context_doc [batch, S], got "
            f"{[tuple(t.shape) for t in (anchor_pos, block_doc, block_valid, context_doc)]}"
        )


_compiled_create_block_mask: Callable | None = None


def build_block_mask(
    anchor_pos: torch.Tensor,
    block_doc: torch.Tensor,
    block_valid: torch.Tensor,
    context_doc: torch.Tensor,
    block_size: int,
    window: int | None = None,
    causal: bool = False,
    *,
    device: torch.device | str,
    compile: bool = True,
) -> BlockMask:
    """The flex `BlockMask` of one batch, on `device` (create_block_mask defaults to cuda otherwise).

    `compile=True` builds it with `torch.compile(create_block_mask)` (one compile per shape bucket;
    milliseconds per step after that); `compile=False` is the eager builder for small CPU tests.
    """
    global _compiled_create_block_mask
    device = torch.device(device)
    _check_shapes(anchor_pos, block_doc, block_valid, context_doc)
    (batch, N), S, B = anchor_pos.shape, context_doc.shape[1], block_size
    tensors = [t.to(device) for t in (anchor_pos, block_doc, block_valid, context_doc)]
    mask_mod = dflash_mask_mod(*tensors, block_size=B, window=window, causal=causal)
    builder = create_block_mask
    if compile:
        if _compiled_create_block_mask is None:
            _compiled_create_block_mask = torch.compile(create_block_mask, dynamic=False)
        builder = _compiled_create_block_mask
    return builder(mask_mod, batch, None, N * B, S + N * B, device=device)


def dense_mask(
    anchor_pos: torch.Tensor,
    block_doc: torch.Tensor,
    block_valid: torch.Tensor,
    context_doc: torch.Tensor,
    block_size: int,
    window: int | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """The same rule as a bool tensor [batch, 1, N*B, S+N*B] (True = may attend), built block-wise."""
    _check_shapes(anchor_pos, block_doc, block_valid, context_doc)
    (batch, N), S, B = anchor_pos.shape, context_doc.shape[1], block_size
    device = anchor_pos.device
    key = torch.arange(S, device=device)
    # context part, one row per block, then repeated for its B tokens
    per_block = (key[None, None, :] < anchor_pos[:, :, None]) & (context_doc[:, None, :] == block_doc[:, :, None])
    context = per_block.repeat_interleave(B, dim=1)  # [batch, N*B, S]
    own_block = torch.kron(torch.eye(N, device=device), torch.ones(B, B, device=device)).bool()
    blocks = own_block.expand(batch, N * B, N * B)
    k = torch.arange(B, device=device).repeat(N)  # token index inside its block, per query row
    if causal:
        blocks = blocks & (k[None, :] <= k[:, None])
    if window is not None:
        query_index = anchor_pos.repeat_interleave(B, dim=1) + k[None, :]
        context = context & ((query_index[:, :, None] - key[None, None, :]) < window)
        blocks = blocks & ((k[:, None] - k[None, :]).abs() < window)
    rows_valid = block_valid.bool().repeat_interleave(B, dim=1)[:, :, None]
    return (torch.cat([context, blocks], dim=-1) & rows_valid)[:, None]


def inference_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None = None, causal: bool = False
) -> torch.Tensor | None:
    """The reference's inference mask (`_attention_mask`) over absolute positions: queries [b, Q] and
    keys [b, K] -> bool [b, 1, Q, K], or None when every key is visible (a full, non-causal layer)."""
    if window is None and not causal:
        return None
    ahead = query_positions[:, :, None] - key_positions[:, None, :]  # how far the key is behind the query
    visible = torch.ones_like(ahead, dtype=torch.bool)
    if causal:
        visible &= ahead >= 0
    if window is not None:
        visible &= ahead < window
        if not causal:
            visible &= -ahead < window
    return visible[:, None]


def sdpa_dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """SDPA with an explicit bool mask; fully masked rows give zeros (and zero gradients), not NaN.

    Such rows are unmasked for the kernel (so softmax stays finite in forward and backward) and
    their output is replaced by zeros, which is what flex returns for them.
    """
    visible = mask.any(dim=-1, keepdim=True)
    safe = mask | ~visible
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=safe, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return torch.where(visible, out, torch.zeros((), dtype=out.dtype, device=out.device))


@contextmanager
def _allow_cpu_backward():
    """torch refuses any CPU flex call whose inputs need grad, because the *compiled* CPU kernel
    has no backward (pytorch #148752). The eager (math) implementation does have a correct
    backward, so for the eager reference we skip that one up-front check, for this call only."""
    original = getattr(_flex_module, "_validate_device", None)
    if original is None:
        yield
        return

    def validate(query, key, value):
        if query.device.type != "cpu":
            original(query, key, value)

    _flex_module._validate_device = validate
    try:
        yield
    finally:
        _flex_module._validate_device = original


def flex_attention_eager(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, scale: float
) -> torch.Tensor:
    """Uncompiled flex: the O(S^2) reference, with forward and backward on CPU and GPU."""
    with _allow_cpu_backward(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


_compiled_flex: Callable | None = None
_fallback_rung = 0


def compiled_flex() -> Callable:
    """`torch.compile(flex_attention, dynamic=False)`, created once per process.

    Inside a compiled region (`--compile-drafter`) plain flex_attention is returned and nothing is
    cached: dynamo traces flex into that graph itself and treats a nested `torch.compile` as a no-op,
    so creating the cache there would store the bare, unfused flex_attention for every later eager
    call (the held-out evaluation's)."""
    global _compiled_flex
    if torch.compiler.is_compiling():
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def current_kernel_options() -> dict:
    """Kernel options the compiled call uses when the caller gives none (the pinned fallback rung)."""
    return dict(KERNEL_OPTION_FALLBACKS[_fallback_rung])


def is_out_of_resources(exc: BaseException) -> bool:
    """True for Triton's shared-memory/register OOM, however inductor wrapped it."""
    seen = 0
    while exc is not None and seen < 8:
        if type(exc).__name__ == "OutOfResources" or "out of resource" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def _step_down(exc: BaseException) -> None:
    global _fallback_rung
    if _fallback_rung + 1 >= len(KERNEL_OPTION_FALLBACKS):
        raise exc
    _fallback_rung += 1
    log.warning(
        "flex_attention ran out of GPU resources (%s); retrying with kernel_options=%s",
        str(exc).splitlines()[0][:200],
        KERNEL_OPTION_FALLBACKS[_fallback_rung],
    )


def flex_attention_compiled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: BlockMask,
    scale: float,
    kernel_options: dict | None = None,
) -> torch.Tensor:
    """The fused flex kernel; on a Triton resource error steps down `KERNEL_OPTION_FALLBACKS`."""
    fn = compiled_flex()
    gqa = q.shape[1] != k.shape[1]
    while True:
        options = kernel_options if kernel_options is not None else current_kernel_options()
        try:
            return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, kernel_options=options or None)
        except Exception as exc:  # noqa: BLE001 - only resource errors are retried, the rest re-raised
            if kernel_options is not None or not is_out_of_resources(exc):
                raise
            _step_down(exc)


def calibrate_kernel_options(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, scale: float
) -> dict:
    """Run forward and backward once at the real shapes, stepping down on resource errors; pin and
    return the options that worked. Call before training (backward failures cannot be retried)."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    while True:
        try:
            out = flex_attention_compiled(q, k, v, block_mask, scale)
            out.sum().backward()
            return current_kernel_options()
        except Exception as exc:  # noqa: BLE001
            if not is_out_of_resources(exc):
                raise
            _step_down(exc)


def reset_kernel_options() -> None:
    """Back to the first rung (tests)."""
    global _fallback_rung
    _fallback_rung = 0


def compiled_graph_count() -> int:
    """Graphs compiled so far by torch.compile in this process (each recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompileCounter:
    """`with CompileCounter() as c: ...; c.count` = graphs compiled inside the block."""

    def __enter__(self) -> CompileCounter:
        self._start = compiled_graph_count()
        return self

    def __exit__(self, *exc) -> None:
        return None

    @property
    def count(self) -> int:
        return compiled_graph_count() - self._start
