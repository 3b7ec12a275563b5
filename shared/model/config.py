"""The drafter's config: the reference's `config.json` layout both ways, and the drafter shaped for a
target (its layer ids to read, hidden size, heads, RoPE, vocabulary)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

CONFIG_FILE = "config.json"
ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}
# DFlash-2 settings, in `dflash_config` (read there first, then top level, as the reference's `_draft_value`)
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
LAYER_TYPES = ("full_attention", "sliding_attention")  # config.json `layer_types` entries
# Qwen3Config's defaults, which the reference's config reads a file with: no window unless
# `use_sliding_window`, then 4096 unless given; without `layer_types`, layers from `max_window_layers` slide
QWEN3_SLIDING_WINDOW, QWEN3_MAX_WINDOW_LAYERS = 4096, 28


class LayerAttention(NamedTuple):
    """One drafter layer's attention as the reference's `Qwen3DFlashAttention` sets it up: causal inside
    the block or not, and its sliding window (None: the whole context)."""

    causal: bool
    window: int | None


def default_target_layer_ids(num_target_layers: int, n: int = 5) -> list[int]:
    """Target layers whose outputs feed the drafter: `n` evenly spaced from 1 to L-3, rounded as the
    released drafters (52 layers -> 1, 13, 25, 37, 49; 36 -> 1, 9, 17, 25, 33); one layer -> L // 2.

    Targets too small for n distinct layers in [1, L-3] use [1, L-2] (the last layer is avoided:
    HF replaces its hidden state by the final-normed one), and fewer than n ids if even that is
    too narrow: 4 layers -> [1, 2]; 2 or 3 layers -> [1]; 1 layer -> [0].
    """
    if num_target_layers < 1 or n < 1:
        raise ValueError(f"need at least one target layer and one id, got {num_target_layers} layers, n={n}")
    if n == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    if hi - lo + 1 < n:
        lo = min(1, num_target_layers - 1)
        hi = max(lo, num_target_layers - 2)
    count = min(n, hi - lo + 1)
    if count == 1:
        return [lo]
    ids = [int(round(lo + i * (hi - lo) / (count - 1))) for i in range(count)]
    return sorted(set(ids))


@dataclass
class DFlashConfig:
    """Drafter hyper-parameters; `to_hf_dict`/`from_hf_dict` map to the reference config.json."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_hidden_layers: int = 5
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_parameters: dict[str, Any] | None = None  # HF 5.x form; default {"rope_type": "default", "rope_theta": ...}
    max_position_embeddings: int = 40960
    block_size: int = 16
    sliding_window: int | None = None  # the window of the "sliding_attention" layers
    layer_types: list[str] | None = None  # one of LAYER_TYPES per layer; None: all sliding iff a window is set
    is_causal: bool | None = False  # causal attention in every layer; None: in the sliding ones (the reference's rule)
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0
    attention_bias: bool = False
    # DFlash-2 (`DFlash2DraftModel`): all four set, or all None for DFlash
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # other config.json keys, kept on round trip

    def __post_init__(self) -> None:
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": float(self.rope_theta)}
        else:
            self.rope_parameters = copy.deepcopy(dict(self.rope_parameters))
            self.rope_parameters.setdefault("rope_type", "default")
            self.rope_theta = float(self.rope_parameters.setdefault("rope_theta", float(self.rope_theta)))
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.attention_bias:
            raise ValueError("attention_bias=True is not supported (the released drafters have none)")
        self._check_attention()
        dflash2 = {name: getattr(self, name) for name in DFLASH2_KEYS}
        if any(v is not None for v in dflash2.values()):
            if any(v is None for v in dflash2.values()):
                raise ValueError(f"DFlash-2 needs all of {', '.join(DFLASH2_KEYS)}, got {dflash2}")
            for name, v in dflash2.items():
                setattr(self, name, int(v))
                if int(v) < 1:
                    raise ValueError(f"{name} must be >= 1, got {v}")
            if self.hidden_size % self.conv_group_size:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not a multiple of conv_group_size {self.conv_group_size}"
                )
            if self.selector_top_k > self.vocab_size:
                raise ValueError(f"selector_top_k {self.selector_top_k} exceeds vocab_size {self.vocab_size}")

    def _check_attention(self) -> None:
        """Check the window, layer types and causality; `layer_types` None becomes its explicit list."""
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive integer or None, got {self.sliding_window!r}")
        if self.is_causal is not None and not isinstance(self.is_causal, bool):
            raise ValueError(f"is_causal must be true, false or absent, got {self.is_causal!r}")
        if self.layer_types is None:
            kind = "sliding_attention" if self.sliding_window is not None else "full_attention"
            self.layer_types = [kind] * self.num_hidden_layers
        self.layer_types = list(self.layer_types)
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown or len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types must name one of {', '.join(LAYER_TYPES)} for each of the {self.num_hidden_layers} "
                f"layers, got {self.layer_types}"
            )

    @property
    def layer_attention(self) -> list[LayerAttention]:
        """Each layer's attention, as the reference reads this config: a "sliding_attention" layer has
        the window, and is causal unless `is_causal` says otherwise; a "full_attention" layer sees the
        whole context, causal only if `is_causal` is true."""
        out = []
        for kind in self.layer_types:
            sliding = kind == "sliding_attention"
            causal = sliding if self.is_causal is None else self.is_causal
            out.append(LayerAttention(causal, self.sliding_window if sliding else None))
        return out

    @property
    def arch(self) -> str:
        """Which drafter: "dflash2" (convolutions and selector) when its fields are set, else "dflash"."""
        return "dflash" if self.conv_kernel_size is None else "dflash2"

    @property
    def architecture(self) -> str:
        """The reference class that loads this config (config.json `architectures`)."""
        return ARCHITECTURES[self.arch]

    @property
    def context_width(self) -> int:
        """Width of the stored context feature: n_layers * hidden."""
        return len(self.target_layer_ids) * self.hidden_size

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json as the reference (`DFlashDraftModel` on a `Qwen3Config`) loads it."""
        window = self.sliding_window
        dflash: dict[str, Any] = {
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
            "output_multiplier": self.output_multiplier,
            "input_embedding_scale": self.input_embedding_scale,
        }
        if self.final_logit_softcapping is not None:
            dflash["final_logit_softcapping"] = self.final_logit_softcapping
        if self.arch == "dflash2":
            dflash.update({name: getattr(self, name) for name in DFLASH2_KEYS})
        out: dict[str, Any] = dict(self.extra)
        out.update(
            {
                "architectures": [self.architecture],
                "model_type": "qwen3",
                "is_causal": self.is_causal,
                "attention_bias": False,
                "attention_dropout": 0.0,
                "hidden_act": "silu",
                "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_hidden_layers,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_dim,
                "rms_norm_eps": self.rms_norm_eps,
                "rope_theta": self.rope_theta,
                "rope_parameters": copy.deepcopy(self.rope_parameters),
                "max_position_embeddings": self.max_position_embeddings,
                "vocab_size": self.vocab_size,
                "num_target_layers": self.num_target_layers,
                "block_size": self.block_size,  # older reference versions read it here, newer in dflash_config
                "layer_types": list(self.layer_types),
                "use_sliding_window": bool(window),
                "sliding_window": window,
                "max_window_layers": self.num_hidden_layers,
                "tie_word_embeddings": False,
                "use_cache": False,
                "initializer_range": 0.02,
                "dflash_config": dflash,
            }
        )
        return out

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> DFlashConfig:
        """Inverse of `to_hf_dict`; `dflash_config` values win over top-level ones (as the reference), and
        the window, layer types and causality are read as the reference's `Qwen3Config` reads them."""
        dflash = d.get("dflash_config") or {}

        def value(name: str, default: Any = None) -> Any:
            return dflash.get(name, d.get(name, default))

        missing = [k for k in ("target_layer_ids", "mask_token_id") if value(k) is None]
        missing += [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in d]
        if missing:
            raise ValueError(f"drafter config lacks {', '.join(missing)}")
        heads = d["num_attention_heads"]
        num_layers = d.get("num_hidden_layers", 5)
        window = d.get("sliding_window", QWEN3_SLIDING_WINDOW) if d.get("use_sliding_window", False) else None
        layer_types = d.get("layer_types")
        if layer_types is None:
            first_sliding = d.get("max_window_layers", QWEN3_MAX_WINDOW_LAYERS)
            layer_types = [
                "sliding_attention" if window is not None and i >= first_sliding else "full_attention"
                for i in range(num_layers)
            ]
        known = {f.name for f in fields(cls)} | {
            "architectures",
            "model_type",
            "attention_dropout",
            "hidden_act",
            "use_sliding_window",
            "max_window_layers",
            "tie_word_embeddings",
            "use_cache",
            "initializer_range",
            "dflash_config",
            "dtype",
            "torch_dtype",
            "transformers_version",
            "rope_scaling",
        }
        return cls(
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads", heads),
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            vocab_size=d["vocab_size"],
            num_target_layers=d.get("num_target_layers", 0),
            mask_token_id=int(value("mask_token_id")),
            target_layer_ids=list(value("target_layer_ids")),
            num_hidden_layers=num_layers,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0),
            rope_parameters=d.get("rope_parameters"),
            max_position_embeddings=d.get("max_position_embeddings", 40960),
            block_size=int(value("block_size", 16)),
            sliding_window=window,
            layer_types=layer_types,
            is_causal=d.get("is_causal"),
            output_multiplier=float(value("output_multiplier", 1.0)),
            final_logit_softcapping=value("final_logit_softcapping"),
            input_embedding_scale=float(value("input_embedding_scale", 1.0)),
            attention_bias=bool(d.get("attention_bias", False)),
            **{name: value(name) for name in DFLASH2_KEYS},
            extra={k: v for k, v in d.items() if k not in known},
        )

    @classmethod
    def for_target(
        cls,
        target_config: Any,
        layer_ids: list[int],
        *,
        mask_token_id: int,
        num_layers: int = 5,
        block_size: int = 16,
        **overrides: Any,
    ) -> DFlashConfig:
        """A drafter shaped like the target (hidden size, heads, head_dim, MLP width, RoPE, eps,
        vocab), as the released drafters are. `target_config`: HF config object or its dict."""
        from dflash_pipeline.shared.target.loading import text_config  # torch, transformers: not for CLI options

        if isinstance(target_config, dict):
            t = dict(target_config)
        else:
            t = text_config(target_config).to_dict()
        n_layers = t["num_hidden_layers"]
        bad = [i for i in layer_ids if not 0 <= i < n_layers]
        if bad:
            raise ValueError(f"target layer ids {bad} outside the target's {n_layers} layers")
        heads = t["num_attention_heads"]
        rope = t.get("rope_parameters")
        if not rope:  # transformers 4.x form
            rope = dict(t.get("rope_scaling") or {})
            rope.setdefault("rope_type", rope.pop("type", "default"))
            rope["rope_theta"] = float(t.get("rope_theta", 10_000.0))
        values: dict[str, Any] = dict(
            hidden_size=t["hidden_size"],
            intermediate_size=t["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=t.get("num_key_value_heads") or heads,
            head_dim=t.get("head_dim") or t["hidden_size"] // heads,
            vocab_size=t["vocab_size"],
            num_target_layers=n_layers,
            mask_token_id=mask_token_id,
            target_layer_ids=list(layer_ids),
            num_hidden_layers=num_layers,
            rms_norm_eps=t.get("rms_norm_eps", 1e-6),
            rope_parameters=rope,
            max_position_embeddings=t.get("max_position_embeddings", 40960),
            block_size=block_size,
        )
        values.update(overrides)
        return cls(**values)
