"""The DFlash drafter (Qwen3-style `DFlashDraftModel`): its layers, cache, and files.

Architecture (as the z-lab/dflash reference): `fc` (Linear n_layers*hidden -> hidden, no bias) and
`hidden_norm` turn the concatenated target hidden states of the context into one context feature;
each decoder layer takes queries from the block tokens only and keys/values from the context
feature AND the block tokens (context first), with per-head q_norm/k_norm, RoPE at the real
positions, a SwiGLU MLP and pre-norm residuals; a final `norm`. Only the block runs through the
layers: the context enters every layer as the same projected feature, so at inference its per-layer
k/v can be cached (`DrafterCache`, `forward_step`).

DFlash-2 (`config.arch == "dflash2"`, the reference's `DFlash2DraftModel`): each layer also has a
`GroupedDynamicCausalConv` around attention (`attention_conv`) and around the MLP (`mlp_conv`), causal
along the positions of each block only, and the drafter a `CandidateSelector` (`propose`) that picks
the block's tokens among the top-k draft logits.

Attention per layer (`config.layer_attention`): bidirectional over the block and the whole context by
default; the config's `layer_types`, `sliding_window` and `is_causal` make layers causal inside the
block and/or windowed, as the reference reads them. Training passes one mask per kind of layer.

Files (`save_pretrained`): `config.json` in the reference's layout (`architectures:
["DFlashDraftModel"]`, `model_type: "qwen3"`, `is_causal` (false by default), `dflash_config`,
`num_target_layers`, `layer_types`, `sliding_window`; DFlash-2: `["DFlash2DraftModel"]` and the
conv/selector keys in `dflash_config`) and
`model.safetensors` with exactly the reference's key names (`fc.weight`, `hidden_norm.weight`,
`layers.{i}.…`, `norm.weight`; DFlash-2 adds `layers.{i}.{attention,mlp}_conv.base_kernel`,
`layers.{i}.{attention,mlp}_conv.kernel_projection.weight`, `candidate_selector.hidden_projection.weight`
and `candidate_selector.{predecessor,successor}_codebook`). Differences from the reference layout:
none in the files. In code, `forward` takes the attention masks explicitly (flex `BlockMask`s or
dense bool masks, one per `LayerAttention`) instead of building them, and the frozen target pieces
live in `TargetHead` (`target_head.safetensors` in the store's `target/` folder), never in the
drafter's weights, as the reference, which borrows them from the live target, expects.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from dflash_pipeline.shared.model import attention as attn
from dflash_pipeline.shared.model.config import CONFIG_FILE, DFlashConfig, LayerAttention
from dflash_pipeline.shared.model.loss import SelectorWeights, compute_logits, selector_scores
from dflash_pipeline.shared.runtime.errors import UserError, first_line

__all__ = ["CandidateSelector", "DFlashDrafter", "DrafterCache", "DrafterError", "GroupedDynamicCausalConv"]

WEIGHTS_FILE = "model.safetensors"


class DrafterError(UserError, ValueError):
    """A drafter folder that is missing, incomplete or not a DFlash drafter."""


BACKENDS = ("flex_compiled", "flex_eager", "sdpa_dense")
Mask = BlockMask | torch.Tensor


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in fp32, scale in the input dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for position ids, the reference's (transformers' Qwen3) RoPE for any static
    HF rope_type. inv_freq stays fp32 whatever dtype the model is cast to (a bf16 inv_freq would
    shift every angle); "dynamic" rope types are used with their static initial frequencies."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        from transformers import Qwen3Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        hf = {k: v for k, v in config.to_hf_dict().items() if k != "architectures"}
        rope = Qwen3RotaryEmbedding(Qwen3Config(**hf))
        self.register_buffer("inv_freq", rope.inv_freq.float().clone(), persistent=False)
        self.scaling = float(rope.attention_scaling)

    def _apply(self, fn, recurse=True):
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(device=self.inv_freq.device)
        return self

    def forward(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(like.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(like.dtype), (emb.sin() * self.scaling).to(like.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, T, d]; cos/sin [b, T, d]."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """q from block tokens; k/v from the context feature and the block tokens (context first)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.scale = d**-0.5
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def _kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def context_kv(
        self, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of the projected context feature [b, S, H] -> 2 x [b, kv_heads, S, d]."""
        return self._kv(context, cos, sin)

    def forward(self, x, context_k, context_v, cos, sin, attend) -> torch.Tensor:
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        block_k, block_v = self._kv(x, cos, sin)
        v = torch.cat([context_v, block_v], dim=2)
        k = torch.cat([context_k, block_k], dim=2).to(v.dtype)
        out = attend(q.to(v.dtype), k, v, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class MLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def grouped_causal_convolve(
    x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int, block_size: int
) -> torch.Tensor:
    """Causal convolution along each block of `block_size` positions of x [b, Q, H] (Q = N * block_size),
    never across blocks (zeros before each block start): out[t] = sum_o (base[o] + dynamic[t, o]) * x[t - o],
    with a per-channel base kernel [K, H] and a per-position, per-group dynamic kernel [b, Q, K, H // group_size]."""
    b, q, h = x.shape
    groups, taps = h // group_size, base.shape[0]
    xs = x.view(b, q // block_size, block_size, groups, group_size)
    dyn = dynamic.reshape(b, q // block_size, block_size, taps, groups, 1)
    out = torch.zeros_like(xs)
    for o in range(min(taps, block_size)):  # a tap reaching before the block start only sees zeros
        shifted = xs if o == 0 else F.pad(xs[:, :, :-o], (0, 0, 0, 0, o, 0))
        out = out + base[o].view(groups, group_size).to(x.dtype) * shifted
        out = torch.addcmul(out, dyn[:, :, :, o], shifted)
    return out.view(b, q, h)


class GroupedDynamicCausalConv(nn.Module):
    """DFlash-2's convolution around attention or the MLP: `prepare` convolves the sublayer's input
    and predicts (from that input) the kernel `finish` applies to its output. `base_kernel` [2, K, H]
    holds the static kernels of both; `kernel_projection` the dynamic ones, per group of channels.
    Initialised to the identity (tap 0 is 1, the rest and the projection 0)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.groups = kernel_size, group_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_identity()

    def reset_identity(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, Q, H] -> (convolved x, the dynamic kernel for `finish`)."""
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        out = grouped_causal_convolve(x, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size, block_size)
        return out, dynamic[..., 1, :, :]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor, block_size: int) -> torch.Tensor:
        return grouped_causal_convolve(x, dynamic, self.base_kernel[1], self.group_size, block_size)


class CandidateSelector(nn.Module):
    """DFlash-2's selector: re-ranks each position's top-k draft tokens by their logit plus a low-rank
    transition score from the previous token, `<P[prev] * W h, S[candidate]>`, then decodes left to
    right from the anchor. The codebooks are bare parameters: the released files name them
    `candidate_selector.{predecessor,successor}_codebook` (no `.weight`)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        rank, self.top_k = config.selector_rank, config.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

    def select(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        anchor_ids: torch.Tensor,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """hidden [b, L, H], logits [b, L, V], anchor ids [b] -> (drafted ids [b, L], candidates
        [b, L, k], and at temperature > 0 the sampling probabilities over the candidates [b, L, k]).
        At temperature > 0 each position draws one multinomial from `generator` (None: torch's global
        one, as the reference does), left to right."""
        unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)
        weights = SelectorWeights.of(self)
        previous, path, probs = anchor_ids, [], []
        for t in range(hidden.shape[1]):
            scores = selector_scores(weights, hidden[:, t], unary[:, t], candidates[:, t], previous)
            if temperature > 0:
                probs.append(torch.softmax(scores.float() / temperature, dim=-1))
                index = torch.multinomial(probs[-1], 1, generator=generator)[:, 0]
            else:
                index = scores.argmax(dim=-1)
            previous = candidates[:, t].gather(-1, index[:, None])[:, 0]
            path.append(previous)
        return torch.stack(path, dim=1), candidates, torch.stack(probs, dim=1) if probs else None


class DecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.attention_conv = self.mlp_conv = None
        if config.arch == "dflash2":
            self.attention_conv = GroupedDynamicCausalConv(
                config.hidden_size, config.conv_kernel_size, config.conv_group_size
            )
            self.mlp_conv = GroupedDynamicCausalConv(
                config.hidden_size, config.conv_kernel_size, config.conv_group_size
            )

    def forward(self, h, context_k, context_v, cos, sin, attend, block_size: int) -> torch.Tensor:
        x = self.input_layernorm(h)
        if self.attention_conv is None:
            h = h + self.self_attn(x, context_k, context_v, cos, sin, attend)
            return h + self.mlp(self.post_attention_layernorm(h))
        x, kernel = self.attention_conv.prepare(x, block_size)
        h = h + self.attention_conv.finish(
            self.self_attn(x, context_k, context_v, cos, sin, attend), kernel, block_size
        )
        x, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(h), block_size)
        return h + self.mlp_conv.finish(self.mlp(x), kernel, block_size)


@dataclass
class DrafterCache:
    """Per-layer k/v of the context fed so far (never of draft blocks), and their positions."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    positions: torch.Tensor | None = None  # [b, T]

    @property
    def length(self) -> int:
        return 0 if self.positions is None else self.positions.shape[1]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        return self.keys[layer], self.values[layer]


class DFlashDrafter(nn.Module):
    """The DFlash drafter. `attention_backend`: "flex_compiled" (fused kernel, training on GPU),
    "flex_eager" (uncompiled flex, reference), "sdpa_dense" (SDPA with a dense bool mask). The mask
    passed to `forward` must fit: a BlockMask for the flex backends, a dense mask for SDPA (a dense
    mask is always run with SDPA)."""

    def __init__(
        self, config: DFlashConfig, attention_backend: str = "flex_compiled", kernel_options: dict | None = None
    ):
        super().__init__()
        self.config = config
        self.attention_backend = attention_backend
        self.kernel_options = kernel_options
        self.fc = nn.Linear(config.context_width, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.candidate_selector = CandidateSelector(config) if config.arch == "dflash2" else None
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """The reference's init (HF `_init_weights`): normal(0, 0.02) linears and codebooks, unit
        norms; DFlash-2's convolutions start as the identity, so a new DFlash-2 drafter computes
        what the same DFlash drafter does."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, CandidateSelector):
                nn.init.normal_(module.predecessor_codebook, std=std)
                nn.init.normal_(module.successor_codebook, std=std)
        for module in self.modules():
            if isinstance(module, GroupedDynamicCausalConv):
                module.reset_identity()

    @property
    def attention_backend(self) -> str:
        return self._backend

    @attention_backend.setter
    def attention_backend(self, name: str) -> None:
        if name not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
        self._backend = name

    def _attend(self, mask: Mask):
        """The attention for this mask: a dense bool mask always runs SDPA (whatever the backend:
        it is exact, only slower); a BlockMask runs flex, compiled unless the backend is flex_eager."""
        backend = self._backend
        if isinstance(mask, torch.Tensor):
            if mask.dtype != torch.bool or mask.dim() != 4:
                raise TypeError(
                    f"dense attention mask must be bool [b, 1, Q, S+Q], got {mask.dtype} {tuple(mask.shape)}"
                )
            return lambda q, k, v, scale: attn.sdpa_dense_attention(q, k, v, mask, scale)
        if not isinstance(mask, BlockMask):
            raise TypeError(f"mask must be a flex BlockMask or a dense bool tensor, got {type(mask).__name__}")
        if backend == "sdpa_dense":
            raise TypeError(
                "attention_backend 'sdpa_dense' needs a dense bool mask [b, 1, Q, S+Q] (attention.dense_mask)"
            )
        if backend == "flex_eager":
            return lambda q, k, v, scale: attn.flex_attention_eager(q, k, v, mask, scale)
        return lambda q, k, v, scale: attn.flex_attention_compiled(q, k, v, mask, scale, self.kernel_options)

    def project_context(self, context_hidden: torch.Tensor) -> torch.Tensor:
        """fc + hidden_norm: [b, S, n_layers*H] -> [b, S, H]."""
        return self.hidden_norm(self.fc(context_hidden))

    def _layer_attends(self, masks: Mask | dict[LayerAttention, Mask]) -> list:
        """Each layer's attention function: a single mask serves every layer; a dict gives each layer
        the mask of its kind (`config.layer_attention`)."""
        if not isinstance(masks, dict):
            return [self._attend(masks)] * len(self.layers)
        missing = sorted(set(self.config.layer_attention) - set(masks))
        if missing:
            raise ValueError(f"no attention mask for layers of kind {missing}")
        attends = {kind: self._attend(mask) for kind, mask in masks.items()}
        return [attends[kind] for kind in self.config.layer_attention]

    def _run_layers(
        self, h, context, context_positions, block_positions, attends, cache: DrafterCache | None, block_size: int
    ):
        cos_c, sin_c = self.rotary_emb(h, context_positions)
        cos_b, sin_b = self.rotary_emb(h, block_positions)
        for i, (layer, attend) in enumerate(zip(self.layers, attends, strict=True)):
            k, v = layer.self_attn.context_kv(context, cos_c, sin_c)
            if cache is not None:
                k, v = cache.append(i, k, v)
            h = layer(h, k, v, cos_b, sin_b, attend, block_size)
        return self.norm(h)

    def forward(
        self,
        context_hidden: torch.Tensor,
        block_embeds: torch.Tensor,
        context_positions: torch.Tensor,
        block_positions: torch.Tensor,
        mask: Mask | dict[LayerAttention, Mask],
    ) -> torch.Tensor:
        """Training forward: [b, S, n_layers*H], [b, Q, H], [b, S], [b, Q], mask -> [b, Q, H]. The
        queries are N blocks of `block_size` tokens (DFlash-2's convolutions run inside each block).
        `mask`: one for every layer, or one per kind of layer (`train.step.attention_masks`)."""
        if context_hidden.shape[-1] != self.config.context_width:
            raise ValueError(
                f"context_hidden width {context_hidden.shape[-1]} != n_layers*hidden {self.config.context_width}"
            )
        block_size = self.config.block_size
        if self.config.arch == "dflash2" and block_embeds.shape[1] % block_size:
            raise ValueError(f"{block_embeds.shape[1]} block tokens are not whole blocks of {block_size}")
        context = self.project_context(context_hidden)
        return self._run_layers(
            block_embeds, context, context_positions, block_positions, self._layer_attends(mask), None, block_size
        )

    def forward_step(
        self,
        new_context_hidden: torch.Tensor,
        new_context_positions: torch.Tensor,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        cache: DrafterCache,
    ) -> torch.Tensor:
        """Inference step: append the newly accepted tokens' context k/v to `cache`, then draft one
        block that sees all cached context and itself (bidirectionally, unless a layer is causal or
        windowed: `attention.inference_mask`, the reference's rule). Returns [b, Q, H]."""
        context = self.project_context(new_context_hidden)
        key_positions = new_context_positions
        if cache.positions is not None:
            key_positions = torch.cat([cache.positions, new_context_positions], dim=1)
        keys = torch.cat([key_positions, block_positions], dim=1)

        def sdpa(mask: torch.Tensor | None):
            return lambda q, k, v, scale: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
            )

        kinds = self.config.layer_attention
        attends = {
            kind: sdpa(attn.inference_mask(block_positions, keys, kind.window, kind.causal))
            for kind in dict.fromkeys(kinds)
        }
        out = self._run_layers(
            block_embeds,
            context,
            new_context_positions,
            block_positions,
            [attends[kind] for kind in kinds],
            cache,
            block_embeds.shape[1],
        )
        cache.positions = key_positions
        return out

    def compute_logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        return compute_logits(
            hidden,
            lm_head_weight,
            output_multiplier=self.config.output_multiplier,
            softcap=self.config.final_logit_softcapping,
        )

    def propose(
        self,
        hidden: torch.Tensor,
        anchor_ids: torch.Tensor,
        lm_head_weight: torch.Tensor,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """DFlash-2's draft of a block: the selector's path over the top-k logits of `hidden` [b, L, H]
        after the anchors [b] (see `CandidateSelector.select`)."""
        if self.candidate_selector is None:
            raise ValueError("propose needs a DFlash-2 drafter (a candidate selector)")
        logits = self.compute_logits(hidden, lm_head_weight)
        return self.candidate_selector.select(hidden, logits, anchor_ids, temperature, generator)

    def save_pretrained(self, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
        """config.json + model.safetensors in the reference layout (weights cast to `dtype` if set)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {k: (v.to(dtype) if dtype else v).detach().contiguous().cpu() for k, v in self.state_dict().items()}
        config = self.config.to_hf_dict()
        config["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
        save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        return directory

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        *,
        attention_backend: str = "flex_compiled",
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> DFlashDrafter:
        directory = Path(directory)
        config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
        if not directory.is_dir():
            raise DrafterError(f"{directory}: no such drafter folder (dflash-train writes OUT/drafter)")
        for path in (config_path, weights_path):
            if not path.is_file():
                raise DrafterError(f"{path}: missing; a drafter folder holds {CONFIG_FILE} and {WEIGHTS_FILE}")
        try:
            raw = json.loads(config_path.read_text())
            arch = raw.get("architectures") or ["DFlashDraftModel"]
            config = DFlashConfig.from_hf_dict(raw)
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise DrafterError(f"{config_path}: not a DFlash drafter config ({first_line(exc)})") from exc
        if arch != [config.architecture]:
            raise DrafterError(
                f"{config_path}: architectures {arch}, but its dflash_config describes a {config.architecture}"
            )
        model = cls(config, attention_backend=attention_backend)
        try:
            state = load_file(str(weights_path))
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for bad files
            raise DrafterError(f"{weights_path}: unreadable ({first_line(exc)})") from exc
        expected = set(model.state_dict())
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise DrafterError(f"{weights_path}: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
        wrong = [k for k, v in model.state_dict().items() if v.shape != state[k].shape]
        if wrong:
            raise DrafterError(
                f"{weights_path}: {wrong[0]} has shape {tuple(state[wrong[0]].shape)}, "
                f"{config_path.name} implies {tuple(model.state_dict()[wrong[0]].shape)}"
            )
        model.load_state_dict(state)
        return model.to(device=device, dtype=dtype)
