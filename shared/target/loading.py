"""Loading the frozen target for extraction and capturing the hidden states DFlash needs.

The target is loaded with its decoder cut after the last layer whose output is needed, so the layers
above it and the LM head never run over the sequence (the LM head over 150K vocab is about as costly
as several decoder layers). Layer outputs are taken with forward hooks on the decoder layers, which
sidesteps the `output_hidden_states` rule that replaces the last entry by the final-normed state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from dflash_pipeline.shared.runtime.errors import UserError


class TargetError(UserError, ValueError):
    """The target cannot be used as asked (bad layer ids, unsupported architecture, ...)."""


def gguf_file_of(target: str | Path) -> str | None:
    """Name of the single .gguf file in a target folder, if the target is a GGUF checkpoint."""
    folder = Path(target)
    if not folder.is_dir():
        return None
    ggufs = sorted(p.name for p in folder.glob("*.gguf"))
    if not ggufs or (folder / "config.json").exists():
        return None
    if len(ggufs) > 1:
        raise TargetError(f"{folder}: several .gguf files ({', '.join(ggufs)}); point --target at one folder per model")
    return ggufs[0]


def require_target_folder(target: str | Path) -> None:
    """--target is a local folder: transformers would take any other name for a Hub repository and spend
    half a minute retrying downloads (this pipeline never reaches the network) before a confusing error."""
    if not Path(target).is_dir():
        what = "not a folder" if Path(target).exists() else "no such folder"
        raise TargetError(
            f"{target}: {what}; --target is the target model's local folder (config.json, weights, tokenizer), "
            "at the same path on every node"
        )


def load_target_config(target: str | Path) -> PretrainedConfig:
    require_target_folder(target)
    gguf = gguf_file_of(target)
    try:
        return (
            AutoConfig.from_pretrained(str(target), gguf_file=gguf) if gguf else AutoConfig.from_pretrained(str(target))
        )
    except (OSError, ValueError) as exc:
        raise TargetError(
            f"{target}: cannot read the target's config ({exc.__class__.__name__}: {str(exc).splitlines()[0]})"
        ) from exc


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder config of a (possibly multimodal) target."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def parse_layer_ids(spec: str | None, num_layers: int, default: list[int]) -> list[int]:
    """`--layers` as given ("1,9,17") or the reference default; validated against the target depth."""
    if spec in (None, "", "auto"):
        ids = list(default)
    else:
        try:
            ids = [int(x) for x in str(spec).split(",") if x.strip()]
        except ValueError as exc:
            raise TargetError(f"--layers {spec!r}: expected comma-separated integers") from exc
    if not ids:
        raise TargetError("--layers: no layer ids given")
    if ids != sorted(set(ids)):
        raise TargetError(f"--layers {ids}: ids must be strictly increasing")
    if ids[0] < 0 or ids[-1] >= num_layers:
        raise TargetError(f"--layers {ids}: the target has decoder layers 0..{num_layers - 1}")
    return ids


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of an HF causal LM (`model.model.layers` for Llama/Qwen/Mistral...)."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TargetError(f"{type(model).__name__}: no `model.layers` decoder list; this architecture is not supported")
    return layers


def truncated_config(config: PretrainedConfig, keep_layers: int) -> PretrainedConfig:
    """A copy of the config with only the first `keep_layers` decoder layers."""
    cfg = config.__class__.from_dict(config.to_dict())
    tc = text_config(cfg)
    tc.num_hidden_layers = keep_layers
    layer_types = getattr(tc, "layer_types", None)
    if layer_types is not None:
        tc.layer_types = list(layer_types)[:keep_layers]
    return cfg


def load_truncated_target(
    target: str | Path,
    layer_ids: list[int],
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> nn.Module:
    """The target causal LM holding only decoder layers 0..max(layer_ids) (plus embedding and head).

    Weights of later layers are not loaded at all. The caller exports the embedding/LM head from it
    and then drops the head (`drop_unused_modules`).
    """
    keep = layer_ids[-1] + 1
    model = _load_causal_lm(target, truncated_config(load_target_config(target), keep), device=device, dtype=dtype)
    if len(decoder_layers(model)) != keep:
        raise TargetError(
            f"{target}: expected {keep} decoder layers after truncation, got {len(decoder_layers(model))}"
        )
    return model


def load_full_target(target: str | Path, *, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The whole frozen target, for generating replies and for verifying drafts."""
    return _load_causal_lm(target, load_target_config(target), device=device, dtype=dtype)


def _load_causal_lm(
    target: str | Path, config: PretrainedConfig, *, device: torch.device, dtype: torch.dtype
) -> nn.Module:
    kwargs: dict[str, Any] = {"config": config, "dtype": dtype, "attn_implementation": "sdpa"}
    gguf = gguf_file_of(target)
    if gguf:
        kwargs["gguf_file"] = gguf
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "weights of layers N.. not used" is what truncation wants
    try:
        model = AutoModelForCausalLM.from_pretrained(str(target), **kwargs)
    except (OSError, ValueError) as exc:
        raise TargetError(
            f"{target}: cannot load the target ({exc.__class__.__name__}: {str(exc).splitlines()[0]})"
        ) from exc
    finally:
        hf_logging.set_verbosity(verbosity)
    model.eval().requires_grad_(False)
    return model.to(device)


def drop_unused_modules(model: nn.Module) -> None:
    """Free the LM head and final norm: extraction never computes logits."""
    if hasattr(model, "lm_head"):
        model.lm_head = nn.Identity()
    base = model.model
    if hasattr(base, "norm"):
        base.norm = nn.Identity()


def compile_decoder_layers(model: nn.Module) -> None:
    """Compile every decoder layer's forward with dynamic shapes, so RMSNorm, rotary, SiLU-gating and
    residual adds fuse instead of each making a round trip through GPU memory (in eager mode they
    take a sizeable share of a layer's time next to its matmuls). The layers share one code object,
    so one graph serves all of them and every batch shape; the capture hooks stay outside it."""
    for layer in decoder_layers(model):
        layer.forward = torch.compile(layer.forward, dynamic=True)


class HiddenStateCapture:
    """Forward hooks that keep the outputs of the chosen decoder layers for one forward pass."""

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        self.layer_ids = list(layer_ids)
        self._outputs: dict[int, torch.Tensor] = {}
        layers = decoder_layers(model)
        self._handles = [layers[i].register_forward_hook(self._hook(i)) for i in self.layer_ids]

    def _hook(self, layer_id: int):
        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            self._outputs[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def take(self) -> list[torch.Tensor]:
        """The captured [batch, seq, hidden] outputs in layer order; clears them."""
        missing = [i for i in self.layer_ids if i not in self._outputs]
        if missing:
            raise RuntimeError(f"hidden states of layers {missing} were not captured")
        outs = [self._outputs.pop(i) for i in self.layer_ids]
        return outs

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def forward_hidden_states(model: nn.Module, capture: HiddenStateCapture, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Run the truncated decoder on right-padded ids; returns the chosen layers' outputs.

    No attention mask is passed on purpose: with right padding and causal attention every real token
    only attends to earlier real tokens, so results for real tokens equal the unpadded forward while
    SDPA can take its fast causal (flash) path. Padded positions are garbage and are dropped later.
    """
    model.model(input_ids=input_ids, use_cache=False)
    return capture.take()
