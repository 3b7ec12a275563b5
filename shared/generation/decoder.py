"""A Llama-style decoder run over a paged KV cache, from the HF model's own modules.

The HF model stays the single source of weights and layer code: its embedding, norms, output
projection, q/k norms (Qwen3), rotary embedding, MLP activation and LM head are called as they are.
What is ours is what HF's per-request cache cannot do: packed prefill of prompts of different
lengths into cache pages (a prompt may continue from pages an earlier turn filled: then only its new
tokens are computed, attending to the cached ones), and a one-token decode step over rows that
each attend to their own pages (no padding, fixed shapes, so it can be captured once as a CUDA
graph). And one regrouping: each layer's q/k/v projections, and its MLP's gate/up projections,
become row blocks of one weight (`fuse_projections`, in place: the HF modules then hold views of
it), so a decode step runs two matmuls where it ran five. At decode sizes the k/v projections
(1,024 output columns for an 8B target) are too narrow to fill the GPU alone.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.varlen import varlen_attn

from dflash_pipeline.shared.generation.paged_attention import KV_FP8, gather, paged_decode_attention
from dflash_pipeline.shared.runtime.errors import UserError
from dflash_pipeline.shared.target.loading import text_config

# Decoders whose layers are exactly: x + attn(norm(x)), then x + mlp(norm(x)); attention with
# q/k/v/o projections (optional bias), optional per-head q/k RMSNorm, rotary positions, GQA.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")  # cos/sin that change with the sequence length


class GenerationError(UserError, ValueError):
    """The target or a request cannot be run by the generation engine; the message says why."""


_HINT = (
    "regenerate the replies with vLLM or SGLang and pass the JSONL as --data without --regenerate "
    "(README: Target-written replies)"
)


def check_supported_config(config: Any, max_context: int) -> None:
    """Refuse, with the reason, a decoder config this runner would compute wrongly (checked before
    any model is loaded, so a run that cannot regenerate stops at once)."""
    kind = getattr(config, "model_type", type(config).__name__)
    if kind not in SUPPORTED_MODEL_TYPES:
        raise GenerationError(
            f"model_type {kind!r}: the generation engine runs {', '.join(SUPPORTED_MODEL_TYPES)} decoders; {_HINT}"
        )
    layer_types = getattr(config, "layer_types", None) or []
    sliding = [t for t in layer_types if t != "full_attention"]
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if sliding or (kind == "mistral" and window is not None and window < max_context):
        raise GenerationError(
            f"{kind}: sliding-window attention layers are not supported by the generation engine; {_HINT}"
        )


def check_supported(model: nn.Module, max_context: int) -> None:
    """`check_supported_config`, and a rotary embedding whose cos/sin do not depend on the length."""
    check_supported_config(text_config(model.config), max_context)
    rope = getattr(model.model.rotary_emb, "rope_type", "default")
    if any(name in rope for name in _POSITION_DEPENDENT_ROPE):
        raise GenerationError(
            f"rope type {rope!r} changes with the sequence length, which the "
            f"generation engine does not support; {_HINT}"
        )


Slots = tuple[torch.Tensor, torch.Tensor]  # (page, slot within the page) of each cached token


@dataclass
class PagedKVCache:
    """Keys and values of every layer in pages of `page_size` tokens, each viewed as [pages, page_size,
    kv_heads, head_dim] (the layout `paged_decode_attention` reads through strides). Page 0 is scratch:
    rows that are only padding write there.

    fp8 values are stored token-minor ([pages, kv_heads, head_dim, page_size] in memory): decode
    attention's probabilities x values dot reduces over tokens, and 8-bit values reach the tensor cores
    without byte-wide loads only when tokens are the contiguous axis. With that, and every value slot
    finite (pages start zeroed; `to_cache_dtype` clamps what is written and zeroes NaN), the kernel
    loads value pages unmasked (`finite_value_tails`): 1.34-1.36x its speed with fp8 pages on an H200
    (bench/RESULTS.md run 14). 16-bit values stay token-major, where that layout measured slower."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    page_size: int

    @classmethod
    def allocate(
        cls,
        layers: int,
        pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> PagedKVCache:
        shape = (pages, page_size, kv_heads, head_dim)
        keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        if dtype == KV_FP8:
            stored = (pages, kv_heads, head_dim, page_size)
            values = [torch.zeros(stored, dtype=dtype, device=device).permute(0, 3, 1, 2) for _ in range(layers)]
        else:
            values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        return cls(keys, values, page_size)

    @staticmethod
    def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * layers * kv_heads * head_dim * dtype.itemsize

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    @property
    def finite_value_tails(self) -> bool:
        """Whether decode attention may load value pages unmasked: the fp8 cache, whose writes are
        made finite (16-bit values are written as the model computed them)."""
        return self.dtype == KV_FP8

    def slots(self, cache_index: torch.Tensor) -> Slots:
        """(page, slot within the page) of each flat cache index page * page_size + slot: what `write`
        and `read` take, worked out once for all layers."""
        return cache_index // self.page_size, cache_index % self.page_size

    def write(self, layer: int, where: Slots, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes k, v [T, kv_heads, head_dim] (in the cache's dtype) into their slots."""
        for pages, held in ((self.keys[layer], k), (self.values[layer], v)):
            if held.dtype == KV_FP8:  # the same bytes as uint8: index_put_ has no fp8 kernel on the CPU
                pages, held = pages.view(torch.uint8), held.view(torch.uint8)
            pages.index_put_(where, held)

    def read(self, layer: int, where: Slots, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values [T, kv_heads, head_dim] of those slots, converted to `dtype`."""
        return gather(self.keys[layer], where, dtype), gather(self.values[layer], where, dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[T, heads_kv, D] -> [T, heads_kv * groups, D]: query head h on kv head h // groups (HF's rule),
    for the varlen call, which is given as many kv heads as query heads."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def uses_varlen(x: torch.Tensor) -> bool:
    """Flash attention's variable-length kernel takes the packed prompts in one call (CUDA, half
    precision); elsewhere (CPU, float32) each prompt gets its own SDPA call."""
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Packing:
    """Where each of the prompts packed back to back lies: prompt i's queries are rows
    `query_bounds[i]:query_bounds[i+1]` of q, its keys and values rows `key_bounds[i]:key_bounds[i+1]`
    of k and v. A prompt continued from tokens already in the cache has more keys than queries: its
    queries are its last tokens. `cu_query`/`cu_key`: the same bounds on the device where the varlen
    kernel runs (`uses_varlen`), else None."""

    query_bounds: list[int]
    key_bounds: list[int]
    cu_query: torch.Tensor | None
    cu_key: torch.Tensor | None

    @classmethod
    def of(cls, query_lengths: list[int], key_lengths: list[int], like: torch.Tensor) -> Packing:
        def bounds(lengths: list[int]) -> list[int]:
            out = [0]
            for n in lengths:
                out.append(out[-1] + n)
            return out

        q, k = bounds(query_lengths), bounds(key_lengths)
        if not uses_varlen(like):
            return cls(q, k, None, None)
        cu_q = torch.tensor(q, dtype=torch.int32, device=like.device)
        return cls(q, k, cu_q, cu_q if k == q else torch.tensor(k, dtype=torch.int32, device=like.device))


def packed_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing, groups: int, scale: float
) -> torch.Tensor:
    """Causal attention within each packed prompt (q [Tq, heads, D], k and v [Tk, kv_heads, D], laid
    out as `packing` says); returns [Tq, heads, D]. A prompt's query j of nq, with nk keys, sits at
    position nk - nq + j and sees keys 0 .. nk - nq + j (causal aligned at the end)."""
    qb, kb = packing.query_bounds, packing.key_bounds
    if packing.cu_query is not None:
        longest_q = max(b - a for a, b in zip(qb[:-1], qb[1:]))
        longest_k = max(b - a for a, b in zip(kb[:-1], kb[1:]))
        k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
        # flash attention aligns a causal mask of fewer queries than keys at the end, as above
        return varlen_attn(
            q, k, v, packing.cu_query, packing.cu_key, longest_q, longest_k, scale=scale, window_size=(-1, 0)
        )
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, T, D]
    out = torch.empty_like(q)
    for q0, q1, k0, k1 in zip(qb[:-1], qb[1:], kb[:-1], kb[1:]):
        nq, nk = q1 - q0, k1 - k0
        mask = None
        if nq != nk:  # SDPA's is_causal aligns at the start
            mask = torch.arange(nk, device=q.device)[None] <= torch.arange(nk - nq, nk, device=q.device)[:, None]
        out[:, q0:q1] = F.scaled_dot_product_attention(
            q[None, :, q0:q1],
            k[None, :, k0:k1],
            v[None, :, k0:k1],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=groups > 1,  # no repeated copy of the keys and values
        )[0]
    return out.transpose(0, 1)


@dataclass(frozen=True)
class FusedLinear:
    """Several nn.Linear of one input as one matmul: `weight` [sum of outputs, in] (and `bias`) whose
    row blocks the modules' own parameters are views of; `sizes` their output widths in order."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: tuple[int, ...]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


def _regroup(params: list[nn.Parameter]) -> torch.Tensor:
    """One tensor holding `params` back to back along dim 0; each parameter becomes a view of its
    block (same values, memory held once)."""
    fused = torch.cat([p.data for p in params])
    start = 0
    for p in params:
        p.data = fused[start : start + p.shape[0]]
        start += p.shape[0]
    return fused


def _still_views(fused: FusedLinear, modules: list[nn.Linear]) -> bool:
    starts = [0]
    for size in fused.sizes[:-1]:
        starts.append(starts[-1] + size)
    return all(m.weight.data_ptr() == fused.weight[a].data_ptr() for m, a in zip(modules, starts))


# the regrouped projections of each model, by their first module: a second engine on one model
# (the benchmarks build several) finds them instead of regrouping (and holding) the weights again
_FUSED: weakref.WeakKeyDictionary[nn.Module, FusedLinear] = weakref.WeakKeyDictionary()


def fuse_projections(modules: list[nn.Linear]) -> FusedLinear:
    """`FusedLinear` of `modules` (all with a bias or none), their parameters regrouped in place."""
    known = _FUSED.get(modules[0])
    if known is not None and _still_views(known, modules):
        return known
    biases = [m.bias for m in modules]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        raise GenerationError("projections of one input with and without a bias are not supported")
    with torch.no_grad():
        weight = _regroup([m.weight for m in modules])
        bias = None if biases[0] is None else _regroup(biases)
    _FUSED[modules[0]] = FusedLinear(weight, bias, tuple(m.out_features for m in modules))
    return _FUSED[modules[0]]


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as a cache of `dtype` holds it. fp8 (one scale of 1, as vLLM's uncalibrated fp8 cache) is
    clamped to its finite range first, since what a cast does beyond +-448 is not the same on every
    device, and NaN is written as 0: decode attention loads fp8 value pages unmasked, so a stale slot
    another request left in a page must be finite (`PagedKVCache`)."""
    if x.dtype == dtype:
        return x
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).nan_to_num(0.0).to(dtype)


def attention_inputs(
    layer: nn.Module,
    qkv: FusedLinear,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
    cache_dtype: torch.dtype,
):
    """q [T, heads, D], k and v [T, kv_heads, D] of one decoder layer: input norm, the q/k/v
    projections in one matmul, the per-head q/k norms where the architecture has them (Qwen3),
    rotary positions; k and v in the KV cache's dtype (compiled, an fp8 cache's rounding fuses in)."""
    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    shape = (x.shape[0], -1, head_dim)
    q, k, v = (t.reshape(shape) for t in qkv(x))
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    k = k * cos + _rotate_half(k) * sin
    return q * cos + _rotate_half(q) * sin, to_cache_dtype(k, cache_dtype), to_cache_dtype(v, cache_dtype)


def layer_output(layer: nn.Module, gate_up: FusedLinear, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """The layer's output from its input and the attention result [T, heads * D]: output projection,
    residual, post-attention norm, MLP (gate and up in one matmul; HF's
    down(act(gate(x)) * up(x))), residual."""
    mlp = layer.mlp
    hidden = hidden + layer.self_attn.o_proj(attended)
    gate, up = gate_up(layer.post_attention_layernorm(hidden))
    return hidden + mlp.down_proj(mlp.act_fn(gate) * up)


class PagedDecoder:
    """Prefill and decode of an HF Llama-style causal LM whose keys and values live in a PagedKVCache
    (the model passed `check_supported`)."""

    def __init__(self, model: nn.Module, cache: PagedKVCache, compile: bool = False):
        base = model.model
        self.embed, self.layers, self.norm, self.rotary = base.embed_tokens, base.layers, base.norm, base.rotary_emb
        self.lm_head = model.lm_head
        attn = self.layers[0].self_attn
        config = text_config(model.config)
        self.head_dim = attn.head_dim
        self.groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = attn.scaling
        self.cache = cache
        # Compiled, the norms, rotary, SiLU gating and residual adds fuse into few kernels instead of
        # ~40 launches per layer. The layers share these two functions, so (parameters being graph
        # inputs) one graph serves every layer, and dynamic shapes one graph every token count.
        wrap = (lambda fn: torch.compile(fn, dynamic=True)) if compile else (lambda fn: fn)
        self._attention_inputs, self._layer_output = wrap(attention_inputs), wrap(layer_output)
        self.qkv = [fuse_projections([a.q_proj, a.k_proj, a.v_proj]) for a in (x.self_attn for x in self.layers)]
        self.gate_up = [fuse_projections([layer.mlp.gate_proj, layer.mlp.up_proj]) for layer in self.layers]

    def _rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(hidden, positions[None])
        return cos[0, :, None], sin[0, :, None]  # [T, 1, D]: broadcast over heads

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden)).float()

    def prefill(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache_index: torch.Tensor,
        lengths: list[int],
        context_index: torch.Tensor | None = None,
        context_lengths: list[int] | None = None,
    ) -> torch.Tensor:
        """Prompts packed back to back (`tokens`, `positions`, `cache_index` of [T]; `lengths` the
        tokens of each, summing to T): writes their keys/values, returns the float32 logits [n, vocab]
        after each prompt's last token. Attention is causal within each prompt only. A prompt whose
        first tokens are already in the cache (an earlier turn's) passes only the rest, at their
        positions; then `context_index` lists the cache slots of every prompt's whole context in order
        (`context_lengths[i]` of prompt i) and attention reads the keys/values from there."""
        hidden = self.embed(tokens)
        cos, sin = self._rotary(hidden, positions)
        packing = Packing.of(lengths, context_lengths or lengths, hidden)
        where = self.cache.slots(cache_index)
        context = None if context_index is None else self.cache.slots(context_index)
        for i, layer in enumerate(self.layers):
            q, k, v = self._attention_inputs(layer, self.qkv[i], hidden, cos, sin, self.head_dim, self.cache.dtype)
            self.cache.write(i, where, k, v)
            # a lossy (fp8) cache: the prompt attends to what decoding and a later turn will read
            if context is None:
                k, v = k.to(q.dtype), v.to(q.dtype)
            else:
                k, v = self.cache.read(i, context, q.dtype)
            out = packed_causal_attention(q, k, v, packing, self.groups, self.scaling)
            hidden = self._layer_output(layer, self.gate_up[i], hidden, out.reshape(len(tokens), -1))
        last = torch.tensor([b - 1 for b in packing.query_bounds[1:]], device=tokens.device)
        return self._logits(hidden[last])

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        """One new token per row ([b] tokens at [b] positions, each row's pages in `block_table`
        [b, pages]): writes its key/value, returns float32 logits [b, vocab]. No host sync."""
        page = self.cache.page_size
        rows = torch.arange(len(tokens), device=tokens.device)
        where = (block_table[rows, positions // page].long(), positions % page)
        lengths = positions + 1
        hidden = self.embed(tokens)
        cos, sin = self._rotary(hidden, positions)
        for i, layer in enumerate(self.layers):
            q, k, v = self._attention_inputs(layer, self.qkv[i], hidden, cos, sin, self.head_dim, self.cache.dtype)
            self.cache.write(i, where, k, v)
            out = paged_decode_attention(
                q,
                self.cache.keys[i],
                self.cache.values[i],
                block_table,
                lengths,
                self.scaling,
                finite_value_tails=self.cache.finite_value_tails,
            )
            hidden = self._layer_output(layer, self.gate_up[i], hidden, out.reshape(len(tokens), -1))
        return self._logits(hidden)


def pages_for(tokens: int, page_size: int) -> int:
    return math.ceil(tokens / page_size)
